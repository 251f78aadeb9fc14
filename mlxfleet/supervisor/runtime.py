"""One model's lifecycle: load, readiness, crash backoff, rolling replace, keep-alive, unload.

Each model has one asyncio task that drives its worker toward the desired
state: loaded with the current manifest, or unloaded. A spec change starts a
new worker while the old one keeps serving; traffic moves only when the new
one is Ready, then the old one drains. Whether a model should be loaded is
decided by the supervisor's scheduler (memory budget) and by keep-alive.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

from ..manifest import Manifest
from ..units import iso, iso_opt
from .process import WorkerProcess
from .reconcile import backoff_delay, failures_after_exit
from .scheduler import Candidate, expires_at

log = logging.getLogger("mlxfleet.supervisor")


class ModelRuntime:
    """The supervisor's record of one model: desired manifest, workers, status."""

    def __init__(self, manifest: Manifest, file: str, supervisor: Any):
        self.manifest = manifest
        self.file = file
        self.sup = supervisor
        self.settings = supervisor.settings
        self.generation = 1
        self.observed_generation: Optional[int] = None
        self.current: Optional[WorkerProcess] = None  # the worker traffic goes to
        self.starting: Optional[WorkerProcess] = None  # a worker still loading
        self.want_loaded = False  # set by the scheduler (Supervisor.ensure_loaded)
        self.restarts = 0
        self.failures = 0  # consecutive, for the backoff
        self.failed_at: Optional[float] = None
        self.last_error: Optional[str] = None
        self.phase = "Unloaded"
        self.created = time.time()
        self.removed = False
        self.manifest_error: Optional[str] = None
        self.events: collections.deque = collections.deque(maxlen=50)
        self.conditions: dict[str, dict[str, Any]] = {}
        self.backoff_until: Optional[float] = None
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
        self._seq = 0
        self._draining: set[asyncio.Task] = set()
        self._set_condition("Ready", False, "Unloaded", "not loaded")
        self.task = asyncio.create_task(self._run(), name=f"model:{manifest.name}")

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.alive and self._ready.is_set()

    @property
    def inflight(self) -> int:
        return self.current.inflight if self.current else 0

    @property
    def keep_alive(self) -> float:
        if self.keep_alive_override is not None:
            return self.keep_alive_override
        if self.manifest.spec.keep_alive is not None:
            return self.manifest.spec.keep_alive
        return self.settings.keep_alive_seconds

    @property
    def holds_memory(self) -> bool:
        return self.want_loaded or self.current is not None or self.starting is not None

    # ---- memory ----------------------------------------------------------

    def cache_bytes(self) -> int:
        c = self.manifest.spec.cache
        if c.memory_mb is not None:
            return c.memory_mb << 20
        if c.memory_percent is not None:
            import psutil

            return int(psutil.virtual_memory().total * c.memory_percent)
        return self.settings.default_cache_mb << 20

    def estimated_bytes(self) -> int:
        return ((self.weight_bytes or 0) + self.cache_bytes()
                + (self.settings.worker_overhead_mb << 20))

    def footprint(self) -> int:
        rss = self._rss()
        if rss:
            self.measured_bytes = max(self.measured_bytes or 0, rss)
        return max(self.estimated_bytes(), self.measured_bytes or 0)

    def candidate(self) -> Candidate:
        s = self.manifest.spec
        busy = self.inflight > 0 or self.starting is not None or (
            self.want_loaded and not self.ready)
        return Candidate(self.name, self.footprint(), self.holds_memory, busy, s.pinned,
                         s.priority, self.last_used or self.created)

    def _rss(self) -> Optional[int]:
        w = self.current
        return _rss(w.pid) if w and w.alive else None

    # ---- control ---------------------------------------------------------

    def update(self, manifest: Manifest, file: str) -> None:
        """A new desired manifest; restarts the worker only if its hash changed."""
        old = self.manifest
        self.file = file
        if manifest == old:
            return
        self.generation += 1
        self.manifest = manifest
        if manifest.source_changed(old):
            self.weight_bytes = self.measured_bytes = None
        if manifest.worker_hash() != old.worker_hash():
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

    def load(self) -> None:
        """Called by the scheduler once the model fits."""
        if not self.want_loaded:
            self.want_loaded = True
            self._unloaded.clear()
            self._failed.clear()
            self._wake.set()

    def unload(self, reason: str) -> None:
        if self.want_loaded:
            self.want_loaded = False
            self.event("Normal", "Unloading", reason)
            self._wake.set()

    def remove(self) -> None:
        self.removed = True
        self._wake.set()

    async def wait_unloaded(self) -> None:
        await self._unloaded.wait()

    async def wait_ready(self, timeout: float) -> WorkerProcess:
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

    def begin(self) -> WorkerProcess:
        """A request starts on the current worker: it is busy, not idle."""
        w = self.current
        w.acquire()
        self.last_used = time.time()
        if self._idle_timer:
            self._idle_timer.cancel()
            self._idle_timer = None
        return w

    def end(self, w: WorkerProcess) -> None:
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
            ka = self.keep_alive
            self.unload(f"idle for {ka:g}s (keepAlive)")

    # ---- status ----------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append({"time": iso(), "type": type_, "reason": reason,
                            "message": message})
        (log.warning if type_ == "Warning" else log.info)("%s: %s: %s", self.name, reason,
                                                           message)

    def _set_condition(self, type_: str, status: bool, reason: str, message: str) -> None:
        cur = self.conditions.get(type_)
        st = "True" if status else "False"
        if cur and cur["status"] == st and cur["reason"] == reason \
                and cur["message"] == message:
            return
        changed = cur is None or cur["status"] != st
        self.conditions[type_] = {
            "type": type_, "status": st, "reason": reason, "message": message,
            "lastTransitionTime": iso() if changed else cur["lastTransitionTime"]}

    def set_manifest_error(self, message: Optional[str]) -> None:
        self.manifest_error = message
        if message:
            self._set_condition("ManifestValid", False, "ParseError",
                                f"{message} (serving the last good spec)")
        else:
            self._set_condition("ManifestValid", True, "Parsed", "manifest is valid")

    def status(self) -> dict[str, Any]:
        w = self.current
        spec = self.manifest.spec
        footprint = self.footprint()
        ka = self.keep_alive
        exp = expires_at(self.last_used, ka, self.inflight > 0) if self.ready else None
        return {
            "name": self.name, "source": spec.source, "aliases": list(spec.aliases),
            "labels": dict(self.manifest.metadata.labels), "file": self.file,
            "phase": self.phase, "ready": self.ready, "loaded": self.holds_memory,
            "generation": self.generation, "observedGeneration": self.observed_generation,
            "restarts": self.restarts, "pid": w.pid if w and w.alive else None,
            "memoryBytes": self._rss(), "lastError": self.last_error,
            "inflight": self.inflight, "waiting": self.waiters,
            "keepAlive": "forever" if math.isinf(ka) else ka,
            "lastUsed": iso_opt(self.last_used), "expiresAt": iso_opt(exp),
            "pinned": spec.pinned, "priority": spec.priority, "preload": spec.preload,
            "memory": {"estimatedBytes": self.estimated_bytes(),
                       "measuredBytes": self.measured_bytes,
                       "weightBytes": self.weight_bytes, "cacheBytes": self.cache_bytes(),
                       "footprintBytes": footprint},
            "createdAt": iso(self.created),
            "ageSeconds": round(time.time() - self.created, 1),
            "conditions": list(self.conditions.values()),
            "events": list(self.events),
            "logFile": str(self.log_path),
        }

    @property
    def log_path(self) -> Path:
        return self.sup.log_dir / f"{self.name}.log"

    # ---- lifecycle -------------------------------------------------------

    def _new_worker(self) -> WorkerProcess:
        self._seq += 1
        sock = self.sup.runtime_dir / f"{self.name}.{self._seq}.sock"
        s = self.settings
        return WorkerProcess(self.manifest, sock, self.log_path, s.log_max_bytes,
                             s.log_backups, s)

    async def _run(self) -> None:
        try:
            while not self.removed:
                cur = self.current
                if not self.want_loaded:
                    await self._stay_unloaded()
                elif cur is not None and cur.alive and \
                        cur.hash == self.manifest.worker_hash():
                    await self._watch(cur)
                else:
                    await self._start_worker()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - never let one model take down the others
            log.exception("%s: lifecycle task failed", self.name)
            self.last_error = f"supervisor error: {e}"
        finally:
            await self._shutdown()

    async def _stay_unloaded(self) -> None:
        workers = [w for w in (self.starting, self.current) if w is not None]
        if workers:
            self.phase = "Unloading"
            self._ready.clear()
            self.current = self.starting = None
            await asyncio.gather(*(w.stop(self.settings.drain_timeout,
                                          self.settings.stop_timeout) for w in workers))
            self.event("Normal", "Unloaded", "worker stopped; memory released")
            self.unloads += 1
            self.sup.notify_idle()
        self.phase = "Unloaded" if not self.failed_at or self.manifest.spec.preload \
            else "Failed"
        reason = "Unloaded" if self.phase == "Unloaded" else "LoadFailed"
        self._set_condition("Ready", False, reason, "not loaded; loads on the next request"
                            if reason == "Unloaded" else f"{self.last_error}")
        self._unloaded.set()
        self._wake.clear()
        if not self.want_loaded and not self.removed:
            await self._wake.wait()

    async def _watch(self, cur: WorkerProcess) -> None:
        """Serve until the worker exits, the spec changes, or an unload is asked."""
        self._wake.clear()
        exited = asyncio.ensure_future(cur.proc.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({exited, woken}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not exited.done():
            exited.cancel()
            return  # re-evaluate: replace, unload or remove
        if cur.stopping or self.removed:
            return
        ready_for = time.monotonic() - (cur.ready_at or time.monotonic())
        self.failures = failures_after_exit(self.failures, ready_for,
                                            self.settings.stable_period)
        self.last_error = f"worker exited unexpectedly with code {cur.proc.returncode}"
        self.event("Warning", "WorkerCrashed", f"{self.last_error} (pid {cur.pid})")
        self._ready.clear()
        self.current = None
        await cur.close()
        await self._backoff()

    async def _start_worker(self) -> None:
        if self.failures:  # a restart after a crash or a failed start
            self.restarts += 1
        if self.weight_bytes is None:
            from ..sources import weight_bytes

            self.weight_bytes = await asyncio.to_thread(weight_bytes, self.manifest.spec.source,
                                                        self.manifest.spec.revision)
        w = self._new_worker()
        self.starting = w
        replacing = self.current is not None
        self._wake.clear()
        self._failed.clear()
        if replacing:
            self._set_condition("Progressing", True, "NewWorkerStarting",
                                "starting a worker for the new spec; the old one serves")
        else:
            self.phase = "Loading"
            self._set_condition("Ready", False, "Loading", "the worker is loading the model")
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
        self.phase = "Ready"
        self.loads += 1
        self.failed_at = None
        self._ready.set()
        self._set_condition("Ready", True, "WorkerReady", f"worker pid {w.pid} is serving")
        self.event("Normal", "Ready", f"worker pid {w.pid} ready in "
                   f"{time.monotonic() - w.started_at:.1f}s")
        if self.weight_bytes is None:  # a builtin or download now on disk
            from ..sources import weight_bytes

            self.weight_bytes = await asyncio.to_thread(weight_bytes, self.manifest.spec.source,
                                                        self.manifest.spec.revision)
        self._arm_idle_timer()  # a load nobody uses still expires
        if old is not None:
            self._set_condition("Progressing", True, "RolloutComplete",
                                "traffic moved to the new worker")
            self._drain(old)

    async def _failed_start(self, w: WorkerProcess, why: str) -> None:
        self.failures += 1
        self.failed_at = time.monotonic()
        self.last_error = why
        self.event("Warning", "LoadFailed", why)
        w.kill()
        await w.stop(0, self.settings.stop_timeout)
        self._failed.set()  # waiters get the error now, not after the retries
        if self.current is not None:
            self._set_condition("Progressing", False, "NewWorkerFailed",
                                f"{why}; the previous worker keeps serving")
        elif not self.manifest.spec.preload:
            # On-demand models do not retry by themselves: the next request does,
            # once the backoff has passed (see Supervisor.ensure_loaded).
            self.want_loaded = False
            self.sup.notify_idle()
            return
        await self._backoff()

    def retry_after(self) -> float:
        """Seconds until an on-demand model that failed to load may be tried again."""
        if self.failed_at is None:
            return 0.0
        delay = backoff_delay(self.failures, self.settings.backoff_base,
                              self.settings.backoff_cap)
        return max(0.0, self.failed_at + delay - time.monotonic())

    async def _backoff(self) -> None:
        delay = backoff_delay(self.failures, self.settings.backoff_base,
                              self.settings.backoff_cap)
        if self.current is None:
            self.phase = "CrashLoopBackOff"
            self._set_condition("Ready", False, "CrashLoopBackOff",
                                f"{self.last_error}; restarting in {delay:.0f}s")
        self.backoff_until = time.monotonic() + delay
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), delay)
        except asyncio.TimeoutError:
            pass
        self.backoff_until = None

    def _drain(self, old: WorkerProcess) -> None:
        async def stop_old():
            code = await old.stop(self.settings.drain_timeout, self.settings.stop_timeout)
            self.event("Normal", "Stopped", f"old worker pid {old.pid} stopped (code {code})")

        t = asyncio.create_task(stop_old())
        self._draining.add(t)
        t.add_done_callback(self._draining.discard)

    async def _shutdown(self) -> None:
        self.phase = "Terminating"
        self._ready.clear()
        if self._idle_timer:
            self._idle_timer.cancel()
        self._set_condition("Ready", False, "Terminating", "the model is stopping")
        workers = [w for w in (self.starting, self.current) if w is not None]
        self.current = self.starting = None
        for w in workers:
            if w.ready_at is None:
                w.kill()
        await asyncio.gather(*(w.stop(self.settings.drain_timeout, self.settings.stop_timeout)
                               for w in workers), *self._draining, return_exceptions=True)
        self.phase = "Stopped"
        self.want_loaded = False
        self._unloaded.set()
        self.sup.notify_idle()
        self.event("Normal", "Stopped", "all workers stopped")


def _rss(pid: Optional[int]) -> Optional[int]:
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # noqa: BLE001 - the process may be gone already
        return None
