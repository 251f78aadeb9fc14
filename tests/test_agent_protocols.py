"""What agent clients send, as they send it: Claude Code's Messages requests (system
messages mid-conversation, thinking, context management, output_config, beta flags, huge
max_tokens), OpenAI's developer role and late system messages on a template that takes one
system message only, and the gateway's log of every refusal. Real gateway, real workers,
the official SDKs."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from served import Served, manifest

#: A chat template that, like Qwen3.5's, takes one system message and only first.
STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mlxfleet.builtin import write_builtin

    root = tmp_path_factory.mktemp("agents")
    strict = write_builtin("tiny", root / "strict-model")
    cfg = json.loads((strict / "tokenizer_config.json").read_text())
    cfg["chat_template"] = STRICT_TEMPLATE
    (strict / "tokenizer_config.json").write_text(json.dumps(cfg))
    f = Served(root, env={"MLXFLEET_DEFAULT_CACHE_MB": "256"})
    f.write("tiny.yaml", manifest("tiny", keepAlive="forever", aliases=["claude-*"]))
    f.write("strict.yaml", manifest("strict", source=str(strict), keepAlive="forever"))
    f.write("short.yaml", manifest("short", keepAlive="forever",
                                   limits={"contextLength": 256}))
    f.start()
    f.wait_ready("tiny")
    f.wait_ready("strict")
    yield f
    f.stop()


#: The shape of Claude Code's first request (trimmed): a system message inside
#: ``messages``, adaptive thinking, context management, cache_control, output_config,
#: metadata, and a max_tokens far above what a small model allows.
def claude_code_body(**over) -> dict:
    body = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 64000, "stream": False,
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The user's working directory is /tmp."},
            {"role": "user", "content": "list the files"}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                           "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": "user_abc"},
        "temperature": 1,
    }
    return {**body, **over}


CLAUDE_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "x",
                  "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "context-management-2025-06-27,some-future-beta"}


@pytest.mark.parametrize("stream", [False, True])
def test_claude_codes_first_request_is_answered(served, stream):
    r = httpx.post(served.url + "/v1/messages?beta=true", headers=CLAUDE_HEADERS, timeout=120,
                   json=claude_code_body(stream=stream, max_tokens=64000))
    assert r.status_code == 200, r.text  # was 400: messages[1].role
    allowed = r.headers["x-mlxfleet-max-tokens"]
    assert allowed.split(";")[0].isdigit() and "asked 64000" in allowed
    if stream:
        assert "event: message_stop" in r.text and "message_delta" in r.text
    else:
        assert r.json()["type"] == "message" and r.json()["model"]


def test_the_anthropic_sdks_beta_client_with_a_late_system_message(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    with client.beta.messages.stream(  # sends ?beta=true and anthropic-beta
            model="claude-haiku-4-5", max_tokens=128000,
            betas=["context-management-2025-06-27"],
            messages=[{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "and now?"}],
            system="Be brief.", thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        m = s.get_final_message()
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens > 0


def test_output_config_format_is_structured_output(served):
    schema = {"type": "object", "properties": {"title": {"type": "string"}},
              "required": ["title"], "additionalProperties": False}
    r = httpx.post(served.url + "/v1/messages", headers=CLAUDE_HEADERS, timeout=120,
                   json=claude_code_body(max_tokens=30, output_config={
                       "effort": "low", "format": {"type": "json_schema", "schema": schema}}))
    assert r.status_code == 200, r.text
    text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
    assert set(json.loads(text)) == {"title"}  # was free text


@pytest.mark.parametrize("model", ["strict", "tiny"])
def test_developer_and_late_system_messages_render_on_any_template(served, model):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=model, max_tokens=3, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Tools changed."},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "again"}])
    assert r.choices[0].message.content is not None  # was a 400 from the template
    # the Anthropic side of the same template
    m = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
        model=model, max_tokens=3, system="Be brief.",
        messages=[{"role": "user", "content": "hi"},
                  {"role": "system", "content": "The date is today."},  # type: ignore
                  {"role": "user", "content": "again"}])
    assert m.content


def test_every_refusal_is_in_the_gateways_log(served):
    r = httpx.post(served.url + "/v1/chat/completions", headers={"X-Request-Id": "probe-404"},
                   json={"model": "no-such-model", "messages": [{"role": "user",
                                                                 "content": "hi"}]})
    assert r.status_code == 404
    r = httpx.get(served.url + "/v1/models/nope", headers={"X-Request-Id": "probe-get"})
    assert r.status_code == 404
    log = served.logs()
    line = next(ln for ln in log.splitlines() if "probe-404" in ln)
    assert "/v1/chat/completions" in line and "no-such-model" in line and "404" in line
    assert "does not exist" in line
    assert any("probe-get" in ln and "/v1/models/nope" in ln for ln in log.splitlines())


def test_a_manifest_sets_the_context_length(served):
    """limits.contextLength (vLLM's --max-model-len, Ollama's num_ctx) instead of the
    checkpoint's 2048: prompts and budgets are held to it, and clients are told."""
    served.wait_ready("short")
    show = httpx.post(served.url + "/api/show", json={"model": "short"}).json()
    assert show["model_info"]["qwen3.context_length"] == 256
    r = httpx.post(served.url + "/v1/chat/completions", json={
        "model": "short", "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": "short", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000, "ignore_eos": True})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
