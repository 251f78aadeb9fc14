"""Admission: from a model to a lease on a worker that serves it, or one typed error.

The gateway resolves a request's model name (``Supervisor.find``) to a ``ServedModel``:
``ModelRuntime`` for a model this node runs, ``RemoteModel`` for one another node
runs. ``ServedModel.lease`` is the only way a request reaches a worker. For a local
model the node's scheduler decides (scheduler.py): it grants the request a worker
at once, loads the model on demand and grants it then, or refuses it. A lease
counts the request in flight until released; ``Lease.send`` retries once when the
worker died before receiving anything. Every failure is an ``AdmissionError``: a
status, a code, a message and when to retry, which each protocol renders in its
own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, Optional

from ..manifest import Manifest
from .handle import WorkerFailed, WorkerHandle, WorkerUnreachable
from .lifecycle import ModelPhase
from .scheduler import AdmissionError

__all__ = ["AdmissionError", "Lease", "ServedModel", "time_left", "timeout_error", "until"]


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


class ServedModel(ABC):
    """A model the gateway routes to, wherever it runs: ``ModelRuntime`` (this node runs
    it) or ``RemoteModel`` (another node does). The gateway, the control API and the
    metrics use only this; none of them asks which one it has."""

    manifest: Manifest
    file: str
    created: float
    weight_bytes: Optional[int]  # its weights on disk, once known

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    @abstractmethod
    def node(self) -> Optional[str]:
        """The node that runs it (None: this server is not in a fleet, or no node can)."""

    @property
    @abstractmethod
    def phase(self) -> ModelPhase: ...

    @property
    @abstractmethod
    def ready(self) -> bool: ...

    @property
    @abstractmethod
    def inflight(self) -> int:
        """Requests it is serving."""

    @property
    @abstractmethod
    def waiters(self) -> int:
        """Requests waiting for it to load."""

    @property
    @abstractmethod
    def keep_alive(self) -> float:
        """Seconds it stays loaded once idle (inf: forever)."""

    @property
    @abstractmethod
    def paths(self) -> Optional[dict]:
        """How its worker runs it (``engine.paths``), once it serves."""

    @abstractmethod
    def status(self) -> dict[str, Any]: ...

    async def lease(self, deadline: float, keep_alive: Optional[float] = None) -> Lease:
        """A lease on a worker that serves it, loading it first if needed; raises
        ``AdmissionError``. ``keep_alive`` (a request's) replaces the manifest's."""
        return Lease(self, await self.hold(deadline, keep_alive), deadline)

    @abstractmethod
    async def hold(self, deadline: float, keep_alive: Optional[float] = None
                   ) -> WorkerHandle:
        """A worker for one request, counted in flight until ``let_go``."""

    @abstractmethod
    def let_go(self, w: WorkerHandle) -> None:
        """The request that held ``w`` is done."""

    @abstractmethod
    async def worker_status(self) -> Optional[dict]:
        """Its serving worker's ``/v1/status``, when this node runs it and it serves."""

    @abstractmethod
    async def load(self, deadline: float, keep_alive: Optional[float] = None) -> dict:
        """Load it and wait until it serves; its status after."""

    @abstractmethod
    async def unload(self, reason: str = "unload requested") -> dict:
        """Unload it once its requests finish; its status after."""

    @abstractmethod
    async def logs(self, tail: int, follow: bool) -> AsyncIterator[str]:
        """Its worker's last ``tail`` log lines, then new ones as they come if
        ``follow``; raises before the first line when they cannot be had."""


class Lease:
    """One request's hold on a ready worker: it counts in flight until released."""

    def __init__(self, model: ServedModel, worker: WorkerHandle, deadline: float):
        self.model, self.deadline = model, deadline
        self.worker: Optional[WorkerHandle] = worker

    @property
    def name(self) -> str:
        return self.model.name

    def release(self) -> None:
        """Idempotent: the request no longer holds the worker."""
        if self.worker is not None:
            w, self.worker = self.worker, None
            self.model.let_go(w)

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
                self.worker = await self.model.hold(self.deadline)
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
