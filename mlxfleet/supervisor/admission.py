"""Admission: from a model name to a lease on a ready worker, or one typed error.

``Supervisor.acquire(name, deadline)`` is the only way a request reaches a
worker: it resolves the name or alias and asks the model (a ``ServedModel``:
``ModelRuntime`` for one this node runs, ``RemoteModel`` for one another node
runs) for a ``Lease``. The model owns its readiness: ``ensure_ready`` loads it on
demand and waits, bounded by the queue (``batching.maxQueue``) and the request's
deadline. A lease counts the request in flight until released; ``Lease.send``
retries once when the worker died before receiving anything. Every failure is an
``AdmissionError``: a status, a code, a message and when to retry, which each
protocol renders in its own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Optional, Protocol

from ..manifest import Manifest
from ..wire import APIError, error_type_for
from .handle import WorkerFailed, WorkerHandle, WorkerUnreachable
from .lifecycle import ModelPhase


class AdmissionError(APIError):
    """Why a request cannot be served now; ``retry_after`` seconds may change that."""

    def __init__(self, status: int, message: str, code: str,
                 retry_after: Optional[float] = None, param: Optional[str] = None):
        headers = {"Retry-After": str(max(1, round(retry_after)))} \
            if retry_after is not None else None
        super().__init__(status, message, type=error_type_for(status), code=code,
                         param=param, headers=headers)
        self.retry_after = retry_after


def time_left(deadline: float) -> float:
    """Seconds until a ``time.monotonic()`` deadline (never negative)."""
    return max(0.0, deadline - time.monotonic())


if sys.version_info >= (3, 11):
    def until(deadline: float) -> Any:
        """``async with until(deadline):`` raises ``TimeoutError`` when the deadline passes.
        Unlike ``asyncio.wait_for`` it starts no task: it is on every request's path."""
        return asyncio.timeout(time_left(deadline))
else:  # pragma: no cover - Python 3.10
    @contextlib.asynccontextmanager
    async def until(deadline: float) -> Any:
        task = asyncio.current_task()
        fired = []
        handle = asyncio.get_running_loop().call_later(
            time_left(deadline), lambda: (fired.append(1), task.cancel()))
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            handle.cancel()


def timeout_error(name: str, timeout: float = 0) -> AdmissionError:
    after = f" after {timeout:g}s" if timeout else ""
    return AdmissionError(504, f"The request to model '{name}' timed out{after}.", "timeout")


class ServedModel(Protocol):
    """A model the gateway routes to, wherever it runs: ``ModelRuntime`` (this node runs
    it) or ``RemoteModel`` (another node does). The gateway and the control API use
    only this; none of them asks which one it has."""

    manifest: Manifest
    file: str

    @property
    def name(self) -> str: ...

    @property
    def node(self) -> Optional[str]:
        """The node that runs it (None: this server is not in a fleet, or no node can)."""

    @property
    def phase(self) -> ModelPhase: ...

    @property
    def ready(self) -> bool: ...

    @property
    def inflight(self) -> int: ...

    @property
    def paths(self) -> Optional[dict]:
        """How its worker runs it (``engine.paths``), once it serves."""

    @property
    def waiters(self) -> int:
        """Requests waiting for it to load."""

    def status(self) -> dict[str, Any]: ...

    async def ensure_ready(self, deadline: float) -> None:
        """Load it if needed and wait until it serves; raises ``AdmissionError``."""

    async def acquire(self, deadline: float, keep_alive: Optional[float] = None) -> Lease:
        """A lease on its worker once it serves (``keep_alive`` from the request)."""

    def begin(self) -> WorkerHandle:
        """A request starts on its worker (called by ``Lease``)."""

    def end(self, w: WorkerHandle) -> None: ...

    async def load(self, deadline: float, keep_alive: Optional[float] = None) -> dict:
        """Load it and wait until it serves; its status after."""

    async def unload(self, reason: str) -> dict:
        """Unload it once its requests finish; its status after."""

    async def logs(self, tail: int, follow: bool) -> AsyncIterator[str]:
        """Its worker's last ``tail`` log lines, then new ones as they come if
        ``follow``; raises before the first line when they cannot be had."""


class Lease:
    """One request's hold on a ready worker: it counts in flight until released."""

    def __init__(self, model: ServedModel, deadline: float):
        self.model, self.deadline = model, deadline
        self.worker: Optional[WorkerHandle] = model.begin()

    @property
    def name(self) -> str:
        return self.model.name

    def release(self) -> None:
        """Idempotent: the request no longer holds the worker."""
        if self.worker is not None:
            w, self.worker = self.worker, None
            self.model.end(w)

    async def send(self, method: str, path: str, body: bytes,
                   headers: dict[str, str]) -> Any:
        """Forward one request; the streaming response. A worker that received nothing
        (it just crashed or is stopping) is waited for once, then it is a 502 (a 503
        with Retry-After when it may be back: a node of the fleet that does not answer)."""
        for attempt in range(2):
            try:
                async with until(self.deadline):
                    return await self.worker.forward(method, path, body, headers)
            except WorkerUnreachable as e:
                if attempt == 1:
                    if e.retry_after is not None:
                        raise AdmissionError(503, str(e), e.code,
                                             retry_after=e.retry_after) from None
                    raise AdmissionError(502, f"The worker for model '{self.name}' failed: "
                                         f"{e}", e.code) from None
                self.release()
                await asyncio.sleep(0.2)
                await self.model.ensure_ready(self.deadline)
                self.worker = self.model.begin()
            except WorkerFailed as e:
                if e.retry_after is not None:
                    raise AdmissionError(503, str(e), e.code,
                                         retry_after=e.retry_after) from None
                raise AdmissionError(502, f"The worker for model '{self.name}' failed: {e}",
                                     e.code) from None
            except (asyncio.TimeoutError, TimeoutError):
                raise timeout_error(self.name) from None
        raise AssertionError("unreachable")

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


class Acquire:
    """``async with sup.acquire(...) as lease`` or ``lease = await sup.acquire(...)``
    (then ``lease.release()`` when done, e.g. at the end of a relayed stream)."""

    def __init__(self, get: Callable[[], Awaitable[Lease]]):
        self._get = get
        self._lease: Optional[Lease] = None

    def __await__(self):
        return self._get().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._get()
        return self._lease

    async def __aexit__(self, *exc: Any) -> None:
        if self._lease is not None:
            self._lease.release()
