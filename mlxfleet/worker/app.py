"""The worker's HTTP app: OpenAI (and Anthropic) routes around one engine."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from quart import Quart, request

from .. import blas
from ..wire import (
    GATEWAY_FIELDS,
    APIError,
    install_error_handlers,
    parse_json_body,
    parse_model,
    sse,
    streaming_response,
)
from .completions import (
    ChoiceDecoder,
    ModelDefaults,
    ModelInfo,
    OutputPlan,
    chat_logprobs,
    chat_prompt,
    completion_logprobs,
    completion_prompts,
    new_id,
    now,
    output_plan,
    sampling_params,
    usage,
)
from .engine import Engine, EngineError, Generation, TokenEvent, stats_dict
from .parsers import (
    ToolFormat,
    arguments_json,
    call_id,
    first_call_only,
    json_calls,
    parse_calls,
)
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("mlxfleet.worker")


@dataclass
class WorkerLimits:
    max_queue: int = 256  # requests waiting beyond max_concurrency before 503


@dataclass
class Choice:
    """What one choice has produced so far, split by kind."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.content)


class Call:
    """One request in flight: its generation, decoders, output parsers, bookkeeping."""

    def __init__(self, engine: Engine, gen: Generation, info: ModelInfo, stops: list[str],
                 prompt_tokens: int, plan: Optional[OutputPlan] = None, tools: Any = None):
        self.engine, self.gen, self.info = engine, gen, info
        n = gen.num_sequences
        self.decoders = [ChoiceDecoder(info.tokenizer, stops) for _ in range(n)]
        self.plan = plan or OutputPlan()
        self.splitters = [self.plan.splitter(tools) for _ in range(n)]
        self.tools = tools
        self.single_call = False
        self.choices = [Choice() for _ in range(n)]
        self.prompt_tokens = prompt_tokens
        self.engine_open = n  # sequences still running in the engine
        self.open = n  # choices not yet finished for the client

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        """Yield the tokens that have arrived, in batches, until every choice is done."""
        q = self.gen.events
        while self.open:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            for ev in batch:
                if isinstance(ev, EngineError):
                    raise APIError(503, f"Generation failed: {ev.message}",
                                   type="server_error", code="engine_error")
            yield batch

    def feed(self, ev: TokenEvent) -> list[tuple[str, Any]]:
        """Consume a token; return new pieces: ("content"|"reasoning", str) or ("call", dict)."""
        dec = self.decoders[ev.index]
        was_done = dec.done
        if ev.finish_reason is not None:
            self.engine_open -= 1
        text = dec.feed(ev)
        pieces = self._split(ev.index, text)
        if dec.done and not was_done:
            self.open -= 1
            pieces += self._finish(ev.index)
            if ev.finish_reason is None:  # a stop string ended it: free its slot now
                self.engine.cancel(self.gen, [ev.index])
                self.engine_open -= 1
        ch = self.choices[ev.index]
        if self.single_call:  # parallel_tool_calls: false
            pieces = first_call_only(pieces, bool(ch.calls))
        for kind, value in pieces:
            {"content": ch.content, "reasoning": ch.reasoning, "call": ch.calls}[kind].append(
                value)
        return pieces

    def _split(self, i: int, text: str) -> list[tuple[str, Any]]:
        if not text:
            return []
        if self.plan.forced_tool:
            return []  # the whole output is one JSON call, parsed when the choice ends
        sp = self.splitters[i]
        return sp.feed(text) if sp else [("content", text)]

    def _finish(self, i: int) -> list[tuple[str, Any]]:
        if self.plan.forced_tool:
            text = self.decoders[i].text
            calls = parse_calls(_FORCED, text, self.tools)
            return [("call", c) for c in calls] if calls else [("content", text)]
        sp = self.splitters[i]
        return sp.finish() if sp else []

    def finish_reason(self, i: int) -> Optional[str]:
        r = self.decoders[i].finish_reason
        return "tool_calls" if self.choices[i].calls and r == "stop" else r

    def close(self) -> None:
        """Free whatever is still running (client disconnected, error)."""
        if self.engine_open > 0:
            self.engine.cancel(self.gen)

    @property
    def completion_tokens(self) -> int:
        return sum(d.tokens for d in self.decoders)

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.gen.cached_tokens)


#: With tool_choice required/named the grammar makes the output one JSON call.
_FORCED = ToolFormat("forced", None, None, json_calls)


def openai_tool_call(call: dict, index: Optional[int] = None) -> dict[str, Any]:
    out = {"id": call.setdefault("id", call_id()), "type": "function",
           "function": {"name": call["name"], "arguments": arguments_json(call)}}
    if index is not None:
        out["index"] = index
    return out


def create_app(engine: Engine, name: str, defaults: Optional[ModelDefaults] = None,
               limits: Optional[WorkerLimits] = None) -> Quart:
    """Build the Quart app serving ``engine`` as model ``name``."""
    from .anthropic import register_anthropic

    app = Quart("mlxfleet.worker")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60, MAX_CONTENT_LENGTH=32 << 20)
    defaults = defaults or ModelDefaults()
    limits = limits or WorkerLimits()
    started = time.time()
    state: dict[str, Any] = {"inflight": 0, "info": None, "calls": {}}

    def model_info() -> ModelInfo:
        if engine.state == "ready":
            if state["info"] is None:
                state["info"] = ModelInfo(name, engine.tokenizer, engine.context_length,
                                          engine.vocab_size, defaults)
            return state["info"]
        if engine.state in ("loading", "pending"):
            raise APIError(503, f"Model '{name}' is still loading; retry shortly.",
                           type="service_unavailable", code="model_loading",
                           headers={"Retry-After": "1"})
        raise APIError(503, f"Model '{name}' is not available: {engine.error or engine.state}",
                       type="service_unavailable", code="model_unavailable")

    install_error_handlers(app)

    @app.get("/health")
    async def health():
        ok = engine.state == "ready"
        body = {"status": "ok" if ok else engine.state, "model": name, "state": engine.state,
                "source": engine.source, "blas": blas.active}
        if engine.error:
            body["error"] = engine.error
        return body, 200 if ok else 503

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": int(started), "owned_by": "mlxfleet",
                                            "state": engine.state}]}

    @app.get("/v1/status")
    async def status():
        return {"status": engine.state, "model": name, "source": engine.source,
                "uptime_s": round(time.time() - started, 3),
                "load_seconds": engine.load_seconds, "context_length": engine.context_length,
                "blas": blas.active,
                "inflight_requests": state["inflight"], **stats_dict(engine),
                "requests": [_request_status(rid, c) for rid, c in state["calls"].items()]}

    async def start(cls: type[SamplingFields], body: Optional[dict] = None):
        """Validate, tokenize and submit; returns (request, Call)."""
        engine.announce(1)
        try:
            if body is None:
                body = parse_json_body(await request.get_data())
            return prepare(parse_model(cls, body))
        finally:
            engine.announce(-1)

    def prepare(req: SamplingFields):
        extras = sorted(set(req.model_extra or {}) - GATEWAY_FIELDS)
        if extras:
            log.info("ignoring unsupported request fields: %s", ", ".join(extras))
        info = model_info()
        plan, tools = None, None
        if isinstance(req, ChatCompletionRequest):
            prompts = [chat_prompt(info, req)]
            plan, tools = output_plan(info, req, prompts[0]), req.tools
        else:
            prompts = completion_prompts(info, req)
        params = sampling_params(info, req, prompts)
        params.grammar = plan.grammar if plan else None
        if state["inflight"] >= engine.config.max_concurrency + limits.max_queue:
            raise APIError(503, f"Model '{name}' is at capacity "
                           f"({state['inflight']} requests in flight); retry shortly.",
                           type="service_unavailable", code="queue_full",
                           headers={"Retry-After": "1"})
        gen = engine.submit(prompts, params, req.n)
        call = Call(engine, gen, info, req.stop_list, sum(len(p) for p in prompts), plan, tools)
        call.single_call = getattr(req, "parallel_tool_calls", None) is False
        call.request_id = request.headers.get("X-Request-Id") or new_id("req")
        state["calls"][call.request_id] = call
        return req, call

    def finished(call: Call) -> None:
        if state["calls"].pop(call.request_id, None) is None:
            return
        g = call.gen
        ttft = (g.first_token_at - g.submitted_at) if g.first_token_at else None
        log.info("request %s: %d prompt (%d cached) + %d completion tokens in %.2fs, "
                 "ttft %s, %s", call.request_id, call.prompt_tokens, g.cached_tokens,
                 call.completion_tokens, time.monotonic() - g.submitted_at,
                 f"{ttft:.3f}s" if ttft is not None else "-",
                 ",".join(str(d.finish_reason) for d in call.decoders))

    async def run_to_end(call: Call) -> None:
        state["inflight"] += 1
        try:
            async for batch in call.events():
                for ev in batch:
                    call.feed(ev)
        finally:
            state["inflight"] -= 1
            call.close()
            finished(call)

    async def tracked(call: Call, body: AsyncIterator[str], on_error=None
                      ) -> AsyncIterator[str]:
        state["inflight"] += 1
        try:
            async for chunk in body:
                yield chunk
        except APIError as err:  # the stream has started: report in-band
            log.warning("stream failed: %s", err.message)
            yield on_error(err) if on_error else sse(err.body()) + "data: [DONE]\n\n"
        finally:
            state["inflight"] -= 1
            call.close()
            finished(call)

    app.extensions["mlxfleet"] = {"start": start, "run_to_end": run_to_end,
                                  "tracked": tracked, "name": name, "model_info": model_info}

    @app.post("/v1/chat/completions")
    async def chat_completions():
        req, call = await start(ChatCompletionRequest)
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            return streaming_response(tracked(call, _chat_stream(call, req, rid, created)))
        await run_to_end(call)
        choices = []
        for i, d in enumerate(call.decoders):
            ch = call.choices[i]
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": ch.text if ch.text or not ch.calls else None}
            if ch.reasoning:
                msg["reasoning"] = msg["reasoning_content"] = "".join(ch.reasoning)
            if ch.calls:
                msg["tool_calls"] = [openai_tool_call(c) for c in ch.calls]
            choices.append({"index": i, "message": msg,
                            "logprobs": chat_logprobs(d, d.logprobs) if req.logprobs else None,
                            "finish_reason": call.finish_reason(i)})
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": choices, "usage": call.usage()}

    async def _chat_stream(call: Call, req: ChatCompletionRequest, rid: str,
                           created: int) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": name}
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, finish: Optional[str] = None,
                  logprobs: Any = None) -> str:
            return sse({**base, "choices": [{"index": index, "delta": delta,
                                             "logprobs": logprobs,
                                             "finish_reason": finish}], **extra})

        yield "".join(chunk(i, {"role": "assistant", "content": ""})
                      for i in range(len(call.decoders)))
        pacer = _Pacer(len(call.decoders), _interval(req, defaults))
        ncalls = [0] * len(call.decoders)
        async for batch in call.events():
            out = []
            for ev in batch:
                dec = call.decoders[ev.index]
                if dec.done:
                    continue
                pieces = call.feed(ev)
                lp = chat_logprobs(dec, [ev])["content"] if req.logprobs \
                    and ev.logprob is not None else None
                text = "".join(v for k, v in pieces if k == "content")
                ready = pacer.add(ev.index, text, lp, dec.done or any(
                    k != "content" for k, _ in pieces))
                for kind, value in pieces:
                    if kind == "reasoning":
                        out.append(chunk(ev.index, {"reasoning": value,
                                                    "reasoning_content": value}))
                    elif kind == "call":
                        out.append(chunk(ev.index, {"tool_calls": [
                            openai_tool_call(value, ncalls[ev.index])]}))
                        ncalls[ev.index] += 1
                if ready is not None:
                    text, lps = ready
                    if text or lps:
                        out.append(chunk(ev.index, {"content": text}, None,
                                         {"content": lps} if lps else None))
                if dec.done:
                    out.append(chunk(ev.index, {}, call.finish_reason(ev.index)))
            if out:
                yield "".join(out)
        if include_usage:
            yield sse({**base, "choices": [], "usage": call.usage()})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions():
        req, call = await start(CompletionRequest)
        rid, created = new_id("cmpl"), now()
        prompt_texts = _prompt_texts(call, req) if req.echo else None
        if req.stream:
            return streaming_response(tracked(call, _completion_stream(call, req, rid, created,
                                                                      prompt_texts)))
        await run_to_end(call)
        choices = []
        for i, d in enumerate(call.decoders):
            prefix = prompt_texts[i // req.n] if prompt_texts else ""
            choices.append({
                "index": i, "text": prefix + d.text,
                "logprobs": completion_logprobs(d, d.logprobs, len(prefix))
                if req.logprobs is not None else None,
                "finish_reason": d.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": choices, "usage": call.usage()}

    async def _completion_stream(call: Call, req: CompletionRequest, rid: str, created: int,
                                 prompt_texts: Optional[list[str]]) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "text_completion", "created": created, "model": name}
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, text: str, finish: Optional[str] = None,
                  logprobs: Any = None) -> str:
            return sse({**base, "choices": [{"index": index, "text": text,
                                             "logprobs": logprobs,
                                             "finish_reason": finish}], **extra})

        if prompt_texts:
            yield "".join(chunk(i, prompt_texts[i // req.n])
                          for i in range(len(call.decoders)))
        pacer = _Pacer(len(call.decoders), _interval(req, defaults))
        async for batch in call.events():
            out = []
            for ev in batch:
                dec = call.decoders[ev.index]
                if dec.done:
                    continue
                text = "".join(v for _, v in call.feed(ev))
                lp = [ev] if req.logprobs is not None and ev.logprob is not None else None
                ready = pacer.add(ev.index, text, lp, dec.done)
                if ready is not None:
                    text, evs = ready
                    if text or evs or dec.done:
                        out.append(chunk(ev.index, text, dec.finish_reason,
                                         completion_logprobs(dec, evs) if evs else None))
            if out:
                yield "".join(out)
        if include_usage:
            yield sse({**base, "choices": [], "usage": call.usage()})
        yield "data: [DONE]\n\n"

    register_anthropic(app)
    return app


def _request_status(rid: str, call: Call) -> dict[str, Any]:
    """One in-flight request, in vllm-mlx's /v1/status terms."""
    g = call.gen
    now_ = time.monotonic()
    ttft = (g.first_token_at - g.submitted_at) if g.first_token_at else None
    gen_time = (now_ - g.first_token_at) if g.first_token_at else 0.0
    max_tokens = g.params.max_tokens * g.num_sequences
    return {"request_id": rid, "phase": g.phase,
            "tokens_per_second": round(g.generated / gen_time, 2) if gen_time > 0 else None,
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            "progress": round(g.generated / max_tokens, 4) if max_tokens else None,
            "cache_hit_type": g.cache_hit, "cached_tokens": g.cached_tokens,
            "prompt_tokens": call.prompt_tokens, "generated_tokens": g.generated,
            "max_tokens": max_tokens, "elapsed_s": round(now_ - g.submitted_at, 3)}


class _Pacer:
    """Groups each choice's tokens into one SSE chunk per ``interval`` tokens."""

    def __init__(self, n: int, interval: int):
        self.interval = interval
        self.text = [""] * n
        self.extra: list[list] = [[] for _ in range(n)]
        self.count = [0] * n

    def add(self, i: int, text: str, extra: Optional[list], flush: bool):
        """Returns (text, extras) when a chunk is due, else None."""
        self.text[i] += text
        if extra:
            self.extra[i].extend(extra)
        self.count[i] += 1
        if self.count[i] < self.interval and not flush:
            return None
        out = (self.text[i], self.extra[i])
        self.text[i], self.extra[i], self.count[i] = "", [], 0
        return out


def _interval(req: SamplingFields, defaults: ModelDefaults) -> int:
    return req.stream_interval or defaults.stream_interval


def _prompt_texts(call: Call, req: CompletionRequest) -> list[str]:
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(x, str) for x in req.prompt):
        return list(req.prompt)
    return [call.info.tokenizer.decode(p) for p in call.gen.prompts]


