"""The prompt cache across unloads (disk tier) and warm prompts: time to first token.

    .venv/bin/python benchmarks/disk_cache.py [--model builtin:tiny-50m] [--tokens 2000]

Runs ``mlxfleet serve`` with two models of the same checkpoint: ``disk`` (cache.diskMB)
and ``warm`` (cache.warmPrompts holding the long system prompt). Reports TTFT of a
conversation with a ``--tokens`` system prompt: cold, then after unloading and loading
the model again (read back from disk); and the first request to ``warm`` against a cold
first request.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, long_prompt, wait_http  # noqa: E402

from mlxfleet.sources import resolve_source  # noqa: E402


def ttft(url: str, model: str, system: str, question: str) -> tuple[float, int]:
    """Seconds for a 1-token answer (its first token: prefill and one step), and the
    prompt tokens served from the cache."""
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    system = long_prompt(resolve_source(args.model), args.tokens)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-disk-"))
    (tmp / "m").mkdir()
    for name, cache in (("disk", {"diskMB": 1024}), ("warm", {"warmPrompts": [[
            {"role": "system", "content": system}, {"role": "user", "content": "Hi"}]]}),
            ("cold", {})):
        (tmp / "m" / f"{name}.yaml").write_text(yaml.safe_dump({
            "apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": name},
            "spec": {"source": args.model, "cache": cache, "limits": {
                "maxPromptTokens": 8192}}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "m"), "--port",
                 str(port), "--state-dir", str(tmp / "state")], tmp / "serve.log")
    try:
        wait_http(url + "/health")
        post = lambda path: httpx.post(url + path, timeout=600)  # noqa: E731
        for name in ("disk", "warm", "cold"):
            post(f"/mlxfleet/v1/models/{name}/load").raise_for_status()
        time.sleep(3)  # the warm-up runs after the load
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, a {args.tokens}-token system "
              "prompt, TTFT of one more question")
        cold, c0 = ttft(url, "disk", system, "What is the capital of France?")
        post("/mlxfleet/v1/models/disk/unload").raise_for_status()
        post("/mlxfleet/v1/models/disk/load").raise_for_status()
        back, c1 = ttft(url, "disk", system, "What is the capital of France?")
        print(f"disk tier: cold {cold * 1000:.0f} ms ({c0} cached); after unload + load "
              f"{back * 1000:.0f} ms ({c1} cached): {cold / back:.1f}x faster")
        first_cold, _ = ttft(url, "cold", system, "Hello there")
        first_warm, cw = ttft(url, "warm", system, "Hello there")
        print(f"warm prompts: first request {first_cold * 1000:.0f} ms without, "
              f"{first_warm * 1000:.0f} ms with ({cw} cached): "
              f"{first_cold / first_warm:.1f}x faster")
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
