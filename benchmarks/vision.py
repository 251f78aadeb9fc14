"""Image requests at 1, 4 and 8 at once, against text requests of the same length.

    .venv/bin/python benchmarks/vision.py [--model builtin:tiny-vlm] [--max-tokens 64]
        [--concurrency 1 4 8] [--rounds 3]

Each image request carries its own image (a cache miss: the vision tower runs every
time). Reports, per concurrency: wall time of the round, aggregate generated tokens/s and
the median time to first token, for image and for text requests, and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

QUESTION = "Describe this picture: the colors, the shapes and the light in it."


def image_uri(seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((240, 320, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def one(url: str, messages: list, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens generated) for one streamed request."""
    t0, first, n = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": "bench", "messages": messages, "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get(
                    "content") is not None:  # a token, even one with no visible text
                first = time.perf_counter() - t0
    return first or 0.0, n


def round_of(url: str, batch: list[list], max_tokens: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as ex:
        res = list(ex.map(lambda m: one(url, m, max_tokens), batch))
    wall = time.perf_counter() - t0
    return wall, sum(n for _, n in res) / wall, statistics.median(t for t, _ in res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-vlm")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = {"name": "bench", "source": args.model, "max_concurrency": 16}
    proc = Proc([PY, "-m", "mlxfleet", "worker", "--bind", f"127.0.0.1:{port}", "--config",
                 json.dumps(cfg)], Path(tempfile.mkdtemp()) / "worker.log")
    seed = 0
    try:
        wait_http(url + "/health")
        one(url, [{"role": "user", "content": "warm up"}], 4)
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.max_tokens} tokens per "
              f"request, median of {args.rounds} rounds")
        print("| concurrent | image: wall s | image tok/s | image TTFT p50 ms | "
              "text: wall s | text tok/s | text TTFT p50 ms | image/text tok/s |")
        print("|---|---|---|---|---|---|---|---|")
        for c in args.concurrency:
            rows = {"image": [], "text": []}
            for _ in range(args.rounds):
                imgs = []
                for _ in range(c):
                    seed += 1
                    imgs.append([{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": image_uri(seed)}},
                        {"type": "text", "text": QUESTION}]}])
                texts = [[{"role": "user", "content": f"{seed + i} {QUESTION}"}]
                         for i in range(c)]
                rows["image"].append(round_of(url, imgs, args.max_tokens))
                rows["text"].append(round_of(url, texts, args.max_tokens))
            med = {k: [statistics.median(r[i] for r in v) for i in range(3)]
                   for k, v in rows.items()}
            im, tx = med["image"], med["text"]
            print(f"| {c} | {im[0]:.2f} | {im[1]:.1f} | {im[2] * 1000:.0f} | {tx[0]:.2f} | "
                  f"{tx[1]:.1f} | {tx[2] * 1000:.0f} | {im[1] / tx[1]:.2f} |")
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
