"""One model's lifecycle: load, readiness, crash backoff, rolling replace, keep-alive, unload.

Each model has one asyncio task that drives its workers toward the desired
state. It asks the pure ``lifecycle.next_step`` what to do, does that one step,
and asks again: serve, start a worker, replace an old one (the old one serves
until the new one is Ready, then drains), back off after a failure, unload, or
shut down. Whether the model should be loaded is decided by the scheduler
(memory budget) and by keep-alive; workers come from the supervisor's factory
(any ``WorkerHandle``).

Over 400 lines on purpose: the task and the state it drives are one unit (its
events and conditions live in record.py, its memory accounting in memory.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Optional

from ..manifest import Manifest
from ..units import iso_opt
from .admission import AdmissionError, Lease, time_left, timeout_error
from .handle import WorkerHandle
from .lifecycle import (
    Desired,
    ModelPhase,
    Observed,
    Step,
    backoff_delay,
    failures_after_exit,
    next_step,
)
from .memory import MemoryAccount
from .record import StatusRecord
from .scheduler import expires_at

log = logging.getLogger("mlxfleet.supervisor")


class ModelRuntime(StatusRecord, MemoryAccount):
    """The supervisor's record of one model: desired manifest, workers, status."""

    def __init__(self, manifest: Manifest, file: str, supervisor: Any,
                 rank: Optional[tuple[int, tuple[str, ...]]] = None):
        super().__init__(manifest.name)
        self.manifest = manifest
        self.file = file
        self.sup = supervisor
        self.settings = supervisor.settings
        self.generation = 1
        self.spec_changed_at = -1e9  # monotonic time of the last spec change needing a worker
        self.observed_generation: Optional[int] = None
        self.current: Optional[WorkerHandle] = None  # the worker traffic goes to
        self.starting: Optional[WorkerHandle] = None  # a worker still loading
        self.want_loaded = False  # set by the scheduler (Supervisor.ensure_loaded)
        self.restarts = 0
        self.failures = 0  # consecutive, for the backoff
        self.failed_at: Optional[float] = None
        self.last_error: Optional[str] = None
        self.created = time.time()
        self.removed = False
        self.keep_alive_override: Optional[float] = None
        self.last_used: Optional[float] = None
        self.weight_bytes: Optional[int] = None
        self.measured_bytes: Optional[int] = None
        self.waiters = 0  # requests waiting for a load
        self.loads = self.unloads = self.evictions = 0  # counters for /metrics
        self._ready = asyncio.Event()
        self._failed = asyncio.Event()
        self._unloaded = asyncio.Event()
        self._unloaded.set()
        self._wake = asyncio.Event()
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        self._draining: set[asyncio.Task] = set()
        self._config_for: Optional[tuple] = None
        self._unloading = self._stopped = False
        # A sharded model (fleets): this node's rank and every rank's host:port. Ranks
        # other than 0 are followers: they serve no requests (``remote`` routes them).
        self.rank = rank
        self.set_condition("Ready", False, "Unloaded", "not loaded")
        self.task = asyncio.create_task(self._run(), name=f"model:{manifest.name}")

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def node(self) -> Optional[str]:
        return self.sup.node_name

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.alive and self._ready.is_set()

    @property
    def paths(self) -> Optional[dict]:
        """The serving worker's engine paths (architecture, parsers, exactness)."""
        w = self.current
        return getattr(w, "paths", None) if w is not None and self.ready else None

    @property
    def phase(self) -> ModelPhase:
        """Derived from the state the lifecycle task keeps, here and nowhere else."""
        if self._stopped:
            return ModelPhase.STOPPED
        if self.removed:
            return ModelPhase.TERMINATING
        if self.ready:  # a replacement may be loading beside it
            return ModelPhase.READY
        if self._unloading:
            return ModelPhase.UNLOADING
        if self.starting is not None:
            return ModelPhase.LOADING
        if self.want_loaded:
            return ModelPhase.BACKOFF if self.retry_after() > 0 else ModelPhase.LOADING
        if self.failed_at is not None and not self.manifest.spec.preload:
            return ModelPhase.FAILED
        return ModelPhase.UNLOADED

    @property
    def inflight(self) -> int:
        return self.current.inflight if self.current else 0

    @property
    def keep_alive(self) -> float:
        if self.rank is not None:  # every rank must run for any to serve
            return math.inf
        if self.keep_alive_override is not None:
            return self.keep_alive_override
        if self.manifest.spec.keep_alive is not None:
            return self.manifest.spec.keep_alive
        return self.settings.keep_alive_seconds

    @property
    def holds_memory(self) -> bool:
        """Runs, is loading, or is about to: a model backing off after failures does not
        hold memory meanwhile."""
        return self.current is not None or self.starting is not None or (
            self.want_loaded and self.retry_after() == 0)

    # ---- control ---------------------------------------------------------

    def update(self, manifest: Manifest, file: str, restart: bool) -> None:
        """A new desired manifest; ``restart`` when the worker hash changed (a new worker)."""
        old = self.manifest
        self.file = file
        if manifest == old:
            return
        self.generation += 1
        self.manifest = manifest
        if manifest.source_changed(old):
            self.weight_bytes = self.measured_bytes = None
        if restart:
            self.spec_changed_at = time.monotonic()
            self.event("Normal", "SpecChanged", "spec changed; rolling to a new worker"
                       if self.holds_memory else "spec changed")
            self.failures = 0
            self.failed_at = None
            self._wake.set()
        else:
            self.event("Normal", "Updated", "updated without restart (aliases, labels, "
                       "keepAlive, preload, pinned or priority)")
            if self.ready:
                self.observed_generation = self.generation
            self._arm_idle_timer()

    def claim_memory(self) -> None:
        """Called by the scheduler once the model fits: start loading."""
        if not self.want_loaded:
            self.want_loaded = True
            self._unloaded.clear()
            self._failed.clear()
            self._wake.set()

    def release_memory(self, reason: str) -> None:
        """Called by the scheduler: stop the workers (once their requests finish)."""
        if self.want_loaded:
            self.want_loaded = False
            self.event("Normal", "Unloading", reason)
            self._wake.set()

    def remove(self) -> None:
        self.removed = True
        self._wake.set()

    async def wait_unloaded(self) -> None:
        await self._unloaded.wait()

    async def wait_ready(self, timeout: float) -> WorkerHandle:
        """The ready worker; raises TimeoutError, or RuntimeError if the load failed."""
        ready = asyncio.ensure_future(self._ready.wait())
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({ready, failed}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            failed.cancel()
        if self.ready:
            return self.current
        if self._failed.is_set():
            raise RuntimeError(self.last_error or "the model failed to load")
        raise TimeoutError

    # ---- admission -------------------------------------------------------

    async def acquire(self, deadline: float, keep_alive: Optional[float] = None) -> Lease:
        """A lease on the serving worker, loading the model first if needed; raises
        ``AdmissionError``. ``keep_alive`` (a request's) replaces the manifest's."""
        if keep_alive is not None:
            self.keep_alive_override = keep_alive
        if self.ready and self.want_loaded:
            self._check_queue()
        await self.ensure_ready(deadline)
        return Lease(self, deadline)

    async def ensure_ready(self, deadline: float) -> None:
        """Load if needed (one load, shared by every waiter) and wait for it.

        504 when the request's ``deadline`` passes first; 503 for everything that
        keeps the model from serving (backoff, failed load, no memory, too slow).
        """
        if self.ready and self.want_loaded:
            return
        if self.phase is ModelPhase.BACKOFF:
            retry = self.retry_after()
            raise AdmissionError(503, f"Model '{self.name}' is not available: "
                                 f"{self.last_error}. Restarting in about "
                                 f"{max(1, round(retry))}s.", "model_unavailable",
                                 retry_after=retry)
        self._check_queue()
        wait = self.settings.request_wait_timeout
        limit = min(deadline, time.monotonic() + wait)
        self.waiters += 1
        try:
            await asyncio.wait_for(self._load_and_wait(limit), time_left(limit))
        except RuntimeError as e:  # the load failed: every waiter hears why
            raise AdmissionError(503, f"Model '{self.name}' failed to load: {e}",
                                 "model_load_failed", retry_after=self.retry_after()) from None
        except (asyncio.TimeoutError, TimeoutError):
            if limit >= deadline:
                raise timeout_error(self.name) from None
            raise AdmissionError(503, f"Model '{self.name}' did not become ready in "
                                 f"{wait:.0f}s" + (f": {self.last_error}" if self.last_error
                                                   else "."),
                                 "model_unavailable", retry_after=5) from None
        finally:
            self.waiters -= 1

    async def _load_and_wait(self, limit: float) -> None:
        while not (self.ready and self.want_loaded):
            await self.sup.ensure_loaded(self)
            await self.wait_ready(max(0.1, time_left(limit)))

    def _check_queue(self) -> None:
        """503 when the model already has ``maxConcurrency + maxQueue`` requests, running
        or waiting (for its load or for a batch slot): the same count the worker keeps."""
        cfg = self.worker_config
        held = self.waiters + self.inflight
        if held >= cfg.max_concurrency + cfg.max_queue:
            raise AdmissionError(503, f"Model '{self.name}' has {held} requests running or "
                                 f"waiting (maxConcurrency {cfg.max_concurrency} + maxQueue "
                                 f"{cfg.max_queue}); retry shortly.", "queue_full",
                                 retry_after=2)

    async def load(self, deadline: float, keep_alive: Optional[float] = None) -> dict:
        """Load it (``keep_alive`` as a request's) and wait until it serves; its status.
        Its keep-alive clock starts now, as after a request."""
        if keep_alive is not None:
            self.keep_alive_override = keep_alive
        await self.ensure_ready(deadline)
        self.last_used = time.time()
        if not self.inflight:
            self._arm_idle_timer()
        return self.status()

    async def unload(self, reason: str = "unload requested") -> dict:
        """Unload once in-flight requests finish (the worker's drain grace period)."""
        await self.sup.unload(self, reason)
        return self.status()

    async def logs(self, tail: int, follow: bool) -> AsyncIterator[str]:
        from .logs import log_lines

        return log_lines(self.sup.log_path(self.name), tail, follow)

    def begin(self) -> WorkerHandle:
        """A request starts on the current worker: it is busy, not idle."""
        w = self.current
        w.acquire()
        self.last_used = time.time()
        if self._idle_timer:
            self._idle_timer.cancel()
            self._idle_timer = None
        return w

    def end(self, w: WorkerHandle) -> None:
        w.release()
        self.last_used = time.time()
        if w is self.current and w.inflight == 0:
            self._arm_idle_timer()
            self.sup.notify_idle()

    def _arm_idle_timer(self) -> None:
        """The keep-alive clock starts when the last in-flight request ends."""
        if self._idle_timer:
            self._idle_timer.cancel()
            self._idle_timer = None
        ka = self.keep_alive
        if not self.want_loaded or self.inflight or math.isinf(ka):
            return
        self._idle_timer = asyncio.get_running_loop().call_later(max(ka, 0.0), self._idle)

    def _idle(self) -> None:
        self._idle_timer = None
        if self.want_loaded and self.inflight == 0 and self.starting is None \
                and self.waiters == 0:
            self.release_memory(f"idle for {self.keep_alive:g}s (keepAlive)")

    def retry_after(self) -> float:
        """Seconds until another start may be tried after a failure (0: now)."""
        if self.failed_at is None:
            return 0.0
        delay = backoff_delay(self.failures, self.settings.backoff_base,
                              self.settings.backoff_cap)
        return max(0.0, self.failed_at + delay - time.monotonic())

    # ---- status ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        w = self.current
        spec = self.manifest.spec
        footprint = self.footprint()
        ka = self.keep_alive
        exp = expires_at(self.last_used, ka, self.inflight > 0) if self.ready else None
        return {
            "name": self.name, "source": spec.source, "aliases": list(spec.aliases),
            "node": self.sup.node_name,
            "labels": dict(self.manifest.metadata.labels), "file": self.file,
            "phase": self.phase.value, "ready": self.ready, "loaded": self.holds_memory,
            "generation": self.generation, "observedGeneration": self.observed_generation,
            "restarts": self.restarts, "pid": w.pid if w and w.alive else None,
            "memoryBytes": self.memory_bytes(), "lastError": self.last_error,
            "inflight": self.inflight, "waiting": self.waiters,
            "keepAlive": "forever" if math.isinf(ka) else ka,
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

    # ---- lifecycle -------------------------------------------------------

    def _desired(self) -> Desired:
        return Desired(self.want_loaded, self.removed, self.manifest.worker_hash())

    def _observed(self) -> Observed:
        cur = self.current
        serving = cur.spec_hash if cur is not None and cur.alive else None
        return Observed(serving, cur is not None or self.starting is not None,
                        self.retry_after())

    async def _run(self) -> None:
        steps = {Step.IDLE: self._stay_unloaded, Step.UNLOAD: self._stop_workers,
                 Step.SERVE: self._watch, Step.START: self._start_worker,
                 Step.REPLACE: self._start_worker, Step.BACKOFF: self._backoff}
        try:
            while True:
                step = next_step(self._desired(), self._observed())
                if step is Step.SHUTDOWN:
                    break
                await steps[step]()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - never let one model take down the others
            log.exception("%s: lifecycle task failed", self.name)
            self.last_error = f"supervisor error: {e}"
        finally:
            await self._shutdown()

    async def _wait_wake(self, timeout: Optional[float] = None) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _stay_unloaded(self) -> None:
        if self.phase is ModelPhase.FAILED:
            self.set_condition("Ready", False, "LoadFailed", f"{self.last_error}")
        else:
            self.set_condition("Ready", False, "Unloaded",
                               "not loaded; loads on the next request")
        self._unloaded.set()
        await self._wait_wake()

    async def _stop_workers(self) -> None:
        workers = [w for w in (self.starting, self.current) if w is not None]
        self._unloading = True
        self._ready.clear()
        self.current = self.starting = None
        try:
            await asyncio.gather(*(w.stop(self.settings.drain_timeout,
                                          self.settings.stop_timeout) for w in workers))
        finally:
            self._unloading = False
        self.event("Normal", "Unloaded", "worker stopped; memory released")
        self.unloads += 1
        self.sup.notify_idle()

    async def _watch(self) -> None:
        """Serve until the worker exits or something changes (spec, unload, removal)."""
        cur = self.current
        exited = asyncio.ensure_future(cur.wait_exit())
        woken = asyncio.ensure_future(self._wake.wait())
        hung = asyncio.ensure_future(self._unresponsive(cur))
        await asyncio.wait({exited, woken, hung}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        self._wake.clear()
        why = f"worker exited unexpectedly with code {cur.returncode}"
        if hung.done() and not exited.done() and not (cur.stopping or self.removed):
            why = (f"worker stopped answering its health check ({hung.result()} times in a "
                   "row); killed")
            self._ready.clear()  # no new requests go to it
            cur.kill()
            await exited
        hung.cancel()
        if not exited.done():
            exited.cancel()
            return  # re-evaluate: replace, unload or remove
        if cur.stopping or self.removed:
            return
        ready_for = time.monotonic() - (cur.ready_at or time.monotonic())
        self.failures = failures_after_exit(self.failures, ready_for,
                                            self.settings.stable_period)
        self.failed_at = time.monotonic()
        self.last_error = why
        self.event("Warning", "WorkerCrashed", f"{self.last_error} (pid {cur.pid})")
        self._ready.clear()
        self.current = None
        await cur.close()

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

    async def _start_worker(self) -> None:
        if self.failures:  # a restart after a crash or a failed start
            self.restarts += 1
        self._wake.clear()  # from here, a wake means: abandon this start
        self._failed.clear()
        settle = self.spec_changed_at + self.settings.spec_settle_ms / 1000 - time.monotonic()
        if settle > 0:  # saved moments ago: more saves may follow; start for the last one
            try:
                await asyncio.wait_for(self._wake.wait(), settle)
                return  # changed again (or unloaded, removed): decide afresh
            except asyncio.TimeoutError:
                pass
        if not await self._pulled():
            return
        if self.weight_bytes is None:
            await self._measure_weights()
        w = self.sup.new_worker(self)
        self.starting = w
        replacing = self.current is not None
        if replacing:
            self.set_condition("Progressing", True, "NewWorkerStarting",
                               "starting a worker for the new spec; the old one serves")
        else:
            self.set_condition("Ready", False, "Loading", "the worker is loading the model")
        try:
            await w.spawn()
        except OSError as e:
            self.starting = None
            await self._failed_start(w, f"could not start the worker: {e}")
            return
        self.event("Normal", "Loading", f"started worker pid {w.pid} for generation "
                   f"{self.generation}")
        ready = asyncio.ensure_future(w.wait_ready(self.settings.startup_timeout))
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({ready, woken}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not ready.done():  # spec changed again, unloaded or removed while loading
            ready.cancel()
            self.starting = None
            w.kill()
            await w.stop(0, self.settings.stop_timeout)
            self.event("Normal", "LoadAbandoned", "superseded while loading")
            return
        ok, why = ready.result()
        self.starting = None
        if not ok:
            await self._failed_start(w, why)
            return
        old, self.current = self.current, w
        self.observed_generation = self.generation
        self.loads += 1
        self.failed_at = None
        self._ready.set()
        self.set_condition("Ready", True, "WorkerReady", f"worker pid {w.pid} is serving")
        self.event("Normal", "Ready", f"worker pid {w.pid} ready in "
                   f"{time.monotonic() - (w.started_at or time.monotonic()):.1f}s")
        if self.weight_bytes is None:  # a builtin or download now on disk
            await self._measure_weights()
        self._arm_idle_timer()  # a load nobody uses still expires
        if old is not None:
            self.set_condition("Progressing", True, "RolloutComplete",
                               "traffic moved to the new worker")
            self._drain(old)

    def pull(self) -> Any:
        """The download of this model's weights under way on this machine, if any."""
        spec = self.manifest.spec
        return self.sup.pulls.active.get((spec.source, spec.revision))

    async def _pulled(self) -> bool:
        """Weights not on disk are pulled through the store (``Supervisor._fetch`` may
        have started it), never by the worker; False when the pull failed (a failed
        start) or a change came first."""
        from ..store import needs_pull
        from .memory import spec_sources

        for source, revision in spec_sources(self.manifest.spec):  # (a draft model too)
            pull = self.sup.pulls.active.get((source, revision))
            if pull is None:
                if not await asyncio.to_thread(needs_pull, source, revision):
                    continue
                pull = self.sup.pulls.start(source, revision)
            if not await self._wait_pull(pull):
                return False
        return True

    async def _wait_pull(self, pull: Any) -> bool:
        from ..store import PullError

        self.set_condition("Ready", False, "Pulling", f"pulling {pull.source}")
        done = asyncio.ensure_future(pull.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({done, woken}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not done.done():
            done.cancel()
            return False
        try:
            done.result()
        except PullError as e:
            await self._failed_start(None, str(e))
            return False
        self.weight_bytes = None  # measured now that they are here
        return True

    async def _measure_weights(self) -> None:
        from .memory import spec_weight_bytes

        self.weight_bytes = await asyncio.to_thread(spec_weight_bytes, self.manifest.spec)

    async def _failed_start(self, w: Optional[WorkerHandle], why: str) -> None:
        """A start that failed: its worker (None: it failed before one was spawned, as a
        pull of the weights can) is stopped, and waiters hear why."""
        self.failures += 1
        self.failed_at = time.monotonic()
        self.last_error = why
        self.event("Warning", "LoadFailed", why)
        if w is not None:
            w.kill()
            await w.stop(0, self.settings.stop_timeout)
        self._failed.set()  # waiters get the error now, not after the retries
        if self.current is not None:
            self.set_condition("Progressing", False, "NewWorkerFailed",
                               f"{why}; the previous worker keeps serving")
        elif not self.manifest.spec.preload:
            # On-demand models do not retry by themselves: the next request does,
            # once the backoff has passed (see Supervisor.ensure_loaded).
            self.want_loaded = False
            self.sup.notify_idle()

    async def _backoff(self) -> None:
        delay = self.retry_after()
        if self.current is None:
            self.set_condition("Ready", False, "CrashLoopBackOff",
                               f"{self.last_error}; restarting in {delay:.0f}s")
        await self._wait_wake(delay)

    def _drain(self, old: WorkerHandle) -> None:
        async def stop_old():
            code = await old.stop(self.settings.drain_timeout, self.settings.stop_timeout)
            self.event("Normal", "Stopped", f"old worker pid {old.pid} stopped (code {code})")

        t = asyncio.create_task(stop_old())
        self._draining.add(t)
        t.add_done_callback(self._draining.discard)

    async def _shutdown(self) -> None:
        self._ready.clear()
        if self._idle_timer:
            self._idle_timer.cancel()
        self.set_condition("Ready", False, "Terminating", "the model is stopping")
        workers = [w for w in (self.starting, self.current) if w is not None]
        self.current = self.starting = None
        for w in workers:
            if w.ready_at is None:
                w.kill()
        await asyncio.gather(*(w.stop(self.settings.drain_timeout, self.settings.stop_timeout)
                               for w in workers), *self._draining, return_exceptions=True)
        self._stopped = True
        self.want_loaded = False
        self._unloaded.set()
        self.sup.notify_idle()
        self.event("Normal", "Stopped", "all workers stopped")
