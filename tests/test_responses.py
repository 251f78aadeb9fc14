"""OpenAI's Responses API through the gateway, driven by the official ``openai`` SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
FORECAST = {"type": "function", "name": "forecast", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"], "additionalProperties": False}}
JAPAN = "What is the capital of Japan?"


@pytest.fixture(scope="module")
def served(demo_served):
    return demo_served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_create(client):
    r = client.responses.create(model="demo", input=JAPAN)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert "Tokyo" in r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    r = client.responses.create(model="demo", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": JAPAN}]}])
    assert "Tokyo" in r.output_text and r.instructions == "Be brief."


def test_stream_events_in_order(client):
    with client.responses.stream(model="demo", input=JAPAN) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Tokyo" in text and final.output_text == text and final.status == "completed"


def test_function_call_round_trip_through_previous_response_id(client):
    r = client.responses.create(model="demo", tools=[WEATHER],
                                input="What is the weather in Paris?")
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    r2 = client.responses.create(
        model="demo", tools=[WEATHER], previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temp_c": 18, "sky": "sunny"})}])
    assert r2.previous_response_id == r.id and r2.output_text
    assert not [o for o in r2.output if o.type == "function_call"]
    # The history was resent as a prefix: the prompt cache served it.
    assert r2.usage.input_tokens_details.cached_tokens > 0


def test_streamed_function_call(client):
    with client.responses.stream(model="demo", tools=[WEATHER],
                                 input="What is the weather in Paris?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_retrieve_input_items_delete_and_store_false(client):
    r = client.responses.create(model="demo", input=JAPAN, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].role == "user"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    r = client.responses.create(model="demo", input=JAPAN, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="demo", input="hi", previous_response_id=r.id)


def test_the_store_is_bounded(client):
    ids = [client.responses.create(model="tiny10m", input="x", max_output_tokens=2).id
           for _ in range(4)]  # the store holds 3 (MLXFLEET_RESPONSES_STORE_MAX)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_structured_output_forced_tools_and_length(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model="tiny10m", input="go", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "x",
                                                 "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"ok", "n"}
    r = client.responses.create(model="tiny10m", input="go", tools=[FORECAST],
                                tool_choice="required", max_output_tokens=60)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "forecast" and set(json.loads(call.arguments)) == {"unit", "days"}
    r = client.responses.create(model="demo", input=JAPAN, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_bad_input_and_unknown_model(client, served):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="demo", input=123)
    assert "input" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    r = httpx.post(served.url + "/v1/responses", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": r'''
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''}}


def test_what_codex_sends_is_accepted(client, served):
    """Codex's tool list: hosted tools this server cannot run are left out (named in a
    header), a namespace's functions are offered and called back with their namespace,
    and its request fields (include, store, prompt_cache_key, reasoning, text.verbosity,
    client_metadata) are taken."""
    r = client.responses.with_raw_response.create(
        model="demo", input="What's the weather in Paris?", max_output_tokens=40,
        tools=[{"type": "web_search"}, {"type": "image_generation"},
               {"type": "namespace", "name": "weather", "description": "Weather tools",
                "tools": [WEATHER]}],
        include=["reasoning.encrypted_content"], store=False, prompt_cache_key="k1",
        reasoning={"effort": "low", "summary": "auto"}, text={"verbosity": "low"},
        extra_body={"client_metadata": {"x": "y"}})
    assert r.headers["x-mlxfleet-dropped-tools"] == "web_search, image_generation"
    calls = [o for o in r.parse().output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.parse().output
    assert calls[0].to_dict()["namespace"] == "weather"
    # the call and its output come back as history, namespace and all
    follow = client.responses.create(model="demo", max_output_tokens=8, input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "namespace": "weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[{"type": "namespace", "name": "weather", "tools": [WEATHER]}])
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_freeform_tool_follows_its_lark_grammar(client, stream):
    """Codex's apply_patch: a custom tool with a Lark grammar; forced, the answer is held
    to the grammar and comes back as a custom_tool_call with its raw input."""
    kw = dict(model="tiny10m", input="Add a file hello.txt", max_output_tokens=40,
              tools=[APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"})
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.custom_tool_call_input.done" in kinds, kinds
        final = [e.response for e in events if e.type in (
            "response.completed", "response.incomplete")][0]
    else:
        final = client.responses.create(**kw)
    (call,) = [o for o in final.output if o.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.input.startswith("*** Begin Patch\n")
    # the call and its output as history: accepted
    again = client.responses.create(model="tiny10m", max_output_tokens=4, tools=[APPLY_PATCH],
                                    input=[{"role": "user", "content": "Add a file"},
                                           {"type": "custom_tool_call", "call_id": call.call_id,
                                            "name": "apply_patch", "input": call.input},
                                           {"type": "custom_tool_call_output",
                                            "call_id": call.call_id, "output": "Done!"}])
    assert again.output


def test_a_client_that_leaves_after_the_last_event_got_its_answer_no_499(served):
    """Codex closes its connection as soon as it reads response.completed, before the
    stream's own end: the gateway counted 3 of ~17 such answers as 499 (client
    disconnected). A stream whose last event was relayed is complete."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(served.url)
    body = json.dumps({"model": "demo", "input": JAPAN, "stream": True}).encode()
    before = served.logs().count("(499)")
    for _ in range(20):
        s = socket.create_connection((u.hostname, u.port), timeout=30)
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b'"response.completed"' not in got:
            data = s.recv(65536)
            assert data, got[-500:]
            got += data
        s.close()  # at once, as Codex does
    import time

    time.sleep(1)
    assert served.logs().count("(499)") == before, served.logs()[-2000:]


def test_codexs_bookkeeping_fields_are_taken_not_logged_as_ignored(client, served):
    r = client.responses.create(model="demo", input=JAPAN, extra_body={
        "prompt_cache_key": "session-1", "include": ["reasoning.encrypted_content"],
        "client_metadata": {"x": "y"}, "unheard_of": 1})
    assert "Tokyo" in r.output_text
    import time

    time.sleep(0.5)
    log = httpx.get(served.url + "/mlxfleet/v1/models/demo/logs?tail=20", timeout=10).text
    ignored = [ln for ln in log.splitlines() if "ignoring unsupported request fields" in ln]
    assert ignored and "'unheard_of'" in ignored[-1], log
    assert "prompt_cache_key" not in ignored[-1] and "include" not in ignored[-1]
