"""A soak: a real ``mlxfleet serve`` under mixed traffic for several minutes, with manifest
edits, clients that hang up mid-stream, and one worker killed with SIGKILL half-way.

    .venv/bin/python benchmarks/soak.py [--minutes 5] [--clients 6] [--model builtin:tiny-10m]

Reports requests, failures (those of the killed worker's in-flight requests are counted
apart: they are expected), and the server's memory (supervisor + workers, RSS) and open file
descriptors before and after. Run by hand, not in CI; results go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, free_port, wait_http  # noqa: E402

MODELS = ("alpha", "beta")


def manifest(name: str, source: str, temperature: float) -> str:
    return yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Model",
                           "metadata": {"name": name},
                           "spec": {"source": source, "preload": True, "keepAlive": "forever",
                                    "defaults": {"temperature": temperature}}})


def server_usage(pid: int) -> dict:
    """RSS of the server and its workers, and the server's open file descriptors."""
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    rss = 0
    for q in procs:
        try:
            rss += q.memory_info().rss
        except psutil.Error:
            pass
    return {"rss_mb": round(rss / 2**20, 1), "fds": p.num_fds(),
            "processes": [" ".join(q.cmdline()[2:4]) for q in procs[1:]]}


class Traffic:
    """Client threads: streaming and not, some hanging up early; outcomes by kind."""

    def __init__(self, url: str):
        self.url = url
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.killed_window: tuple[float, float] = (0.0, 0.0)
        self.killed_model = ""
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def record(self, kind: str, model: str, started: float, error: str = "") -> None:
        with self.lock:
            if not error:
                self.outcomes[kind] += 1
                return
            lo, hi = self.killed_window
            if model == self.killed_model and started <= hi and time.monotonic() >= lo:
                self.outcomes["failed (killed worker's in-flight)"] += 1
            else:
                self.outcomes["failed"] += 1
                self.failures.append(f"{kind} {model}: {error}")

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.stop.is_set():
                model = rng.choice(MODELS)
                body = {"model": model, "max_tokens": rng.randint(4, 48),
                        "messages": [{"role": "user", "content": f"tell me {rng.random()}"}]}
                kind = rng.choice(["stream", "stream", "plain", "hangup"])
                t0 = time.monotonic()
                try:
                    if kind == "plain":
                        r = c.post("/v1/chat/completions", json=body)
                        ok = r.status_code == 200 and r.json()["choices"]
                        self.record(kind, model, t0, "" if ok else f"{r.status_code} {r.text}")
                        continue
                    with c.stream("POST", "/v1/chat/completions",
                                  json={**body, "stream": True}) as r:
                        if r.status_code != 200:
                            r.read()
                            self.record(kind, model, t0, f"{r.status_code} {r.text}")
                            continue
                        lines = 0
                        done = False
                        for line in r.iter_lines():
                            if '"error"' in line:
                                raise RuntimeError(line)
                            lines += 1
                            done = done or line == "data: [DONE]"
                            if kind == "hangup" and lines > 3:
                                break  # the client goes away mid-stream
                        if kind != "hangup" and not done:
                            raise RuntimeError("stream ended without [DONE]")
                    self.record(kind, model, t0)
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    self.record(kind, model, t0, f"{type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--model", default="builtin:tiny-10m")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-soak-"))
    mdir = tmp / "manifests"
    mdir.mkdir()
    for i, name in enumerate(MODELS):
        (mdir / f"{name}.yaml").write_text(manifest(name, args.model, 0.5 + i / 10))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "serve.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlxfleet", "serve", "--manifests", str(mdir), "--port",
         str(port), "--state-dir", str(tmp / "state")], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "MLXFLEET_BACKOFF_BASE": "0.5"})
    try:
        wait_http(url + "/health")
        for name in MODELS:
            wait_http(f"{url}/mlxfleet/v1/models/{name}",
                      ok=lambda r: r.status_code == 200 and r.json()["ready"])
        traffic = Traffic(url)
        warm = threading.Thread(target=traffic.client, args=(0,))
        warm.start()  # one client for a few seconds, so "before" is a warm server
        time.sleep(5)
        traffic.stop.set()
        warm.join()
        traffic.stop.clear()
        traffic.outcomes.clear()
        before = server_usage(server.pid)
        threads = [threading.Thread(target=traffic.client, args=(i + 1,))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        edits, killed = 0, False
        while time.monotonic() < end:
            time.sleep(min(20, max(0, end - time.monotonic())))
            if not killed and time.monotonic() - t0 > args.minutes * 30:
                pid = httpx.get(f"{url}/mlxfleet/v1/models/beta").json()["pid"]
                traffic.killed_model = "beta"
                traffic.killed_window = (time.monotonic(), time.monotonic() + 0.5)
                os.kill(pid, signal.SIGKILL)
                killed = True
                continue
            if end - time.monotonic() < 30:
                continue  # the last replacement settles before the "after" reading
            edits += 1  # a rolling replace of alpha with a new temperature
            (mdir / "alpha.yaml").write_text(manifest("alpha", args.model,
                                                      round(random.random(), 2)))
        traffic.stop.set()
        for t in threads:
            t.join(120)
        time.sleep(10)  # old workers drain and exit
        after = server_usage(server.pid)
        models = httpx.get(url + "/v1/status", timeout=30).json()["models"]
        caches = {n: {"prompt_cache_mb": round(m["prompt_cache"]["bytes"] / 2**20, 1),
                      "prompt_cache_entries": m["prompt_cache"]["entries"],
                      "mlx_active_mb": round(m["mlx_memory"]["active_bytes"] / 2**20, 1),
                      "mlx_buffer_cache_mb": round(m["mlx_memory"]["cache_bytes"] / 2**20, 1)}
                  for n, m in models.items() if "prompt_cache" in m}
        total = sum(traffic.outcomes.values())
        print(f"soak: {args.minutes:g} min, {args.clients} clients, model {args.model}, "
              f"BLAS {BLAS or 'bundled'}")
        print(f"requests: {total} ({dict(traffic.outcomes)})")
        print(f"edits (rolling replaces): {edits}; worker kills: {int(killed)}")
        print(f"before: {before}")
        print(f"after:  {after}")
        print(f"workers after: {caches}")
        for f in traffic.failures[:20]:
            print("  failure:", f)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        print(f"(server log: {tmp / 'serve.log'})")


if __name__ == "__main__":
    main()
