"""The gateway's hop alone: the same worker asked through the gateway and straight on its
Unix socket, request by request in a shuffled order, so the difference is only the hop
(no second worker, no drift between two runs).

    .venv/bin/python benchmarks/hop.py [--model builtin:tiny] [--requests 400] [--stream]

Prints p50/p90 of both and the difference. ``--stream`` asks for a streamed answer and
times the first byte of the body as well.
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--pause", type=float, default=0.02)
    ap.add_argument("--count-tokens", action="store_true",
                    help="ask /v1/messages/count_tokens instead: no generation, the hop alone")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-hop-"))
    (tmp / "m").mkdir()
    (tmp / "run").mkdir(mode=0o700)
    (tmp / "m" / "bench.yaml").write_text(
        "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
        f"spec: {{source: {json.dumps(args.model)}, preload: true, keepAlive: forever}}\n")
    port = free_port()
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "m"), "--port",
                 str(port), "--state-dir", str(tmp / "state")], tmp / "serve.log",
                env={"XDG_RUNTIME_DIR": str(tmp / "run")})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/mlxfleet/v1/models/bench",
                  ok=lambda r: r.status_code == 200 and r.json()["ready"])
        sock = next((tmp / "run").glob("mlxfleet-*/*.sock"))  # its one worker
        clients = {
            "gateway": httpx.Client(base_url=url, timeout=60),
            "worker": httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                                   base_url="http://worker", timeout=60),
        }
        times: dict[str, list[float]] = {k: [] for k in clients}
        first: dict[str, list[float]] = {k: [] for k in clients}
        order = list(clients)
        for i in range(args.requests + 20):
            random.shuffle(order)
            for k in order:
                time.sleep(args.pause)
                body = {"model": "bench", "max_tokens": 1, "temperature": 0,
                        "messages": [{"role": "user", "content": f"hi {i % 7}"}]}
                if args.stream:
                    body["stream"] = True
                path = "/v1/chat/completions"
                if args.count_tokens:
                    path = "/v1/messages/count_tokens"
                    del body["max_tokens"], body["temperature"]
                t0 = time.perf_counter()
                t1 = None
                with clients[k].stream("POST", path, json=body) as r:
                    for _ in r.iter_raw():
                        t1 = t1 or time.perf_counter()
                dt = time.perf_counter() - t0
                assert r.status_code == 200, r.status_code
                if i >= 20:  # warm-up
                    times[k].append(dt)
                    first[k].append(t1 - t0)
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.requests} sequential "
              f"1-token chat requests each ({'streamed' if args.stream else 'whole'}), "
              f"interleaved, same worker, pid {os.getpid()}")
        for label, data in (("whole answer", times), ("first byte", first)):
            p50 = {k: 1000 * pct(v, .5) for k, v in data.items()}
            for k, v in data.items():
                print(f"{label:13} {k:8} p50 {p50[k]:6.2f} ms   p90 {1000 * pct(v, .9):6.2f} ms")
            print(f"{label:13} hop p50: {p50['gateway'] - p50['worker']:+.2f} ms")
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
