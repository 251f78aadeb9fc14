"""Replicas: cache-affine routing against a balancer that ignores the session.

    .venv/bin/python benchmarks/replicas.py [--model zoo:qwen3] [--sessions 8]
        [--turns 6] [--tool-words 30]

Three `mlxfleet serve --node` processes on this machine (loopback), one model with two
copies (on b and c). ``--sessions`` agent sessions (a 4,000-token system prompt, then
turns that each add the answer and a tool result of ``--tool-words`` words) run at once
through a, b and c in turn, twice:

- **affine**: each session sends its own ``prompt_cache_key`` (what Codex does; Claude
  Code's ``metadata.user_id`` works the same): the fleet routes it to its copy;
- **ignoring the session**: a fresh key on every request, so the copy is a coin toss per
  turn (what a round-robin or least-loaded balancer in front of two servers gives).

Reported per turn: the share of prompt tokens read from cache and the median time to the
first streamed token; and how many requests each copy ran. On one 2-core machine the
copies share the cores, so this shows the cache effect, not throughput scaling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

SYSTEM = "You are a careful coding agent. Read the files, run the tests, fix what fails. " * 250


def session(i: int, url: str, turns: int, words: int, affine: bool, out: list) -> None:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {i}: make the test suite pass."}]
    with httpx.Client(base_url=url, timeout=600) as c:
        for t in range(turns):
            key = f"s{i}" if affine else f"s{i}-t{t}-{time.monotonic_ns()}"
            t0 = time.perf_counter()
            first, text, usage, node = None, "", {}, None
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": "coder", "max_tokens": 8, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt_cache_key": key,
                    "messages": messages}) as r:
                assert r.status_code == 200, r.read()
                node = r.headers.get("x-mlxfleet-node")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter() - t0
                            text += piece
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out.append({"turn": t, "prompt": usage.get("prompt_tokens", 0), "cached": cached,
                        "ttft": first or time.perf_counter() - t0, "node": node})
            tool = " ".join(f"tests/test_{i}_{t}_{k}.py::case PASSED" for k in range(words // 3))
            messages += [{"role": "assistant", "content": text or "ok"},
                         {"role": "user", "content": f"Tool result:\n{tool}"}]


def run(urls: list[str], args, affine: bool) -> list[dict]:
    out: list[dict] = []
    threads = [threading.Thread(target=session, args=(i, urls[i % len(urls)], args.turns,
                                                      args.tool_words, affine, out))
               for i in range(args.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def report(name: str, rows: list[dict], turns: int) -> None:
    print(f"\n{name}")
    print(f"{'turn':>4} {'cached':>8} {'TTFT p50 ms':>12}")
    for t in range(turns):
        rs = [r for r in rows if r["turn"] == t]
        share = sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs))
        print(f"{t + 1:>4} {share:8.1%} {statistics.median(r['ttft'] for r in rs) * 1e3:12.0f}")
    later = [r for r in rows if r["turn"] > 0]
    share = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
    print(f"after the first turn: {share:.1%} from cache, TTFT p50 "
          f"{statistics.median(r['ttft'] for r in later) * 1e3:.0f} ms; requests per copy "
          f"{dict(sorted(Counter(r['node'] for r in rows).items()))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="zoo:qwen3", help="default: the zoo's Qwen3 (random "
                    "weights, the real tokenizer, 40k context)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tool-words", type=int, default=30)
    args = ap.parse_args()
    source = args.model
    if source.startswith("zoo:"):  # built here, then served from its directory
        from mlxfleet.builtin import builtin_cache_dir
        from mlxfleet.zoo import build

        source = str(build(source[4:], builtin_cache_dir().parent / "zoo"))
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-replicas-"))
    man = tmp / "manifests"
    man.mkdir()
    ports = {n: free_port() for n in "abc"}
    (man / "nodes.yaml").write_text("---\n".join(
        f"apiVersion: mlxfleet/v1\nkind: Node\nmetadata: {{name: {n}}}\n"
        f"spec: {{url: 'http://127.0.0.1:{p}', memory: 16GB}}\n" for n, p in ports.items()))
    procs = []
    try:
        for n, p in ports.items():
            procs.append(Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(man),
                               "--port", str(p), "--state-dir", str(tmp / n), "--node", n,
                               "--fleet-key", "replicas-bench"], tmp / f"{n}.log"))
        urls = [f"http://127.0.0.1:{p}" for p in ports.values()]
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}; {args.sessions} sessions x "
              f"{args.turns} turns through a, b, c at once; copies on b and c")
        for affine in (True, False):  # a fresh model each time: nothing cached before
            (man / "coder.yaml").write_text(
                "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: coder}\n"
                f"spec: {{source: {json.dumps(source)}, preload: true, replicas: 2,\n"
                "  keepAlive: forever, placement: {nodes: [b, c]},\n"
                f"  env: {{RUN: '{affine}'}}}}\n")  # (a new worker per run)
            time.sleep(2)
            for u in urls[1:]:
                wait_http(u + "/mlxfleet/v1/models/coder", ok=lambda r: r.status_code == 200
                          and r.json()["ready"] and r.json()["observedGeneration"]
                          == r.json()["generation"])
            time.sleep(1)
            report("affine (the session's own key)" if affine else
                   "ignoring the session (a fresh key per request)",
                   run(urls, args, affine), args.turns)
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
