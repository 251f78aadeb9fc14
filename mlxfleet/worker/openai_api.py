"""OpenAI's chat and text completions: request conversion and response formatting.

Both routes convert to a ``GenRequest``, take a ``Pipeline`` from the worker,
and format its events as OpenAI's JSON or SSE chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Optional

from quart import Quart

from ..wire import APIError, parse_model, sse
from .app import Worker
from .images import ImageRef, openai_image
from .pipeline import Done, Finish, Pipeline, ReasoningDelta, TextDelta, ToolCall
from .prompts import GenRequest, new_id, now
from .schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TextPart,
)


def _sampling(req: SamplingFields) -> dict[str, Any]:
    return dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                logit_bias={int(k): v for k, v in req.logit_bias.items()}
                if req.logit_bias else None,
                stop=req.stop_list, n=req.n, stream=req.stream,
                stream_interval=req.stream_interval, ignore_eos=req.ignore_eos,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                skip_special_tokens=req.skip_special_tokens,
                return_token_ids=req.return_token_ids)


def _message(m: ChatMessage, i: int, images: list[ImageRef]) -> dict[str, Any]:
    content: Any = m.text()
    if m.has_image():  # text and image parts, in order; the images go to ``images``
        content = []
        for j, p in enumerate(m.content):
            if isinstance(p, TextPart):
                content.append({"type": "text", "text": p.text})
            else:
                images.append(openai_image(p.model_dump(), f"messages[{i}].content[{j}]"))
                content.append({"type": "image"})
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                         "content": content}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for tc in m.tool_calls:
            args = tc.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    pass  # templates accept the raw string too
            calls.append({"id": tc.id, "type": "function",
                          "function": {"name": tc.function.name, "arguments": args}})
        d["tool_calls"] = calls
    return d


def _response_schema(rf: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema") or {}
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise APIError(400, "response_format.json_schema must be an object with a "
                           "'schema' object (the JSON Schema the answer must follow).",
                           param="response_format.json_schema.schema",
                           code="invalid_value")
        return js["schema"] or {"type": "object"}
    raise APIError(400, f"Unknown response_format type '{kind}'; use text, json_object "
                   "or json_schema.", param="response_format", code="invalid_value")


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must name a function: "
                           '{"type": "function", "function": {"name": ...}}',
                           param="tool_choice", code="invalid_value")
        return {"name": name}
    return choice


def _prediction(pred: Optional[dict[str, Any]]) -> Optional[str]:
    """The text of OpenAI's predicted output (``{"type": "content", "content": ...}``)."""
    if pred is None:
        return None
    content = pred.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        content = "".join(parts) if all(isinstance(t, str) for t in parts) else None
    if pred.get("type") != "content" or not isinstance(content, str):
        raise APIError(400, 'prediction must be {"type": "content", "content": TEXT} (or '
                       "content as a list of text parts).", param="prediction",
                       code="invalid_value")
    return content or None


def chat_request(body: dict[str, Any]) -> GenRequest:
    req = parse_model(ChatCompletionRequest, body)
    images: list[ImageRef] = []
    return GenRequest(
        messages=[_message(m, i, images) for i, m in enumerate(req.messages)],
        images=images,
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_schema=_response_schema(req.response_format),
        template_kwargs=req.chat_template_kwargs or {},
        prediction=_prediction(req.prediction),
        max_tokens=req.max_completion_tokens or req.max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        **_sampling(req))


def completion_request(body: dict[str, Any]) -> GenRequest:
    req = parse_model(CompletionRequest, body)
    one = isinstance(req.prompt, str) or all(isinstance(t, int) for t in req.prompt)
    prompt = [req.prompt] if one else req.prompt  # one prompt: a string or token ids
    return GenRequest(prompts=prompt, max_tokens=req.max_tokens, logprobs=req.logprobs,
                      echo=req.echo, prompt_param="prompt", **_sampling(req))


def tool_call_json(call: ToolCall, with_index: bool = False) -> dict[str, Any]:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    if with_index:
        out["index"] = call.call_index
    return out


def _token(tok: Any, token: int, lp: float) -> dict[str, Any]:
    s = tok.decode([token])
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def chat_logprobs(tok: Any, events: list) -> dict[str, Any]:
    return {"content": [
        {**_token(tok, ev.token, ev.logprob),
         "top_logprobs": [_token(tok, t, lp) for t, lp in (ev.top_logprobs or [])]}
        for ev in events]}


def completion_logprobs(tok: Any, events: list, offset: int = 0) -> dict[str, Any]:
    tokens, offsets = [], []
    for ev in events:
        offsets.append(offset)
        s = tok.decode([ev.token])
        tokens.append(s)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [ev.logprob for ev in events],
            "top_logprobs": [{tok.decode([t]): lp for t, lp in (ev.top_logprobs or [])}
                             for ev in events],
            "text_offset": offsets}


def _chunk(base: dict[str, Any], include_usage: bool, index: int, content: dict[str, Any],
           finish: Optional[str], logprobs: Any) -> str:
    """One streamed chunk of one choice (``content``: a chat ``delta`` or a completion's
    ``text``); with ``stream_options.include_usage`` every chunk says ``usage: null``."""
    extra = {"usage": None} if include_usage else {}
    return sse({**base, "choices": [{"index": index, **content, "logprobs": logprobs,
                                     "finish_reason": finish}], **extra})


class ChatFold:
    """A chat completion as one fold over the pipeline's events: ``start()`` and each
    ``feed(batch)`` give the stream's chunks, and ``completion()`` is the non-streamed
    answer built from the same deltas, so the two cannot differ. ``tok`` (the tokenizer)
    is given when logprobs were asked for."""

    def __init__(self, rid: str, created: int, model: str, n: int, tok: Any = None,
                 include_usage: bool = False):
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": model}
        self.n, self.tok, self.include_usage = n, tok, include_usage
        self.choices = [{"content": "", "reasoning": "", "calls": [], "logprobs": [],
                         "finish": None} for _ in range(n)]
        self.usage: Optional[dict[str, Any]] = None

    def _chunk(self, index: int, delta: dict, finish: Optional[str] = None,
               logprobs: Any = None) -> str:
        return _chunk(self.base, self.include_usage, index, {"delta": delta}, finish,
                      logprobs)

    def start(self) -> str:
        return "".join(self._chunk(i, {"role": "assistant", "content": ""})
                       for i in range(self.n))

    def feed(self, batch: list) -> str:
        out = []
        for ev in batch:
            ch = self.choices[ev.index] if not isinstance(ev, Done) else None
            if isinstance(ev, TextDelta):
                ch["content"] += ev.text
                lp = None
                if self.tok is not None and ev.logprobs:
                    ch["logprobs"] += ev.logprobs
                    lp = chat_logprobs(self.tok, ev.logprobs)
                out.append(self._chunk(ev.index, {"content": ev.text}, None, lp))
            elif isinstance(ev, ReasoningDelta):
                ch["reasoning"] += ev.text
                out.append(self._chunk(ev.index, {"reasoning": ev.text,
                                                  "reasoning_content": ev.text}))
            elif isinstance(ev, ToolCall):
                ch["calls"].append(ev)
                out.append(self._chunk(ev.index, {"tool_calls": [tool_call_json(ev, True)]}))
            elif isinstance(ev, Finish):
                ch["finish"] = ev.reason
                out.append(self._chunk(ev.index, {}, ev.reason))
            elif isinstance(ev, Done):
                self.usage = ev.usage
                if self.include_usage:
                    out.append(sse({**self.base, "choices": [], "usage": ev.usage}))
        return "".join(out)

    def completion(self) -> dict[str, Any]:
        choices = []
        for i, ch in enumerate(self.choices):
            msg: dict[str, Any] = {"role": "assistant", "refusal": None,
                                   "content": ch["content"] if ch["content"] or not ch["calls"]
                                   else None}
            if ch["reasoning"]:
                msg["reasoning"] = msg["reasoning_content"] = ch["reasoning"]
            if ch["calls"]:
                msg["tool_calls"] = [tool_call_json(c) for c in ch["calls"]]
            choices.append({"index": i, "message": msg, "finish_reason": ch["finish"],
                            "logprobs": chat_logprobs(self.tok, ch["logprobs"])
                            if self.tok is not None else None})
        return {**self.base, "object": "chat.completion", "choices": choices,
                "usage": self.usage}


class CompletionFold:
    """A text completion as one fold over the pipeline's events (see ``ChatFold``):
    ``prompts`` are echoed before each choice's text when asked; a choice's finish reason
    rides on its last text chunk of a batch, as OpenAI sends it."""

    def __init__(self, rid: str, created: int, model: str, n_choices: int, n: int,
                 prompts: Optional[list[str]], tok: Any = None, include_usage: bool = False):
        self.base = {"id": rid, "object": "text_completion", "created": created,
                     "model": model}
        self.n, self.prompts, self.tok, self.include_usage = n, prompts, tok, include_usage
        self.choices = [{"text": "", "logprobs": [], "finish": None}
                        for _ in range(n_choices)]
        self.usage: Optional[dict[str, Any]] = None

    def _prefix(self, i: int) -> str:
        return self.prompts[i // self.n] if self.prompts else ""

    def _chunk(self, index: int, text: str, finish: Optional[str] = None,
               logprobs: Any = None) -> str:
        return _chunk(self.base, self.include_usage, index, {"text": text}, finish,
                      logprobs)

    def start(self) -> str:
        return "".join(self._chunk(i, self._prefix(i)) for i in range(len(self.choices))) \
            if self.prompts else ""

    def feed(self, batch: list) -> str:
        parts: list[list] = []  # [index, text, finish, logprobs]
        last: dict[int, list] = {}
        for ev in batch:
            if isinstance(ev, TextDelta):
                ch = self.choices[ev.index]
                lp = None
                if self.tok is not None and ev.logprobs:
                    lp = completion_logprobs(self.tok, ev.logprobs,
                                             len(self._prefix(ev.index)) + len(ch["text"]))
                    ch["logprobs"] += ev.logprobs
                ch["text"] += ev.text
                last[ev.index] = [ev.index, ev.text, None, lp]
                parts.append(last[ev.index])
            elif isinstance(ev, Finish):
                self.choices[ev.index]["finish"] = ev.reason
                if ev.index in last:
                    last.pop(ev.index)[2] = ev.reason
                else:
                    parts.append([ev.index, "", ev.reason, None])
            elif isinstance(ev, Done):
                self.usage = ev.usage
        out = [self._chunk(*p) for p in parts]
        if self.include_usage and batch and isinstance(batch[-1], Done):
            out.append(sse({**self.base, "choices": [], "usage": batch[-1].usage}))
        return "".join(out)

    def completion(self) -> dict[str, Any]:
        choices = []
        for i, ch in enumerate(self.choices):
            prefix = self._prefix(i)
            choices.append({"index": i, "text": prefix + ch["text"],
                            "logprobs": completion_logprobs(self.tok, ch["logprobs"],
                                                            len(prefix))
                            if self.tok is not None else None,
                            "finish_reason": ch["finish"]})
        return {**self.base, "choices": choices, "usage": self.usage}


def register_openai(app: Quart, worker: Worker) -> None:
    name = worker.name

    def tokenizer():
        return worker.model_info().tokenizer

    @app.post("/v1/chat/completions")
    async def chat_completions():
        req, pipe = await worker.begin(chat_request)
        fold = ChatFold(new_id("chatcmpl"), now(), name, len(pipe.choices),
                        tokenizer() if req.logprobs is not None else None, req.include_usage)
        if req.stream:
            return worker.stream(pipe, _chat_stream(pipe, fold))
        await worker.fold(pipe, fold.feed)
        return _with_token_ids(fold.completion(), pipe, req)

    async def _chat_stream(pipe: Pipeline, fold: ChatFold) -> AsyncIterator[str]:
        yield fold.start()
        async for batch in pipe.events():
            text = fold.feed(batch)
            if text:
                yield text
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions():
        req, pipe = await worker.begin(completion_request)
        tok = tokenizer()
        fold = CompletionFold(new_id("cmpl"), now(), name, len(pipe.choices), req.n,
                              _prompt_texts(pipe, req, tok) if req.echo else None,
                              tok if req.logprobs is not None else None, req.include_usage)
        if req.stream:
            return worker.stream(pipe, _completion_stream(pipe, fold))
        await worker.fold(pipe, fold.feed)
        return _with_token_ids(fold.completion(), pipe, req)

    async def _completion_stream(pipe: Pipeline, fold: CompletionFold
                                 ) -> AsyncIterator[str]:
        yield fold.start()
        async for batch in pipe.events():
            text = fold.feed(batch)
            if text:
                yield text
        yield "data: [DONE]\n\n"


def _with_token_ids(out: dict[str, Any], pipe: Pipeline, req: GenRequest) -> dict[str, Any]:
    """vLLM's ``return_token_ids``: the prompt's token ids on the answer, each choice's
    generated ids on the choice (what a client needs to check or continue exactly)."""
    if req.return_token_ids:
        ids = pipe.token_ids()
        out["prompt_token_ids"] = ids["prompt_token_ids"]
        for choice, tokens in zip(out["choices"], ids["token_ids"]):
            choice["token_ids"] = tokens
    return out


def _prompt_texts(pipe: Pipeline, req: GenRequest, tok: Any) -> list[str]:
    if all(isinstance(x, str) for x in req.prompts):
        return list(req.prompts)
    return [tok.decode(p) for p in pipe.gen.prompts]
