"""Shared fixtures: real worker processes serving real (tiny, builtin) MLX models."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _one_default_tls_context() -> None:
    """Every httpx client the tests make shares one default TLS context. httpx builds a
    new one per client, parsing certifi's bundle again: 43 ms of CPU on these machines,
    and ``httpx.get`` in a polling loop makes a client per poll, so a test waiting on a
    server at 10 polls a second took ~40% of a core from the server it waited on (and
    no test here speaks TLS with the default context: those that use TLS bring their own)."""
    from httpx._transports import default

    made = default.create_ssl_context
    shared = []

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        if not shared:
            shared.append(made(verify=True, trust_env=trust_env))
        return shared[0]

    default.create_ssl_context = create_ssl_context


_one_default_tls_context()

# One BLAS thread in every process the tests start. OpenBLAS (mlxfleet/blas.py) runs a
# thread per core that spins between matmuls; with two test processes and their
# workers sharing these 2 cores, the spinning took about a tenth of a zoo test's CPU
# time (four families: system time 7.3 -> 3.2 s of ~40 s; wall time the same) from the
# process beside it. The tiny models' matmuls gain nothing from a second thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The tests' own MLX (mlx-lm references, in-process engines) on the BLAS workers use.
from mlxfleet.blas import preload_blas  # noqa: E402

preload_blas()

#: The fast tier (``bash scripts/test.sh fast``, well under 90 s): pure decisions as
#: tables, the control plane against fake workers, formatters, in-process engine steps.
#: Run it on every change; the rest (real processes, real models) runs in CI.
FAST = frozenset({
    "test_scheduler.py", "test_lifecycle.py", "test_formatters.py", "test_placement.py",
    "test_manifest.py", "test_engine_policy.py", "test_engine_steps.py",
    "test_uds_client.py", "test_mlx_lm_api.py", "test_prompt_cache.py", "test_replicas.py",
    "test_accelerator.py"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in FAST:
            item.add_marker(pytest.mark.fast)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    """A ``mlxfleet worker`` subprocess and the URL it answers on."""

    def __init__(self, args: list[str], log_path: Path, uds: Optional[str] = None,
                 port: Optional[int] = None):
        self.args, self.log_path, self.uds, self.port = args, log_path, uds, port
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxfleet", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def base_url(self) -> str:
        return "http://worker" if self.uds else f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(base_url=self.base_url, transport=transport, timeout=60, **kw)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                with self.client() as c:
                    if c.get("/health").status_code == 200:
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready in {timeout}s:\n{self.logs()}")

    def status(self) -> dict:
        with self.client() as c:
            return c.get("/v1/status").json()

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def start_worker(tmp_path_factory):
    """Factory: start a worker with extra CLI args; all are stopped at session end."""
    procs: list[WorkerProc] = []

    def start(*extra: str, source: str = "builtin:tiny", name: str = "tiny",
              uds: bool = False, wait: bool = True) -> WorkerProc:
        d = tmp_path_factory.mktemp("worker")
        if uds:
            path = str(d / "w.sock")
            bind, port = f"unix:{path}", None
        else:
            path, port = None, free_port()
            bind = f"127.0.0.1:{port}"
        w = WorkerProc(["worker", "--source", source, "--name", name, "--bind", bind, *extra],
                       d / "worker.log", uds=path, port=port)
        procs.append(w)
        if wait:
            w.wait_ready()
        return w

    yield start
    for w in procs:
        w.stop()


@pytest.fixture(scope="session")
def worker(start_worker) -> WorkerProc:
    """The shared worker most tests talk to: builtin:tiny, 16 concurrent sequences."""
    return start_worker("--max-concurrency", "16", "--max-request-tokens", "1500",
                        "--temperature", "0.7")


@pytest.fixture(scope="session")
def demo_served(tmp_path_factory):
    """One ``mlxfleet serve`` shared by the protocol tests (test_api_breadth,
    test_responses): ``demo`` (the trained model, greedy, alias ``default``), ``tiny``
    (reasoning parser qwen3) and ``tiny10m`` (builtin:tiny-10m); the Responses store
    keeps 3 per key."""
    from served import Served, manifest

    f = Served(tmp_path_factory.mktemp("demo-fleet"), env={"MLXFLEET_RESPONSES_STORE_MAX": "3"})
    f.write("demo.yaml", manifest("demo", source="builtin:demo", aliases=["default"],
                                  defaults={"temperature": 0}))
    f.write("tiny.yaml", manifest("tiny", parsers={"reasoning": "qwen3"}))
    f.write("tiny10m.yaml", manifest("tiny10m", source="builtin:tiny-10m"))
    f.start()
    for name in ("demo", "tiny", "tiny10m"):
        f.wait_ready(name)
    yield f
    f.stop()


#: Debian's chromium (scripts/setup.sh test installs it), for the dashboard's tests.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium driven by Playwright."""
    from playwright.sync_api import sync_playwright

    if CHROMIUM is None and not os.environ.get("CI"):
        pytest.skip("no chromium here (scripts/setup.sh test installs it)")
    assert CHROMIUM, "chromium is missing: scripts/setup.sh test installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
