"""Protocol formatters as tables, without processes: pipeline events in, wire bytes out.
A streamed answer, replayed as a client would, must equal the non-streamed one (the same
fold's result)."""

from __future__ import annotations

import json

import pytest

from mlxfleet.worker.anthropic import MessageFold
from mlxfleet.worker.pipeline import Done, Finish, ReasoningDelta, TextDelta, ToolCall
from mlxfleet.worker.prompts import usage


def sse(text: str) -> list[tuple[str, dict]]:
    """(event, data) pairs of an SSE text."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def replay(events: list[tuple[str, dict]]) -> dict:
    """What an Anthropic SDK builds from a stream: the message, its blocks in order."""
    msg: dict = {}
    for kind, data in events:
        if kind == "message_start":
            msg = {**data["message"], "content": []}
        elif kind == "content_block_start":
            assert data["index"] == len(msg["content"])  # indices in order, none skipped
            msg["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, delta = msg["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
        elif kind == "content_block_stop":
            block = msg["content"][data["index"]]
            if "_json" in block:
                block["input"] = json.loads(block.pop("_json"))
        elif kind == "message_delta":
            msg.update(data["delta"])
            msg["usage"] = {**msg["usage"], **data["usage"]}
    return msg


CALL = ToolCall(0, 0, "call_abc", "get_weather", {"city": "Paris"})
DONE = Done(usage(12, 7, cached_tokens=5))

CASES = {
    "thinking, text, tool": [
        [ReasoningDelta(0, "Let me "), ReasoningDelta(0, "see.")],
        [TextDelta(0, "Calling"), TextDelta(0, " it.")],
        [CALL, Finish(0, "tool_calls")], [DONE]],
    "text only, length": [[TextDelta(0, "Hello")], [TextDelta(0, " world")],
                          [Finish(0, "length")], [DONE]],
    "stop sequence": [[TextDelta(0, "a")], [Finish(0, "stop", "END")], [DONE]],
    "text, tool, text": [[TextDelta(0, "one")], [CALL], [TextDelta(0, "two")],
                         [Finish(0, "tool_calls")], [DONE]],
    "empty answer": [[Finish(0, "stop")], [DONE]],
}


@pytest.mark.parametrize("name", CASES)
def test_anthropic_stream_and_message_are_one_fold(name):
    fold = MessageFold("msg_1", "m", 12)
    text = fold.start(5) + "".join(fold.feed(batch) for batch in CASES[name])
    events = sse(text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                     "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    message = fold.message()
    streamed = replay(events)
    assert streamed["content"] == message["content"]
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == \
        (message["stop_reason"], message["stop_sequence"])
    assert streamed["usage"]["output_tokens"] == message["usage"]["output_tokens"] == 7
    # Anthropic's input_tokens leave out what was read from cache, and the stream says so
    # from its first event (Claude Code reads message_start's usage)
    inputs = {"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5}
    assert message["usage"] == {**inputs, "output_tokens": 7}
    start = events[0][1]["message"]["usage"]
    assert {k: start[k] for k in inputs} == inputs
    assert {k: events[-2][1]["usage"][k] for k in inputs} == inputs


def test_anthropic_block_order_and_shapes():
    fold = MessageFold("msg_1", "m", 12)
    fold.start()
    for batch in CASES["thinking, text, tool"]:
        fold.feed(batch)
    m = fold.message()
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use"]
    assert m["content"][0] == {"type": "thinking", "thinking": "Let me see.", "signature": ""}
    assert m["content"][2] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                               "input": {"city": "Paris"}}
    assert m["stop_reason"] == "tool_use"
    fold = MessageFold("msg_2", "m", 12)
    for batch in CASES["stop sequence"]:
        fold.feed(batch)
    assert (fold.message()["stop_reason"], fold.message()["stop_sequence"]) == \
        ("stop_sequence", "END")


def responses_fold(custom: bool = False):
    from mlxfleet.worker.responses import ResponseFold, ResponsesRequest, ToolMap, _Shell

    tmap = ToolMap(custom={"apply_patch": "start: ..."} if custom else {})
    return ResponseFold(_Shell(ResponsesRequest(model="m", input="x"), "m"), tmap)


def replay_responses(events: list[tuple[str, dict]]) -> list[dict]:
    """The output items as a streaming client assembles them from the item events."""
    items: dict[int, dict] = {}
    seqs = [data["sequence_number"] for _, data in events]
    assert seqs == list(range(len(events)))  # numbered in order, from 0
    for kind, data in events:
        if kind == "response.output_item.done":
            items[data["output_index"]] = data["item"]
    return [items[i] for i in sorted(items)]


PATCH = ToolCall(0, 0, "call_p", "apply_patch", {"input": "*** Begin Patch\n*** End Patch\n"})


@pytest.mark.parametrize("name", CASES)
def test_responses_stream_and_response_are_one_fold(name):
    fold = responses_fold()
    text = fold.start() + "".join(fold.feed(batch) for batch in CASES[name])
    events = sse(text)
    assert events[0][0] == "response.created" and events[-1][0] in (
        "response.completed", "response.incomplete")
    final = fold.final
    assert replay_responses(events) == final["output"]
    assert events[-1][1]["response"] == final
    assert final["usage"]["output_tokens"] == 7
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 5
    assert (final["status"] == "incomplete") == (name == "text only, length")
    if name == "empty answer":
        assert [i["type"] for i in final["output"]] == ["message"]


def test_responses_freeform_calls_are_custom_tool_call_items():
    fold = responses_fold(custom=True)
    text = fold.start() + fold.feed([PATCH, Finish(0, "tool_calls")]) + fold.feed([DONE])
    kinds = [k for k, _ in sse(text)]
    assert "response.custom_tool_call_input.done" in kinds
    assert "response.function_call_arguments.done" not in kinds
    (item,) = fold.final["output"]
    assert item["type"] == "custom_tool_call" and item["input"].startswith("*** Begin Patch")


def replay_chat(text: str) -> tuple[dict[int, dict], dict | None]:
    """Chat chunks as a client accumulates them: per choice, content, reasoning, tool
    calls (by their index) and finish reason; and the usage chunk."""
    assert text.endswith("data: [DONE]\n\n")
    got: dict[int, dict] = {}
    use = None
    for line in text.split("\n\n"):
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if not chunk["choices"]:
            use = chunk["usage"]
        for c in chunk["choices"]:
            ch = got.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {},
                                             "finish": None})
            d = c["delta"]
            ch["content"] += d.get("content") or ""
            ch["reasoning"] += d.get("reasoning") or ""
            for call in d.get("tool_calls") or []:
                ch["calls"][call["index"]] = call["function"]
            ch["finish"] = c["finish_reason"] or ch["finish"]
    return got, use


@pytest.mark.parametrize("name", [*CASES, "two choices"])
def test_chat_stream_and_completion_are_one_fold(name):
    from mlxfleet.worker.openai_api import ChatFold

    batches = CASES.get(name) or [
        [TextDelta(0, "a"), TextDelta(1, "b")], [CALL, TextDelta(1, "c")],
        [Finish(0, "tool_calls"), Finish(1, "stop")], [DONE]]
    n = 2 if name == "two choices" else 1
    fold = ChatFold("chatcmpl-1", 1, "m", n, include_usage=True)
    text = fold.start() + "".join(fold.feed(b) for b in batches) + "data: [DONE]\n\n"
    streamed, use = replay_chat(text)
    done = fold.completion()
    assert use == done["usage"] and done["usage"]["completion_tokens"] == 7
    for choice in done["choices"]:
        s, m = streamed[choice["index"]], choice["message"]
        assert s["content"] == (m["content"] or "")
        assert s["reasoning"] == m.get("reasoning", "")
        assert [s["calls"][i] for i in sorted(s["calls"])] == \
            [c["function"] for c in m.get("tool_calls", [])]
        assert s["finish"] == choice["finish_reason"]


@pytest.mark.parametrize("key", ["message", "response"])
@pytest.mark.parametrize("name", CASES)
def test_ollama_lines_and_answer_are_one_fold(name, key):
    from mlxfleet.worker.ollama import OllamaFold

    fold = OllamaFold("m", key, True, lambda finish: {
        "done": True, "done_reason": "length" if finish and finish.reason == "length"
        else "stop", "eval_count": 7})
    lines = [json.loads(ln) for ln in "".join(fold.feed(b) for b in CASES[name]).splitlines()]
    assert [ln["done"] for ln in lines] == [False] * (len(lines) - 1) + [True]
    answer = fold.answer()
    if key == "message":
        parts = [ln["message"] for ln in lines]
        assert "".join(p["content"] for p in parts) == answer["message"]["content"]
        assert "".join(p.get("thinking", "") for p in parts) == \
            answer["message"].get("thinking", "")
        assert [c for p in parts for c in p.get("tool_calls", [])] == \
            answer["message"].get("tool_calls", [])
    else:
        assert "".join(ln["response"] for ln in lines) == answer["response"]
    assert lines[-1]["done_reason"] == answer["done_reason"]
    assert (answer["done_reason"] == "length") == (name == "text only, length")


@pytest.mark.parametrize("echo", [False, True])
def test_completion_stream_and_answer_are_one_fold(echo):
    from mlxfleet.worker.openai_api import CompletionFold

    batches = [[TextDelta(0, " a"), TextDelta(1, " b")], [TextDelta(0, "c"),
               Finish(0, "length")], [Finish(1, "stop")], [DONE]]
    fold = CompletionFold("cmpl-1", 1, "m", 2, 2, ["Say:"] if echo else None,
                          include_usage=True)
    text = fold.start() + "".join(fold.feed(b) for b in batches)
    got: dict[int, str] = {}
    finish: dict[int, str] = {}
    for line in text.split("\n\n"):
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                got[c["index"]] = got.get(c["index"], "") + c["text"]
                finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    done = fold.completion()
    assert [got[c["index"]] for c in done["choices"]] == [c["text"] for c in done["choices"]]
    assert done["choices"][0]["text"] == ("Say:" if echo else "") + " ac"
    assert [finish[c["index"]] for c in done["choices"]] == ["length", "stop"]
    assert done["usage"]["completion_tokens"] == 7


@pytest.mark.parametrize("path,check", [
    ("/v1/chat/completions", lambda t: t.endswith("data: [DONE]\n\n")
     and json.loads(t.split("\n\n")[0][6:])["error"]["code"] == "timeout"),
    ("/v1/completions", lambda t: t.endswith("data: [DONE]\n\n")),
    ("/v1/messages", lambda t: t.startswith("event: error\n") and json.loads(
        t.split("data: ", 1)[1])["error"]["type"] == "api_error" and "[DONE]" not in t),
    ("/v1/responses", lambda t: t.startswith("event: error\n") and json.loads(
        t.split("data: ", 1)[1])["code"] == "timeout"),
    ("/api/chat", lambda t: json.loads(t)["error"].startswith("The request")),
])
def test_in_band_errors_in_each_protocols_shape(path, check):
    from mlxfleet.wire import APIError, stream_error

    err = APIError(504, "The request to model 'm' timed out.", type="server_error",
                   code="timeout")
    assert check(stream_error(err, path)), stream_error(err, path)


@pytest.mark.parametrize("body,message,code", [
    (b'{"error": {"message": "Too long.", "type": "invalid_request_error", '
     b'"param": "messages", "code": "context_length_exceeded"}}', "Too long.",
     "context_length_exceeded"),
    (b'{"type": "error", "error": {"type": "invalid_request_error", "message": "Too long."}}',
     "Too long.", None),
    (b'{"error": "Too long."}', "Too long.", None),
    (b"<html>Bad Gateway</html>", "node 'b' answered HTTP 400", None),
    (b'["not", "an", "error"]', "node 'b' answered HTTP 400", None),
])
def test_an_error_another_server_answered_keeps_its_message_and_code(body, message, code):
    from mlxfleet.wire import APIError

    err = APIError.answered(400, body, "node 'b'", {"retry-after": "3"})
    assert (err.status, err.message, err.code) == (400, message, code)
    assert err.type == "invalid_request_error" and err.headers == {"Retry-After": "3"}


def test_a_responses_stream_error_has_the_next_sequence_number():
    from mlxfleet.wire import APIError

    fold = responses_fold()
    text = fold.start() + fold.feed([TextDelta(0, "a")])
    text += fold.error(APIError(503, "Generation failed: boom", code="engine_error"))
    events = sse(text)
    assert events[-1][0] == "error" and events[-1][1]["code"] == "engine_error"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


def test_a_choices_tokens_that_arrive_together_go_out_as_one_delta_in_order():
    """A speculative step gives a row several tokens at once: one delta for them (text and
    logprobs joined), never across another event of the same choice, order kept."""
    from mlxfleet.worker.pipeline import _coalesce

    lp = [object() for _ in range(5)]  # stand-ins for TokenEvents: only carried along
    out = _coalesce([TextDelta(0, "a", [lp[0]]), TextDelta(1, "x", [lp[1]]),
                     TextDelta(0, "b", [lp[2]]), ReasoningDelta(1, "r"),
                     TextDelta(1, "y", [lp[3]]), TextDelta(0, "c", [lp[4]]),
                     Finish(0, "length"), TextDelta(1, "z")])
    assert out == [TextDelta(0, "abc", [lp[0], lp[2], lp[4]]), TextDelta(1, "x", [lp[1]]),
                   ReasoningDelta(1, "r"), TextDelta(1, "yz", [lp[3]]), Finish(0, "length")]
