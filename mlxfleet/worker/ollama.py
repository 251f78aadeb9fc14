"""Ollama's native API on the worker: ``/api/chat`` and ``/api/generate``.

Requests become the worker's ``GenRequest`` and answers are formatted from the
one pipeline's events, as for OpenAI and Anthropic: NDJSON lines while
streaming (Ollama's default), one object otherwise, with Ollama's fields
(``message.thinking``, ``tool_calls`` with arguments as objects, ``done_reason``
and durations in nanoseconds). Model lifetime (``keep_alive``, loads and unloads
by empty requests) belongs to the gateway; errors are ``{"error": "..."}``
(see ``wire.error_body``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from quart import Quart

from ..wire import APIError, ollama_done, ollama_empty_request, ollama_time, parse_model
from .app import Worker
from .images import ImageRef, from_base64
from .parsers import call_id
from .pipeline import Done, Finish, Pipeline, ReasoningDelta, TextDelta, ToolCall
from .prompts import GenRequest

NDJSON = "application/x-ndjson"


class Options(BaseModel):
    """Ollama's ``options``: the sampling ones are honoured, the rest (runner settings
    such as num_gpu, num_thread) ignored, as Ollama ignores what a model cannot use."""

    model_config = ConfigDict(extra="allow")
    temperature: Optional[StrictFloat] = Field(default=None, ge=0, le=2)
    top_p: Optional[StrictFloat] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    min_p: Optional[StrictFloat] = Field(default=None, ge=0, le=1)
    num_predict: Optional[StrictInt] = None
    num_ctx: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[StrictInt] = None
    repeat_penalty: Optional[StrictFloat] = Field(default=None, gt=0)
    presence_penalty: Optional[StrictFloat] = None
    frequency_penalty: Optional[StrictFloat] = None


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr = Field(min_length=1)
    arguments: Union[dict[str, Any], StrictStr] = Field(default_factory=dict)


class _Call(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: _Function


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Optional[StrictStr] = ""
    thinking: Optional[StrictStr] = None
    images: Optional[list[StrictStr]] = None
    tool_calls: Optional[list[_Call]] = None
    tool_name: Optional[StrictStr] = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr = Field(min_length=1)
    format: Union[StrictStr, dict[str, Any], None] = None
    options: Optional[Options] = None
    stream: StrictBool = True
    think: Union[StrictBool, StrictStr, None] = None


class ChatBody(_Common):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None


class GenerateBody(_Common):
    prompt: StrictStr = ""
    suffix: Optional[StrictStr] = None
    system: Optional[StrictStr] = None
    template: Optional[StrictStr] = None
    raw: StrictBool = False
    images: Optional[list[StrictStr]] = None
    context: Optional[list[StrictInt]] = None


def _with_images(text: str, images: Optional[list[str]], where: str,
                 refs: list[ImageRef]) -> Any:
    """A message's content: the text, or (with ``images``, base64 as Ollama sends them)
    image parts followed by the text."""
    if not images:
        return text
    for j, data in enumerate(images):
        refs.append(ImageRef(f"{where}[{j}]", data=from_base64(data, f"{where}[{j}]")))
    return [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]


def _schema(fmt: Union[str, dict, None]) -> Optional[dict[str, Any]]:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        return fmt
    raise APIError(400, f"invalid format {fmt!r}: use \"json\" or a JSON Schema object",
                   param="format", code="invalid_value")


def _sampling(body: _Common) -> dict[str, Any]:
    o = body.options or Options()
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    # num_predict: -1 (Ollama's default, "until done") and -2 ("fill the context") take
    # the model's default length; 0 or less otherwise is meaningless.
    n = o.num_predict
    if n is not None and n < -2:
        raise APIError(400, "options.num_predict must be positive, -1 or -2",
                       param="options.num_predict", code="invalid_value")
    return {"max_tokens": n if n is not None and n > 0 else None,
            "temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k,
            "min_p": o.min_p, "seed": o.seed, "repetition_penalty": o.repeat_penalty,
            "presence_penalty": o.presence_penalty, "frequency_penalty": o.frequency_penalty,
            "stop": stop, "stream": body.stream}


def _messages(body: ChatBody, refs: list[ImageRef]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"invalid role {m.role!r} in messages[{i}]",
                           param=f"messages[{i}].role", code="invalid_value")
        d: dict[str, Any] = {"role": m.role, "content": _with_images(
            m.content or "", m.images, f"messages[{i}].images", refs)}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):  # some clients send the JSON text
                    try:
                        args = json.loads(args)
                    except ValueError:
                        raise APIError(400, f"messages[{i}].tool_calls: arguments are not "
                                       "a JSON object", param=f"messages[{i}].tool_calls",
                                       code="invalid_value") from None
                calls.append({"id": call_id(), "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        out.append(d)
    return out


def _think(body: _Common) -> dict[str, Any]:
    """``think`` for the chat template: Qwen3-style templates read ``enable_thinking``,
    gpt-oss-style ones ``reasoning_effort`` ("high", "medium", "low")."""
    if body.think is None:
        return {}
    if isinstance(body.think, str):
        return {"enable_thinking": True, "reasoning_effort": body.think}
    return {"enable_thinking": body.think}


def chat_request(raw: dict[str, Any]) -> GenRequest:
    body = parse_model(ChatBody, raw)
    refs: list[ImageRef] = []
    return GenRequest(messages=_messages(body, refs), images=refs, tools=body.tools or None,
                      response_schema=_schema(body.format), template_kwargs=_think(body),
                      **_sampling(body))


_GO_IF = re.compile(r"\{\{-?\s*if\s+\.(\w+)\s*-?\}\}(.*?)\{\{-?\s*end\s*-?\}\}", re.S)
_GO_VAR = re.compile(r"\{\{-?\s*\.(\w+)\s*-?\}\}")


def render_template(template: str, values: dict[str, str]) -> str:
    """The subset of Go templates that prompt templates use: ``{{ .Prompt }}``,
    ``{{ .System }}``, ``{{ .Response }}`` and ``{{ if .X }}...{{ end }}``. (No Go
    template engine exists for Python; anything else is refused, not guessed.)"""
    text = _GO_IF.sub(lambda m: m.group(2) if values.get(m.group(1)) else "", template)
    text = _GO_VAR.sub(lambda m: values.get(m.group(1), ""), text)
    if "{{" in text:
        raise APIError(400, "template uses Go template features beyond {{ .System }}, "
                       "{{ .Prompt }}, {{ .Response }} and {{ if .X }}...{{ end }}",
                       param="template", code="unsupported_template")
    return text


def generate_request(raw: dict[str, Any]) -> GenRequest:
    body = parse_model(GenerateBody, raw)
    if body.suffix:
        raise APIError(400, "this model does not support insert (suffix)", param="suffix",
                       code="unsupported_parameter")
    common = {"response_schema": _schema(body.format), **_sampling(body)}
    if (body.raw or body.template) and body.images:
        raise APIError(400, "images need the model's chat template; they cannot be sent "
                       "with raw or template", param="images", code="invalid_value")
    if body.raw or body.template:
        text = body.prompt if body.raw else render_template(
            body.template, {"System": body.system or "", "Prompt": body.prompt,
                            "Response": ""})
        return GenRequest(prompts=[text], prompt_param="prompt", **common)
    refs: list[ImageRef] = []
    msgs = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": _with_images(body.prompt, body.images, "images", refs)}]
    return GenRequest(messages=msgs, images=refs, prompt_param="prompt",
                      template_kwargs=_think(body), **common)


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


def _calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"function": {"index": c.call_index, "name": c.name, "arguments": c.arguments}}
            for c in calls]


def _final(pipe: Pipeline, finish: Optional[Finish]) -> dict[str, Any]:
    """``done_reason`` and Ollama's counters, durations in nanoseconds."""
    g, end = pipe.gen, time.monotonic()
    first = g.first_token_at or end
    start = g.started_at or g.submitted_at
    return {"done": True, "done_reason": "length" if finish and finish.reason == "length"
            else "stop",
            "total_duration": int((end - g.submitted_at) * 1e9), "load_duration": 0,
            # Ollama counts the prompt tokens it evaluated: those read from cache are not
            "prompt_eval_count": pipe.prompt_tokens - g.cached_tokens,
            "prompt_eval_duration": int((first - start) * 1e9),
            "eval_count": pipe.completion_tokens,
            "eval_duration": int((end - first) * 1e9)}


class OllamaFold:
    """Ollama's answer as one fold over the pipeline's events: each ``feed(batch)`` gives
    NDJSON lines (one per delta, then the last with the counters), and ``answer()`` is the
    non-streamed object built from the same deltas. ``key`` is "message" (/api/chat) or
    "response" (/api/generate); ``counters(finish)`` gives done_reason and the counts."""

    def __init__(self, model: str, key: str, think: bool,
                 counters: Callable[[Optional[Finish]], dict[str, Any]]):
        self.model, self.key, self.think, self.counters = model, key, think, counters
        self.text, self.thinking, self.calls = "", "", []
        self.finish: Optional[Finish] = None
        self.final: dict[str, Any] = {}

    def _line(self, **part: Any) -> str:
        if self.key == "message":
            body = {"message": {"role": "assistant", "content": "", **part}}
        else:
            body = {"response": part.pop("content", ""), **part}
        return _line({"model": self.model, "created_at": ollama_time(), **body, "done": False})

    def feed(self, batch: list) -> str:
        out = []
        for ev in batch:
            if isinstance(ev, TextDelta) and ev.text:
                self.text += ev.text
                out.append(self._line(content=ev.text))
            elif isinstance(ev, ReasoningDelta) and ev.text and self.think:
                self.thinking += ev.text
                out.append(self._line(thinking=ev.text))
            elif isinstance(ev, ToolCall) and self.key == "message":
                self.calls.append(ev)
                out.append(self._line(tool_calls=_calls([ev])))
            elif isinstance(ev, Finish):
                self.finish = ev
            elif isinstance(ev, Done):
                self.final = self.counters(self.finish)
                empty = {"message": {"role": "assistant", "content": ""}} \
                    if self.key == "message" else {"response": ""}
                out.append(_line({"model": self.model, "created_at": ollama_time(), **empty,
                                  **self.final}))
        return "".join(out)

    def answer(self) -> dict[str, Any]:
        thinking = {"thinking": self.thinking} if self.thinking else {}
        if self.key == "message":
            calls = {"tool_calls": _calls(self.calls)} if self.calls else {}
            body: dict[str, Any] = {"message": {"role": "assistant", "content": self.text,
                                                **thinking, **calls}}
        else:
            body = {"response": self.text, **thinking}
        return {"model": self.model, "created_at": ollama_time(), **body, **self.final}


def register_ollama(app: Quart, worker: Worker) -> None:
    name = worker.name

    async def answer(key: str, schema: type, to_request) -> Any:
        """/api/chat (``key`` "message") and /api/generate ("response"): a request with
        nothing to generate loads the model; otherwise NDJSON lines or one object."""
        from quart import request

        from ..wire import parse_json_body

        raw = parse_json_body(await request.get_data())
        if ollama_empty_request(request.path, raw):
            parse_model(schema, raw)  # still a 400 for a malformed body
            return ollama_done(name, request.path)
        req, pipe = await worker.begin(to_request)
        fold = OllamaFold(name, key, raw.get("think") is not False,
                          lambda finish: _final(pipe, finish))
        if req.stream:
            return worker.stream(pipe, _stream(pipe, fold), NDJSON)
        await worker.fold(pipe, fold.feed)
        return fold.answer()

    @app.post("/api/chat")
    async def chat():
        return await answer("message", ChatBody, chat_request)

    @app.post("/api/generate")
    async def generate():
        return await answer("response", GenerateBody, generate_request)

    async def _stream(pipe: Pipeline, fold: OllamaFold):
        """NDJSON lines: one per delta, then the final one with the counters."""
        async for batch in pipe.events():
            text = fold.feed(batch)
            if text:
                yield text
