"""Speculative decoding against mlx_lm.server, with and without its draft model, in one run.

    .venv/bin/python benchmarks/speculative.py [--streams 1 8 32] [--ballast 768 64]

The model is ``builtin:scripted`` carrying ballast: at every token it multiplies
``--ballast WIDTH LAYERS`` random matrices (768 x 768, 64 of them: about tiny-50m's
work per token), so a step costs what a small real model's does, while the answer is
the one its script gives. That is what makes the workloads mean something with no
trained model at hand: random weights only repeat one token, which any prompt lookup
drafts perfectly. Two workloads:

- **edit**: "rename `total` to `result` in this code and write it out": the answer is
  the code with the rename (what a coding agent's edit looks like).
- **chat**: a question whose answer is prose the prompt does not contain.
- **sampled**: the chat questions at temperature 0.8, top_p 0.95: each drafted token is
  accepted with the probability the sampler gives it (speculative sampling). The script's
  token takes nearly all of the probability, so the answers are still the script's.

mlx_lm.server's draft mode, and mlxfleet's (``--draft-model``), get a draft model with
the same script (its drafts are always right: the best case) and a fifth of the
ballast. mlx_lm.server decodes one request at a time with a draft model (it turns
batching off). Each server answers every workload at each stream count; the
acceptance rates are our workers' (their ``/v1/status``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxfleet.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

import httpx  # noqa: E402
from compare import PY, Proc, free_port, wait_http  # noqa: E402

from mlxfleet.sources import resolve_source  # noqa: E402

#: Chat answers: windows of real English prose (this repository's docs), not in the prompt.
PROSE = " ".join((ROOT / "docs" / name).read_text() for name in
                 ("operator.md", "fleet.md", "integrations.md")).split()

#: mlx_lm.server with the scripted model type registered and its tokenizer attached.
MLX_LM_SERVER = (
    "import sys; sys.path.insert(0, {root!r}); from mlxfleet.blas import preload_blas; "
    "preload_blas(); from mlxfleet.scripted import register; register(); "
    "import mlx_lm.server as s; real = s.load\n"
    "def load(*a, **k):\n"
    "    out = real(*a, **k); out[0].attach_tokenizer(out[1]); return out\n"
    "s.load = load; sys.argv = sys.argv[1:]; s.main()")


def code(i: int) -> str:
    return "".join(
        f"def step_{i}_{j}(values, scale):\n"
        f"    total = 0\n"
        f"    for v in values:\n"
        f"        total += v * scale + {j}\n"
        f"    return total / {i + j + 1}\n\n" for j in range(4))


def prose(i: int) -> str:
    at = random.Random(i).randrange(len(PROSE) - 120)
    return " ".join(w for w in PROSE[at:at + 110] if "<" not in w and "\\" not in w)


def workloads(n: int) -> dict[str, list[tuple[str, str]]]:
    """(prompt, scripted answer) pairs per workload."""
    edit = [(f"Task {i}: rename total to result in this code and write it out in full:\n"
             f"```python\n{code(i)}```",
             f"```python\n{code(i).replace('total', 'result')}```") for i in range(n)]
    chat = [(f"Question {i}: what do you see from the old bridge in the morning?",
             prose(i)) for i in range(n)]
    return {"edit": edit, "chat": chat, "sampled": chat}


#: Sampling parameters per workload (greedy where not named).
SAMPLING = {"sampled": {"temperature": 0.8, "top_p": 0.95}}


def checkpoint(tmp: Path, name: str, ballast: list[int], pairs: list[tuple[str, str]]
               ) -> Path:
    """builtin:scripted with ballast and a rule per prompt."""
    out = tmp / name
    shutil.copytree(resolve_source("builtin:scripted"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["ballast"] = ballast
    cfg["script"] = {"rules": [{"when": prompt.split(":")[0] + ":", "say": answer}
                               for prompt, answer in pairs], "otherwise": "?"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


async def round_of(url: str, model: str, pairs: list[tuple[str, str]],
                   sampling: dict | None = None, timeout: float = 300) -> dict:
    """All prompts at once; output tokens per second over the round (requests that took
    longer than ``timeout`` count as failed)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        async def one(prompt: str, answer: str) -> int:
            for attempt in range(10):
                try:
                    r = await c.post("/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 600, **(sampling or {"temperature": 0})})
                    break
                except (httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError):
                    # mlx_lm.server's listen backlog (5) resets connections past it
                    await asyncio.sleep(0.05 * (attempt + 1))
                except httpx.TimeoutException:
                    failed.append(prompt)
                    return 0
            r.raise_for_status()
            body = r.json()
            said = body["choices"][0]["message"]["content"] or ""
            if said.strip() != answer.strip():
                wrong.append(said[:200])
            return body["usage"]["completion_tokens"]

        wrong: list[str] = []
        failed: list[str] = []

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, a) for p, a in pairs))
        wall = time.perf_counter() - t0
    if wrong:
        print(f"{url}: {len(wrong)} answers differ from the script, e.g. {wrong[0]!r}",
              flush=True)
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall,
            "wrong": len(wrong), "failed": len(failed)}


def lone_ms(url: str, model: str, n: int = 20) -> float:
    """Median time of a 1-token request (after two warm-ups)."""
    times = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for i in range(n + 2):
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            time.sleep(0.05)
    return 1000 * sorted(times)[len(times) // 2]


def quiet(procs, limit: float = 300) -> None:
    """Wait until the servers are idle (under 5% of a CPU over a second, all together):
    work left from the last round must not take the CPU from the next one."""
    def ticks() -> int:
        total = 0
        for p in procs:
            try:
                stat = Path(f"/proc/{p.p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # (not Linux: no /proc; nothing to wait for)
                return 0
            total += int(stat[11]) + int(stat[12])  # utime + stime, in clock ticks
        return total

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        before = ticks()
        time.sleep(1)
        if ticks() - before < 0.05 * os.sysconf("SC_CLK_TCK"):
            return
    print(f"servers still busy after {limit:.0f} s", flush=True)


def spec_stats(url: str) -> dict:
    return httpx.get(url + "/v1/status").json().get("speculation") or {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ballast", type=int, nargs=2, default=[768, 64])
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--workloads", nargs="+", default=["edit", "chat", "sampled"])
    ap.add_argument("--repeats", type=int, default=2, help="rounds per server and cell "
                    "(alternating order; the best counts)")
    ap.add_argument("--servers", nargs="+", help="run only these, named as in the table "
                    "(mlx_lm.server + draft times out at 32 streams: minutes per round)")
    args = ap.parse_args()
    n = max(args.streams)
    work = workloads(n)
    everything = work["edit"] + work["chat"]
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-spec-"))
    target = checkpoint(tmp, "target", args.ballast, everything)
    draft = checkpoint(tmp, "draft", [args.ballast[0], max(1, args.ballast[1] // 5)],
                       everything)
    servers = {"mlx_lm.server": [], "mlx_lm.server + draft": ["--draft-model", str(draft),
                                                              "--num-draft-tokens", "4"]}
    workers = {"mlxfleet, speculation off": ["--speculative", "off"],
               "mlxfleet": ["--speculative", "auto"],
               "mlxfleet + draft": ["--speculative", "auto", "--draft-model", str(draft)]}
    counted = ("mlxfleet", "mlxfleet + draft")  # (their acceptance is reported)
    commands: dict[str, list[str]] = {}
    for name, extra in servers.items():
        commands[name] = [PY, "-c", MLX_LM_SERVER.format(root=str(ROOT)), "mlx_lm.server",
                          "--model", str(target), "--port", "{port}",
                          "--decode-concurrency", str(n), "--prompt-concurrency", "8", *extra]
    for name, extra in workers.items():
        commands[name] = [PY, "-m", "mlxfleet", "worker", "--source", str(target),
                          "--name", "bench", "--bind", "127.0.0.1:{port}",
                          "--max-concurrency", str(n), "--max-request-tokens", "4096",
                          "--cache-mb", "2048", "--draft-tokens", str(args.draft_tokens),
                          *extra]
    if args.servers:
        commands = {k: v for k, v in commands.items() if k in args.servers}
    counted = tuple(c for c in counted if c in commands)
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}

    def start(name: str) -> None:
        port = free_port()
        procs[name] = Proc([a.format(port=port) for a in commands[name]],
                           tmp / f"{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
        wait_http(urls[name] + ("/health" if name.startswith("mlxfleet") else "/v1/models"))

    try:
        for name in commands:
            start(name)
        model = {name: "bench" if name.startswith("mlxfleet") else str(target)
                 for name in urls}
        results: dict = {"rounds": {}, "lone_ms": {}}
        for kind, pairs in ((k, work[k]) for k in args.workloads):
            for s in args.streams:
                row: dict = {}
                # Each server --repeats times, every other time in the reverse order;
                # its best round counts (this machine's speed drifts over a run).
                order, schedule = list(urls.items()), []
                for r in range(args.repeats):
                    schedule += order if r % 2 == 0 else order[::-1]
                for name, _ in schedule:
                    url = urls[name]
                    quiet(procs.values())
                    before = spec_stats(url) if name in counted else {}
                    got_round = asyncio.run(round_of(url, model[name], pairs[:s],
                                                     SAMPLING.get(kind)))
                    if name in counted:
                        after = spec_stats(url)
                        drafted = after["draft_tokens"] - before.get("draft_tokens", 0)
                        got = after["accepted_tokens"] - before.get("accepted_tokens", 0)
                        got_round["acceptance"] = got / drafted if drafted else None
                    if got_round["failed"]:
                        # A request given up on goes on being decoded (mlx_lm.server does
                        # not notice): it would take the CPU from the next server's round.
                        # (after its statistics: the restarted server starts from zero)
                        procs[name].stop()
                        start(name)
                    if name not in row or got_round["tokens_per_s"] > row[name]["tokens_per_s"]:
                        row[name] = got_round
                results["rounds"][f"{kind} x{s}"] = row
                print(kind, s, {k: round(v["tokens_per_s"], 1) for k, v in row.items()},
                      "acceptance", [row[c]["acceptance"] for c in counted], flush=True)
        for name in ("mlx_lm.server", "mlxfleet"):
            if name in urls:
                results["lone_ms"][name] = lone_ms(urls[name], model[name])
    finally:
        for p in procs.values():
            p.stop()
    print(render(results, args))


def cell(result: dict) -> str:
    out = f"{result['tokens_per_s']:.1f}"
    bad = [f"{result[k]} {k}" for k in ("failed", "wrong") if result.get(k)]
    return out + (f" ({', '.join(bad)})" if bad else "")


def render(r: dict, args) -> str:
    names = list(next(iter(r["rounds"].values())))
    lines = ["| workload x streams | " + " | ".join(names) +
             " | mlxfleet / mlx_lm.server | + draft / mlx_lm.server | acceptance "
             "(lookup / draft model) |",
             "|---" * (len(names) + 4) + "|"]

    def acc(a):
        return f"{a:.0%}" if a is not None else "no drafts"

    def ratio(row, name):  # (a server left out with --servers: "-")
        if name not in row or "mlx_lm.server" not in row:
            return "-"
        return f"{row[name]['tokens_per_s'] / row['mlx_lm.server']['tokens_per_s']:.2f}x"

    for key, row in r["rounds"].items():
        lines.append(f"| {key} | " + " | ".join(cell(row[n]) for n in names)
                     + f" | {ratio(row, 'mlxfleet')} | {ratio(row, 'mlxfleet + draft')} | "
                     + " / ".join(acc(row[n]["acceptance"]) if n in row else "-"
                                  for n in ("mlxfleet", "mlxfleet + draft")) + " |")
    lone = r["lone_ms"]
    lines.append("")
    lines.append("Lone 1-token request (median of 20): " + ", ".join(
        f"{k} {v:.1f} ms" for k, v in lone.items()) + ".")
    import platform

    import mlx.core as mx
    import mlx_lm

    lines.append(f"\nOutput tokens per second; ballast {args.ballast[0]} x {args.ballast[1]}; "
                 f"BLAS {BLAS or 'bundled'}; {platform.machine()}, {os.cpu_count()} CPUs; "
                 f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; command: python "
                 "benchmarks/speculative.py " + " ".join(sys.argv[1:]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
