"""``Served``: a real ``mlxfleet serve`` process over a temporary manifests folder (one
node, or ``Served.nodes``: several as a fleet), for tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import httpx
import openai
from conftest import free_port


def manifest(name: str, source: str = "builtin:tiny", **spec) -> str:
    """A manifest document as YAML text; ``spec`` values are inlined as YAML flow."""
    import yaml

    body = {"source": source, "preload": True, **spec}
    return yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Model",
                           "metadata": {"name": name}, "spec": body}, sort_keys=False)


def in_parallel(fn: Callable, calls) -> list:
    """Run ``fn`` once per argument tuple in ``calls`` (or ``calls`` times with no
    arguments), all at once; return the results in order, raising the first error."""
    from concurrent.futures import ThreadPoolExecutor

    args = [()] * calls if isinstance(calls, int) else list(calls)
    with ThreadPoolExecutor(len(args)) as ex:
        futures = [ex.submit(fn, *a) for a in args]
        return [f.result(timeout=120) for f in futures]


def wait_for(pred: Callable, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


class Served:
    """One ``mlxfleet serve``; ``manifests`` shares another's folder (nodes of a fleet),
    ``args`` are more flags (``--node a``)."""

    def __init__(self, root: Path, env: Optional[dict] = None,
                 manifests: Optional[Path] = None, args: tuple[str, ...] = ()):
        root.mkdir(parents=True, exist_ok=True)
        self.dir = manifests or root / "manifests"
        self.dir.mkdir(exist_ok=True)
        self.args = args
        self.state = root / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "serve.log"
        # Where the supervisor makes its private socket folder: short, as a socket path
        # must be (pytest's folders, with xdist's, are too deep); removed with the Fleet.
        self.run_dir = Path(tempfile.mkdtemp(prefix="mft-"))
        weakref.finalize(self, shutil.rmtree, self.run_dir, True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLXFLEET_BACKOFF_BASE": "0.5",
                    "MLXFLEET_RELOAD_DEBOUNCE_MS": "100", "MLXFLEET_DRAIN_TIMEOUT": "20",
                    "MLXFLEET_SERVER": self.url,
                    "XDG_RUNTIME_DIR": str(self.run_dir), **(env or {})}
        self.proc: Optional[subprocess.Popen] = None

    @classmethod
    def nodes(cls, root: Path, names: str, env: dict) -> dict[str, Served]:
        """Nodes of one fleet (not started): one shared manifests folder, each node with
        its own port, state and ``--node NAME``."""
        shared = root / "manifests"
        shared.mkdir(exist_ok=True)
        return {n: cls(root / n, env, manifests=shared, args=("--node", n)) for n in names}

    def write(self, filename: str, text: str) -> Path:
        """Write a manifest file atomically, as editors do."""
        p = self.dir / filename
        tmp = self.dir / f".{filename}.tmp"
        tmp.write_text(text)
        os.replace(tmp, p)
        return p

    def start(self) -> Served:
        self.launch()
        ok = wait_for(self._up, timeout=30)
        assert ok, self.logs()
        return self

    @staticmethod
    def start_all(nodes: dict[str, Served]) -> None:
        """Start the nodes of a fleet together, as machines booting at once do (each
        node gives the others ``fleet_grace`` seconds to answer)."""
        for n in nodes.values():
            n.launch()
        for n in nodes.values():
            assert wait_for(n._up, timeout=30), n.logs()

    @staticmethod
    def wait_fleet(nodes: dict[str, Served], timeout: float = 60) -> None:
        """Until every node lists every node of the fleet, and all it lists are Ready."""
        def rows(n: Served) -> dict[str, str]:
            items = httpx.get(n.url + "/mlxfleet/v1/nodes", timeout=5).json()["items"]
            return {r["name"]: r["status"] for r in items}

        def ready(n: Served) -> bool:
            seen = rows(n)
            return set(seen) >= set(nodes) and set(seen.values()) == {"Ready"}

        for n in nodes.values():
            assert wait_for(lambda n=n: ready(n), timeout), (rows(n), n.logs())

    def launch(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxfleet", "serve", "--manifests", str(self.dir),
             "--port", str(self.port), "--state-dir", str(self.state), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve exited:\n{self.logs()}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def cli(self, *args: str, input: Optional[str] = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mlxfleet", *args], capture_output=True,
                              text=True, env=self.env, timeout=60, input=input)

    @property
    def headers(self) -> dict:
        key = self.env.get("MLXFLEET_API_KEY", "").split(",")[0].strip()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def models(self) -> dict:
        r = httpx.get(self.url + "/mlxfleet/v1/models", timeout=10, headers=self.headers).json()
        return {m["name"]: m for m in r["items"]} | {"_errors": r["manifestErrors"]}

    def status(self, name: str) -> Optional[dict]:
        r = httpx.get(f"{self.url}/mlxfleet/v1/models/{name}", timeout=10,
                      headers=self.headers)
        return r.json() if r.status_code == 200 else None

    def wait_ready(self, name: str, timeout: float = 60, pid_not: Optional[int] = None
                   ) -> dict:
        def ok():
            s = self.status(name)
            return s if s and s["ready"] and s["pid"] != pid_not else None

        s = wait_for(ok, timeout)
        assert s, f"{name} not ready: {self.status(name)}\n{self.logs()}"
        return s

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    def chat(self, model: str, max_tokens: int = 4, **kw):
        return self.openai().chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
            temperature=0, **kw)

    def sockets(self) -> list[str]:
        """Worker socket files in the supervisors' runtime folders."""
        return sorted(p.name for p in self.run_dir.glob("mlxfleet-*/*.sock"))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()
