"""One person typing: sequential 1-token chat requests, mlx_lm.server against our worker
and our gateway, interleaved in a shuffled order with a pause between requests, so drift
and each server's leftover BLAS spinning hit all three alike.

    .venv/bin/python benchmarks/lone.py [--model builtin:tiny-50m] [--requests 200]

Prints p50 and p90 end-to-end latency for each, and the differences: gateway - worker (two
worker processes: the hop alone is benchmarks/hop.py's) and our total against mlx_lm.server
(gateway - mlx_lm.server).

``--alone``: each server is asked while the other two are frozen (SIGSTOP), in blocks of
ten requests in turn, so that none pays for another's leftover threads on a 2-core machine
(as a person running one server sees it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, pct, wait_http  # noqa: E402

from mlxfleet.sources import resolve_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--alone", action="store_true",
                    help="freeze the other two servers while one is asked (blocks of 10)")
    args = ap.parse_args()
    model_dir = resolve_source(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-lone-"))
    procs = []
    try:
        p_mlx, p_w, p_g = free_port(), free_port(), free_port()
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from mlxfleet.blas import "
                "preload_blas; preload_blas(); from mlx_lm.server import main; "
                "sys.argv=sys.argv[1:]; main()")
        procs.append(Proc([PY, "-c", code, "mlx_lm.server", "--model", str(model_dir),
                           "--port", str(p_mlx)], tmp / "mlx_lm.log"))
        procs.append(Proc([PY, "-m", "mlxfleet", "worker", "--source", args.model, "--name",
                           "bench", "--bind", f"127.0.0.1:{p_w}"], tmp / "worker.log"))
        (tmp / "m").mkdir()
        (tmp / "m" / "bench.yaml").write_text(
            "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
            f"spec: {{source: {json.dumps(args.model)}, preload: true, keepAlive: forever}}\n")
        procs.append(Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "m"),
                           "--port", str(p_g), "--state-dir", str(tmp / "state")],
                          tmp / "serve.log"))
        targets = {"mlx_lm.server": (f"http://127.0.0.1:{p_mlx}", str(model_dir)),
                   "worker": (f"http://127.0.0.1:{p_w}", "bench"),
                   "gateway": (f"http://127.0.0.1:{p_g}", "bench")}
        wait_http(targets["mlx_lm.server"][0] + "/v1/models")
        wait_http(targets["worker"][0] + "/health")
        wait_http(targets["gateway"][0] + "/mlxfleet/v1/models/bench",
                  ok=lambda r: r.status_code == 200 and r.json()["ready"])
        clients = {k: httpx.Client(base_url=u, timeout=60) for k, (u, _) in targets.items()}
        times: dict[str, list[float]] = {k: [] for k in targets}
        order = list(targets)
        pids = dict(zip(targets, (p.p.pid for p in procs)))

        def ask(k: str, i: int) -> None:
            time.sleep(0.05)
            body = {"model": targets[k][1], "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": f"hi {i % 7}"}]}
            t0 = time.perf_counter()
            r = clients[k].post("/v1/chat/completions", json=body)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            if i >= 10:  # warm-up
                times[k].append(dt)

        if args.alone:
            for block in range(0, args.requests + 10, 10):
                random.shuffle(order)
                for k in order:
                    others = [pids[o] for o in targets if o != k]
                    for pid in others:
                        os.kill(pid, signal.SIGSTOP)
                    try:
                        for i in range(block, block + 10):
                            ask(k, i)
                    finally:
                        for pid in others:
                            os.kill(pid, signal.SIGCONT)
        else:
            for i in range(args.requests + 10):
                # A shuffled order and a pause: a server's BLAS threads spin for a moment
                # after its work, which would tax whichever server is asked next.
                random.shuffle(order)
                for k in order:
                    ask(k, i)
        how = "each alone (the others frozen), blocks of 10" if args.alone else "interleaved"
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.requests} sequential "
              f"1-token chat requests each, {how}")
        p50 = {k: 1000 * pct(v, .5) for k, v in times.items()}
        for k, v in times.items():
            print(f"{k:14} p50 {p50[k]:6.2f} ms   p90 {1000 * pct(v, .9):6.2f} ms")
        print(f"gateway - worker (another process; the hop alone: benchmarks/hop.py) p50: "
              f"{p50['gateway'] - p50['worker']:+.2f} ms")
        print(f"gateway - mlx_lm.server p50: {p50['gateway'] - p50['mlx_lm.server']:+.2f} ms")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
