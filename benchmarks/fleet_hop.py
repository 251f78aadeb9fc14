"""The fleet's extra hop: a model on node b, asked through b's own gateway and through
node a (which forwards to b), interleaved in a shuffled order with a pause between
requests. Two `mlxfleet serve --node` processes on this machine (loopback).

    .venv/bin/python benchmarks/fleet_hop.py [--model builtin:tiny-50m] [--requests 200]
        [--stream]

Prints p50 and p90 end-to-end latency of 1-token chat requests (with --stream also the
time to the first byte of a streamed one) for each path, and the difference.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, pct, wait_http  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--stream", action="store_true", help="also time streamed requests' "
                    "first byte")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-hop-"))
    man = tmp / "manifests"
    man.mkdir()
    ports = {"a": free_port(), "b": free_port()}
    nodes = "---\n".join(
        f"apiVersion: mlxfleet/v1\nkind: Node\nmetadata: {{name: {n}}}\n"
        f"spec: {{url: 'http://127.0.0.1:{p}', memory: 16GB}}\n" for n, p in ports.items())
    (man / "nodes.yaml").write_text(nodes)
    (man / "bench.yaml").write_text(
        "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
        f"spec: {{source: {json.dumps(args.model)}, preload: true, keepAlive: forever,\n"
        "  placement: {nodes: [b]}}\n")
    env_key = "hop-bench-key"
    procs = []
    try:
        for n, p in ports.items():
            procs.append(Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(man),
                               "--port", str(p), "--state-dir", str(tmp / n), "--node", n,
                               "--fleet-key", env_key], tmp / f"{n}.log"))
        urls = {"direct (b)": f"http://127.0.0.1:{ports['b']}",
                "via a": f"http://127.0.0.1:{ports['a']}"}
        for u in urls.values():
            wait_http(u + "/mlxfleet/v1/models/bench",
                      ok=lambda r: r.status_code == 200 and r.json()["ready"])
        clients = {k: httpx.Client(base_url=u, timeout=60) for k, u in urls.items()}
        times: dict[str, list[float]] = {k: [] for k in urls}
        firsts: dict[str, list[float]] = {k: [] for k in urls}
        order = list(urls)
        for i in range(args.requests + 10):
            random.shuffle(order)
            for k in order:
                time.sleep(0.05)
                body = {"model": "bench", "max_tokens": 1, "temperature": 0,
                        "messages": [{"role": "user", "content": f"hi {i % 7}"}]}
                t0 = time.perf_counter()
                r = clients[k].post("/v1/chat/completions", json=body)
                dt = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                if args.stream:
                    time.sleep(0.05)
                    t1 = time.perf_counter()
                    with clients[k].stream("POST", "/v1/chat/completions",
                                           json={**body, "stream": True, "max_tokens": 4}) as s:
                        chunks = s.iter_raw()
                        next(chunks)
                        first = time.perf_counter() - t1
                        for _ in chunks:
                            pass
                if i >= 10:
                    times[k].append(dt)
                    if args.stream:
                        firsts[k].append(first)
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.requests} sequential "
              "1-token chat requests per path, interleaved; two nodes on loopback")
        print(f"{'path':<12} {'p50 ms':>8} {'p90 ms':>8}" + (
            f" {'stream 1st byte p50':>20}" if args.stream else ""))
        for k in urls:
            line = f"{k:<12} {pct(times[k], 0.5) * 1e3:8.1f} {pct(times[k], 0.9) * 1e3:8.1f}"
            if args.stream:
                line += f" {pct(firsts[k], 0.5) * 1e3:20.1f}"
            print(line)
        d = (pct(times["via a"], 0.5) - pct(times["direct (b)"], 0.5)) * 1e3
        print(f"extra hop (via a - direct): {d:+.1f} ms p50")
        if args.stream:
            d = (pct(firsts["via a"], 0.5) - pct(firsts["direct (b)"], 0.5)) * 1e3
            print(f"extra hop, first streamed byte: {d:+.1f} ms p50")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
