"""The gateway's cost, A/B: one worker started directly and one behind ``mlxfleet serve``,
same model and settings, benchmarked in alternation (A B A B ...) so drift and noise hit both.

    .venv/bin/python benchmarks/gateway_ab.py [--model builtin:tiny-50m] [--streams 8 32]
        [--max-tokens 64] [--repeats 3]

Prints tok/s per run and the gateway/direct ratio of the medians per stream count.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

from mlxfleet.bench import run_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    conc = max(args.streams)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-ab-"))
    p_w, p_g = free_port(), free_port()
    man = tmp / "manifests"
    man.mkdir()
    (man / "bench.yaml").write_text(
        "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
        f"spec: {{source: {args.model}, preload: true, keepAlive: forever,\n"
        f"  batching: {{maxConcurrency: {conc}}}, cache: {{memoryMB: 2048}},\n"
        "  limits: {maxRequestTokens: 4096}}\n")
    procs = [
        Proc([PY, "-m", "mlxfleet", "worker", "--source", args.model, "--name", "bench",
              "--bind", f"127.0.0.1:{p_w}", "--max-concurrency", str(conc),
              "--max-request-tokens", "4096", "--cache-mb", "2048"], tmp / "worker.log"),
        Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(man), "--port", str(p_g),
              "--state-dir", str(tmp / "state")], tmp / "serve.log"),
    ]
    urls = {"direct": f"http://127.0.0.1:{p_w}", "gateway": f"http://127.0.0.1:{p_g}"}
    try:
        wait_http(urls["direct"] + "/health")
        wait_http(urls["gateway"] + "/mlxfleet/v1/models/bench",
                  ok=lambda r: r.status_code == 200 and r.json()["ready"])
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.max_tokens} tokens/request")
        for s in args.streams:
            got: dict[str, list[float]] = {"direct": [], "gateway": []}
            for i in range(args.repeats):
                order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                for name in order:
                    rep = asyncio.run(run_bench(urls[name], "bench", s, s * 2, 64,
                                                args.max_tokens)).summary()
                    got[name].append(rep["output_tokens_per_s"])
                    time.sleep(1)
            med = {k: statistics.median(v) for k, v in got.items()}
            print(f"streams {s}: direct {got['direct']} gateway {got['gateway']} -> "
                  f"gateway/direct {med['gateway'] / med['direct']:.2f}x")
        mem = httpx.get(urls["gateway"] + "/mlxfleet/v1/models/bench").json()["memory"]
        st = httpx.get(urls["direct"] + "/v1/status").json()["mlx_memory"]
        print(f"gateway worker memory {mem}; direct worker mlx_memory {st}")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
