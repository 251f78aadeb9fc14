"""The prompt cache's disk tier (``cache.diskMB``) and warm prompts (``cache.warmPrompts``).

A real fleet: a conversation is cached, its model unloaded (the cache goes to disk) and
loaded again by a new worker process, which reads it back; a corrupted file is dropped,
not a crash; a new source wipes the old entries. Warm prompts are prefilled at load.
"""

from __future__ import annotations

import httpx
import pytest
from served import Served, manifest, wait_for

SYSTEM = ("You are a careful assistant who answers questions about cities, countries, "
          "the weather, numbers and time zones, always in one short sentence. " * 4)


def ask(served, model: str, question: str) -> dict:
    r = served.openai().chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return {"cached": r.usage.prompt_tokens_details.cached_tokens,
            "prompt": r.usage.prompt_tokens, "text": r.choices[0].message.content}


def control(served, name: str, action: str) -> None:
    r = httpx.post(f"{served.url}/mlxfleet/v1/models/{name}/{action}", timeout=120)
    assert r.status_code == 200, r.text


def disk_files(served, name: str) -> list:
    return sorted((served.state / "prompt-cache" / name).glob("*/*.safetensors"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("diskcache"))
    f.write("disk.yaml", manifest("disk", cache={"diskMB": 64}))
    f.write("warm.yaml", manifest("warm", cache={"warmPrompts": [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]]}))
    f.start()
    f.wait_ready("disk")
    f.wait_ready("warm")
    yield f
    f.stop()


def test_a_conversation_survives_unload_and_reload(served):
    cold = ask(served, "disk", "What is the capital of France?")
    assert cold["cached"] == 0
    control(served, "disk", "unload")
    assert disk_files(served, "disk"), "unloading wrote the cache to disk"
    control(served, "disk", "load")
    again = ask(served, "disk", "What is the capital of France?")
    assert again["cached"] == again["prompt"] - 1  # everything but the last token
    assert again["text"] == cold["text"]  # the cache read back gives the same answer


def test_a_corrupted_file_is_dropped_not_a_crash(served):
    ask(served, "disk", "What is the capital of Italy?")
    control(served, "disk", "unload")
    files = disk_files(served, "disk")
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[:100])  # truncated: a crash mid-write, a bad disk
    control(served, "disk", "load")
    r = ask(served, "disk", "What is the capital of Italy?")
    assert r["cached"] == 0 and r["text"]  # a miss, answered
    log = httpx.get(f"{served.url}/mlxfleet/v1/models/disk/logs?tail=200", timeout=10).text
    assert "prompt cache: dropping" in log  # logged, with the file's name
    assert served.status("disk")["restarts"] == 0


def test_a_new_source_wipes_the_old_entries(served):
    ask(served, "disk", "What is the capital of Spain?")
    control(served, "disk", "unload")
    old = {p.parent.name for p in disk_files(served, "disk")}
    assert old
    served.write("disk.yaml", manifest("disk", source="builtin:tiny-10m", cache={"diskMB": 64}))
    assert wait_for(lambda: served.status("disk")["source"] == "builtin:tiny-10m", timeout=30)
    control(served, "disk", "load")
    ask(served, "disk", "What is the capital of Spain?")
    folders = {p.name for p in (served.state / "prompt-cache" / "disk").iterdir()}
    assert not folders & old  # the old checkpoint's entries are gone


def test_warm_prompts_are_cached_at_load(served):
    r = ask(served, "warm", "Hello again")
    assert r["cached"] >= 32  # the system prompt came from the warm-up


def test_a_warm_prompts_file_that_is_a_fifo_stalls_nothing_and_the_model_serves(served):
    import os
    import time

    fifo = served.dir / "prompts.fifo"
    os.mkfifo(fifo)
    served.write("fifo.yaml", manifest("fifo", cache={"warmPrompts": "prompts.fifo"}))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:  # the gateway answers all along (it hung ~23 s)
        assert httpx.get(served.url + "/health", timeout=2).status_code == 200
        time.sleep(0.2)
    served.wait_ready("fifo")
    assert served.chat("fifo").choices[0].message.content is not None
    log = httpx.get(f"{served.url}/mlxfleet/v1/models/fifo/logs?tail=200", timeout=10).text
    assert "not a regular file" in log, log[-2000:]


def test_a_large_inline_warm_prompt_starts_and_stays_out_of_ps(served):
    secret = "warm-secret-" + "x" * 200_000  # 210 KB: "Argument list too long" before
    served.write("big.yaml", manifest("big", cache={"warmPrompts": [
        [{"role": "user", "content": secret}]]}))
    st = served.wait_ready("big")
    with open(f"/proc/{st['pid']}/cmdline", "rb") as f:
        assert b"warm-secret" not in f.read()  # not on the command line any local user reads
    (served.dir / "big.yaml").unlink()


def test_a_captured_agent_request_warms_the_cache_for_every_new_session(tmp_path_factory):
    """cache.warmPrompts naming a file with a request as an agent sent it (Claude Code's
    system blocks, billing line and tools): once loaded, a new session, with another
    billing line and another question, reads >= 95% of its prompt from cache."""
    import json

    import anthropic

    tools = [{"name": f"tool_{i}", "description": f"Does thing number {i} to a file. " * 4,
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                               "required": ["path"]}} for i in range(4)]
    system = "You are an agent that helps with code, carefully and briefly. " * 8

    def body(billing: str, question: str) -> dict:
        return {"model": "agent", "max_tokens": 4, "tools": tools,
                "system": [{"type": "text", "text": "x-anthropic-billing-header: "
                            f"cc_version=2.1.332.{billing}; cc_entrypoint=sdk-cli;"},
                           {"type": "text", "text": system}],
                "messages": [{"role": "user", "content": question}]}

    f = Served(tmp_path_factory.mktemp("warm-agent"))
    (f.dir / "captured.json").write_text(json.dumps(
        [{"path": "/v1/messages", "body": body("3a1", "Please list the files.")}]))
    f.write("agent.yaml", manifest("agent", cache={"warmPrompts": "captured.json"}))
    try:
        f.start()
        f.wait_ready("agent")
        import time

        deadline = time.monotonic() + 30  # the warm-up runs once the model is loaded
        while "warmed the prompt cache with 1 of 1" not in httpx.get(
                f"{f.url}/mlxfleet/v1/models/agent/logs?tail=50", timeout=10).text:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        m = anthropic.Anthropic(base_url=f.url, api_key="x").messages.create(
            **body("b7e", "What does tool_3 do?"))
        total = m.usage.input_tokens + m.usage.cache_read_input_tokens
        assert m.usage.cache_read_input_tokens >= 0.95 * total, m.usage
    finally:
        f.stop()
