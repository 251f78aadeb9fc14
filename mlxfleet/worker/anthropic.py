"""Anthropic's Messages API: request conversion and response formatting.

``POST /v1/messages`` (plain and streaming, with Anthropic's exact event order)
and ``POST /v1/messages/count_tokens``. A request becomes the worker's
``GenRequest``, so batching, tools, reasoning and stop strings are one code
path (the pipeline); only the input and output shapes differ.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from quart import Quart

from ..wire import APIError, parse_model
from .app import Worker
from .images import ImageRef, anthropic_image
from .parsers import call_id
from .pipeline import Done, Finish, Pipeline, ReasoningDelta, TextDelta, ToolCall
from .prompts import GenRequest


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    # "system" mid-conversation: Claude Code's mid-conversation-system beta
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[_Block]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[_Block], None] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[StrictFloat] = Field(default=None, ge=0, le=1)
    top_p: Optional[StrictFloat] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    stream: StrictBool = False
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None  # enabled | adaptive | disabled
    output_config: Optional[dict[str, Any]] = None  # effort; format: structured output
    # taken and not acted on: context_management, cache_control, container, service_tier


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[_Block], None] = None
    tools: Optional[list[AnthropicTool]] = None


def _text(content: Any, sep: str = "") -> str:
    """Text blocks as one string (``sep`` between blocks)."""
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
    return sep.join(parts)


def _messages(req: MessagesRequest | CountTokensRequest, images: list[ImageRef]
              ) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (system blocks one per paragraph);
    image blocks become image parts, their sources appended to ``images``."""
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "\n\n")})
    for i, m in enumerate(req.messages):
        if m.role == "system":  # in place; folded for templates that want one, first
            msgs.append({"role": "system", "content": _text(m.content, "\n\n")})
            continue
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        text, calls, results, parts = [], [], [], []
        for j, b in enumerate(m.content):
            d = b.model_dump()
            kind = d["type"]
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(str(d.get("text", "")))
                parts.append({"type": "text", "text": text[-1]})
            elif kind == "image" and m.role == "user":
                images.append(anthropic_image(d, where))
                parts.append({"type": "image"})
            elif kind == "image" or kind == "document":
                raise APIError(400, f"This model does not accept {kind} content.",
                               param=where, code="unsupported_content")
            elif kind == "tool_use" and m.role == "assistant":
                name, args = d.get("name"), d.get("input") or {}
                if not isinstance(name, str) or not name or not isinstance(args, dict):
                    raise APIError(400, "A tool_use block needs a 'name' (string) and an "
                                   "'input' (object).", param=where, code="invalid_value")
                calls.append({"id": d.get("id") or call_id(), "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind == "tool_result" and m.role == "user":
                results.append({"role": "tool", "tool_call_id": d.get("tool_use_id"),
                                "content": _text(d.get("content"))})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not fed back, as with OpenAI's API
            else:
                raise APIError(400, f"Unsupported content block type '{kind}' in a "
                               f"{m.role} message.", param=where, code="invalid_value")
        msgs.extend(results)
        if text or calls or not results:
            has_image = any(p["type"] == "image" for p in parts)
            msg: dict[str, Any] = {"role": m.role,
                                   "content": parts if has_image else "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    return msgs


def _tools(req: MessagesRequest | CountTokensRequest) -> Optional[list[dict[str, Any]]]:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name,
                                              "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in req.tools]


def _tool_choice(tc: Optional[dict[str, Any]]) -> Any:
    kind = (tc or {}).get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise APIError(400, "tool_choice of type 'tool' needs a 'name'.",
                           param="tool_choice", code="invalid_value")
        return {"name": tc["name"]}
    if kind in (None, "none", "auto"):
        return kind
    raise APIError(400, f"Unknown tool_choice type '{kind}'.", param="tool_choice",
                   code="invalid_value")


def _output_schema(oc: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``output_config.format`` (Claude Code's side requests): a JSON schema the answer
    follows, through the same grammar as OpenAI's ``response_format``."""
    fmt = (oc or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", "
                       "\"schema\": {...}}.", param="output_config.format",
                       code="invalid_value")
    return fmt["schema"]


def _thinking(req: MessagesRequest) -> dict[str, Any]:
    """``thinking`` for templates that can turn reasoning on or off (Qwen3's
    ``enable_thinking``); ``output_config.effort`` for those that take an effort."""
    out: dict[str, Any] = {}
    kind = (req.thinking or {}).get("type")
    if kind in ("enabled", "adaptive", "disabled"):
        out["enable_thinking"] = kind != "disabled"
    effort = (req.output_config or {}).get("effort")
    if effort in ("low", "medium", "high"):
        out["reasoning_effort"] = effort
    return out


def messages_request(body: dict[str, Any]) -> GenRequest:
    req = parse_model(MessagesRequest, body)
    images: list[ImageRef] = []
    return GenRequest(messages=_messages(req, images), images=images, tools=_tools(req),
                      tool_choice=_tool_choice(req.tool_choice), max_tokens=req.max_tokens,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stop=list(req.stop_sequences or []), stream=req.stream,
                      response_schema=_output_schema(req.output_config),
                      template_kwargs=_thinking(req))


def _stop_reason(r: Finish, has_calls: bool) -> tuple[str, Optional[str]]:
    if has_calls:
        return "tool_use", None
    if r.reason == "length":
        return "max_tokens", None
    if r.stop_sequence is not None:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _tool_id(call: ToolCall) -> str:
    """Anthropic's id style for a call the pipeline named ``call_...``."""
    return "toolu_" + call.id.split("_", 1)[-1]


class MessageFold:
    """Anthropic's answer as one fold over the pipeline's events: ``start()`` and each
    ``feed(batch)`` give the stream's SSE text, and ``message()`` is the non-streamed
    answer, built from the same blocks in the same order, so the two cannot differ."""

    def __init__(self, mid: str, model: str, prompt_tokens: int):
        self.mid, self.model, self.prompt_tokens = mid, model, prompt_tokens
        self.blocks: list[dict[str, Any]] = []
        self._open: Optional[str] = None  # the kind of the text/thinking block being written
        self._calls = 0
        self._finish: Optional[Finish] = None
        self._usage: dict[str, Any] = {}
        self.cached = 0  # prompt tokens read from the prompt cache

    def start(self, cached: int = 0) -> str:
        """``message_start``: sent once the prompt cache was looked up, so that its usage
        says how much of the prompt was read from cache (what Claude Code shows)."""
        self.cached = cached
        return _event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**self._input_usage(), "output_tokens": 0}}}) + _event("ping", {})

    def _input_usage(self) -> dict[str, int]:
        """Anthropic's input fields: ``input_tokens`` excludes what was read from cache
        (``cache_read_input_tokens``); nothing is written to a cache a client pays for."""
        return {"input_tokens": self.prompt_tokens - self.cached,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached}

    def _close(self) -> list[str]:
        if not self._open:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": len(self.blocks) - 1})]

    def feed(self, batch: list) -> str:
        out: list[str] = []
        for ev in batch:
            if isinstance(ev, ToolCall):
                out += self._close()
                self._calls += 1
                index = len(self.blocks)
                self.blocks.append({"type": "tool_use", "id": _tool_id(ev), "name": ev.name,
                                    "input": ev.arguments})
                out.append(_event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": _tool_id(ev), "name": ev.name, "input": {}}}))
                out.append(_event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": ev.arguments_json}}))
                out.append(_event("content_block_stop", {"index": index}))
            elif isinstance(ev, (TextDelta, ReasoningDelta)) and ev.text:
                kind = "thinking" if isinstance(ev, ReasoningDelta) else "text"
                if self._open != kind:
                    out += self._close()
                    self._open = kind
                    empty = {"type": "text", "text": ""} if kind == "text" else \
                        {"type": "thinking", "thinking": "", "signature": ""}
                    self.blocks.append(dict(empty))
                    out.append(_event("content_block_start", {
                        "index": len(self.blocks) - 1, "content_block": empty}))
                self.blocks[-1][kind] += ev.text
                delta = {"type": "text_delta", "text": ev.text} if kind == "text" \
                    else {"type": "thinking_delta", "thinking": ev.text}
                out.append(_event("content_block_delta", {"index": len(self.blocks) - 1,
                                                          "delta": delta}))
            elif isinstance(ev, Finish):
                self._finish = ev
            elif isinstance(ev, Done):
                out += self._close()
                self._usage = ev.usage
                self.cached = _cached(ev.usage)
                reason, seq = _stop_reason(self._finish, self._calls > 0)
                out.append(_event("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {**self._input_usage(), "output_tokens": self._output_tokens}}))
                out.append(_event("message_stop", {}))
        return "".join(out)

    @property
    def _output_tokens(self) -> int:
        return int(self._usage.get("completion_tokens", 0))

    def message(self) -> dict[str, Any]:
        reason, seq = _stop_reason(self._finish, self._calls > 0)
        self.cached = _cached(self._usage)
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": reason, "stop_sequence": seq,
                "usage": {**self._input_usage(), "output_tokens": self._output_tokens}}


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def register_anthropic(app: Quart, worker: Worker) -> None:
    name = worker.name

    @app.post("/v1/messages")
    async def messages():
        req, pipe = await worker.begin(messages_request)
        fold = MessageFold(f"msg_{call_id().split('_', 1)[-1]}", name, pipe.prompt_tokens)
        if req.stream:
            return worker.stream(pipe, _stream(pipe, fold))
        await worker.fold(pipe, fold.feed)
        return fold.message()

    async def _stream(pipe: Pipeline, fold: MessageFold):
        await pipe.gen.admitted.wait()
        yield fold.start(pipe.gen.cached_tokens)
        async for batch in pipe.events():
            text = fold.feed(batch)
            if text:
                yield text

    @app.post("/v1/messages/count_tokens")
    async def count_tokens():
        from quart import request

        from ..wire import parse_json_body

        req = parse_model(CountTokensRequest, parse_json_body(await request.get_data()))
        images: list[ImageRef] = []
        chat = GenRequest(messages=_messages(req, images), images=images, tools=_tools(req))
        return {"input_tokens": await worker.count_tokens(chat)}
