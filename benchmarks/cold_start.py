"""Cold start of one worker: process spawned -> model loaded and answering /health.

Compared, in one run and interleaved, with a bare process that imports mlx_lm and loads
the same checkpoint, with torch importable and with it hidden (as a worker hides it, see
``worker/server.py``): transformers imports torch whenever it is installed.

    python benchmarks/cold_start.py [--model builtin:tiny-50m] [--runs 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxfleet.sources import resolve_source  # noqa: E402

PY = sys.executable


def worker_start(source: str, sock: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([PY, "-m", "mlxfleet", "worker", "--source", source, "--name", "m",
                          "--bind", f"unix:{sock}"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                          base_url="http://w") as c:
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                if p.poll() is not None:
                    raise RuntimeError("the worker exited")
                time.sleep(0.02)
    finally:
        p.terminate()
        p.wait()


def raw_load(model_dir: Path, hide_torch: bool) -> float:
    code = ("import sys; sys.modules['torch'] = None; " if hide_torch else "") + \
        (f"sys.path.insert(0, {str(ROOT)!r}); from mlxfleet.blas import preload_blas; "
         f"preload_blas(); import mlx_lm; mlx_lm.load({str(model_dir)!r})")
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", "import sys; " + code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    model_dir = resolve_source(args.model)
    times: dict[str, list[float]] = {"worker": [], "raw, torch importable": [],
                                     "raw, torch hidden": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            times["worker"].append(worker_start(args.model, Path(tmp) / f"w{i}.sock"))
            times["raw, torch importable"].append(raw_load(model_dir, False))
            times["raw, torch hidden"].append(raw_load(model_dir, True))
    torch = "installed" if importlib.util.find_spec("torch") else "not installed"
    print(f"{args.model}, {args.runs} runs each, interleaved; torch {torch}\n")
    print("| process | median | min |\n| --- | --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} s | {min(ts):.2f} s |")


if __name__ == "__main__":
    main()
