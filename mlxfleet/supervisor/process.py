"""One worker process: spawn, log capture, readiness, stop.

Parent-death detection: the supervisor hands each worker the read end of a
pipe whose write end only the supervisor holds. When the supervisor dies, even
by SIGKILL, the kernel closes the write end, the worker reads EOF and exits.
This works the same on Linux and macOS (unlike ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from ..manifest import Manifest
from .handle import InflightCounter, WorkerFailed, WorkerUnreachable
from .uds_client import UDSClient, UpstreamResponse
from .worker_config import worker_config

log = logging.getLogger("mlxfleet.supervisor")

PARENT_FD_ENV = "MLXFLEET_PARENT_FD"
#: The server's secrets: a worker needs none of them (it is reached only through the gateway).
SECRET_ENV = frozenset({"MLXFLEET_API_KEY", "MLXFLEET_ADMIN_KEY", "MLXFLEET_FLEET_KEY"})
#: Connections opened to a worker as it becomes ready (a first burst of up to this many
#: requests then pays no connection setup; docs/performance.md, "The first burst").
PRIMED_CONNECTIONS = 16


class WorkerProcess(InflightCounter):
    """A spawned ``mlxfleet worker`` for one generation of one model's spec
    (a ``WorkerHandle``)."""

    def __init__(self, manifest: Manifest, socket_path: Path, log_path: Path,
                 log_max_bytes: int, log_backups: int, settings: Any = None,
                 config: Any = None):
        super().__init__()
        self.manifest = manifest
        self.config = config or worker_config(manifest, settings)
        self.spec_hash = manifest.worker_hash()
        self.socket_path = socket_path
        self.log_path = log_path
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.ready_at: Optional[float] = None
        self.paths: Optional[dict] = None  # the worker's parsers and exact paths, once ready
        self.started_at: Optional[float] = None
        self.stopping = False
        self._parent_w: Optional[int] = None
        self._log_task: Optional[asyncio.Task] = None
        self._logger = _file_logger(log_path, log_max_bytes, log_backups)
        self._uds: Optional[UDSClient] = None  # forwarded requests
        self._config_path: Optional[Path] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode if self.proc else None

    async def wait_exit(self) -> Optional[int]:
        return await self.proc.wait()

    def memory_bytes(self) -> Optional[int]:
        if not self.alive:
            return None
        try:
            import psutil

            return psutil.Process(self.pid).memory_info().rss
        except Exception:  # noqa: BLE001 - the process may be gone already
            return None

    def _pool(self) -> UDSClient:
        """The keep-alive connections to this worker's socket: requests, health and
        status all go through them."""
        if self._uds is None:
            self._uds = UDSClient(self.socket_path)
        return self._uds

    async def forward(self, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> UpstreamResponse:
        """Send one request and return the response, its body still streaming."""
        return await self._pool().request(method, path, body, headers)

    async def get_json(self, path: str, timeout: float) -> Optional[dict]:
        """A small JSON answer (``/health``, ``/v1/status``); None when the worker does
        not give one within ``timeout`` seconds."""
        got: list[UpstreamResponse] = []

        async def fetch() -> Any:
            got.append(await self._pool().request("GET", path, b"", {}))
            return json.loads(await got[0].aread())

        try:
            return await asyncio.wait_for(fetch(), timeout)
        except (asyncio.TimeoutError, WorkerUnreachable, WorkerFailed, httpx.HTTPError,
                ValueError, OSError):
            if got:
                await got[0].aclose()  # (half read: the connection is not reused)
            return None

    async def spawn(self) -> None:
        r, w = os.pipe()
        env = {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV},
               **self.manifest.spec.env, PARENT_FD_ENV: str(r), "PYTHONUNBUFFERED": "1"}
        self._logger.info(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting worker "
                          f"{self.manifest.name} ({self.manifest.spec.source}) ---")
        # The configuration goes in a file of the private socket folder, not on the
        # command line: argv is capped (a 210 KB warmPrompts could never start) and any
        # local user reads it in `ps`.
        self._config_path = self.socket_path.with_suffix(".json")
        fd = os.open(self._config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config.model_dump_json())
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mlxfleet", "worker", "--bind",
                f"unix:{self.socket_path}", "--config", f"@{self._config_path}",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env, pass_fds=(r,),
                start_new_session=True)  # our signals are ours to forward, not the tty's
        finally:
            os.close(r)
        self._parent_w = w
        self.started_at = time.monotonic()
        self._log_task = asyncio.create_task(self._pump_logs())

    async def _pump_logs(self) -> None:
        assert self.proc and self.proc.stdout
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            self._logger.info(line.decode(errors="replace").rstrip("\n"))

    async def wait_ready(self, timeout: float) -> tuple[bool, str]:
        """Poll ``/health`` until ready; (False, reason) on exit, load failure or timeout."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while time.monotonic() < deadline:
            if not self.alive:
                return False, f"worker exited with code {self.proc.returncode} while loading"
            h = await self.get_json("/health", 5.0)
            if h is not None:
                if h.get("state") == "ready":
                    self.ready_at, self.paths = time.monotonic(), h.get("paths")
                    await self._pool().prime(PRIMED_CONNECTIONS)
                    return True, ""
                if h.get("state") == "failed":
                    return False, h.get("error") or "the model failed to load"
            await asyncio.sleep(delay)
            # A cold load waits on this poll: at most 0.1 s late (a health check on the
            # worker's socket costs about a millisecond; it was 0.5 s, +0.25 s on average).
            delay = min(delay * 1.5, 0.1)
        return False, f"not ready after {timeout:.0f}s"

    async def stop(self, drain_timeout: float, stop_timeout: float) -> Optional[int]:
        """Let gateway requests finish, SIGTERM (worker drains too), SIGKILL if it lingers."""
        self.stopping = True
        if self.alive and self.inflight and not await self.drained(drain_timeout):
            log.warning("%s: %d requests still running after %.0fs; stopping anyway",
                        self.manifest.name, self.inflight, drain_timeout)
        code = None
        if self.proc is not None:
            if self.alive:
                self._signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(self.proc.wait(), stop_timeout)
            except asyncio.TimeoutError:
                log.warning("%s: worker %s ignored SIGTERM; killing", self.manifest.name,
                            self.pid)
                self._signal(signal.SIGKILL)
                code = await self.proc.wait()
        await self.close()
        return code

    def kill(self) -> None:
        if self.alive:
            self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the worker leads its own process group
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def close(self) -> None:
        if self._parent_w is not None:
            os.close(self._parent_w)
            self._parent_w = None
        if self._log_task is not None:
            try:
                await asyncio.wait_for(self._log_task, 2)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._log_task.cancel()
            self._log_task = None
        if self._uds is not None:
            self._uds.close()
            self._uds = None
        if not self.alive:  # a crashed worker leaves its socket file behind
            self.socket_path.unlink(missing_ok=True)
            if self._config_path is not None:
                self._config_path.unlink(missing_ok=True)


_loggers: dict[str, logging.Logger] = {}


class _PrivateRotatingFile(logging.handlers.RotatingFileHandler):
    """Log files readable by the user only (requests may be logged), after rotation too."""

    def _open(self):
        stream = super()._open()
        os.chmod(self.baseFilename, 0o600)
        return stream


def _file_logger(path: Path, max_bytes: int, backups: int) -> logging.Logger:
    """A rotating file for one model's worker output (shared across its generations)."""
    key = str(path)
    lg = _loggers.get(key)
    if lg is None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lg = logging.getLogger(f"mlxfleet.workerlog.{len(_loggers)}")
        lg.propagate = False
        lg.setLevel(logging.INFO)
        h = _PrivateRotatingFile(path, maxBytes=max_bytes, backupCount=backups)
        h.setFormatter(logging.Formatter("%(message)s"))
        lg.addHandler(h)
        _loggers[key] = lg
    return lg
