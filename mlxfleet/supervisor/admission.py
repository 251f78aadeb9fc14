"""Admission: from a model name to a lease on a ready worker, or one typed error.

``Supervisor.acquire(name, deadline)`` is the only way a request reaches a
worker. It resolves the name or alias, applies a per-request keep-alive, bounds
the queue (``batching.maxQueue``: requests beyond ``maxConcurrency`` that may
wait, for the load or for a batch slot), loads the model on demand and waits for it,
and counts the request in flight until the lease is released. ``Lease.send``
retries once when the worker died before receiving anything. Every failure is
an ``AdmissionError``: a status, a code, a message and when to retry, which
each protocol renders in its own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from ..wire import APIError, error_type_for
from .handle import WorkerFailed, WorkerHandle, WorkerUnreachable
from .lifecycle import ModelPhase

if TYPE_CHECKING:
    from .runtime import ModelRuntime
    from .supervisor import Supervisor


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


def queue_check(rt: ModelRuntime) -> None:
    """503 when the model already has ``maxConcurrency + maxQueue`` requests, running or
    waiting (for its load or for a batch slot): the same count the worker keeps."""
    cfg = rt.worker_config
    held = rt.waiters + rt.inflight
    if held >= cfg.max_concurrency + cfg.max_queue:
        raise AdmissionError(503, f"Model '{rt.name}' has {held} requests running or waiting "
                             f"(maxConcurrency {cfg.max_concurrency} + maxQueue "
                             f"{cfg.max_queue}); retry shortly.", "queue_full", retry_after=2)


async def until_ready(sup: Supervisor, rt: ModelRuntime, deadline: float) -> None:
    """Load ``rt`` if needed (one load, shared by every waiter) and wait for it.

    504 when the request's ``deadline`` passes first; 503 for everything that
    keeps the model from serving (backoff, failed load, no memory, too slow).
    """
    if rt.ready and rt.want_loaded:
        return
    if rt.phase is ModelPhase.BACKOFF:
        retry = rt.retry_after()
        raise AdmissionError(503, f"Model '{rt.name}' is not available: {rt.last_error}. "
                             f"Restarting in about {max(1, round(retry))}s.",
                             "model_unavailable", retry_after=retry)
    queue_check(rt)
    wait = sup.settings.request_wait_timeout
    limit = min(deadline, time.monotonic() + wait)
    rt.waiters += 1
    try:
        await asyncio.wait_for(_load_and_wait(sup, rt, limit), time_left(limit))
    except RuntimeError as e:  # the load failed: every waiter hears why
        raise AdmissionError(503, f"Model '{rt.name}' failed to load: {e}",
                             "model_load_failed", retry_after=rt.retry_after()) from None
    except (asyncio.TimeoutError, TimeoutError):
        if limit >= deadline:
            raise timeout_error(rt.name) from None
        raise AdmissionError(503, f"Model '{rt.name}' did not become ready in {wait:.0f}s"
                             + (f": {rt.last_error}" if rt.last_error else "."),
                             "model_unavailable", retry_after=5) from None
    finally:
        rt.waiters -= 1


async def _load_and_wait(sup: Supervisor, rt: ModelRuntime, limit: float) -> None:
    while not (rt.ready and rt.want_loaded):
        await sup.ensure_loaded(rt)
        await rt.wait_ready(max(0.1, time_left(limit)))


def timeout_error(name: str, timeout: float = 0) -> AdmissionError:
    after = f" after {timeout:g}s" if timeout else ""
    return AdmissionError(504, f"The request to model '{name}' timed out{after}.", "timeout")


class Lease:
    """One request's hold on a ready worker: it counts in flight until released."""

    def __init__(self, sup: Supervisor, rt: ModelRuntime, deadline: float):
        self.sup, self.rt, self.deadline = sup, rt, deadline
        self.worker: Optional[WorkerHandle] = None

    @property
    def name(self) -> str:
        return self.rt.name

    def _take(self) -> None:
        self.worker = self.rt.begin()

    def release(self) -> None:
        """Idempotent: the request no longer holds the worker."""
        if self.worker is not None:
            w, self.worker = self.worker, None
            self.rt.end(w)

    async def send(self, method: str, path: str, body: bytes,
                   headers: dict[str, str]) -> Any:
        """Forward one request; the streaming response. A worker that received nothing
        (it just crashed or is stopping) is waited for once, then it is a 502."""
        for attempt in range(2):
            try:
                async with until(self.deadline):
                    return await self.worker.forward(method, path, body, headers)
            except WorkerUnreachable as e:
                if attempt == 1:
                    raise AdmissionError(502, f"The worker for model '{self.name}' failed: "
                                         f"{e}", "worker_unavailable") from None
                self.release()
                await asyncio.sleep(0.2)
                await until_ready(self.sup, self.rt, self.deadline)
                self._take()
            except WorkerFailed as e:
                raise AdmissionError(502, f"The worker for model '{self.name}' failed: {e}",
                                     "worker_unavailable") from None
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

    def __init__(self, sup: Supervisor, model: str, deadline: float,
                 keep_alive: Optional[float] = None):
        self.sup, self.model, self.deadline, self.keep_alive = sup, model, deadline, keep_alive
        self._lease: Optional[Lease] = None

    async def _get(self) -> Lease:
        rt = self.sup.resolve(self.model)
        if rt is None:
            known = ", ".join(self.sup.all_names() + sorted(self.sup.aliases)) or "none"
            raise AdmissionError(404, f"The model '{self.model}' does not exist. Available "
                                 f"models: {known}.", "model_not_found", param="model")
        if rt.remote:  # another node admits it, loading the model there if needed
            rt.check()
            lease = Lease(self.sup, rt, self.deadline)
            lease._take()
            return lease
        if self.keep_alive is not None and rt.rank is None:  # sharded models stay loaded
            rt.keep_alive_override = self.keep_alive
        if rt.ready and rt.want_loaded:
            queue_check(rt)
        await until_ready(self.sup, rt, self.deadline)
        lease = Lease(self.sup, rt, self.deadline)
        lease._take()
        return lease

    def __await__(self):
        return self._get().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._get()
        return self._lease

    async def __aexit__(self, *exc: Any) -> None:
        if self._lease is not None:
            self._lease.release()
