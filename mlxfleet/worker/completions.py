"""From an OpenAI request to token prompts, and from tokens back to OpenAI responses.

Everything here runs on the event loop and never touches MLX: the tokenizer is
plain Python/Rust, and tokens arrive from the engine as ints and floats.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from mlx_lm.generate import TextStateMachine

from ..wire import APIError
from .engine import SamplingParams, TokenEvent
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass
class ModelDefaults:
    """Worker-level defaults; a request's own values win."""

    max_tokens: int = 512
    max_tokens_limit: Optional[int] = None  # a request above this gets a 400
    max_request_tokens: Optional[int] = None  # a longer prompt gets a 400
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream_interval: int = 1  # tokens per SSE chunk
    tool_parser: Optional[str] = None  # parsers.toolCall (None/auto: from the tokenizer)
    reasoning_parser: Optional[str] = None  # parsers.reasoning


@dataclass
class ModelInfo:
    """What request handling needs to know about the loaded model."""

    name: str
    tokenizer: Any
    context_length: Optional[int]
    vocab_size: int
    defaults: ModelDefaults = field(default_factory=ModelDefaults)


# ---- prompts ----------------------------------------------------------------

def _message_dict(m) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                         "content": m.text()}
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


def chat_prompt(info: ModelInfo, req: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it."""
    for i, m in enumerate(req.messages):
        if m.has_image():
            raise APIError(400, f"Model '{info.name}' does not accept images.",
                           param=f"messages[{i}].content", code="unsupported_content")
    tok = info.tokenizer
    messages = [_message_dict(m) for m in req.messages]
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    if not getattr(tok, "has_chat_template", False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return tok.encode(text)
    try:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                      tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input problem
        raise APIError(400, f"The chat template could not render these messages: {e}",
                       param="messages", code="invalid_messages") from None
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class OutputPlan:
    """How a chat request's output is constrained and split (tools, reasoning, JSON)."""

    grammar: Optional[str] = None
    tool_format: Any = None  # a parsers.ToolFormat when tool calls are parsed
    think: Optional[tuple[str, str]] = None
    starts_in_reasoning: bool = False
    forced_tool: bool = False  # tool_choice required/named: the output is one JSON call

    def splitter(self, tools: Any):
        from .parsers import OutputSplitter

        if self.tool_format is None and self.think is None:
            return None
        return OutputSplitter(self.tool_format, tools, self.think, self.starts_in_reasoning)


def output_plan(info: ModelInfo, req: ChatCompletionRequest, prompt: list[int]) -> OutputPlan:
    """Grammar and parsers for a chat request; 400 for what cannot be honoured."""
    from .grammar import GrammarError, check_grammar, json_schema_grammar, tool_call_schema
    from .parsers import think_markers, tool_format

    plan = OutputPlan()
    tok = info.tokenizer
    try:
        plan.think = think_markers(info.defaults.reasoning_parser, tok)
    except ValueError as e:
        raise APIError(500, str(e), type="server_error", code="bad_parser") from None
    if plan.think:
        tail = tok.decode(prompt[-8:]).rstrip()
        plan.starts_in_reasoning = tail.endswith(plan.think[0])
    choice = req.tool_choice
    schema = None
    if req.tools and (choice == "required" or isinstance(choice, dict)):
        name = None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") or choice.get("name")
            if not isinstance(name, str):
                raise APIError(400, "tool_choice must name a function: "
                               '{"type": "function", "function": {"name": ...}}',
                               param="tool_choice", code="invalid_value")
        try:
            schema = tool_call_schema(req.tools, name)
        except (GrammarError, KeyError, TypeError) as e:
            raise APIError(400, f"Invalid tools or tool_choice: {e}", param="tool_choice",
                           code="invalid_value") from None
        plan.forced_tool = True
    elif req.tools and choice != "none":
        try:
            plan.tool_format = tool_format(info.defaults.tool_parser, tok)
        except ValueError as e:
            raise APIError(500, str(e), type="server_error", code="bad_parser") from None
    elif choice in ("required",) or isinstance(choice, dict):
        raise APIError(400, "tool_choice requires tools.", param="tool_choice",
                       code="invalid_value")
    rf = req.response_format or {}
    kind = rf.get("type", "text")
    if kind == "json_object":
        schema = schema or {"type": "object"}
    elif kind == "json_schema":
        js = rf.get("json_schema") or {}
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a "
                           "'schema'.", param="response_format", code="invalid_value")
        schema = schema or js.get("schema") or {"type": "object"}
    elif kind != "text":
        raise APIError(400, f"Unknown response_format type '{kind}'; use text, json_object "
                       "or json_schema.", param="response_format", code="invalid_value")
    if schema is not None:
        try:
            plan.grammar = json_schema_grammar(schema)
            check_grammar(plan.grammar, tok, info.vocab_size)
        except (GrammarError, ValueError, TypeError) as e:
            raise APIError(400, f"The JSON schema cannot be enforced: {e}",
                           param="response_format" if not plan.forced_tool else "tools",
                           code="invalid_schema") from None
    return plan


def completion_prompts(info: ModelInfo, req: CompletionRequest) -> list[list[int]]:
    """One token list per prompt (a completion request may carry several)."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [info.tokenizer.encode(p)]
    elif all(isinstance(x, str) for x in p):
        prompts = [info.tokenizer.encode(x) for x in p]
    elif all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="empty_prompt")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} in prompt {i} is outside the model's "
                           f"vocabulary (0..{info.vocab_size - 1}).", param="prompt",
                           code="invalid_token")
    return prompts


def sampling_params(info: ModelInfo, req: SamplingFields,
                    prompts: list[list[int]]) -> SamplingParams:
    """Apply defaults and check token budgets against the model's context."""
    d = info.defaults
    requested = req.requested_max_tokens
    longest = max(len(p) for p in prompts)
    ctx = info.context_length
    if d.max_tokens_limit is not None and requested is not None \
            and requested > d.max_tokens_limit:
        raise APIError(400, f"max_tokens is too large: {requested}. This server allows at "
                       f"most {d.max_tokens_limit} completion tokens.",
                       param="max_tokens", code="invalid_value")
    if d.max_request_tokens is not None and longest > d.max_request_tokens:
        raise APIError(400, f"Your prompt has {longest} tokens; this server accepts at most "
                       f"{d.max_request_tokens}.",
                       param="messages" if hasattr(req, "messages") else "prompt",
                       code="prompt_too_long")
    if ctx is not None:
        if longest >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. "
                           f"However, your prompt has {longest} tokens. Please shorten it.",
                           param="messages" if hasattr(req, "messages") else "prompt",
                           code="context_length_exceeded")
        if requested is not None and longest + requested > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. "
                           f"However, you requested {longest + requested} tokens "
                           f"({longest} in the prompt, {requested} in the completion). "
                           "Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
    max_tokens = requested or d.max_tokens
    if d.max_tokens_limit is not None:
        max_tokens = min(max_tokens, d.max_tokens_limit)
    if ctx is not None:
        max_tokens = min(max_tokens, ctx - longest)
    bias = None
    if req.logit_bias:
        bias = {int(k): v for k, v in req.logit_bias.items()}
        bad = [t for t in bias if t >= info.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is outside the model's "
                           f"vocabulary (0..{info.vocab_size - 1}).", param="logit_bias",
                           code="invalid_value")
    top_k = req.top_k if req.top_k is not None else d.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else d.temperature,
        top_p=req.top_p if req.top_p is not None else d.top_p,
        top_k=max(top_k, 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        logit_bias=bias,
        logprobs=req.num_logprobs,
        ignore_eos=req.ignore_eos,
    )


# ---- decoding ---------------------------------------------------------------

class ChoiceDecoder:
    """Turns one sequence's tokens into text: streaming detokenizer + stop strings."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self._tok = tokenizer
        self._detok = tokenizer.detokenizer
        self._stops = stops
        self._sm = TextStateMachine({"normal": [(s, None) for s in stops]}) if stops else None
        self._state = self._sm.make_state() if self._sm else None
        self._raw = ""
        self.stop_sequence: Optional[str] = None  # which stop string ended the choice
        self.text = ""
        self.tokens = 0
        self.finish_reason: Optional[str] = None
        self.logprobs: list[TokenEvent] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: TokenEvent) -> str:
        """Consume one token; return the text that may now be shown."""
        if self.done:
            return ""
        self.tokens += 1
        if ev.logprob is not None:
            self.logprobs.append(ev)
        eos = ev.finish_reason == "stop"  # the engine stops on EOS tokens only
        if not eos:
            self._detok.add_token(ev.token)
        if ev.finish_reason is not None:
            self._detok.finalize()
        out = self._filter(self._detok.last_segment)
        if self.finish_reason is None and ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            if self._state is not None:  # not a stop string after all: show it
                self._state, tail, _ = TextStateMachine.flush(self._state)
                out += tail
        self.text += out
        return out

    def _filter(self, segment: str) -> str:
        if self._sm is None or not segment:
            return segment
        self._raw += segment
        self._state, segments = TextStateMachine.split(self._state, segment)
        out = "".join(t for s, t in segments if s is not None)
        if self._state[0] is None:
            self.finish_reason = "stop"
            self._state = None
            cut = len(self.text) + len(out)
            found = [(self._raw.find(s, cut), s) for s in self._stops]
            self.stop_sequence = min((f for f in found if f[0] >= 0), default=(0, None))[1]
        return out

    def token_text(self, token: int) -> str:
        return self._tok.decode([token])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(dec: ChoiceDecoder, events: list[TokenEvent]) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        s = dec.token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [
        {**entry(ev.token, ev.logprob),
         "top_logprobs": [entry(t, lp) for t, lp in (ev.top_logprobs or [])]}
        for ev in events]}


def completion_logprobs(dec: ChoiceDecoder, events: list[TokenEvent],
                        offset: int = 0) -> dict[str, Any]:
    tokens, offsets = [], []
    for ev in events:
        offsets.append(offset)
        s = dec.token_text(ev.token)
        tokens.append(s)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [ev.logprob for ev in events],
            "top_logprobs": [{dec.token_text(t): lp for t, lp in (ev.top_logprobs or [])}
                             for ev in events],
            "text_offset": offsets}


def now() -> int:
    return int(time.time())
