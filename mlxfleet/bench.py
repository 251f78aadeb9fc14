"""``mlxfleet bench``: a load generator for any OpenAI-compatible server.

N concurrent streaming clients send chat (or text) completions with a fixed
prompt length and a fixed output length (``ignore_eos``, honoured by mlxfleet
and vLLM; other servers may stop early, which the report shows), and we report
aggregate output tokens/s, requests/s, time to first token and inter-token
latency percentiles, and errors.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp


@dataclass
class RequestResult:
    ok: bool
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency: float = 0.0
    error: str = ""


@dataclass
class BenchReport:
    concurrency: int
    requests: int
    wall: float
    results: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall if self.wall else 0.0

    def summary(self) -> dict[str, Any]:
        ttft = [r.ttft for r in self.ok if r.ttft is not None]
        itl = [x for r in self.ok for x in r.itl]
        # Time per output token after the first, per request: unlike the gaps between
        # events (``itl``), it holds when one event carries several tokens (accepted drafts).
        tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in self.ok
                if r.ttft is not None and r.tokens > 1]
        return {
            "concurrency": self.concurrency, "requests": self.requests,
            "errors": len(self.results) - len(self.ok), "wall_s": round(self.wall, 3),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 2),
            "requests_per_s": round(len(self.ok) / self.wall, 3) if self.wall else 0.0,
            "ttft_ms": _pcts(ttft), "itl_ms": _pcts(itl), "tpot_ms": _pcts(tpot),
            "first_error": next((r.error for r in self.results if not r.ok), None),
        }


def _pcts(xs: list[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    xs = sorted(xs)

    def q(p: float) -> float:
        return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 3)

    return {"p50": q(0.50), "p95": q(0.95), "p99": q(0.99),
            "mean": round(1000 * statistics.fmean(xs), 3)}


def make_prompt(n_words: int, salt: str = "") -> str:
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
             "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()
    return salt + " ".join(words[i % len(words)] for i in range(n_words))


async def sse_lines(r: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """An event stream's lines. aiohttp splits at LF only (not at U+2028 and friends,
    which JSON strings may hold raw); a CR before it is dropped here."""
    async for line in r.content:
        yield line.rstrip(b"\r\n")


async def one_request(client: aiohttp.ClientSession, path: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.post(path, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for line in sse_lines(r):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                usage = obj.get("usage")
                if usage:
                    res.tokens = usage.get("completion_tokens", res.tokens)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    elif last is not None:
                        res.itl.append(now - last)
                    last = now
        res.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - t0
    return res


async def run_bench(url: str, model: str, concurrency: int, requests: int,
                    prompt_words: int = 64, max_tokens: int = 64, chat: bool = True,
                    uds: Optional[str] = None, extra: Optional[dict] = None,
                    distinct_prompts: bool = True) -> BenchReport:
    """Keep ``concurrency`` streams busy until ``requests`` have finished.

    The client is aiohttp, not httpx: it shares the machine with the server it measures,
    and reading a 256-stream burst of 128 tokens took httpx's async client 5.6-6.8 s of
    CPU against aiohttp's 1.7-2.2 s (2 cores: a third of the machine's time went to the
    measuring), so the server's figures were the client's."""
    connector = (aiohttp.UnixConnector(path=uds, limit=concurrency + 4) if uds
                 else aiohttp.TCPConnector(limit=concurrency + 4))
    results: list[RequestResult] = []
    counter = iter(range(requests))
    run = uuid.uuid4().hex[:6]  # distinct prompts per run: no prompt-cache hits across runs
    async with aiohttp.ClientSession(base_url=url.rstrip("/") + "/", connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def worker():
            for i in counter:
                prompt = make_prompt(prompt_words, f"{run}-{i} " if distinct_prompts else "")
                body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                                        "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True},
                                        "ignore_eos": True, **(extra or {})}
                if chat:
                    body["messages"] = [{"role": "user", "content": prompt}]
                    path = "v1/chat/completions"
                else:
                    body["prompt"] = prompt
                    path = "v1/completions"
                results.append(await one_request(client, path, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return BenchReport(concurrency, requests, wall, results)


def format_report(s: dict[str, Any]) -> str:
    t, i = s["ttft_ms"], s["itl_ms"]

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [
        f"concurrency {s['concurrency']}, {s['requests']} requests, {s['errors']} errors, "
        f"{s['wall_s']:.2f}s",
        f"output tokens/s: {s['output_tokens_per_s']:.1f}   requests/s: "
        f"{s['requests_per_s']:.2f}   output tokens: {s['output_tokens']}",
        f"TTFT ms  p50 {f(t['p50'])}  p95 {f(t['p95'])}  p99 {f(t['p99'])}",
        f"ITL ms   p50 {f(i['p50'])}  p95 {f(i['p95'])}  p99 {f(i['p99'])}",
    ]
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines)
