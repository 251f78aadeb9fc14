"""One model's lifecycle: start, readiness, crash backoff, rolling replace, stop.

Each model has one asyncio task that drives its worker toward the current
manifest. A spec change starts a new worker while the old one keeps serving;
traffic moves only when the new one is Ready, then the old one drains.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from ..manifest import Manifest
from .process import WorkerProcess
from .reconcile import backoff_delay, failures_after_exit

log = logging.getLogger("mlxfleet.supervisor")


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        self.restarts = 0
        self.failures = 0  # consecutive, for the backoff
        self.last_error: Optional[str] = None
        self.phase = "Pending"
        self.created = time.time()
        self.removed = False
        self.manifest_error: Optional[str] = None
        self.events: collections.deque = collections.deque(maxlen=50)
        self.conditions: dict[str, dict[str, Any]] = {}
        self.backoff_until: Optional[float] = None
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._seq = 0
        self._draining: set[asyncio.Task] = set()
        self._set_condition("Ready", False, "Pending", "no worker yet")
        self.task = asyncio.create_task(self._run(), name=f"model:{manifest.name}")

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.alive and self._ready.is_set()

    # ---- control ---------------------------------------------------------

    def update(self, manifest: Manifest, file: str) -> None:
        """A new desired manifest; restarts the worker only if its hash changed."""
        old = self.manifest
        self.file = file
        if manifest == old:
            return
        self.generation += 1
        self.manifest = manifest
        if manifest.worker_hash() != old.worker_hash():
            self.event("Normal", "SpecChanged", "spec changed; rolling to a new worker")
            self.failures = 0
            self._wake.set()
        else:
            self.event("Normal", "Updated", "updated without restart (aliases, labels, "
                       "keepAlive, preload or pinned)")
            if self.ready:
                self.observed_generation = self.generation

    def remove(self) -> None:
        self.removed = True
        self._wake.set()

    async def wait_ready(self, timeout: float) -> WorkerProcess:
        """The ready worker, waiting while one starts; raises TimeoutError."""
        await asyncio.wait_for(self._ready.wait(), timeout)
        if self.current is None:
            raise TimeoutError
        return self.current

    # ---- status ----------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append({"time": _now_iso(), "type": type_, "reason": reason,
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
            "lastTransitionTime": _now_iso() if changed else cur["lastTransitionTime"]}

    def set_manifest_error(self, message: Optional[str]) -> None:
        self.manifest_error = message
        if message:
            self._set_condition("ManifestValid", False, "ParseError",
                                f"{message} (serving the last good spec)")
        else:
            self._set_condition("ManifestValid", True, "Parsed", "manifest is valid")

    def status(self) -> dict[str, Any]:
        w = self.current
        rss = _rss(w.pid) if w and w.alive else None
        spec = self.manifest.spec
        return {
            "name": self.name, "source": spec.source, "aliases": list(spec.aliases),
            "labels": dict(self.manifest.metadata.labels), "file": self.file,
            "phase": self.phase, "ready": self.ready,
            "generation": self.generation, "observedGeneration": self.observed_generation,
            "restarts": self.restarts, "pid": w.pid if w and w.alive else None,
            "memoryBytes": rss, "lastError": self.last_error,
            "inflight": (w.inflight if w else 0),
            "createdAt": datetime.fromtimestamp(self.created, timezone.utc)
            .strftime("%Y-%m-%dT%H:%M:%SZ"),
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
                             s.log_backups)

    async def _run(self) -> None:
        try:
            while not self.removed:
                cur = self.current
                if cur is not None and cur.alive and cur.hash == self.manifest.worker_hash():
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

    async def _watch(self, cur: WorkerProcess) -> None:
        """Serve until the worker exits or the spec changes."""
        self._wake.clear()
        exited = asyncio.ensure_future(cur.proc.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({exited, woken}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not exited.done():
            exited.cancel()
            return  # re-evaluate: replace or remove
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
        w = self._new_worker()
        self.starting = w
        replacing = self.current is not None
        self._wake.clear()
        if replacing:
            self._set_condition("Progressing", True, "NewWorkerStarting",
                                "starting a worker for the new spec; the old one serves")
        else:
            self.phase = "Starting"
            self._set_condition("Ready", False, "Starting", "the worker is loading the model")
        try:
            await w.spawn()
        except OSError as e:
            self.starting = None
            await self._failed(w, f"could not start the worker: {e}")
            return
        self.event("Normal", "Starting", f"started worker pid {w.pid} for generation "
                   f"{self.generation}")
        ready = asyncio.ensure_future(w.wait_ready(self.settings.startup_timeout))
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({ready, woken}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not ready.done():  # spec changed again or model removed while loading
            ready.cancel()
            self.starting = None
            w.kill()
            await w.stop(0, self.settings.stop_timeout)
            self.event("Normal", "StartAbandoned", "superseded while loading")
            return
        ok, why = ready.result()
        self.starting = None
        if not ok:
            await self._failed(w, why)
            return
        old, self.current = self.current, w
        self.observed_generation = self.generation
        self.phase = "Ready"
        self._ready.set()
        self._set_condition("Ready", True, "WorkerReady", f"worker pid {w.pid} is serving")
        self.event("Normal", "Ready", f"worker pid {w.pid} ready in "
                   f"{time.monotonic() - w.started_at:.1f}s")
        if old is not None:
            self._set_condition("Progressing", True, "RolloutComplete",
                                "traffic moved to the new worker")
            self._drain(old)

    async def _failed(self, w: WorkerProcess, why: str) -> None:
        self.failures += 1
        self.last_error = why
        self.event("Warning", "StartFailed", why)
        w.kill()
        await w.stop(0, self.settings.stop_timeout)
        if self.current is not None:
            self._set_condition("Progressing", False, "NewWorkerFailed",
                                f"{why}; the previous worker keeps serving")
        await self._backoff()

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
        self._set_condition("Ready", False, "Terminating", "the model is stopping")
        workers = [w for w in (self.starting, self.current) if w is not None]
        self.current = self.starting = None
        for w in workers:
            if w.ready_at is None:
                w.kill()
        await asyncio.gather(*(w.stop(self.settings.drain_timeout, self.settings.stop_timeout)
                               for w in workers), *self._draining, return_exceptions=True)
        self.phase = "Stopped"
        self.event("Normal", "Stopped", "all workers stopped")


def _rss(pid: Optional[int]) -> Optional[int]:
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # noqa: BLE001 - the process may be gone already
        return None
