"""A new agent session's first request: time to first token and the share of its prompt
read from cache, for each real agent client, against mlx_lm.server on the same checkpoint.

    .venv/bin/python benchmarks/agent_sessions.py [--model zoo:qwen3]
        [--clients claude codex opencode]

1. Capture: each client (tests/agents, installed by ``scripts/setup.sh test``) runs two
   one-shot sessions with different questions against ``mlxfleet serve`` on the bundled
   ``agents`` placeholder, through a recording proxy; the first agent request of each
   session (the one with its tools) is kept, as the client sent it. Nothing is written to
   the repository: the prompts are the clients' own.
2. Replay both first requests, one token each, on ``--model`` (default: the zoo's Qwen3,
   random weights, 40k context, the real Qwen3 tokenizer), in four setups:
   - **cold**: session B's first request on a freshly loaded model;
   - **warm**: session A's, then session B's (a second session on a running server);
   - **restart**: A, then the model unloads (its prompt cache to the disk tier,
     ``cache.diskMB``) and loads again, then B;
   - **warmPrompts**: a fresh load with A's captured request as a warm prompt, then B;
   and on **mlx_lm.server** (its LRU prompt cache), A then B, converted to OpenAI chat
   (the only API it speaks). Reported: B's time for one token and its cached share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from compare import BLAS, PY, Proc, free_port, wait_http  # noqa: E402

AGENTS = ROOT / "tests" / "agents" / "node_modules" / ".bin"
ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


# ---- 1. capture ----------------------------------------------------------------------

class Recorder:
    """A proxy in front of ``upstream`` that keeps every model request's body."""

    def __init__(self, upstream: str):
        self.requests: list[tuple[str, dict]] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _do(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                path = self.path.split("?", 1)[0]
                if path in ROUTES and body:
                    rec.requests.append((path, json.loads(body)))
                r = httpx.request(self.command, upstream + self.path, content=body,
                                  timeout=300, headers={k: v for k, v in self.headers.items()
                                                        if k.lower() not in (
                                                            "host", "content-length")})
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding",
                                         "content-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_HEAD = _do

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def run_client(name: str, url: str, work: Path, home: Path, question: str) -> None:
    env = {**os.environ, "HOME": str(home), "PWD": str(work), "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_API_KEY": "unused", "CODEX_HOME": str(home / ".codex"),
           "MLX_KEY": "unused", "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".data"), "XDG_STATE_HOME": str(home / ".state"),
           "PATH": f"{AGENTS}:{os.environ['PATH']}"}
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    if name == "claude":
        argv = ["claude", "-p", question, "--model", "agents"]
    elif name == "codex":
        provider = (f'model_providers.mlx={{name="mlx", base_url="{url}/v1", '
                    'wire_api="responses", env_key="MLX_KEY"}')
        argv = ["codex", "exec", "--skip-git-repo-check", "--ephemeral", "-c",
                "model_provider=mlx", "-c", provider, "-m", "gpt-5.5", question]
    else:
        (work / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json", "model": "mlxfleet/agents",
            "provider": {"mlxfleet": {"npm": "@ai-sdk/openai-compatible", "name": "mlxfleet",
                                      "options": {"baseURL": url + "/v1", "apiKey": "x"},
                                      "models": {"agents": {"name": "agents",
                                                            "tool_call": True}}}}}))
        argv = ["opencode", "run", "-m", "mlxfleet/agents", question]
    subprocess.run(argv, cwd=work, env=env, capture_output=True, timeout=300,
                   stdin=subprocess.DEVNULL)


def capture(clients: list[str], tmp: Path) -> dict[str, list[tuple[str, dict]]]:
    """Each client's two sessions' first agent requests: {client: [(route, body)] * 2}."""
    (tmp / "cm").mkdir()
    shutil.copy(ROOT / "manifests" / "agents.yaml", tmp / "cm" / "agents.yaml")
    port = free_port()
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(tmp / "cm"), "--port",
                 str(port), "--state-dir", str(tmp / "cs")], tmp / "capture.log")
    out: dict[str, list[tuple[str, dict]]] = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        for name in clients:
            if not (AGENTS / name).exists():
                print(f"{name}: not installed (scripts/setup.sh test); skipped")
                continue
            work, home = tmp / name / "work", tmp / name / "home"
            work.mkdir(parents=True)
            home.mkdir(parents=True)
            firsts = []
            for question in ("Please list the files here.", "What does this project do?"):
                rec = Recorder(f"http://127.0.0.1:{port}")
                run_client(name, rec.url, work, home, question)
                rec.server.shutdown()
                agent = [r for r in rec.requests if r[1].get("tools")]
                if agent:
                    firsts.append(agent[0])
            if len(firsts) == 2:
                out[name] = firsts
            else:
                print(f"{name}: no agent request captured; skipped")
    finally:
        proc.stop()
    return out


# ---- 2. replay -----------------------------------------------------------------------

def one_token(url: str, route: str, body: dict, model: str) -> tuple[float, int, int]:
    """(seconds for a one-token answer, prompt tokens, of them read from cache)."""
    body = {**body, "model": model, "stream": False, "temperature": 0}
    for k in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        body.pop(k, None)
    body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = 1
    t0 = time.perf_counter()
    r = httpx.post(url + route, json=body, timeout=900)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    u = r.json().get("usage") or {}
    if route == "/v1/messages":
        cached = u.get("cache_read_input_tokens") or 0
        return dt, u.get("input_tokens", 0) + cached, cached
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    return dt, u.get("prompt_tokens") or u.get("input_tokens") or 0, \
        details.get("cached_tokens") or 0


def as_chat(route: str, body: dict) -> dict:
    """A captured request as OpenAI chat (text and tools), for mlx_lm.server."""
    def text(content) -> str:
        if isinstance(content, str):
            return content
        return "\n".join(p.get("text", "") for p in content or [] if isinstance(p, dict))

    msgs, tools = [], []
    if route == "/v1/messages":
        system = body.get("system")
        if system:
            msgs.append({"role": "system", "content": text(system)})
        msgs += [{"role": m["role"], "content": text(m["content"])} for m in body["messages"]]
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema", {})}} for t in body.get("tools", [])
            if "name" in t]
    elif route == "/v1/responses":
        if body.get("instructions"):
            msgs.append({"role": "system", "content": body["instructions"]})
        items = body["input"] if isinstance(body["input"], list) else [
            {"role": "user", "content": body["input"]}]
        msgs += [{"role": "system" if it.get("role") == "developer" else it["role"],
                  "content": text(it.get("content"))}
                 for it in items if it.get("role")]
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("parameters", {})}} for t in body.get("tools", [])
            if t.get("type") == "function"]
    else:
        msgs, tools = body["messages"], body.get("tools", [])
    return {"messages": msgs, **({"tools": tools} if tools else {})}


def serve(tmp: Path, tag: str, source: str, cache: dict) -> tuple[Proc, str]:
    d = tmp / f"m-{tag}"
    d.mkdir()
    (d / "agent.yaml").write_text(yaml.safe_dump({
        "apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": "agent"},
        "spec": {"source": source, "preload": True, "cache": {"memoryMB": 4096, **cache},
                 "limits": {"maxPromptTokens": 200_000}}}))
    port = free_port()
    proc = Proc([PY, "-m", "mlxfleet", "serve", "--manifests", str(d), "--port", str(port),
                 "--state-dir", str(tmp / f"s-{tag}")], tmp / f"serve-{tag}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    wait_http(url + "/v1/models/agent", ok=lambda r: r.status_code == 200
              and r.json().get("ready"))
    return proc, url


def replay(name: str, reqs: list[tuple[str, dict]], model_dir: Path, tmp: Path) -> dict:
    (ra, a), (rb, b) = reqs
    rows: dict = {}
    src = str(model_dir)
    proc, url = serve(tmp, f"{name}-cold", src, {})
    rows["cold"] = one_token(url, rb, b, "agent")
    rows["warm"] = (one_token(url, ra, a, "agent"), one_token(url, rb, b, "agent"))[1]
    proc.stop()
    proc, url = serve(tmp, f"{name}-disk", src, {"diskMB": 8192})
    one_token(url, ra, a, "agent")
    httpx.post(url + "/mlxfleet/v1/models/agent/unload", timeout=300).raise_for_status()
    httpx.post(url + "/mlxfleet/v1/models/agent/load", timeout=300).raise_for_status()
    rows["restart"] = one_token(url, rb, b, "agent")
    proc.stop()
    captured = tmp / f"{name}-warm.json"
    captured.write_text(json.dumps([{"path": ra, "body": a}]))
    proc, url = serve(tmp, f"{name}-warm", src, {"warmPrompts": str(captured)})
    time.sleep(2)
    deadline = time.monotonic() + 600
    while "warmed the prompt cache" not in httpx.get(
            url + "/mlxfleet/v1/models/agent/logs?tail=50", timeout=10).text:
        assert time.monotonic() < deadline, "the warm-up did not finish"
        time.sleep(0.5)
    rows["warmPrompts"] = one_token(url, rb, b, "agent")
    proc.stop()
    port = free_port()
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from mlxfleet.blas import "
            "preload_blas; preload_blas(); from mlx_lm.server import main; "
            "sys.argv=sys.argv[1:]; main()")
    mlx = Proc([PY, "-c", code, "mlx_lm.server", "--model", src, "--port", str(port)],
               tmp / f"mlx-{name}.log")
    try:
        murl = f"http://127.0.0.1:{port}"
        wait_http(murl + "/v1/models")
        one_token(murl, "/v1/chat/completions", as_chat(ra, a), src)
        rows["mlx_lm.server"] = one_token(murl, "/v1/chat/completions", as_chat(rb, b), src)
    finally:
        mlx.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="zoo:qwen3", help="zoo:FAMILY, builtin:NAME or a path")
    ap.add_argument("--clients", nargs="+", default=["claude", "codex", "opencode"])
    args = ap.parse_args()
    if args.model.startswith("zoo:"):
        from mlxfleet.builtin import builtin_cache_dir
        from mlxfleet.zoo import build

        model_dir = build(args.model[4:], builtin_cache_dir().parent / "zoo")
    else:
        from mlxfleet.sources import resolve_source

        model_dir = resolve_source(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="mlxfleet-agents-"))
    captured = capture(args.clients, tmp)
    print(f"model {args.model} ({model_dir.name}), BLAS {BLAS or 'bundled'}; a new "
          "session's first request (session B), one token")
    print("| client | prompt tokens | setup | time | from cache |")
    print("|---|---|---|---|---|")
    for name, reqs in captured.items():
        rows = replay(name, reqs, model_dir, tmp)
        for setup, (dt, prompt, cached) in rows.items():
            share = f"{cached / prompt:.1%}" if prompt and setup != "mlx_lm.server" else \
                (f"{cached / prompt:.1%}" if cached else "-")
            print(f"| {name} | {prompt} | {setup} | {dt:.2f} s | {share} |", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
