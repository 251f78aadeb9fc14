"""A fake ``WorkerHandle``: drives ModelRuntime and admission with no process at all.

Mocked on purpose, for unit tests of the control plane's decisions (the real
worker process is covered by the operator and worker tests). The test decides
when a worker becomes ready, fails to load, crashes, or what ``forward`` does;
every effect is recorded for the assertions, the way llama-swap tests its
scheduler against recorded effects.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from mlxfleet.settings import ServerSettings
from mlxfleet.supervisor.handle import InflightCounter
from mlxfleet.supervisor.supervisor import Supervisor

_pids = itertools.count(1000)


class FakeWorker(InflightCounter):
    def __init__(self, rt: Any, log: list):
        super().__init__()
        self.name = rt.name
        self.spec_hash = rt.manifest.worker_hash()
        self.source = rt.manifest.spec.source
        self.ready_at: Optional[float] = None
        self.started_at: Optional[float] = None
        self.stopping = False
        self.returncode: Optional[int] = None
        self.spawn_error: Optional[str] = None
        self.forward_effects: list[Callable[[], Any]] = []  # consumed one per forward
        self.healthy = True  # False: answers no health check (a frozen process)
        self._pid = next(_pids)
        self._spawned = False
        self._loaded: asyncio.Future = asyncio.get_running_loop().create_future()
        self._exited = asyncio.Event()
        self.log = log

    def record(self, what: str) -> None:
        self.log.append((what, self.name, self._pid))

    # ---- what the test does ----------------------------------------------

    def become_ready(self) -> None:
        if not self._loaded.done():
            self._loaded.set_result((True, ""))

    def fail_load(self, why: str = "the model failed to load") -> None:
        self._loaded.set_result((False, why))
        self.returncode = 1
        self._exited.set()

    def crash(self, code: int = -9) -> None:
        self.returncode = code
        self._exited.set()
        self.record("crash")

    # ---- WorkerHandle ----------------------------------------------------

    @property
    def pid(self) -> Optional[int]:
        return self._pid if self._spawned else None

    @property
    def alive(self) -> bool:
        return self._spawned and self.returncode is None

    async def spawn(self) -> None:
        if self.spawn_error:
            raise OSError(self.spawn_error)
        self._spawned = True
        self.started_at = time.monotonic()
        self.record("spawn")

    async def wait_ready(self, timeout: float) -> tuple[bool, str]:
        try:
            ok, why = await asyncio.wait_for(asyncio.shield(self._loaded), timeout)
        except asyncio.TimeoutError:
            return False, f"not ready after {timeout:.0f}s"
        if ok:
            self.ready_at = time.monotonic()
            self.record("ready")
        return ok, why

    async def wait_exit(self) -> Optional[int]:
        await self._exited.wait()
        return self.returncode

    async def forward(self, method: str, path: str, body: bytes, headers: dict) -> Any:
        self.record(f"forward {path}")
        effect = self.forward_effects.pop(0) if self.forward_effects else (lambda: "ok")
        return effect()

    async def get_json(self, path: str, timeout: float) -> Optional[dict]:
        return {"status": "ok", "state": "ready"} if self.healthy else None

    def memory_bytes(self) -> Optional[int]:
        return None

    async def stop(self, drain_timeout: float, stop_timeout: float) -> Optional[int]:
        self.stopping = True
        if self.inflight:
            await self.drained(drain_timeout)
        if self.returncode is None:
            self.returncode = 0
            self._exited.set()
        self.record("stop")
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9
            self._exited.set()
            self.record("kill")

    async def close(self) -> None:
        pass


class FakeNode:
    """A Supervisor over a manifests folder whose workers are FakeWorkers."""

    def __init__(self, root: Path, **settings: Any):
        self.dir = root / "manifests"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log: list = []
        self.workers: list[FakeWorker] = []
        opts = {"backoff_base": 0.01, "backoff_cap": 0.05, "worker_overhead_mb": 0,
                "health_interval": 0.01, "spec_settle_ms": 0,
                "drain_timeout": 2.0, "keep_alive": "forever", **settings}
        self.sup = Supervisor(ServerSettings(manifests_dir=self.dir, state_dir=root / "state",
                                             **opts), worker_factory=self._new)

    def _new(self, rt: Any) -> FakeWorker:
        w = FakeWorker(rt, self.log)
        self.workers.append(w)
        return w

    def write(self, name: str, file: Optional[str] = None, **spec: Any) -> None:
        import yaml

        doc = {"apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": name},
               "spec": {"source": f"/nonexistent/{name}", **spec}}
        (self.dir / (file or f"{name}.yaml")).write_text(yaml.safe_dump(doc))

    def effects(self, name: Optional[str] = None) -> list[str]:
        return [what for what, n, _ in self.log if name is None or n == name]

    async def close(self) -> None:
        await self.sup.stop()


async def until(pred: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Let the event loop run until ``pred()`` holds (fails the test after ``timeout``).

    A condition here takes milliseconds; the generous timeout is for a loaded CI machine.
    A condition that holds only for a while (a backoff) must hold for seconds, or a
    stalled event loop misses it whatever the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        await asyncio.sleep(0.001)
    raise AssertionError(f"condition not met in {timeout}s")
