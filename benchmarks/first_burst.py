"""The first burst after Ready against the bursts after it, over several starts of the
gateway (issue #46: "the first 8-stream burst after Ready within 20% of a later one").

    .venv/bin/python benchmarks/first_burst.py [--model builtin:tiny] [--starts 3]
        [--bursts 5] [--streams 8] [--rounds 2] [--max-tokens 128]

Each start: `mlxfleet serve` on an empty folder, a manifest saved, the model Ready, then
``--bursts`` identical bursts back to back (distinct prompts each: no prompt-cache hits).
compare.py's one-burst row swings 0.67-1.22x from run to run on this machine (a burst of
8 x 128 tokens lasts half a second); this one prints every burst, and per start the first
burst over the median of the later ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import PY, Proc, free_port, wait_http  # noqa: E402

from mlxfleet.bench import run_bench  # noqa: E402


def one_start(args, tmp: Path) -> list[dict]:
    man, run = tmp / "manifests", tmp / "run"
    man.mkdir()
    run.mkdir(mode=0o700)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(man), "--port", str(port),
                 "--state-dir", str(tmp / "state")], tmp / "serve.log",
                env={"MLXFLEET_RELOAD_DEBOUNCE_MS": "50", "XDG_RUNTIME_DIR": str(run)})
    try:
        wait_http(url + "/health")
        (man / "bench.yaml").write_text(
            "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
            f"spec: {{source: {json.dumps(args.model)}, preload: true, keepAlive: forever}}\n")
        wait_http(url + "/mlxfleet/v1/models/bench",
                  ok=lambda r: r.status_code == 200 and r.json()["ready"])
        out = []
        for _ in range(args.bursts):
            report = asyncio.run(run_bench(url, "bench", args.streams,
                                           args.streams * args.rounds, 64, args.max_tokens))
            out.append(report.summary())
            time.sleep(args.pause)
        return out
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream in a burst")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between bursts")
    args = ap.parse_args()
    ratios = []
    for i in range(args.starts):
        with tempfile.TemporaryDirectory() as d:
            bursts = one_start(args, Path(d))
        tps = [b["output_tokens_per_s"] for b in bursts]
        errors = sum(b["errors"] for b in bursts)
        later = statistics.median(tps[1:])
        ratios.append(tps[0] / later)
        print(f"start {i + 1}: tok/s " + " ".join(f"{t:.0f}" for t in tps)
              + " | TTFT p50 ms " + " ".join(f"{b['ttft_ms']['p50']:.0f}" for b in bursts)
              + f" | first / median of later {ratios[-1]:.2f}x"
              + (f" | {errors} failed" if errors else ""), flush=True)
    print(f"first burst / later: {min(ratios):.2f}-{max(ratios):.2f}x over {args.starts} "
          f"starts ({args.streams} streams x {args.rounds} requests x {args.max_tokens} "
          f"tokens, {args.model})")


if __name__ == "__main__":
    main()
