"""OpenAI's Responses API on the worker: ``POST /v1/responses``.

A request becomes the worker's ``GenRequest`` (input items -> chat messages)
and the pipeline's events become Responses output items: ``reasoning`` (the
model's reasoning, when it has a reasoning parser), ``message`` with
``output_text``, and ``function_call``; streamed as the documented typed events,
each with a ``sequence_number``. The worker keeps nothing: stored responses,
``previous_response_id`` and the ``GET``/``DELETE`` routes are the gateway's
(``api/responses.py``), which sends the conversation so far as ``input``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from quart import Quart

from ..names import loggable
from ..wire import HISTORY_FIELD, RESPONSE_ID_FIELD, APIError, parse_model
from .app import Worker
from .images import ImageRef, openai_image
from .parsers import call_id
from .pipeline import (
    Done,
    Finish,
    Pipeline,
    ReasoningDelta,
    TextDelta,
    ToolCall,
)
from .prompts import GenRequest

log = logging.getLogger("mlxfleet.worker")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: Optional[dict[str, Any]] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[StrictFloat] = Field(default=None, ge=0, le=2)
    top_p: Optional[StrictFloat] = Field(default=None, gt=0, le=1)
    stream: StrictBool = False
    store: Optional[StrictBool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None


def _text(content: Any, where: str, images: Optional[list[ImageRef]] = None) -> Any:
    """A message's content: a string, or input_text / output_text parts joined; with
    ``input_image`` parts (when ``images`` collects them), text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"Invalid value for '{where}': expected a string or a list of "
                       "content parts.", param=where, code="invalid_value")
    out, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            out.append(str(part.get("text") or part.get("refusal") or ""))
            parts.append({"type": "text", "text": out[-1]})
        elif kind == "input_image" and images is not None:
            images.append(openai_image(part, f"{where}[{j}]"))
            parts.append({"type": "image"})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"This model does not accept {kind} content.",
                           param=f"{where}[{j}]", code="unsupported_content")
        else:
            raise APIError(400, f"Unsupported content part type {kind!r}.",
                           param=f"{where}[{j}]", code="invalid_value")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(out)


def input_messages(items: Union[str, list[dict[str, Any]]], instructions: Optional[str],
                   images: Optional[list[ImageRef]] = None,
                   tmap: Optional[ToolMap] = None) -> list[dict[str, Any]]:
    """Responses input items as chat-template messages (``input_image`` parts collected
    into ``images``)."""
    msgs: list[dict[str, Any]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"Invalid value for '{where}.role': {role!r}.",
                               param=f"{where}.role", code="invalid_value")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text(item.get("content", ""), f"{where}.content",
                                          images if role == "user" else None)})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            args = item.get("arguments", "{}") if kind == "function_call" \
                else item.get("input", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise APIError(400, f"'{where}' needs a 'name' and "
                               + ("'arguments' (a JSON string)." if kind == "function_call"
                                  else "an 'input' (a string)."), param=where,
                               code="invalid_value")
            if kind == "custom_tool_call":
                parsed: Any = {"input": args}
            else:
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except ValueError:
                    parsed = args  # templates accept the raw string too
            if tmap is not None:
                name = tmap.shown(name, item.get("namespace"))
            call = {"id": item.get("call_id") or call_id(), "type": "function",
                    "function": {"name": name, "arguments": parsed}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            elif msgs and msgs[-1]["role"] == "assistant":
                msgs[-1]["tool_calls"] = [call]
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = item.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str)
                         else _text(out, f"{where}.output")})
        elif kind in ("reasoning", "web_search_call", "image_generation_call",
                      "file_search_call", "compaction", "item_reference"):
            continue  # earlier reasoning is not fed back; hosted tools' records neither
        else:
            raise APIError(400, f"Unsupported input item type {kind!r}.", param=where,
                           code="invalid_value")
    return msgs


#: Says which of a request's tools this server cannot run (hosted by OpenAI: web search,
#: image generation, ...): they are left out, never a 400.
DROPPED_TOOLS_HEADER = "X-Mlxfleet-Dropped-Tools"


@dataclass
class ToolMap:
    """How a request's tools were shown to the model, to name its calls back: custom
    (freeform) tools take one string ``input``; a namespace's functions are flattened
    (under their own names, or ``namespace__name`` when two would collide)."""

    custom: dict[str, Optional[str]] = field(default_factory=dict)  # name -> Lark grammar
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # shown -> (ns, name)
    dropped: list[str] = field(default_factory=list)

    def shown(self, name: str, namespace: Optional[str]) -> str:
        """The name the model knows a (namespaced) function by."""
        if namespace:
            for shown, pair in self.namespaced.items():
                if pair == (namespace, name):
                    return shown
        return name


def _custom_function(t: dict[str, Any]) -> dict[str, Any]:
    """A freeform tool as the model sees it: a function with one string, its grammar in
    the description (so a model can follow it; a forced call is held to it)."""
    fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
    desc = str(t.get("description") or "")
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        desc += ("\n\nThe input is free text, not JSON, following this "
                 f"{fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}")
    return {"name": t["name"], "description": desc, "parameters": {
        "type": "object", "properties": {"input": {"type": "string",
                                                  "description": "the tool's input"}},
        "required": ["input"]}}


def _tools(req: ResponsesRequest) -> tuple[Optional[list[dict[str, Any]]], ToolMap]:
    tmap = ToolMap()
    if not req.tools:
        return None, tmap
    found: list[tuple[Optional[str], dict[str, Any], str]] = []  # (namespace, tool, where)
    for i, t in enumerate(req.tools):
        d = {**t.model_dump(exclude_none=True), **(t.model_extra or {})}
        if t.type == "namespace":
            subs = d.get("tools") or d.get("functions") or []
            for j, sub in enumerate(subs if isinstance(subs, list) else []):
                if isinstance(sub, dict):
                    found.append((str(d.get("name") or ""), sub, f"tools[{i}].tools[{j}]"))
        elif t.type in ("function", "custom"):
            found.append((None, d, f"tools[{i}]"))
        else:  # web_search, image_generation, file_search, code_interpreter, ...
            tmap.dropped.append(t.type)
    names = [str(t.get("name")) for _, t, _ in found]
    out = []
    for (ns, t, where), name in zip(found, names):
        kind = t.get("type", "function")
        if kind not in ("function", "custom") or not t.get("name") \
                or not isinstance(t["name"], str):
            raise APIError(400, f"A {kind} tool needs a 'name'.", param=where,
                           code="invalid_value")
        shown = name if not ns or names.count(name) == 1 else f"{ns}__{name}"
        if ns:
            tmap.namespaced[shown] = (ns, name)
        if kind == "custom":
            fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
            tmap.custom[shown] = fmt.get("definition") if fmt.get("type") == "grammar" \
                and fmt.get("syntax", "lark") == "lark" else None
            fn = _custom_function(t)
        else:
            fn = {"name": name, "description": t.get("description") or "",
                  "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": {**fn, "name": shown}})
    return out or None, tmap


def _tool_choice(tc: Union[str, dict, None], tmap: ToolMap) -> tuple[Any, Any]:
    """(tool_choice for the generation, the forced freeform tool and its grammar)."""
    if isinstance(tc, dict):
        kind, name = tc.get("type"), tc.get("name")
        if kind == "custom" and isinstance(name, str) and tmap.custom.get(name):
            return "auto", (name, tmap.custom[name])  # the grammar is the whole answer
        if kind in ("function", "custom") and isinstance(name, str):
            return {"name": tmap.shown(name, tc.get("namespace"))}, None
        raise APIError(400, "tool_choice must be auto, none, required or "
                       '{"type": "function", "name": ...}.', param="tool_choice",
                       code="invalid_value")
    if tc not in (None, "auto", "none", "required"):
        raise APIError(400, f"Invalid tool_choice {tc!r}.", param="tool_choice",
                       code="invalid_value")
    return tc, None


def _schema(text: Optional[TextConfig]) -> Optional[dict[str, Any]]:
    fmt = (text.format if text else None) or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "text.format of type json_schema needs a 'schema' object.",
                           param="text.format.schema", code="invalid_value")
        return schema
    raise APIError(400, f"Unknown text.format type {kind!r}; use text, json_object or "
                   "json_schema.", param="text.format", code="invalid_value")


def responses_request(body: dict[str, Any], keep: Optional[list] = None) -> GenRequest:
    """The generation request; the validated Responses request goes into ``keep`` (the
    response object echoes its fields), so the body is validated once."""
    req = parse_model(ResponsesRequest, body)
    if keep is not None:
        keep.append(req)
    if req.previous_response_id and not body.get(HISTORY_FIELD):
        raise APIError(400, "previous_response_id needs the gateway's response store; send "
                       "this request to the gateway (a worker keeps no responses).",
                       param="previous_response_id", code="unsupported_parameter")
    tools, tmap = _tools(req)
    if keep is not None:
        keep.append(tmap)
    choice, forced = _tool_choice(req.tool_choice, tmap)
    images: list[ImageRef] = []
    return GenRequest(messages=input_messages(req.input, req.instructions, images, tmap),
                      images=images, tools=tools, tool_choice=choice, forced_grammar=forced,
                      parallel_tool_calls=req.parallel_tool_calls is not False,
                      response_schema=_schema(req.text), max_tokens=req.max_output_tokens,
                      temperature=req.temperature, top_p=req.top_p, stream=req.stream,
                      template_kwargs=_effort(req.reasoning))


def _effort(reasoning: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``reasoning.effort`` for templates that take it (gpt-oss's ``reasoning_effort``)."""
    effort = (reasoning or {}).get("effort")
    return {"reasoning_effort": effort} if effort in ("minimal", "low", "medium", "high") \
        else {}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{call_id().split('_', 1)[-1]}"


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": rid, "status": status,
            "summary": [{"type": "summary_text", "text": text}] if text else []}


def _message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" else []}


def _call_item(c: ToolCall, tmap: ToolMap, status: str = "completed") -> dict[str, Any]:
    """A call as the Responses API names it: a ``custom_tool_call`` with its raw input
    for a freeform tool, a ``function_call`` (with its ``namespace``) otherwise."""
    done = status == "completed"
    if c.name in tmap.custom:
        raw = c.arguments.get("input", "")
        return {"type": "custom_tool_call", "id": "ctc_" + c.id.split("_", 1)[-1],
                "call_id": c.id, "name": c.name, "status": status,
                "input": (raw if isinstance(raw, str) else json.dumps(raw)) if done else ""}
    item = {"type": "function_call", "id": "fc_" + c.id.split("_", 1)[-1], "call_id": c.id,
            "name": c.name, "arguments": c.arguments_json if done else "", "status": status}
    if c.name in tmap.namespaced:
        item["namespace"], item["name"] = tmap.namespaced[c.name]
    return item


class _Shell:
    """The response object's fields that do not depend on the output."""

    def __init__(self, req: ResponsesRequest, name: str):
        given = (req.model_extra or {}).get(RESPONSE_ID_FIELD)
        self.id = given if isinstance(given, str) and given.startswith("resp_") \
            and len(given) <= 100 else _item_id("resp")
        self.created_at = int(time.time())
        fmt = (req.text.format if req.text else None) or {"type": "text"}
        self.fields = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "model": name, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls":
                req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": "disabled", "user": req.user}

    def response(self, status: str, output: list, usage: Optional[dict[str, Any]] = None,
                 finish: Optional[Finish] = None) -> dict[str, Any]:
        """The response object; ``usage`` is the pipeline's (OpenAI's shape)."""
        r = {**self.fields, "status": status, "output": output, "usage": None}
        if finish is not None and finish.reason == "length" and status != "in_progress":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None and status != "in_progress":
            r["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}
        return r


class ResponseFold:
    """The Responses answer as one fold over the pipeline's events: ``start()`` and each
    ``feed(batch)`` give the stream's events, and ``final`` (set by the last batch) is
    the non-streamed response: the same items in the same order."""

    def __init__(self, shell: _Shell, tmap: ToolMap):
        self.shell, self.tmap = shell, tmap
        self.output: list[dict[str, Any]] = []
        self.final: Optional[dict[str, Any]] = None
        self._seq = 0
        self._open: Optional[dict[str, Any]] = None  # the reasoning or message being written
        self._parts: list[str] = []
        self._finish: Optional[Finish] = None

    def _event(self, kind: str, **data: Any) -> str:
        self._seq += 1
        payload = json.dumps({"type": kind, "sequence_number": self._seq - 1, **data},
                             ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n"

    def error(self, err: APIError) -> str:
        """A failure after the stream started: the typed error event, numbered in turn."""
        return self._event("error", code=err.code, message=err.message, param=err.param)

    def start(self) -> str:
        return self._event("response.created", response=self.shell.response("in_progress", [])) \
            + self._event("response.in_progress",
                          response=self.shell.response("in_progress", []))

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        item, idx, text = self._open, len(self.output), "".join(self._parts)
        ev = self._event
        out = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(ev("response.output_text.done", item_id=item["id"], output_index=idx,
                          content_index=0, text=text, logprobs=[]))
            out.append(ev("response.content_part.done", item_id=item["id"],
                          output_index=idx, content_index=0, part=part))
            done = _message_item(item["id"], text)
        else:
            out.append(ev("response.reasoning_summary_text.done", item_id=item["id"],
                          output_index=idx, summary_index=0, text=text))
            out.append(ev("response.reasoning_summary_part.done", item_id=item["id"],
                          output_index=idx, summary_index=0,
                          part={"type": "summary_text", "text": text}))
            done = _reasoning_item(item["id"], text)
        out.append(ev("response.output_item.done", output_index=idx, item=done))
        self.output.append(done)
        self._open = None
        self._parts.clear()
        return out

    def _begin(self, kind: str) -> list[str]:
        idx, ev = len(self.output), self._event
        if kind == "message":
            self._open = item = _message_item(_item_id("msg"), "", "in_progress")
            return [ev("response.output_item.added", output_index=idx, item=item),
                    ev("response.content_part.added", item_id=item["id"], output_index=idx,
                       content_index=0, part={"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []})]
        self._open = item = _reasoning_item(_item_id("rs"), "", "in_progress")
        return [ev("response.output_item.added", output_index=idx, item=item),
                ev("response.reasoning_summary_part.added", item_id=item["id"],
                   output_index=idx, summary_index=0,
                   part={"type": "summary_text", "text": ""})]

    def _call(self, call: ToolCall) -> list[str]:
        idx, ev = len(self.output), self._event
        item, done = _call_item(call, self.tmap, "in_progress"), _call_item(call, self.tmap)
        out = [ev("response.output_item.added", output_index=idx, item=item)]
        if done["type"] == "custom_tool_call":
            out.append(ev("response.custom_tool_call_input.delta", item_id=item["id"],
                          output_index=idx, delta=done["input"]))
            out.append(ev("response.custom_tool_call_input.done", item_id=item["id"],
                          output_index=idx, input=done["input"]))
        else:
            out.append(ev("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=idx, delta=call.arguments_json))
            out.append(ev("response.function_call_arguments.done", item_id=item["id"],
                          output_index=idx, arguments=call.arguments_json))
        out.append(ev("response.output_item.done", output_index=idx, item=done))
        self.output.append(done)
        return out

    def feed(self, batch: list) -> str:
        out: list[str] = []
        for e in batch:
            if isinstance(e, (TextDelta, ReasoningDelta)) and e.text:
                kind = "message" if isinstance(e, TextDelta) else "reasoning"
                if self._open is None or self._open["type"] != kind:
                    out += self._close() + self._begin(kind)
                self._parts.append(e.text)
                item, idx = self._open, len(self.output)
                if kind == "message":
                    out.append(self._event("response.output_text.delta", item_id=item["id"],
                                           output_index=idx, content_index=0, delta=e.text,
                                           logprobs=[]))
                else:
                    out.append(self._event("response.reasoning_summary_text.delta",
                                           item_id=item["id"], output_index=idx,
                                           summary_index=0, delta=e.text))
            elif isinstance(e, ToolCall):
                out += self._close() + self._call(e)
            elif isinstance(e, Finish):
                self._finish = e
            elif isinstance(e, Done):
                if not self.output and self._open is None:
                    out += self._begin("message")  # an empty answer is still a message
                out += self._close()
                self.final = self.shell.response("completed", self.output, e.usage,
                                                 self._finish)
                kind = "response.completed" if self.final["status"] == "completed" \
                    else "response.incomplete"
                out.append(self._event(kind, response=self.final))
        return "".join(out)


def register_responses(app: Quart, worker: Worker) -> None:
    name = worker.name

    @app.post("/v1/responses")
    async def create():
        parsed: list = []
        req, pipe = await worker.begin(lambda body: responses_request(body, parsed))
        tmap = parsed[1]
        fold = ResponseFold(_Shell(parsed[0], name), tmap)
        if tmap.dropped:
            log.info("left out tools this server cannot run: %s",
                     ", ".join(loggable(t, 64) for t in tmap.dropped[:20]))
            pipe.headers[DROPPED_TOOLS_HEADER] = ", ".join(tmap.dropped)
        if req.stream:
            return worker.stream(pipe, _stream(pipe, fold), in_band=fold.error)
        await worker.fold(pipe, fold.feed)
        return fold.final

    async def _stream(pipe: Pipeline, fold: ResponseFold):
        yield fold.start()
        async for batch in pipe.events():
            text = fold.feed(batch)
            if text:
                yield text
