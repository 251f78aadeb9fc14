"""The worker's HTTP app: common routes, admission, and the protocols over one pipeline.

``create_app`` serves a generation engine; ``create_embedding_app``
(embeddings.py) an encoder. Both share ``common_routes`` (health, models,
status, and a clear 400 for routes of the other task). Protocols register
their routes with a ``Worker``: ``worker.begin(to_request)`` checks capacity,
parses and converts the body, tokenizes and submits, and returns the
``Pipeline`` whose events the protocol formats (``openai_api.py``,
``anthropic.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Optional

from quart import Quart, g, request

from .. import blas
from ..formats import pick_parsers
from ..names import loggable
from ..wire import (
    CACHE_SCOPE_HEADER,
    GATEWAY_FIELDS,
    APIError,
    install_error_handlers,
    parse_json_body,
    stream_error,
    streaming_response,
)
from .engine import Engine
from .generation import EngineState
from .images import load as load_images
from .images import trim_heap, vision_prompt
from .pipeline import Pipeline
from .prompts import (
    GenRequest,
    ModelInfo,
    OutputPlan,
    chat_prompt,
    completion_prompts,
    new_id,
    output_plan,
    sampling_params,
)
from .volatile import Steadier

log = logging.getLogger("mlxfleet.worker")

GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                   "/v1/messages/count_tokens", "/api/chat", "/api/generate",
                   "/v1/responses")
EMBED_ROUTES = ("/v1/embeddings", "/api/embed", "/api/embeddings")


def common_routes(app: Quart, name: str, task: str, engine: Any,
                  status: Callable[[], dict[str, Any]]) -> None:
    """Health, models and status for any worker, and a 400 for the other task's routes."""
    started = time.time()
    install_error_handlers(app)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60, MAX_CONTENT_LENGTH=32 << 20)

    @app.get("/health")
    async def health():
        problem = engine.problem() if hasattr(engine, "problem") else None
        state = EngineState.FAILED if problem else EngineState(engine.state)
        ok = state == EngineState.READY
        body = {"status": "ok" if ok else state.value, "model": name, "state": state.value,
                "source": engine.source, "task": task, "blas": blas.active}
        if problem or engine.error:
            body["error"] = problem or engine.error
        if ok and getattr(engine, "paths", None):
            body["paths"] = engine.paths  # parsers and exact paths, for the supervisor
        return body, 200 if ok else 503

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "task": task,
                                            "created": int(started), "owned_by": "mlxfleet",
                                            "state": str(engine.state)}]}

    @app.get("/v1/status")
    async def status_route():
        """vllm-mlx's documented shape (status, counters, ``metal``, ``cache``,
        ``requests``), then our own fields."""
        st = status()
        return {"status": seed_state(str(engine.state)), "model": name,
                "uptime_s": round(time.time() - started, 3), **seed_counters(st),
                "state": str(engine.state), "source": engine.source, "task": task,
                "load_seconds": engine.load_seconds, "blas": blas.active, **st}

    other = EMBED_ROUTES if task == "generate" else GENERATE_ROUTES
    use = "/v1/chat/completions, /v1/completions or /v1/messages" if task == "generate" \
        else "/v1/embeddings"

    async def wrong_task():
        kind = "an embedding model" if task == "embedding" else "not an embedding model"
        raise APIError(400, f"Model '{name}' is {kind}; use {use}.", param="model",
                       code="wrong_task")

    for route in other:
        app.add_url_rule(route, endpoint=f"wrong_task:{route}", view_func=wrong_task,
                         methods=["POST"])


def seed_state(state: str) -> str:
    """vllm-mlx's ``status``: running, not_loaded (loading or failed) or stopped."""
    return {"ready": "running", "stopped": "stopped"}.get(state, "not_loaded")


def seed_counters(st: dict[str, Any]) -> dict[str, Any]:
    """vllm-mlx's counters from a worker's status (an embedding worker has fewer)."""
    mem = st.get("mlx_memory") or {}
    pc = st.get("prompt_cache") or {}
    hits = sum((pc.get("hits") or {}).values())
    looked = hits + pc.get("misses", 0)
    gb = 1 << 30
    return {
        "steps_executed": st.get("steps_executed", 0), "num_running": st.get("num_running", 0),
        "num_waiting": st.get("num_waiting", 0),
        "total_requests_processed": st.get("requests_total", 0),
        "total_prompt_tokens": st.get("prompt_tokens_total", 0),
        "total_completion_tokens": st.get("generation_tokens_total", 0),
        "metal": {"active_memory_gb": round(mem.get("active_bytes", 0) / gb, 3),
                  "peak_memory_gb": round(mem.get("peak_bytes", 0) / gb, 3),
                  "cache_memory_gb": round(mem.get("cache_bytes", 0) / gb, 3)},
        "cache": {"type": pc.get("type", "prefix_lru"), "entries": pc.get("entries", 0),
                  "hit_rate": round(hits / looked, 4) if looked else 0.0,
                  "memory_mb": round(pc.get("bytes", 0) / (1 << 20), 1)},
    }


#: Says that a request's max_tokens was lowered to what the model allows (and from what).
MAX_TOKENS_HEADER = "X-Mlxfleet-Max-Tokens"

#: Prompts with more text than this are templated and tokenized in a thread.
INLINE_PREPARE_BYTES = 32 * 1024


def _text_bytes(content: Any) -> int:
    """UTF-8 size of a message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return len(content.encode("utf-8", "replace"))
    if isinstance(content, list):
        return sum(_text_bytes(p.get("text")) for p in content if isinstance(p, dict))
    return 0


def _prepare(info: ModelInfo, req: GenRequest, images: Optional[list] = None):
    """Prompt tokens, output plan (parsers, grammar), sampling parameters and, with
    images, the ``VisionPrompt``; no MLX on this side."""
    vision = None
    if images:
        tok = info.tokenizer
        vision = vision_prompt(info.vision.processor, chat_prompt(info, req, tokenize=False),
                               images, info.vision.image_token,
                               getattr(tok, "bos_token_id", None))
        prompts = [vision.ids]
        plan = output_plan(info, req, prompts[0])
    elif req.messages is not None:
        prompts = [chat_prompt(info, req)]
        plan = output_plan(info, req, prompts[0])
    else:
        prompts = completion_prompts(info, req)
        plan = output_plan(info, req, prompts[0]) if req.response_schema and \
            len(prompts) == 1 else OutputPlan()
    params = sampling_params(info, req, prompts)
    params.grammar = plan.grammar
    if req.prediction:  # drafts for speculative decoding; the answer is the model's own
        params.prediction = info.tokenizer.encode(req.prediction, add_special_tokens=False)
    if plan.grammar is not None and plan.grammar.min_tokens > params.max_tokens:
        raise APIError(400, f"max_tokens {params.max_tokens} is too small for the JSON "
                       f"schema: its shortest complete value takes {plan.grammar.min_tokens} "
                       "tokens.", param="max_tokens", code="invalid_value")
    return prompts, plan, params, vision


class Worker:
    """Admission and request preparation for one generation engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.config = engine.config
        self.name = engine.config.name
        self.inflight = 0  # sequences admitted and not finished (n x prompts per request)
        self.calls: dict[str, Pipeline] = {}
        self._info: Optional[ModelInfo] = None
        self._image_lock = asyncio.Lock()

    def model_info(self) -> ModelInfo:
        e = self.engine
        if e.state == EngineState.READY:
            problem = e.problem()
            if problem:
                raise APIError(503, f"Model '{self.name}' cannot serve: {problem}; it will "
                               "be restarted.", type="service_unavailable",
                               code="engine_unavailable", headers={"Retry-After": "5"})
            if self._info is None:
                self._info = ModelInfo(self.name, e.tokenizer, e.context_length,
                                       e.vocab_size, self.config, e.unknown_ids, e.vision,
                                       e.parsers or pick_parsers(
                                           None, None, self.config.tool_call_parser,
                                           self.config.reasoning_parser),
                                       e.template_style, Steadier(tuple(self.config.volatile)))
            return self._info
        if e.state in (EngineState.LOADING, EngineState.PENDING):
            raise APIError(503, f"Model '{self.name}' is still loading; retry shortly.",
                           type="service_unavailable", code="model_loading",
                           headers={"Retry-After": "1"})
        raise APIError(503, f"Model '{self.name}' is not available: {e.error or e.state}",
                       type="service_unavailable", code="model_unavailable",
                       headers={"Retry-After": "5"})

    async def begin(self, to_request: Callable[[dict[str, Any]], GenRequest]
                    ) -> tuple[GenRequest, Pipeline]:
        """Admit, parse, convert, tokenize and submit one request. The capacity check
        comes first: a full worker answers 503 before any parsing or grammar work."""
        cap = self.config.max_concurrency + self.config.max_queue
        if self.config.dist_rank > 0:
            raise APIError(503, f"This worker is rank {self.config.dist_rank} of the sharded "
                           f"model '{self.name}'; requests go to rank 0.",
                           type="service_unavailable", code="not_rank_zero")
        if self.inflight >= cap:
            raise APIError(503, f"Model '{self.name}' is at capacity ({self.inflight} "
                           "requests in flight); retry shortly.", type="service_unavailable",
                           code="queue_full", headers={"Retry-After": "1"})
        weight = 1  # in-flight slots this request takes: one per sequence
        self.inflight += weight
        self.engine.announce(1)
        try:
            body = parse_json_body(await request.get_data())
            extras = sorted(set(body) - _KNOWN_FIELDS - GATEWAY_FIELDS)
            req = to_request(body)
            if req.sequences > 1:
                self.inflight += req.sequences - weight
                weight = req.sequences
                if self.inflight > cap and weight <= self.config.max_concurrency:
                    raise APIError(503, f"Model '{self.name}' has no room for {weight} more "
                                   f"sequences ({self.inflight - weight} in flight); retry "
                                   "shortly.", type="service_unavailable", code="queue_full",
                                   headers={"Retry-After": "1"})
            pipe = await self._submit(req, request.headers.get(CACHE_SCOPE_HEADER, "")[:64])
            pipe.weight = weight
        except BaseException:
            self.inflight -= weight
            raise
        finally:
            self.engine.announce(-1)
        if extras:
            log.info("ignoring unsupported request fields: %s",
                     ", ".join(loggable(x, 64) for x in extras[:20]))
        pipe.request_id = request.headers.get("X-Request-Id") or new_id("req")
        self.calls[pipe.request_id] = pipe
        g.reply_headers = pipe.headers
        return req, pipe

    async def _submit(self, req: GenRequest, scope: str = "") -> Pipeline:
        info = self.model_info()
        text_bytes = self._check_size(info, req)
        if req.images:
            prompts, plan, params, vision = await self._prepare_images(info, req)
        elif text_bytes > INLINE_PREPARE_BYTES or req.constrained:
            # Templating and tokenizing a long text, or compiling a grammar, takes a
            # while: off the event loop, so the neighbours' streams keep flowing and
            # health checks are answered. (Short ones stay inline: a thread hop costs
            # more than they do.)
            prompts, plan, params, vision = await asyncio.to_thread(_prepare, info, req)
        else:
            prompts, plan, params, vision = _prepare(info, req)
        gen = self.engine.submit(prompts, params, req.n, vision, scope)
        pipe = Pipeline(self.engine, gen, plan, req.tools, sum(len(p) for p in prompts),
                        req.stream_interval or self.config.stream_interval,
                        not req.parallel_tool_calls)
        if params.asked_max_tokens is not None:
            pipe.headers[MAX_TOKENS_HEADER] = (
                f"{params.max_tokens}; asked {params.asked_max_tokens}, more than this model "
                "allows after this prompt")
        return pipe

    async def count_tokens(self, req: GenRequest) -> int:
        """Prompt tokens of a chat request, images included (as the model sees them)."""
        info = self.model_info()
        if not req.images:
            return len(chat_prompt(info, req))
        prompts, *_ = await self._prepare_images(info, req)
        return len(prompts[0])

    async def _prepare_images(self, info: ModelInfo, req: GenRequest):
        """``_prepare`` for a request with images: fetched, checked against the pixel
        budgets, decoded and run through the processor off the event loop. One request's
        images at a time, so decoded pixels in memory stay within one request's budget;
        the heap is trimmed after (the decoded images are large and short-lived)."""
        if info.vision is None:
            raise APIError(400, f"Model '{self.name}' does not accept images: it is not a "
                           "vision model.", param=req.images[0].param,
                           code="unsupported_content")
        async with self._image_lock:
            images = await load_images(req.images, self.config)

            def work():
                try:
                    return _prepare(info, req, images)
                finally:
                    images.clear()
                    trim_heap()

            return await asyncio.to_thread(work)

    def _check_size(self, info: ModelInfo, req: GenRequest) -> int:
        """Cheap refusals before any tokenizing: more sequences than the batch holds, or a
        text so long that it cannot fit the context whatever its tokens. Returns the
        prompt text's size in bytes."""
        count = req.sequences
        if count > self.config.max_concurrency:
            raise APIError(400, f"This request asks for {count} sequences (prompts x n); "
                           f"model '{self.name}' runs at most {self.config.max_concurrency} "
                           "at once.", param="n", code="too_many_sequences")
        if req.messages is not None:  # one prompt: the whole conversation
            sizes = [sum(_text_bytes(m.get("content")) for m in req.messages)]
        else:  # several prompts: each must fit
            sizes = [_text_bytes(p) for p in req.prompts or []]
        ctx = info.context_length
        at_least = max(sizes, default=0) // info.max_token_bytes
        if ctx is not None and at_least >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. "
                           f"However, your prompt has at least {at_least} tokens. Please "
                           "shorten it.", param=req.prompt_param,
                           code="context_length_exceeded")
        return sum(sizes)

    def finished(self, pipe: Pipeline) -> None:
        """The request is over (answered, failed or abandoned): free its slot."""
        pipe.close()
        if self.calls.pop(pipe.request_id, None) is None:
            return
        self.inflight -= pipe.weight
        g = pipe.gen
        ttft = (g.first_token_at - g.submitted_at) if g.first_token_at else None
        log.info("request %s: %d prompt (%d cached) + %d completion tokens in %.2fs, "
                 "ttft %s", pipe.request_id, pipe.prompt_tokens, g.cached_tokens,
                 pipe.completion_tokens, time.monotonic() - g.submitted_at,
                 f"{ttft:.3f}s" if ttft is not None else "-")

    async def fold(self, pipe: Pipeline, feed: Callable[[list], Any]) -> None:
        """A non-streamed answer as the stream's fold: every event batch to ``feed``."""
        try:
            async for batch in pipe.events():
                feed(batch)
        finally:
            self.finished(pipe)

    def stream(self, pipe: Pipeline, body: AsyncIterator[str],
               content_type: str = "text/event-stream",
               in_band: Optional[Callable[[APIError], str]] = None):
        """A streaming answer; an error after the first byte goes in-band, in the shape
        of this route's protocol (``in_band``: the protocol's fold writes it, e.g. with the
        stream's next sequence number)."""
        path = request.path

        async def tracked():
            try:
                async for chunk in body:
                    yield chunk
            except APIError as err:
                log.warning("stream failed: %s", err.message)
                yield in_band(err) if in_band else stream_error(err, path)
            finally:
                self.finished(pipe)

        return streaming_response(tracked(), content_type=content_type)

    async def warm(self) -> None:
        """Prefill ``warm_prompts`` into the prompt cache once the model is loaded (as
        vllm-mlx's --warm-prompts): the first real request with one of those prefixes
        starts from the cache."""
        conversations = list(self.config.warm_prompts)
        if self.config.warm_prompts_file:
            conversations += await asyncio.to_thread(_warm_file,
                                                     self.config.warm_prompts_file)
        if not conversations:
            return
        await self.engine.wait_ready()
        done = 0
        for entry in conversations:
            try:
                prompts, _, params, _ = _prepare(self.model_info(), warm_request(entry))
                await Pipeline(self.engine, self.engine.submit(prompts, params), OutputPlan(),
                               None, len(prompts[0]), 1, False).collect()
                done += 1
            except Exception as e:  # noqa: BLE001 - a bad warm prompt is logged, not fatal
                log.warning("warm prompt %d skipped: %s", done + 1, e)
        log.info("warmed the prompt cache with %d of %d prompts", done, len(conversations))

    def status(self) -> dict[str, Any]:
        return {"context_length": self.engine.context_length,
                "inflight_requests": self.inflight, **self.engine.report,
                "requests": [_request_status(rid, p) for rid, p in self.calls.items()]}


#: The largest warm-prompts file read (a FIFO or /dev/zero is refused, not read).
MAX_WARM_FILE = 32 << 20


def warm_request(entry: Any) -> GenRequest:
    """One warm prompt: a conversation (a list of chat messages), or a request a client
    sent, as captured (``{"path": "/v1/messages", "body": {...}}``, or the bare body:
    Anthropic's when it has ``system`` or tools with ``input_schema``, Responses' when it
    has ``input``, else OpenAI chat), tools and all, so that the prefix an agent sends
    (its system prompt and tools: tens of thousands of tokens) is the one cached."""
    if isinstance(entry, list):
        return GenRequest(messages=entry, max_tokens=1, temperature=0.0)
    if not isinstance(entry, dict):
        raise ValueError("a warm prompt is a list of messages or a captured request")
    path, body = (entry.get("path"), entry["body"]) if "body" in entry else (None, entry)
    body = {"model": "warm", **{k: v for k, v in body.items()
                                if k not in ("stream", "max_output_tokens")}}
    tools = body.get("tools") or []
    if path == "/v1/responses" or (path is None and "input" in body):
        from .responses import responses_request

        req = responses_request({**body, "max_output_tokens": 1})
    elif path == "/v1/messages" or (path is None and ("system" in body or any(
            isinstance(t, dict) and "input_schema" in t for t in tools))):
        from .anthropic import messages_request

        req = messages_request({**body, "max_tokens": 1})
    else:
        from .openai_api import chat_request

        req = chat_request({**body, "max_tokens": 1})
    req.max_tokens, req.temperature = 1, 0.0
    return req


def _warm_file(path: str) -> list:
    """The warm prompts of a ``warmPrompts`` file: a JSON list of conversations (message
    lists) or captured requests; a file that is not one is logged and skipped (the model
    serves without them)."""
    import json

    from ..files import read_regular

    try:
        data = json.loads(read_regular(Path(path), MAX_WARM_FILE))
        if not isinstance(data, list) or not all(isinstance(c, (list, dict)) for c in data):
            raise ValueError("not a JSON list of conversations or requests")
    except (OSError, ValueError) as e:
        log.warning("cache.warmPrompts: cannot use %s: %s", path, e)
        return []
    return data


#: Request fields some protocol acts on (anything else is logged as ignored).
_KNOWN_FIELDS = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_sequences", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "n", "user", "stream",
    "stream_options", "stream_interval", "ignore_eos", "logprobs", "top_logprobs", "tools",
    "tool_choice", "parallel_tool_calls", "response_format", "echo", "system", "metadata",
    "skip_special_tokens", "thinking", "chat_template_kwargs", "return_token_ids",
    # Ollama
    "options", "format", "think", "raw", "template", "suffix", "images", "context",
    # Responses
    "input", "instructions", "text", "reasoning", "max_output_tokens", "store",
    "previous_response_id", "mlxfleet_history",
    # accepted with nothing to act on (docs/integrations.md says so): Codex sends them on
    # every request. The prompt cache matches prompts by their tokens, so it needs no
    # prompt_cache_key; include asks for encrypted reasoning, which a local model has not
    "prompt_cache_key", "include", "client_metadata", "safety_identifier"})


def _request_status(rid: str, pipe: Pipeline) -> dict[str, Any]:
    """One in-flight request, in vllm-mlx's /v1/status terms."""
    g = pipe.gen
    now_ = time.monotonic()
    ttft = (g.first_token_at - g.submitted_at) if g.first_token_at else None
    gen_time = (now_ - g.first_token_at) if g.first_token_at else 0.0
    max_tokens = g.params.max_tokens * g.num_sequences
    return {"request_id": rid, "phase": g.phase,
            "tokens_per_second": round(g.generated / gen_time, 2) if gen_time > 0 else None,
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            "progress": round(g.generated / max_tokens, 4) if max_tokens else None,
            "cache_hit_type": g.cache_hit, "cached_tokens": g.cached_tokens,
            "prompt_tokens": pipe.prompt_tokens, "generated_tokens": g.generated,
            "max_tokens": max_tokens, "elapsed_s": round(now_ - g.submitted_at, 3)}
