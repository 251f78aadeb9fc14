"""What the gateway costs a stream: the same worker asked through the gateway and straight
on its Unix socket, in alternating rounds, with the CPU time the gateway process (``mlxfleet
serve``) spends per 1,000 tokens it relays, per protocol.

    .venv/bin/python benchmarks/relay_cost.py [--model builtin:tiny] [--streams 1 8 32]
        [--max-tokens 128] [--rounds 4] [--protocols openai anthropic ollama responses]
        [--speculative off]

One worker, so the difference is the hop alone (no second worker, no drift between two
servers). Each round sends ``streams`` streaming requests at once and counts the tokens
that come back; rounds alternate worker, gateway, gateway, worker... Prints tokens/s per
path (median of the rounds), gateway/worker, and the gateway's CPU seconds per 1,000
tokens (user + system, from psutil) at each stream count and for each protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402


def _usage(line: bytes, path: tuple) -> int:
    """The output tokens a streamed line reports at its end (0 for every other line): a
    line holds several tokens when they arrived together, so lines are not tokens."""
    if not any(k in line for k in (b'"usage"', b'"eval_count"')):
        return 0
    obj = json.loads(line[line.index(b"{"):])
    for key in path:
        obj = (obj or {}).get(key) if isinstance(obj, dict) else None
    return obj if isinstance(obj, int) else 0


#: (path, body, the output tokens a streamed line reports at the end) per protocol
PROTOCOLS = {
    "openai": ("/v1/chat/completions",
               {"stream": True, "stream_options": {"include_usage": True}},
               lambda line: _usage(line, ("usage", "completion_tokens"))),
    "anthropic": ("/v1/messages", {"stream": True},
                  lambda line: _usage(line, ("usage", "output_tokens"))
                  if b"message_delta" in line else 0),
    "ollama": ("/api/chat", {"stream": True, "options": {"num_predict": None}},
               lambda line: _usage(line, ("eval_count",))),
    "responses": ("/v1/responses", {"stream": True},
                  lambda line: _usage(line, ("response", "usage", "output_tokens"))),
}


def body_for(protocol: str, i: int, max_tokens: int) -> tuple[str, dict]:
    path, extra, _ = PROTOCOLS[protocol]
    msg = [{"role": "user", "content": f"Request {i}: tell me a story about the sea."}]
    body: dict = {"model": "bench", "temperature": 0, "ignore_eos": True, **extra}
    if protocol == "responses":
        body.update(input=msg, max_output_tokens=max_tokens)
    elif protocol == "ollama":
        body.update(messages=msg, options={"num_predict": max_tokens, "temperature": 0})
        body.pop("temperature")
    else:
        body.update(messages=msg, max_tokens=max_tokens)
    return path, body


async def one_round(client: httpx.AsyncClient, protocol: str, streams: int,
                    max_tokens: int) -> tuple[int, float]:
    count = PROTOCOLS[protocol][2]

    async def one(i: int) -> int:
        path, body = body_for(protocol, i, max_tokens)
        n = 0
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, (r.status_code, await r.aread())
            async for line in r.aiter_lines():
                n += count(line.encode())
        assert n == max_tokens, (protocol, n)  # ignore_eos: exactly max_tokens, reported
        return n

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(got), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--speculative", default="auto", choices=["auto", "off"],
                    help="off: one token per event (random weights repeat themselves, "
                         "which drafts perfectly: several tokens per event)")
    ap.add_argument("--protocols", nargs="+", default=["openai"], choices=list(PROTOCOLS))
    args = ap.parse_args()
    conc = max(args.streams)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-relay-"))
    (tmp / "m").mkdir()
    (tmp / "run").mkdir(mode=0o700)
    (tmp / "m" / "bench.yaml").write_text(
        "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bench}\n"
        f"spec: {{source: {json.dumps(args.model)}, preload: true, keepAlive: forever,\n"
        f"  batching: {{maxConcurrency: {conc}}},\n"
        f"  speculative: {{mode: {json.dumps(args.speculative)}}}}}\n")
    port = free_port()
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "m"), "--port",
                 str(port), "--state-dir", str(tmp / "state")], tmp / "serve.log",
                env={"XDG_RUNTIME_DIR": str(tmp / "run")})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/mlxfleet/v1/models/bench",
                  ok=lambda r: r.status_code == 200 and r.json()["ready"])
        sock = next((tmp / "run").glob("mlxfleet-*/*.sock"))  # its one worker
        gateway = psutil.Process(proc.p.pid)
        print(f"model {args.model}, BLAS {BLAS or 'bundled'}, {args.max_tokens} tokens per "
              f"request, {args.rounds} rounds per path; the gateway's CPU per 1,000 tokens")
        print("| protocol | streams | worker tok/s | gateway tok/s | gateway/worker "
              "| gateway CPU s / 1k tokens |")
        print("|---|---|---|---|---|---|")

        async def run() -> None:
            limits = httpx.Limits(max_connections=conc * 2)
            clients = {
                "worker": httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(
                    uds=str(sock), limits=limits), base_url="http://worker", timeout=300),
                "gateway": httpx.AsyncClient(base_url=url, timeout=300, limits=limits),
            }
            for protocol in args.protocols:
                await one_round(clients["gateway"], protocol, 2, 8)  # warm up
                for s in args.streams:
                    rate: dict[str, list[float]] = {"worker": [], "gateway": []}
                    cpu = tokens = 0.0
                    for i in range(args.rounds):
                        order = ("worker", "gateway") if i % 2 == 0 else ("gateway", "worker")
                        for name in order:
                            before = gateway.cpu_times()
                            n, dt = await one_round(clients[name], protocol, s,
                                                    args.max_tokens)
                            after = gateway.cpu_times()
                            rate[name].append(n / dt)
                            if name == "gateway":
                                cpu += (after.user - before.user) \
                                    + (after.system - before.system)
                                tokens += n
                            await asyncio.sleep(0.5)
                    w, g = (statistics.median(rate[k]) for k in ("worker", "gateway"))
                    print(f"| {protocol} | {s} | {w:.0f} | {g:.0f} | {g / w:.2f}x "
                          f"| {cpu / tokens * 1000:.3f} |", flush=True)
            for c in clients.values():
                await c.aclose()

        asyncio.run(run())
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
