"""Anthropic's Messages API, translated to the worker's chat pipeline.

``POST /v1/messages`` (plain and streaming, with Anthropic's exact event order)
and ``POST /v1/messages/count_tokens``. A request becomes an OpenAI-style chat
request internally, so batching, tools, reasoning and stop strings are one code
path; only the input and output shapes differ.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Quart, request

from ..wire import APIError, from_validation_error, parse_json_body, streaming_response
from .completions import chat_prompt
from .parsers import call_id
from .schemas import ChatCompletionRequest


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: Union[str, list[_Block]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[_Block], None] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[_Block], None] = None
    tools: Optional[list[AnthropicTool]] = None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return str(content)
    parts = []
    for b in content:
        d = b if isinstance(b, dict) else b.model_dump() if isinstance(b, BaseModel) else {}
        if d.get("type") == "text":
            parts.append(str(d.get("text", "")))
    return "".join(parts)


def to_chat(req: MessagesRequest | CountTokensRequest, max_tokens: Optional[int] = None
            ) -> dict[str, Any]:
    """The equivalent OpenAI chat request body."""
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for j, b in enumerate(m.content):
            d = b.model_dump()
            kind = d["type"]
            if kind == "text":
                text.append(d.get("text", ""))
            elif kind == "image" or kind == "document":
                raise APIError(400, f"This model does not accept {kind} content.",
                               param=f"messages[{i}].content[{j}]", code="unsupported_content")
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": d.get("id") or call_id(), "type": "function",
                              "function": {"name": d.get("name", ""),
                                           "arguments": d.get("input") or {}}})
            elif kind == "tool_result" and m.role == "user":
                content = d.get("content")
                results.append({"role": "tool", "tool_call_id": d.get("tool_use_id"),
                                "content": _text(content)})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not fed back, as with OpenAI's API
            else:
                raise APIError(400, f"Unsupported content block type '{kind}' in a "
                               f"{m.role} message.", param=f"messages[{i}].content[{j}]",
                               code="invalid_value")
        msgs.extend(results)
        if text or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    body: dict[str, Any] = {"model": req.model, "messages": msgs}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema}} for t in req.tools]
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=max_tokens or req.max_tokens, stream=req.stream)
        for k in ("temperature", "top_p", "top_k"):
            if getattr(req, k) is not None:
                body[k] = getattr(req, k)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        tc = req.tool_choice or {}
        kind = tc.get("type")
        if kind == "any":
            body["tool_choice"] = "required"
        elif kind == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
        elif kind in ("none", "auto"):
            body["tool_choice"] = kind
        elif kind is not None:
            raise APIError(400, f"Unknown tool_choice type '{kind}'.", param="tool_choice",
                           code="invalid_value")
        if "keep_alive" in (req.model_extra or {}):
            body["keep_alive"] = req.model_extra["keep_alive"]
    return body


def _parse(cls, body: dict[str, Any]):
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _stop_reason(call, i: int) -> tuple[str, Optional[str]]:
    dec = call.decoders[i]
    if call.choices[i].calls:
        return "tool_use", None
    if dec.finish_reason == "length":
        return "max_tokens", None
    if dec.stop_sequence is not None:
        return "stop_sequence", dec.stop_sequence
    return "end_turn", None


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def register_anthropic(app: Quart) -> None:
    ext = app.extensions["mlxfleet"]
    name = ext["name"]

    @app.post("/v1/messages")
    async def messages():
        req = _parse(MessagesRequest, parse_json_body(await request.get_data()))
        chat, call = await ext["start"](ChatCompletionRequest, to_chat(req))
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return streaming_response(ext["tracked"](call, _stream(call, mid),
                                                     on_error=_stream_error))
        await ext["run_to_end"](call)
        ch = call.choices[0]
        content: list[dict[str, Any]] = []
        if ch.reasoning:
            content.append({"type": "thinking", "thinking": "".join(ch.reasoning),
                            "signature": ""})
        if ch.text:
            content.append({"type": "text", "text": ch.text})
        for c in ch.calls:
            content.append({"type": "tool_use", "id": _tool_id(c), "name": c["name"],
                            "input": c["arguments"]})
        reason, seq = _stop_reason(call, 0)
        return {"id": mid, "type": "message", "role": "assistant", "model": name,
                "content": content, "stop_reason": reason, "stop_sequence": seq,
                "usage": _usage(call)}

    async def _stream(call, mid: str):
        yield _event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0}}})
        yield _event("ping", {})
        index, open_kind = -1, None
        async for batch in call.events():
            out = []
            for ev in batch:
                if call.decoders[ev.index].done:
                    continue
                for kind, value in call.feed(ev):
                    if kind == "call":
                        if open_kind:
                            out.append(_event("content_block_stop", {"index": index}))
                        index += 1
                        open_kind = None
                        out.append(_event("content_block_start", {"index": index,
                                   "content_block": {"type": "tool_use", "id": _tool_id(value),
                                                     "name": value["name"], "input": {}}}))
                        out.append(_event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(value["arguments"])}}))
                        out.append(_event("content_block_stop", {"index": index}))
                        continue
                    if not value:
                        continue
                    block = "thinking" if kind == "reasoning" else "text"
                    if open_kind != block:
                        if open_kind:
                            out.append(_event("content_block_stop", {"index": index}))
                        index += 1
                        open_kind = block
                        out.append(_event("content_block_start", {
                            "index": index, "content_block": {"type": block, block: ""}
                            if block == "text" else {"type": "thinking", "thinking": "",
                                                     "signature": ""}}))
                    delta = {"type": "text_delta", "text": value} if block == "text" else \
                        {"type": "thinking_delta", "thinking": value}
                    out.append(_event("content_block_delta", {"index": index, "delta": delta}))
            if out:
                yield "".join(out)
        if open_kind:
            yield _event("content_block_stop", {"index": index})
        reason, seq = _stop_reason(call, 0)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": {"output_tokens": call.completion_tokens}})
        yield _event("message_stop", {})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens():
        req = _parse(CountTokensRequest, parse_json_body(await request.get_data()))
        info = ext["model_info"]()
        chat = ChatCompletionRequest.model_validate(to_chat(req))
        return {"input_tokens": len(chat_prompt(info, chat))}


def _tool_id(call: dict) -> str:
    if "anthropic_id" not in call:
        call["anthropic_id"] = f"toolu_{uuid.uuid4().hex[:24]}"
    return call["anthropic_id"]


def _usage(call) -> dict[str, int]:
    return {"input_tokens": call.prompt_tokens, "output_tokens": call.completion_tokens,
            "cache_read_input_tokens": call.gen.cached_tokens}


def _stream_error(err: APIError) -> str:
    from ..wire import anthropic_body

    body = anthropic_body(err)
    return f"event: error\ndata: {json.dumps(body)}\n\n"
