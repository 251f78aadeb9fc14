"""One model this node runs: its workers, and what the scheduler's effects do to them.

The node's scheduler (scheduler.py) decides; a ``ModelRuntime`` carries out its
effects for one model and reports back as events: it starts a worker (pulling the
weights first when they are not on disk), watches it (exit, health checks), stops
it (draining its requests, or killing a start that was abandoned). It is also the
model as the gateway sees it (a ``ServedModel``): leases, loads, unloads, status.
Its phase, queue and keep-alive are the scheduler's ``ModelState``, read here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Optional

from ..manifest import Manifest
from ..units import iso_opt
from .admission import AdmissionError, ServedModel, timeout_error, until
from .eviction import expires_at
from .fleet import with_replicas
from .handle import WorkerHandle
from .lifecycle import ModelPhase
from .memory import MemoryAccount
from .record import StatusRecord
from .scheduler import (
    Finished,
    GaveUp,
    ModelState,
    StartFailed,
    UnloadAsked,
    Wanted,
    WorkerExited,
    WorkerReady,
    WorkerStopped,
)

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = logging.getLogger("mlxfleet.supervisor")

#: Events of a rolling update (they set the Progressing condition).
ROLLOUT = ("NewWorkerStarting", "RolloutComplete", "NewWorkerFailed")


class ModelRuntime(ServedModel, StatusRecord, MemoryAccount):
    """One model this node runs: its manifest, workers, events and conditions."""

    def __init__(self, manifest: Manifest, file: str, key: str, supervisor: Supervisor,
                 rank: Optional[tuple[int, tuple[str, ...]]] = None):
        StatusRecord.__init__(self, manifest.name)
        self.manifest, self.file, self.key = manifest, file, key
        self.sup = supervisor
        self.settings = supervisor.settings
        self.state: Optional[ModelState] = None  # the scheduler's, once it has it
        self.generation = 1
        self.observed_generation: Optional[int] = None
        self.created = time.time()
        self.weight_bytes: Optional[int] = None
        self.measured_bytes: Optional[int] = None
        self.pull_failed = False  # its last start failed pulling the weights
        self.ttft = 0.0  # its worker's median time to first token (replicas scale by it)
        self.workers: dict[int, WorkerHandle] = {}
        self._generation_of: dict[int, int] = {}
        self._tasks: dict[int, asyncio.Task] = {}  # a worker's start, then its watch
        self._stops: set[asyncio.Task] = set()
        self.gone = asyncio.Event()  # the scheduler forgot it: nothing of it runs
        self._config_for: Optional[tuple] = None
        # A sharded model (fleets): this node's rank and every rank's host:port. Ranks
        # other than 0 are followers: they serve no requests (``remote`` routes them).
        self.rank = rank

    # ---- what the scheduler keeps ------------------------------------------

    @property
    def node(self) -> Optional[str]:
        return self.sup.node_name

    @property
    def removed(self) -> bool:
        return self.state.removed

    @property
    def phase(self) -> ModelPhase:
        return self.state.phase

    @property
    def current(self) -> Optional[WorkerHandle]:
        """The worker requests go to."""
        w = self.state.serving if self.state is not None else None
        return self.workers.get(w.id) if w is not None else None

    @property
    def starting(self) -> Optional[WorkerHandle]:
        """A worker loading (beside ``current`` during a rollout), once spawned."""
        w = self.state.starting
        return self.workers.get(w.id) if w is not None else None

    @property
    def ready(self) -> bool:
        w = self.current
        return self.state.ready and w is not None and w.alive

    @property
    def inflight(self) -> int:
        return self.state.inflight

    @property
    def waiters(self) -> int:
        return self.state.waiters

    @property
    def keep_alive(self) -> float:
        return self.sup.scheduler.keep_alive(self.state)

    @property
    def holds_memory(self) -> bool:
        return self.sup.scheduler.holds_memory(self.state)

    @property
    def last_error(self) -> Optional[str]:
        return self.state.last_error

    @property
    def restarts(self) -> int:
        return self.state.restarts

    @property
    def loads(self) -> int:
        return self.state.loads

    @property
    def unloads(self) -> int:
        return self.state.unloads

    @property
    def evictions(self) -> int:
        return self.state.evictions

    @property
    def last_used(self) -> Optional[float]:
        """Wall-clock time of its last use (the scheduler keeps monotonic time)."""
        used = self.state.last_used
        return None if used is None else time.time() - (time.monotonic() - used)

    @property
    def paths(self) -> Optional[dict]:
        """The serving worker's engine paths (architecture, parsers, exactness)."""
        return getattr(self.current, "paths", None) if self.ready else None

    def update(self, manifest: Manifest, file: str, restart: bool) -> None:
        """A new desired manifest (the scheduler hears of it from the supervisor)."""
        old = self.manifest
        self.file = file
        if manifest == old:
            return
        self.generation += 1
        self.manifest = manifest
        if manifest.source_changed(old):
            self.weight_bytes = self.measured_bytes = None
        if not restart and self.ready:
            self.observed_generation = self.generation

    # ---- the gateway's side (ServedModel) -----------------------------------

    async def hold(self, deadline: float, keep_alive: Optional[float] = None
                   ) -> WorkerHandle:
        """Ask the scheduler for a worker and wait for its answer: at once when the
        model serves, after the load when it does not (504 when the request's
        deadline passes first; 503 after ``request_wait_timeout``)."""
        return await self._ask(deadline, Wanted, lease=True, keep_alive=keep_alive)

    def let_go(self, w: WorkerHandle) -> None:
        w.release()
        self.sup.dispatch(Finished(self.key))

    async def load(self, deadline: float, keep_alive: Optional[float] = None) -> dict:
        """Load it and wait until it serves; its status. Its keep-alive clock starts
        now, as after a request."""
        await self._ask(deadline, Wanted, lease=False, keep_alive=keep_alive)
        return self.status()

    async def unload(self, reason: str = "unload requested") -> dict:
        """Unload once in-flight requests finish (the worker's drain grace period)."""
        ticket, answer = self.sup.ticket()
        self.sup.dispatch(UnloadAsked(self.key, reason, ticket))
        await answer
        return self.status()

    async def _ask(self, deadline: float, event: type, **kw: Any) -> Any:
        wait = self.settings.request_wait_timeout
        limit = min(deadline, time.monotonic() + wait)
        ticket, answer = self.sup.ticket()
        self.sup.dispatch(event(self.key, ticket, **kw))
        try:
            async with until(limit):
                return await asyncio.shield(answer)
        except (asyncio.TimeoutError, TimeoutError):
            self._give_up(ticket, answer)
            if limit >= deadline:
                raise timeout_error(self.name) from None
            raise AdmissionError(503, f"Model '{self.name}' did not become ready in "
                                 f"{wait:.0f}s" + (f": {self.last_error}" if self.last_error
                                                   else "."),
                                 "model_unavailable", retry_after=5) from None
        except asyncio.CancelledError:  # the client left while waiting
            self._give_up(ticket, answer)
            raise

    def _give_up(self, ticket: int, answer: asyncio.Future) -> None:
        if not answer.done():
            self.sup.dispatch(GaveUp(ticket))
            answer.cancel()
        elif not answer.cancelled() and answer.exception() is None \
                and answer.result() is not None:
            self.let_go(answer.result())  # granted just as it gave up

    async def worker_status(self) -> Optional[dict]:
        w = self.current
        return await w.get_json("/v1/status", 2.0) if w is not None and self.ready else None

    async def logs(self, tail: int, follow: bool) -> AsyncIterator[str]:
        from .logs import log_lines

        return log_lines(self.sup.log_path(self.name), tail, follow)

    # ---- the scheduler's effects ---------------------------------------------

    def start(self, wid: int) -> None:
        self._generation_of[wid] = self.generation
        self._tasks[wid] = asyncio.create_task(self._run_worker(wid),
                                               name=f"worker:{self.name}:{wid}")

    def stop(self, wid: int, drain: bool) -> None:
        t = asyncio.create_task(self._stop_worker(wid, drain))
        self._stops.add(t)
        t.add_done_callback(self._stops.discard)

    def grant(self, wid: int) -> WorkerHandle:
        """The worker a granted request holds (counted on it, for draining)."""
        w = self.workers[wid]
        w.acquire()
        return w

    def phase_changed(self, phase: ModelPhase, reason: str, message: str) -> None:
        """The scheduler moved it: its Ready condition says so."""
        self.set_condition("Ready", phase is ModelPhase.READY, reason, message)

    def note(self, type_: str, reason: str, message: str) -> None:
        """An event from the scheduler; a rollout's also set the Progressing condition."""
        self.event(type_, reason, message)
        if reason in ROLLOUT:
            self.set_condition("Progressing", reason != "NewWorkerFailed", reason, message)

    async def wait_gone(self) -> None:
        await self.gone.wait()
        await asyncio.gather(*self._stops, return_exceptions=True)

    # ---- workers ---------------------------------------------------------------

    async def _run_worker(self, wid: int) -> None:
        """Start worker ``wid``, tell the scheduler when it serves, then watch it until
        it exits on its own (a stop cancels this task first)."""
        try:
            why = await self._start(wid)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave waiters hanging
            log.exception("%s: starting worker %d failed", self.name, wid)
            why = f"supervisor error: {type(e).__name__}: {e}"
        if why is not None:
            self.sup.dispatch(StartFailed(self.key, wid, why))
            return
        w = self.workers[wid]
        self.observed_generation = self._generation_of.get(wid)
        self.event("Normal", "Started", f"worker pid {w.pid} ready in "
                   f"{time.monotonic() - (w.started_at or time.monotonic()):.1f}s")
        self.sup.dispatch(WorkerReady(self.key, wid))
        if self.weight_bytes is None:  # a builtin or download now on disk
            await self._measure_weights()
        try:
            why = await self._watch(w)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the worker can no longer be watched
            log.exception("%s: watching worker pid %s failed", self.name, w.pid)
            w.kill()
            why = f"supervisor error: {type(e).__name__}: {e}; killed"
        self.sup.dispatch(WorkerExited(self.key, wid, f"{why} (pid {w.pid})"))
        self.workers.pop(wid, None)
        await w.close()

    async def _start(self, wid: int) -> Optional[str]:
        """The worker loaded and serving (None), or why not."""
        why = await self._pulled()
        if why is not None:
            return why
        if self.weight_bytes is None:
            await self._measure_weights()
        w = self.workers[wid] = self.sup.new_worker(self)
        if self.current is not None:
            self.note("Normal", "NewWorkerStarting",
                      "starting a worker for the new spec; the old one serves")
        try:
            await w.spawn()
        except OSError as e:
            return f"could not start the worker: {e}"
        self.event("Normal", "Loading", f"started worker pid {w.pid} for generation "
                   f"{self._generation_of.get(wid)}")
        ok, why = await w.wait_ready(self.settings.startup_timeout)
        return None if ok else why

    async def _watch(self, w: WorkerHandle) -> str:
        """Why a serving worker stopped serving on its own: it exited, or it stopped
        answering its health check (then it is killed)."""
        exited = asyncio.ensure_future(w.wait_exit())
        hung = asyncio.ensure_future(self._unresponsive(w))
        try:
            await asyncio.wait({exited, hung}, return_when=asyncio.FIRST_COMPLETED)
            if hung.done() and not exited.done():
                w.kill()
                await exited
                return (f"worker stopped answering its health check ({hung.result()} "
                        "times in a row); killed")
            return f"worker exited unexpectedly with code {w.returncode}"
        finally:
            exited.cancel()
            hung.cancel()

    async def _unresponsive(self, w: WorkerHandle) -> int:
        """Return once ``w`` has failed ``health_failures`` health checks in a row (no
        answer within ``health_interval``, or an engine that reports itself failed)."""
        interval, limit = self.settings.health_interval, self.settings.health_failures
        misses = 0
        while misses < limit:
            await asyncio.sleep(interval)
            h = await w.get_json("/health", interval)
            misses = misses + 1 if h is None or h.get("state") == "failed" else 0
        return misses

    async def _stop_worker(self, wid: int, drain: bool) -> None:
        task = self._tasks.pop(wid, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        w = self.workers.pop(wid, None)
        try:
            if w is not None:
                if not drain or w.ready_at is None:
                    w.kill()
                code = await w.stop(self.settings.drain_timeout if drain else 0,
                                    self.settings.stop_timeout)
                await w.close()
                if drain and w.pid:
                    self.event("Normal", "Stopped", f"worker pid {w.pid} stopped (code {code})")
        finally:
            self._generation_of.pop(wid, None)
            self.sup.dispatch(WorkerStopped(self.key, wid))

    def pull(self) -> Any:
        """The download of this model's weights under way on this machine, if any."""
        spec = self.manifest.spec
        return self.sup.pulls.active.get((spec.source, spec.revision))

    async def _pulled(self) -> Optional[str]:
        """Weights not on disk are pulled through the store (``Supervisor._fetch`` may
        have started it), never by the worker: None once they are here, else why not."""
        from ..store import PullError, needs_pull
        from .memory import spec_sources

        for source, revision in spec_sources(self.manifest.spec):  # (a draft model too)
            pull = self.sup.pulls.active.get((source, revision))
            if pull is None:
                if not await asyncio.to_thread(needs_pull, source, revision):
                    continue
                pull = self.sup.pulls.start(source, revision)
            self.set_condition("Ready", False, "Pulling", f"pulling {pull.source}")
            try:
                await pull.wait()
            except PullError as e:
                self.pull_failed = True
                return str(e)
            self.weight_bytes = None  # measured now that they are here
        self.pull_failed = False
        return None

    async def _measure_weights(self) -> None:
        from .memory import spec_weight_bytes

        self.weight_bytes = await asyncio.to_thread(spec_weight_bytes, self.manifest.spec)

    # ---- status ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        w = self.current
        spec = self.manifest.spec
        footprint = self.footprint()
        ka = self.keep_alive
        exp = expires_at(self.last_used, ka, self.inflight > 0) if self.ready else None
        st = {
            "name": self.name, "source": spec.source, "aliases": list(spec.aliases),
            "node": self.sup.node_name,
            "labels": dict(self.manifest.metadata.labels), "file": self.file,
            "phase": self.phase.value, "ready": self.ready, "loaded": self.holds_memory,
            "generation": self.generation, "observedGeneration": self.observed_generation,
            "specHash": self.manifest.worker_hash(),
            "restarts": self.restarts, "pid": w.pid if w and w.alive else None,
            "memoryBytes": self.memory_bytes(), "lastError": self.last_error,
            "inflight": self.inflight, "waiting": self.waiters,
            "ttftP50": self.ttft,
            "keepAlive": "forever" if ka == float("inf") else ka,
            "lastUsed": iso_opt(self.last_used), "expiresAt": iso_opt(exp),
            "pinned": spec.pinned, "priority": spec.priority, "preload": spec.preload,
            "memory": {"estimatedBytes": self.estimated_bytes(),
                       "measuredBytes": self.measured_bytes,
                       "weightBytes": self.weight_bytes, "cacheBytes": self.cache_bytes(),
                       "footprintBytes": footprint},
            **self.record_status(self.created),
            "logFile": str(self.sup.log_path(self.name)),
            "paths": self.paths,
            "pull": (lambda p: p.progress() if p else None)(self.pull()),
        }
        fleet = self.sup.fleet
        return with_replicas(st, fleet.replica_view(self.name, st) if fleet else None)
