"""KV cache quantization (``spec.cache.kvBits``): memory per token, how many sequences a
KV budget runs at once, and tokens per second, full precision against 8 and 4 bits, in
one run.

    .venv/bin/python benchmarks/kv_bits.py [--model builtin:tiny-50m] [--cache-mb 64]
        [--streams 1 32] [--prompt-words 250] [--max-tokens 128]

Each worker differs only in ``--kv-bits``. A round sends N requests at once (the same
long prompt with a different opening word, ``ignore_eos``), polls ``/v1/status`` for the
most sequences running together, and reports output tokens per second over the round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

WORDS = ("river stone cloud apple garden window letter morning silver engine "
         "harbor candle forest mirror ladder").split()


def prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))
    return f"{WORDS[i % len(WORDS)]} {i}: please summarize: {body}"


async def round_of(url: str, n: int, words: int, max_tokens: int) -> dict:
    peak = [0]
    stop = threading.Event()

    def watch():
        with httpx.Client(base_url=url, timeout=10) as c:
            while not stop.is_set():
                peak[0] = max(peak[0], c.get("/v1/status").json()["num_running"])
                time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    async with httpx.AsyncClient(base_url=url, timeout=900) as c:
        async def one(i: int) -> int:
            r = await c.post("/v1/chat/completions", json={
                "model": "bench", "messages": [{"role": "user", "content": prompt(i, words)}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    stop.set()
    t.join()
    return {"tokens_per_s": sum(tokens) / wall, "peak_running": peak[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--cache-mb", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-words", type=int, default=250)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-kvbits-"))
    variants = {"full precision": [], "8 bits": ["--kv-bits", "8"], "4 bits": ["--kv-bits", "4"]}
    procs, urls = [], {}
    try:
        for name, extra in variants.items():
            port = free_port()
            procs.append(Proc([PY, "-m", "mlxfleet", "worker", "--source", args.model,
                               "--name", "bench", "--bind", f"127.0.0.1:{port}",
                               "--max-concurrency", str(max(args.streams)),
                               "--cache-mb", str(args.cache_mb), *extra],
                              tmp / f"{len(urls)}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_http(url + "/health")
        rows = {}
        for name, url in urls.items():
            st = httpx.get(url + "/v1/status").json()
            rows[name] = {"bytes_per_token": st["paths"]["kv"]["bytes_per_token"],
                          "kv_cache": st["paths"]["kv_cache"]}
        for n in args.streams:
            for name, url in urls.items():  # interleaved: each variant, then again
                runs = [asyncio.run(round_of(url, n, args.prompt_words, args.max_tokens))
                        for _ in range(2)]
                rows[name][n] = {"tokens_per_s": statistics.mean(
                    r["tokens_per_s"] for r in runs),
                    "peak_running": max(r["peak_running"] for r in runs)}
                print(name, n, rows[name][n], flush=True)
    finally:
        for p in procs:
            p.stop()
    full = rows["full precision"]
    head = ("| KV cache | bytes per token | " + " | ".join(
        f"{n} streams: tok/s (vs full) | most running" for n in args.streams) + " |")
    lines = [head, "|---" * (2 + 2 * len(args.streams)) + "|"]
    for name, r in rows.items():
        cells = [f"{r['bytes_per_token']} ({full['bytes_per_token'] / r['bytes_per_token']:.1f}x "
                 "less)" if r is not full else str(r["bytes_per_token"])]
        for n in args.streams:
            cells.append(f"{r[n]['tokens_per_s']:.1f} "
                         f"({r[n]['tokens_per_s'] / full[n]['tokens_per_s']:.2f}x)")
            cells.append(str(r[n]["peak_running"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    import platform

    import mlx.core as mx
    import mlx_lm

    lines.append(f"\n{args.model}, KV budget {args.cache_mb} MB, prompts of about "
                 f"{args.prompt_words} words, {args.max_tokens} tokens each; BLAS "
                 f"{BLAS or 'bundled'}; {platform.machine()}, {__import__('os').cpu_count()} "
                 f"CPUs; mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; command: python "
                 "benchmarks/kv_bits.py " + " ".join(sys.argv[1:]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
