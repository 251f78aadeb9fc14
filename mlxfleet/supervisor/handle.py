"""The worker interface: what the supervisor and the gateway may do with a worker.

``WorkerProcess`` (process.py) is a local process on a Unix socket; the tests'
``FakeWorker`` drives the lifecycle with no process at all; a worker on another
node will be a third implementation. Nothing above this line knows which.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Protocol, runtime_checkable


class WorkerUnreachable(Exception):
    """Nothing reached the worker (it is not listening): the request may be retried.
    ``retry_after``: when it may be back (a node of a fleet that does not answer)."""

    def __init__(self, message: str, retry_after: Optional[float] = None,
                 code: str = "worker_unavailable"):
        super().__init__(message)
        self.retry_after, self.code = retry_after, code


class WorkerFailed(Exception):
    """The worker broke off an exchange that had started. ``retry_after`` and ``code``:
    when it may be back and why (a node of a fleet that went silent: a 503)."""

    def __init__(self, message: str, retry_after: Optional[float] = None,
                 code: str = "worker_unavailable"):
        super().__init__(message)
        self.retry_after, self.code = retry_after, code


@runtime_checkable
class WorkerHandle(Protocol):
    """One worker serving one generation of one model's spec."""

    spec_hash: str  # the manifest's worker hash this worker runs
    inflight: int  # requests leased to this worker
    ready_at: Optional[float]  # monotonic time it became ready
    started_at: Optional[float]
    stopping: bool

    @property
    def pid(self) -> Optional[int]: ...

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> Optional[int]: ...

    async def spawn(self) -> None:
        """Start it; raises OSError if it cannot start at all."""

    async def wait_ready(self, timeout: float) -> tuple[bool, str]:
        """(True, "") once it serves; (False, why) if it died, failed or timed out."""

    async def wait_exit(self) -> Optional[int]:
        """Return its exit code once it has exited."""

    async def forward(self, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> Any:
        """Send one request; a streaming response (``httpx.Response``). Raises
        ``WorkerUnreachable`` when nothing was sent, ``WorkerFailed`` otherwise."""

    async def get_json(self, path: str, timeout: float) -> Optional[dict]:
        """A small JSON document from the worker (status), or None."""

    def memory_bytes(self) -> Optional[int]:
        """Resident memory, when it can be measured."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...

    async def stop(self, drain_timeout: float, stop_timeout: float) -> Optional[int]:
        """Let leased requests finish (up to ``drain_timeout``), then stop it."""

    def kill(self) -> None: ...

    async def close(self) -> None: ...


class InflightCounter:
    """Leases on a worker, and an event for "none left" (for draining)."""

    def __init__(self) -> None:
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)
        if self.inflight == 0:
            self._idle.set()

    async def drained(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
