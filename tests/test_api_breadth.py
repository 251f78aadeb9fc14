"""Anthropic Messages, tool calling, reasoning and structured output."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from mlxfleet.worker.parsers import (
    OutputSplitter,
    ToolFormat,
    first_call_only,
    json_calls,
    tool_format,
)

WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# Bounded arguments: even a random-weight model must finish a valid call.
FORECAST = {"type": "function", "function": {
    "name": "forecast", "parameters": {
        "type": "object", "properties": {
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                  "maximum": 23},
                                         "on": {"type": "boolean"}},
        "required": ["hour", "on"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(demo_served):
    return demo_served


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


# ---- Anthropic Messages -------------------------------------------------------------

def test_anthropic_create_and_usage(claude):
    m = claude.messages.create(model="demo", max_tokens=50,
                               messages=[{"role": "user",
                                          "content": "What is the capital of Japan?"}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert "Tokyo" in m.content[0].text
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0


def test_every_protocol_reports_the_cache_hits_the_worker_logged(claude, served):
    """The same conversation twice through each protocol: the second is a cache hit, and
    each protocol says so in its own terms, in agreement with the worker's log line
    (``N prompt (C cached)``): Anthropic's input_tokens leave out the cached tokens, from
    the stream's very first event; Ollama counts only the tokens it evaluated."""
    import re

    import ollama

    system = "You answer questions about capitals of countries, in one sentence. " * 5
    ask = [{"role": "user", "content": "What is the capital of Japan?"}]

    seen = [0]

    def logged() -> tuple[int, int]:
        """The worker's line for the request just answered (the log follows a moment
        after the answer: wait for one more line)."""
        import time

        for _ in range(100):
            log = httpx.get(served.url + "/mlxfleet/v1/models/demo/logs?tail=100000",
                            timeout=10).text
            lines = re.findall(r"(\d+) prompt \((\d+) cached\)", log)
            if len(lines) > seen[0]:
                seen[0] = len(lines)
                return int(lines[-1][0]), int(lines[-1][1])
            time.sleep(0.05)
        raise AssertionError("the worker logged no line for the request")

    logged_before = httpx.get(served.url + "/mlxfleet/v1/models/demo/logs?tail=100000",
                              timeout=10).text
    seen[0] = len(re.findall(r"(\d+) prompt \((\d+) cached\)", logged_before))

    claude.messages.create(model="demo", max_tokens=5, system=system, messages=ask)
    logged()
    with claude.messages.stream(model="demo", max_tokens=5, system=system,
                                messages=ask) as stream:
        first = next(iter(stream))  # message_start
        final = stream.get_final_message()
    n, c = logged()
    assert c > 0 and first.type == "message_start"
    start = first.message.usage
    assert (start.input_tokens, start.cache_read_input_tokens) == (n - c, c)  # (was n, -)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (n - c, c)
    m = claude.messages.create(model="demo", max_tokens=5, system=system, messages=ask)
    n, c = logged()
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens) == (n - c, c)  # (was n)
    chat = [{"role": "system", "content": system}, *ask]
    r = openai.OpenAI(base_url=served.url + "/v1", api_key="x").chat.completions.create(
        model="demo", max_tokens=5, messages=chat)
    n, c = logged()
    assert (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens) == (n, c)
    resp = openai.OpenAI(base_url=served.url + "/v1", api_key="x").responses.create(
        model="demo", max_output_tokens=5, instructions=system, input=ask[0]["content"])
    n, c = logged()
    assert (resp.usage.input_tokens, resp.usage.input_tokens_details.cached_tokens) == (n, c)
    o = ollama.Client(host=served.url).chat(model="demo", messages=chat,
                                           options={"num_predict": 5})
    n, c = logged()
    assert c > 0 and o.prompt_eval_count == n - c


def test_anthropic_system_as_blocks_and_stop_sequences(claude):
    m = claude.messages.create(
        model="demo", max_tokens=50, system=[{"type": "text", "text": "You are concise."}],
        stop_sequences=["Tokyo"],
        messages=[{"role": "user", "content": [{"type": "text",
                                                "text": "What is the capital of Japan?"}]}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Tokyo"
    assert m.content[0].text.endswith("is ")
    m = claude.messages.create(model="demo", max_tokens=3,
                               messages=[{"role": "user", "content": "Hello!"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_anthropic_stream_text(claude):
    with claude.messages.stream(model="demo", max_tokens=50, messages=[
            {"role": "user", "content": "What colour is the sky?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "blue" in text and final.stop_reason == "end_turn"


def test_anthropic_event_order(served):
    events = []
    with httpx.stream("POST", served.url + "/v1/messages", timeout=60, json={
            "model": "demo", "max_tokens": 30, "stream": True,
            "messages": [{"role": "user", "content": "Hello!"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_tool_round_trip(claude):
    q = {"role": "user", "content": "What's the weather in Paris?"}
    m = claude.messages.create(model="demo", max_tokens=60, tools=[WEATHER], messages=[q])
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    m2 = claude.messages.create(model="demo", max_tokens=60, tools=[WEATHER], messages=[
        q, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"city": "Paris",
                                                             "temperature": 25,
                                                             "condition": "sunny"})}]}])
    assert m2.stop_reason == "end_turn"
    assert "sunny" in m2.content[0].text and "25" in m2.content[0].text
    # Streaming a tool call.
    with claude.messages.stream(model="demo", max_tokens=60, tools=[WEATHER],
                                messages=[q]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_anthropic_tool_choice_any_forces_a_call(claude):
    m = claude.messages.create(
        model="tiny", max_tokens=60, tool_choice={"type": "any"},
        tools=[{"name": "set_alarm", "input_schema": ALARM["function"]["parameters"]}],
        messages=[{"role": "user", "content": "hi"}])
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "set_alarm" and 0 <= use.input["hour"] <= 23
    assert isinstance(use.input["on"], bool)


def test_anthropic_count_tokens(claude):
    base = claude.messages.count_tokens(model="demo", messages=[
        {"role": "user", "content": "What is the capital of Japan?"}])
    more = claude.messages.count_tokens(model="demo", system="You are a helpful assistant.",
                                        tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the capital of Japan?"}])
    assert 5 < base.input_tokens < more.input_tokens


def test_anthropic_system_blocks_are_separate_paragraphs(claude):
    msgs = [{"role": "user", "content": "hi"}]

    def count(system) -> int:
        return claude.messages.count_tokens(model="demo", system=system,
                                            messages=msgs).input_tokens

    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    assert count(blocks) == count("Be brief.\n\nBe kind.") != count("Be brief.Be kind.")


@pytest.mark.parametrize("body", [
    {"model": "demo", "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": 5, "input": {}}]}]},
    {"model": "demo", "messages": []},
    {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
    {"model": "demo", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
])
def test_count_tokens_errors_are_400_in_anthropics_shape(served, body):
    r = httpx.post(served.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"


def test_anthropic_errors_use_anthropics_shape(served, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=5,
                               messages=[{"role": "user", "content": "x"}])
    assert "does not exist" in str(e.value)
    r = httpx.post(served.url + "/v1/messages", json={
        "model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]
    # Odd but valid-JSON shapes are handled, never a 500.
    r = httpx.post(served.url + "/v1/messages", json={
        "model": "demo", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [1, "two", {"type": "text",
                                                                 "text": "ok"}]}]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(served.url + "/v1/messages", json={
        "model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "bogus"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"


# ---- OpenAI tool calling with grammars ---------------------------------------------------

def test_required_tool_choice_gives_a_valid_call_even_from_random_weights(served):
    client = served.openai()
    for choice, name in (("required", None), ({"type": "function",
                                               "function": {"name": "set_alarm"}},
                                              "set_alarm")):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
            tools=[FORECAST, ALARM], tool_choice=choice, temperature=1.0, seed=3)
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("forecast", "set_alarm")
        if name:
            assert call.function.name == name
        if call.function.name == "forecast":
            assert args["unit"] in ("c", "f") and 1 <= args["days"] <= 7
        else:
            assert 0 <= args["hour"] <= 23 and isinstance(args["on"], bool)
        assert r.choices[0].finish_reason == "tool_calls"


def test_json_schema_response_format_parses_and_validates(served):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "n", "colour"], "additionalProperties": False}
    for stream in (False, True):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=60,
                  temperature=1.0, seed=11,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema,
                                                   "strict": True}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           served.openai().chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            text = served.openai().chat.completions.create(**kw).choices[0].message.content
        obj = json.loads(text)
        assert set(obj) == {"ok", "n", "colour"} and isinstance(obj["ok"], bool)
        assert 0 <= obj["n"] <= 99 and obj["colour"] in ("red", "green", "blue")


UNBOUNDED = {
    "strings": {"type": "object", "properties": {"a": {"type": "string"},
                                                 "b": {"type": "string"}},
                "required": ["a", "b"]},
    "nested": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"]}}}, "required": ["items"]},
    "deep": {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "array", "items": {
            "type": "array", "items": {"type": "string"}}}}, "required": ["b"]},
        "c": {"type": "string", "minLength": 3}}, "required": ["a", "c"]},
    "any": {"type": "object"},
}


@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_structured_output_always_parses_even_when_the_budget_runs_out(served, name):
    import jsonschema

    schema = UNBOUNDED[name]
    forced = 0
    for max_tokens in (16, 24, 32):
        for seed in range(3):
            kw = dict(model="tiny", messages=[{"role": "user", "content": "go"}],
                      max_tokens=max_tokens, temperature=1.0, seed=seed,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": schema}})
            r = served.openai().chat.completions.create(**kw)
            c = r.choices[0]
            jsonschema.validate(json.loads(c.message.content), schema)
            assert r.usage.completion_tokens <= max_tokens
            forced += c.finish_reason == "length"
    assert forced  # the random model never closes on its own: the budget did it
    chunks = list(served.openai().chat.completions.create(stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), schema)


def test_a_value_with_a_pattern_to_meet_still_closes_within_the_budget(served):
    """Choosing the key ``b`` costs more than its bytes: its value must contain "11".
    The closer must spell that pattern and count it before letting the model choose."""
    import jsonschema

    schema = {"type": "object", "properties": {"b": {"type": "string", "pattern": "11"}},
              "required": ["a"]}
    for max_tokens in range(8, 22):
        r = served.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
            max_tokens=max_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    top = served.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "11"}}})
    assert "11" in json.loads(top.choices[0].message.content)  # not refused as impossible


def test_json_object_with_the_demo_model(served):
    r = served.openai().chat.completions.create(
        model="demo", response_format={"type": "json_object"}, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give me a JSON object with name Bob and age 41."}])
    assert json.loads(r.choices[0].message.content) == {"name": "Bob", "age": 41}
    status = httpx.get(served.url + "/mlxfleet/v1/models/demo").json()
    assert status["ready"]


def test_bad_schema_is_a_400_naming_the_problem(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})
    assert "cannot be enforced" in str(e.value) and "nope" in str(e.value)


# ---- reasoning -----------------------------------------------------------------------

def test_reasoning_goes_to_its_own_field(served, tiny_think_id):
    # Force the random model to open a <think> block; it never closes it, so
    # everything it writes is reasoning and the answer is empty.
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=12,
              temperature=0, logit_bias={str(tiny_think_id): 100})
    r = served.openai().chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] and msg.model_extra["reasoning_content"]
    assert "<think>" not in (msg.content or "") and not msg.content
    chunks = list(served.openai().chat.completions.create(stream=True, **kw))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or ""
                        for c in chunks if c.choices)
    assert reasoning == msg.model_extra["reasoning"]


@pytest.fixture(scope="module")
def tiny_think_id():
    from tokenizers import Tokenizer

    from mlxfleet.builtin import ensure_builtin

    return Tokenizer.from_file(str(ensure_builtin("tiny") / "tokenizer.json")).token_to_id(
        "<think>")


def test_splitter_streams_reasoning_content_and_calls():
    fmt = ToolFormat("hermes", "<tool_call>", "</tool_call>", json_calls)
    sp = OutputSplitter(fmt, None, ("<think>", "</think>"), starts_in_reasoning=True)
    text = ('I should call it.</think>Sure. <tool_call>\n{"name": "f", "arguments": '
            '{"x": 1}}\n</tool_call>')
    pieces = []
    for i in range(0, len(text), 3):  # markers split across chunks
        pieces += sp.feed(text[i:i + 3])
    pieces += sp.finish()
    reasoning = "".join(v for k, v in pieces if k == "reasoning")
    content = "".join(v for k, v in pieces if k == "content")
    calls = [v for k, v in pieces if k == "call"]
    assert reasoning == "I should call it." and content == "Sure. "
    assert calls == [{"name": "f", "arguments": {"x": 1}}]


@pytest.mark.parametrize("family,text,expected", [
    ("hermes", '{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),
    ("llama", '{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ("mistral", '[{"name": "f", "arguments": {"a": 1}}]', [("f", {"a": 1})]),
    ("granite", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     [("f", {"a": 1}), ("g", {})]),
    ("nemotron", '[{"name": "f", "arguments": "{\\"a\\": 1}"}]', [("f", {"a": 1})]),
    ("xlam", '```json\n[{"name": "f", "arguments": {"a": 1}}]\n```', [("f", {"a": 1})]),
    ("deepseek", '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
                 '<｜tool▁call▁end｜>', [("f", {"a": 1})]),
    ("functionary", '<function=f>{"a": 1}</function>', [("f", {"a": 1})]),
])
def test_tool_call_families(family, text, expected):
    fmt = tool_format(family, None)
    calls = fmt.parse(text, None)
    assert [(c["name"], c["arguments"]) for c in calls] == expected


def test_an_invalid_call_is_shown_not_lost():
    fmt = tool_format("hermes", None)
    sp = OutputSplitter(fmt, None, None)
    pieces = sp.feed("<tool_call>not json</tool_call> after") + sp.finish()
    assert "".join(v for k, v in pieces if k == "content") == \
        "<tool_call>not json</tool_call> after"


def test_parallel_tool_calls_false_keeps_the_first_call():
    pieces = [("content", "a"), ("call", {"name": "f"}), ("call", {"name": "g"})]
    assert first_call_only(pieces, False) == pieces[:2]
    assert first_call_only(pieces, True) == pieces[:1]


def test_what_clients_probe_is_answered_quietly(served):
    """Claude Code probes HEAD /api/hello at start (a 404 logged a warning each time)."""
    assert httpx.head(served.url + "/api/hello", timeout=10).status_code == 200
    assert httpx.get(served.url + "/api/hello", timeout=10).status_code == 200
    assert "/api/hello" not in served.logs()
