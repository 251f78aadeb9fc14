"""The block ("paged") prefix cache against the whole-prompt LRU: N conversations that share
one long system prompt, each asked once, on two workers that differ only in the cache.

    .venv/bin/python benchmarks/paged_cache.py [--model builtin:tiny-10m]
        [--conversations 32] [--system-tokens 1000]

Reports the cache's bytes and entries after all conversations, and TTFT (median of the
conversations after the first) for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, long_prompt, wait_http  # noqa: E402

from mlxfleet.sources import resolve_source  # noqa: E402


def ttft(url: str, messages: list) -> float:
    """Seconds to the first generated text (the stream is read to its end, so the
    sequence finishes and its cache is kept)."""
    t0, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
            "model": "bench", "messages": messages, "max_tokens": 4, "stream": True,
            "temperature": 0, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token")
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-10m")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1000)
    args = ap.parse_args()
    system = long_prompt(resolve_source(args.model), args.system_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-paged-"))
    urls, procs = {}, []
    for kind, paged in (("lru", False), ("paged", True)):
        port = free_port()
        cfg = {"name": "bench", "source": args.model, "cache_bytes": 2 << 30,
               "paged_cache": paged, "max_request_tokens": 4096}
        procs.append(Proc([PY, "-m", "mlxfleet", "worker", "--bind", f"127.0.0.1:{port}",
                           "--config", json.dumps(cfg)], tmp / f"{kind}.log"))
        urls[kind] = f"http://127.0.0.1:{port}"
    try:
        for u in urls.values():
            wait_http(u + "/health")
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.conversations} "
              f"conversations sharing a {args.system_tokens}-token system prompt")
        for kind, u in urls.items():
            times = [ttft(u, [{"role": "system", "content": system},
                              {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}])
                     for i in range(args.conversations)]
            pc = httpx.get(u + "/v1/status").json()["prompt_cache"]
            print(f"{kind:6} cache {pc['bytes'] / 2**20:7.1f} MiB in {pc['entries']:4} entries;"
                  f" TTFT first {times[0] * 1000:6.0f} ms, then median "
                  f"{statistics.median(times[1:]) * 1000:6.0f} ms; hits {pc['hits']}")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
