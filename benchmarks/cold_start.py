"""Cold start: what a client waits for when it asks for a model that is not loaded
(through the gateway: request -> worker spawned and loaded -> 1-token answer), and a
worker alone (process spawned -> model loaded and answering /health).

Compared, in one run and interleaved, with a bare process that imports mlx_lm and loads
the same checkpoint, with torch importable and with it hidden (as a worker hides it, see
``worker/server.py``): transformers imports torch whenever it is installed.

    python benchmarks/cold_start.py [--model builtin:tiny-50m] [--runs 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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


def serve(source: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    """``mlxfleet serve`` over one model that is not preloaded: (process, url)."""
    import socket

    (tmp / "m").mkdir()
    (tmp / "m" / "m.yaml").write_text(
        "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: m}\n"
        f"spec: {{source: {source!r}, preload: false}}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "m"),
                          "--port", str(port), "--state-dir", str(tmp / "state")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "XDG_RUNTIME_DIR": str(tmp)})
    url = f"http://127.0.0.1:{port}"
    while p.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                time.sleep(2)  # past the start's settle time
                return p, url
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("mlxfleet serve exited")


def cold_request(url: str) -> float:
    """A 1-token chat request for the unloaded model; unloads it afterwards."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    took = time.perf_counter() - t0
    r.raise_for_status()
    httpx.post(url + "/mlxfleet/v1/models/m/unload", timeout=60).raise_for_status()
    return took


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
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    model_dir = resolve_source(args.model)
    times: dict[str, list[float]] = {
        "a request for the unloaded model, through the gateway": [],
        "`mlxfleet worker`: spawned -> model loaded, `/health` 200": [],
        "a bare process: `import mlx_lm; mlx_lm.load(...)`, torch importable": [],
        "the same, torch hidden": []}
    runs = list(times.values())
    with tempfile.TemporaryDirectory() as tmp:
        gateway, url = serve(args.model, Path(tmp))
        try:
            for i in range(args.runs):
                runs[0].append(cold_request(url))
                runs[1].append(worker_start(args.model, Path(tmp) / f"w{i}.sock"))
                runs[2].append(raw_load(model_dir, False))
                runs[3].append(raw_load(model_dir, True))
        finally:
            gateway.terminate()
            gateway.wait()
    torch = "installed" if importlib.util.find_spec("torch") else "not installed"
    print(f"{args.model}, {args.runs} runs each, interleaved; torch {torch}\n")
    print("| process | median | min |\n| --- | --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} s | {min(ts):.2f} s |")


if __name__ == "__main__":
    main()
