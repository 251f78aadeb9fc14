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
    text = fold.start() + "".join(fold.feed(batch) for batch in CASES[name])
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
    assert message["usage"] == {"input_tokens": 12, "output_tokens": 7,
                                "cache_read_input_tokens": 5}


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
