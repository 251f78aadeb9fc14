"""Pull speed: mlxfleet's pull (ranged GETs + SHA-256 check) against huggingface_hub's
``snapshot_download`` alone, from the same local stand-in for the hub (tests/hub.py), in
one run. The stand-in is a Python HTTP server, so absolute MB/s are this machine's, not
the network's; the ratio is what the pull's own work (hashing, progress) costs.

    python benchmarks/pull.py [--model tiny-50m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-50m", help="builtin model served by the hub")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from hub import Hub, Repo

    from mlxfleet.builtin import ensure_builtin

    hub = Hub({"acme/model": Repo.from_dir(ensure_builtin(args.model))})
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    size = sum(len(b) for b in hub.repos["acme/model"].files.values())
    times: dict[str, list[float]] = {"snapshot_download": [], "mlxfleet pull": []}
    for _ in range(args.rounds):
        for name in times:
            with tempfile.TemporaryDirectory() as cache:
                os.environ.update(hub.env(Path(cache)))
                import huggingface_hub.constants as c

                c.HF_HUB_CACHE = cache  # read at import: set it for this round
                t = time.perf_counter()
                if name == "mlxfleet pull":
                    from mlxfleet.store import pull

                    pull("acme/model")
                else:
                    from huggingface_hub import snapshot_download

                    from mlxfleet.sources import ALLOW_PATTERNS

                    snapshot_download("acme/model", allow_patterns=ALLOW_PATTERNS)
                times[name].append(time.perf_counter() - t)
    hub.close()
    base = statistics.median(times["snapshot_download"])
    print(f"{args.model}: {size / 2**20:.0f} MiB, median of {args.rounds}")
    print("| pull | seconds | MiB/s | vs snapshot_download |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {size / 2**20 / m:.0f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
