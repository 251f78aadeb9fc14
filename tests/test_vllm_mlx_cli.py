"""vllm-mlx's documented command lines, run unchanged against `mlxfleet serve SOURCE`
(real processes, the official openai SDK)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from conftest import free_port
from served import wait_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextmanager
def serve(tmp: Path, *args: str, key: str = "x"):
    """``mlxfleet serve ARGS --port P``; yields (openai client, base URL) once ready."""
    port = free_port()
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlxfleet", "serve", *args, "--port",
                             str(port), "--state-dir", str(tmp / "state")],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    try:
        def ready():  # /health: open, and not counted by the rate limit
            if proc.poll() is not None:
                raise AssertionError((tmp / "serve.log").read_text())
            try:
                h = httpx.get(url + "/health", timeout=5).json()
                return h["models"] and h["ready"] == h["models"]
            except httpx.HTTPError:
                return False

        assert wait_for(ready, 90), (tmp / "serve.log").read_text()
        yield client, url
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()


def test_the_documented_production_command(tmp_path):
    # "Paramètres recommandés": --continuous-batching --use-paged-cache --api-key --rate-limit
    # --timeout --port
    with serve(tmp_path, "builtin:demo", "--continuous-batching", "--use-paged-cache",
               "--api-key", "your-secret-key", "--rate-limit", "60", "--timeout", "120",
               key="your-secret-key") as (client, url):
        r = client.chat.completions.create(model="default", temperature=0, messages=[
            {"role": "user", "content": "What is the capital of Japan?"}])
        # (greedy: vllm-mlx's default temperature samples, and the tiny demo model then
        # sometimes says "The capital of language.")
        assert "Tokyo" in r.choices[0].message.content
        assert httpx.get(url + "/v1/models").status_code == 401  # the key is required
        s = httpx.get(url + "/v1/status", headers={"Authorization":
                                                   "Bearer your-secret-key"}).json()
        assert s["status"] == "running" and s["model"] == "demo"
        assert s["cache"]["type"] == "paged"  # --use-paged-cache: the block cache
        system = {"role": "system", "content": "You are helpful. " * 60}
        for question, expect_cached in (("Hello!", False), ("What colour is the sky?", True)):
            r = client.chat.completions.create(model="demo", max_tokens=5, messages=[
                system, {"role": "user", "content": question}])
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert (cached >= 128) == expect_cached, cached  # the shared blocks
        # vllm-mlx's defaults: 32768 tokens by default and at most; 20% of RAM for the cache
        import psutil

        budget = s["models"]["demo"]["prompt_cache"]["budget_bytes"]
        assert abs(budget - 0.2 * psutil.virtual_memory().total) < 1 << 20
        with_key = {"Authorization": "Bearer your-secret-key"}
        r = httpx.post(url + "/v1/chat/completions", headers=with_key, timeout=30, json={
            "model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40000})
        assert r.status_code == 200 and "asked 40000" in r.headers["x-mlxfleet-max-tokens"]
        # Without --enable-auto-tool-choice, as in vllm-mlx, tool calls stay text.
        r = client.chat.completions.create(model="demo", messages=PARIS, tools=[WEATHER],
                                           temperature=0)
        assert not r.choices[0].message.tool_calls
        assert "<tool_call>" in r.choices[0].message.content


def test_parser_cache_sampling_and_embedding_flags(tmp_path):
    emb = "builtin:tiny-embed"  # a random BERT encoder, built offline
    with serve(tmp_path, "builtin:demo", "--enable-auto-tool-choice", "--tool-call-parser",
               "hermes", "--reasoning-parser", "qwen3", "--cache-memory-mb", "300",
               "--max-tokens", "5", "--max-request-tokens", "50", "--default-temperature",
               "0", "--stream-interval", "2", "--embedding-model", emb) as (client, url):
        r = client.chat.completions.create(model="demo", messages=PARIS, tools=[WEATHER],
                                           max_tokens=50)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        r = client.chat.completions.create(model="demo", messages=[
            {"role": "user", "content": "Hello!"}])
        assert r.usage.completion_tokens == 5  # --max-tokens is the default length
        r = client.chat.completions.with_raw_response.create(  # lowered to the limit, said
            model="demo", max_tokens=51, messages=PARIS, extra_body={"ignore_eos": True})
        assert r.headers["x-mlxfleet-max-tokens"].startswith("50; asked 51")
        assert r.parse().usage.completion_tokens == 50
        chunks = list(client.chat.completions.create(
            model="demo", stream=True, max_tokens=4,
            messages=[{"role": "user", "content": "Hello!"}]))
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 2
        s = httpx.get(url + "/v1/status").json()["models"]
        assert s["demo"]["prompt_cache"]["budget_bytes"] == 300 << 20
        assert set(s) == {"demo", "tiny-embed"}
        v = client.embeddings.create(model="tiny-embed", input="a cat").data[0].embedding
        assert len(v) == 64 and abs(sum(x * x for x in v) - 1) < 1e-4  # normalized


def test_mcp_config_starts_its_servers_and_a_bad_file_is_a_clear_error(tmp_path):
    (tmp_path / "calc.py").write_text(
        "from mcp.server.mcpserver import MCPServer\napp = MCPServer('calc')\n"
        "@app.tool()\ndef add(a: int, b: int) -> int:\n    return a + b\napp.run()\n")
    cfg = tmp_path / "mcp.json"
    cfg.write_text(json.dumps({"mcpServers": {"calc": {
        "command": sys.executable, "args": [str(tmp_path / "calc.py")]}}}))
    with serve(tmp_path, "builtin:tiny", "--continuous-batching", "--mcp-config",
               str(cfg)) as (_, url):
        assert wait_for(lambda: httpx.get(url + "/v1/mcp/status").json()["servers"][0]
                        ["state"] == "ready", 60)
    r = subprocess.run([sys.executable, "-m", "mlxfleet", "serve", "builtin:tiny",
                        "--mcp-config", str(tmp_path / "missing.json"), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "MCP config" in r.stderr and "Traceback" not in r.stderr
