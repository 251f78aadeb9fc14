"""Per model family (the zoo, mlxfleet/zoo.py), in one run: tokens/s at 1 and 8 streams,
our worker against mlx_lm.server on the same checkpoint, and prefix reuse on agent turns
(the share of prompt tokens served from the cache on turns 2-10 of a growing 10-turn
conversation with tool calls and tool results, and those turns' TTFT with and without it).

    .venv/bin/python benchmarks/families.py [--families qwen3 gemma3 ...]
        [--max-tokens 64] [--write docs/performance.md]

The conversation is an agent loop: a system prompt and tool definitions, then each turn
the assistant's tool call and the tool's result (text the model did not write: the client
sends it, as agents do), so reuse only comes from what the server kept of earlier
prompts. "Without" (cold) sends the same turn with a fresh first line (nothing to reuse).
Random weights: the models are tiny, only ratios in one run mean anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

from mlxfleet.bench import run_bench  # noqa: E402
from mlxfleet.builtin import builtin_cache_dir  # noqa: E402
from mlxfleet.zoo import FAMILIES, build  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} for a path or a query; "
    "returns text. Use it whenever the user asks about files.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "query": {"type": "string"}},
                   "required": ["path"]}}} for name in ("read_file", "grep", "list_dir")]
SYSTEM = ("You are a coding agent working in a repository. Read files before editing them, "
          "keep answers short, and call tools to inspect the workspace. ") * 40  # (agents'
# system prompts run to thousands of tokens: Claude Code's is over 10k)


def turns(nonce: str = "", tools: bool = True) -> list[list[dict]]:
    """The conversation's ten prompts, each extending the previous one; without
    ``tools`` (templates that cannot write tool turns, Gemma 3's) the same text goes in
    plain assistant and user turns."""
    msgs = [{"role": "system", "content": nonce + SYSTEM},
            {"role": "user", "content": "Find where the server binds its port and explain."}]
    out = [list(msgs)]
    for i in range(9):
        call = {"id": f"call{i:05d}x", "type": "function",
                "function": {"name": "read_file",
                             "arguments": json.dumps({"path": f"src/module_{i}.py"})}}
        result = f"# module {i}\n" + "def handler(request):\n    return 42\n" * 6
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "name": "read_file",
                  "content": result}] if tools else [
                 {"role": "assistant", "content": f"read_file {call['function']['arguments']}"},
                 {"role": "user", "content": result}]
        out.append(list(msgs))
    return out


def ask(url: str, model: str, messages: list[dict], tools: bool = True
        ) -> tuple[float, int, int]:
    """(time to the first token, prompt tokens, prompt tokens served from the cache): a
    one-token answer, so the parsers cannot hold the first text back."""
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0,
            **({"tools": TOOLS} if tools else {})}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    took = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return took, usage.get("prompt_tokens", 0), cached


def agent_turns(url: str, model: str) -> dict:
    try:
        ask(url, model, turns("probe\n")[1])  # (its own prefix: it primes nothing)
        tools = True
    except httpx.HTTPStatusError:  # a template without tool turns: plain chat turns
        tools = False
    warm, cold = [], []
    for i, w in enumerate(turns("", tools)):  # interleaved: both equally warm
        cold.append(ask(url, model, turns(uuid.uuid4().hex + "\n", tools)[i], tools))
        warm.append(ask(url, model, w, tools))
    later = warm[1:]
    prompt = sum(p for _, p, _ in later)
    before = sum(p for _, p, _ in warm[:-1])  # an ideal cache: all of the previous prompt
    return {"cached_share": sum(c for _, _, c in later) / prompt if prompt else None,
            "of_reusable": sum(c for _, _, c in later) / before if prompt else None,
            "ttft_warm_ms": 1000 * statistics.median(t for t, _, _ in later),
            "ttft_cold_ms": 1000 * statistics.median(t for t, _, _ in cold[1:]),
            "tool_turns": tools}


def throughput(url: str, model: str, streams: int, max_tokens: int) -> float:
    rep = asyncio.run(run_bench(url, model, streams, streams * 2, 64, max_tokens))
    return rep.summary()["output_tokens_per_s"]


def family(name: str, args, tmp: Path) -> dict:
    path = build(name, builtin_cache_dir().parent / "zoo")
    ours, theirs = free_port(), free_port()
    code = ("import sys; from mlxfleet.blas import preload_blas; preload_blas(); "
            "from mlx_lm.server import main; sys.argv=sys.argv[1:]; main()")
    procs = [Proc([PY, "-m", "mlxfleet", "worker", "--source", str(path), "--name", "m",
                   "--bind", f"127.0.0.1:{ours}", "--max-concurrency", "8",
                   "--cache-mb", "1024"], tmp / f"{name}-worker.log"),
             Proc([PY, "-c", code, "mlx_lm.server", "--model", str(path), "--port",
                   str(theirs), "--decode-concurrency", "8", "--prompt-concurrency", "8"],
                  tmp / f"{name}-mlx_lm.log")]
    try:
        urls = {"mlxfleet": f"http://127.0.0.1:{ours}", "mlx_lm": f"http://127.0.0.1:{theirs}"}
        wait_http(urls["mlxfleet"] + "/health")
        wait_http(urls["mlx_lm"] + "/v1/models")
        paths = httpx.get(urls["mlxfleet"] + "/v1/status").json().get("paths", {})
        out = {"paths": paths}
        for streams in (1, 8):
            for who, url in urls.items():
                model = "m" if who == "mlxfleet" else str(path)
                out[f"{who}_{streams}"] = throughput(url, model, streams, args.max_tokens)
        out["agent"] = agent_turns(urls["mlxfleet"], "m")
        try:  # (it reports no cached tokens when streaming: its TTFT tells)
            out["agent_mlx_lm"] = agent_turns(urls["mlx_lm"], str(path))
        except Exception as e:  # noqa: BLE001 - a template mlx_lm.server cannot render
            out["agent_mlx_lm"] = {"error": f"{type(e).__name__}: {e}"}
        return out
    finally:
        for p in procs:
            p.stop()


def pct(x) -> str:
    return f"{100 * x:.0f}%" if x is not None else "n/a"


def agent(a: dict) -> str:
    return (f"{pct(a['cached_share'])} ({pct(a['of_reusable'])})"
            f"{'' if a['tool_turns'] else ' chat turns'}, {a['ttft_warm_ms']:.0f} / "
            f"{a['ttft_cold_ms']:.0f} ms")


def table(results: dict) -> str:
    rows = ["| family | tok/s 1 stream (vs mlx_lm.server) | tok/s 8 streams (vs) | "
            "agent turns 2-10 from cache (of the reusable), TTFT warm / cold | "
            "the same, mlx_lm.server | exact paths |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        a, b = r["agent"], r["agent_mlx_lm"]
        theirs = agent(b) if "ttft_warm_ms" in b else b["error"][:40]
        p = r["paths"]
        fallback = "; ".join(x for x in (
            "prefill one at a time" if p.get("prefill", "").startswith("one") else "",
            "snapshots at prompt ends" if p.get("prefix_reuse", "").startswith("prompt")
            else "") if x) or "-"
        rows.append(
            f"| {name} | {r['mlxfleet_1']:.1f} ({r['mlxfleet_1'] / r['mlx_lm_1']:.2f}x) | "
            f"{r['mlxfleet_8']:.1f} ({r['mlxfleet_8'] / r['mlx_lm_8']:.2f}x) | "
            f"{agent(a)} | {theirs} | {fallback} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-families-"))
    results = {}
    for name in args.families:
        results[name] = family(name, args, tmp)
        print(name, json.dumps(results[name]), flush=True)
    text = table(results)
    print(text)
    if args.write:
        cmd = "python benchmarks/families.py " + " ".join(sys.argv[1:])
        args.write.write_text(args.write.read_text() + (
            f"\n\n## Model families (zoo), {time.strftime('%Y-%m-%d')}\n\n"
            f"`{cmd.replace(' --write ' + str(args.write), '')}` on {platform.machine()}, "
            f"{platform.processor() or platform.system()}, BLAS: {BLAS or 'bundled'}.\n\n"
            + text + "\n"))


if __name__ == "__main__":
    main()
