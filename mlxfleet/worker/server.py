"""Run one worker in the foreground: ``mlxfleet worker --source ... --bind ...``.

The HTTP server answers at once (``/health`` is 503 while the model loads),
so a supervisor can watch the load. SIGTERM/SIGINT stop accepting, let
in-flight requests finish (up to ``drain_timeout``), then exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Optional

from ..worker_settings import WorkerConfig

log = logging.getLogger("mlxfleet.worker")

PARENT_FD_ENV = "MLXFLEET_PARENT_FD"  # set by the supervisor (see supervisor/process.py)


def _hypercorn_bind(bind: str) -> str:
    if bind.startswith("unix:"):
        path = bind[len("unix:"):]
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a previous run
        return bind
    return bind


async def serve_worker(config: WorkerConfig, bind: str,
                       stop: Optional[asyncio.Event] = None) -> None:
    """Load the model on the engine thread and serve HTTP until stopped."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from .routes import create_app

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if config.task == "embedding":
        from .embeddings import EmbeddingEngine, create_embedding_app

        engine = EmbeddingEngine(config.source, config.revision)
        app = create_embedding_app(engine, config.name)
    else:
        from .engine import Engine

        engine = Engine(config)
        app = create_app(engine)
    hc = Config()
    hc.bind = [_hypercorn_bind(bind)]
    hc.graceful_timeout = config.drain_timeout
    hc.keep_alive_timeout = 75  # clients (and the gateway) keep connections pooled
    # room in the accept queue for every request the worker takes (the kernel caps it:
    # somaxconn); the gateway connects a few at a time besides (uds_client)
    hc.backlog = max(1024, config.max_concurrency + config.max_queue)
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    _watch_parent(loop, stop)
    engine.start(loop)
    log.info("worker %s serving %s on %s", config.name, config.source, bind)
    try:
        await serve(app, hc, shutdown_trigger=stop.wait)
    finally:
        log.info("worker %s stopping", config.name)
        await loop.run_in_executor(None, engine.stop)
        if bind.startswith("unix:"):
            try:
                os.unlink(bind[len("unix:"):])
            except FileNotFoundError:
                pass


def _watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Exit when the supervisor dies: its end of our pipe closes and we read EOF."""
    fd = os.environ.pop(PARENT_FD_ENV, None)
    if fd is None:
        return
    fd = int(fd)

    def on_readable() -> None:
        try:
            data = os.read(fd, 1)
        except OSError:
            data = b""
        if data:
            return
        loop.remove_reader(fd)
        log.warning("supervisor is gone; exiting")
        stop.set()
        loop.call_later(5.0, os._exit, 1)  # in case draining hangs

    loop.add_reader(fd, on_readable)


def run_worker(config: WorkerConfig, bind: str) -> int:
    from ..event_loop import run_loop
    from ..transformers_imports import install

    _without_torch(config)
    install()  # (0.8 s of every worker start: transformers' folder walk, from disk)
    _fewer_collections()
    run_loop(serve_worker(config, bind))
    # Drained and stopped: leave now, without the interpreter's teardown. MLX's CUDA
    # backend aborts in its static destructors ("terminate called without an active
    # exception", exit code 134) when Python unloads it; nothing is left to flush but
    # our own streams.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: Allocations between young-generation collections (Python's default: 700).
GC_GEN0 = 10_000


def _fewer_collections() -> None:
    """Python's cyclic garbage collector at its default thresholds took 1.1 s of a
    256-stream burst (`builtin:tiny`, 14 s, half of it full collections over a heap that
    the prompt cache's token trie grows by 120k objects a burst), each pause holding the
    GIL. Young collections every 10,000 allocations instead of 700 made it 0.19 s, with
    no full collection during a burst; the engine collects in full when it goes idle
    (``Engine._idle_wait``), so cycles a burst leaves, MLX arrays among them, do not wait
    for the next one."""
    import gc

    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])


def _without_torch(config: WorkerConfig) -> None:
    """A worker computes with MLX only, yet transformers imports torch whenever it is
    installed: 2 s of every worker start measured here, and its memory. Text and
    embedding workers hide it (``find_spec`` then reports it missing). A vision model
    keeps it for image processors that need it, a checkpoint's own code
    (``trustRemoteCode``) in case it imports it, and so does a checkpoint not on disk yet
    (it might be either)."""
    from ..sources import is_vision_checkpoint, local_dir

    if config.task == "vision" or config.trust_remote_code or "torch" in sys.modules:
        return
    path = local_dir(config.source, config.revision)
    if path is not None and not is_vision_checkpoint(path):
        sys.modules["torch"] = None  # type: ignore[assignment]
