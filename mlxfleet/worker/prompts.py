"""From a generation request to token prompts, an output plan and sampling parameters.

Everything here runs on the event loop and never touches MLX: the tokenizer is
plain Python/Rust. Every protocol arrives here as the same ``GenRequest``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..wire import APIError
from ..worker_settings import WorkerConfig
from .images import ImageRef
from .sampling import SamplingParams
from .volatile import Steadier

if TYPE_CHECKING:
    from .grammar import Grammar


@dataclass
class GenRequest:
    """A protocol-neutral generation request (what every protocol is converted to)."""

    messages: Optional[list[dict[str, Any]]] = None  # chat: chat-template message dicts
    prompts: Optional[list[Any]] = None  # completions: strings or token lists
    tools: Optional[list[dict[str, Any]]] = None  # OpenAI function-tool format
    tool_choice: Any = None  # None, "auto", "none", "required" or {"name": NAME}
    parallel_tool_calls: bool = True
    response_schema: Optional[dict[str, Any]] = None  # JSON Schema the output must follow
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: Optional[int] = None  # None: off; k: the sampled token plus top k
    stream: bool = False
    stream_interval: Optional[int] = None
    include_usage: bool = False  # a last streamed chunk with usage
    echo: bool = False  # completions: the prompt before the completion
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # answers carry prompt_token_ids and token_ids (vLLM)
    prompt_param: str = "messages"  # the field errors about the prompt name
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # for the chat template
    prediction: Optional[str] = None  # the expected output (OpenAI's predicted outputs)
    #: a freeform tool the answer must be a call of: (name, its Lark grammar)
    forced_grammar: Optional[tuple[str, str]] = None
    # Images, in prompt order; each sits in its message's content as {"type": "image"}.
    images: list[ImageRef] = field(default_factory=list)

    @property
    def forces_a_call(self) -> bool:
        """``tool_choice`` required or naming a tool: the answer must be a call."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @property
    def constrained(self) -> bool:
        """Whether the output follows a grammar (a schema, a forced call or freeform
        tool): compiling it takes a while."""
        return self.response_schema is not None or self.forced_grammar is not None \
            or bool(self.tools) and self.forces_a_call

    @property
    def sequences(self) -> int:
        """How many sequences this request puts in the batch (prompts x n)."""
        return (len(self.prompts) if self.prompts is not None else 1) * self.n


@dataclass
class ModelInfo:
    """What request handling needs to know about the loaded model."""

    name: str
    tokenizer: Any
    context_length: Optional[int]
    vocab_size: int
    defaults: WorkerConfig
    unknown_ids: frozenset = frozenset()  # ids below vocab_size the tokenizer lacks
    vision: Any = None  # the engine's vision.VisionModel: its processor and image token
    parsers: Any = None  # formats.Parsers: the tool-call and reasoning formats parsed
    template_style: Optional[TemplateStyle] = None
    steady: Optional[Steadier] = None  # removes volatile fragments (volatile.py)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes (at least 1): ``bytes // this`` is a
        lower bound on a text's token count, known without tokenizing it."""
        try:
            vocab = self.tokenizer.get_vocab()
        except Exception:  # noqa: BLE001 - no vocabulary listing: assume long tokens
            return 64
        return max((len(t.encode("utf-8", "replace")) for t in vocab), default=64) or 1


def chat_prompt(info: ModelInfo, req: GenRequest, tokenize: bool = True) -> Any:
    """Render the conversation with the model's chat template and tokenize it (or, with
    ``tokenize=False``, the text: what a vision model's processor reads)."""
    tok = info.tokenizer
    messages = req.messages or []
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    if not getattr(tok, "has_chat_template", False):
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return tok.encode(text + "assistant:") if tokenize else text + "assistant:"
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                for m in messages]
    if info.steady is not None:  # what changes every request must not key the cache
        messages = info.steady.messages(messages)
    messages = opening_system_first(messages)
    messages = for_template(messages, info.template_style)
    try:
        try:
            ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                          tokenize=tokenize, **req.template_kwargs)
        except Exception:  # noqa: BLE001 - e.g. "System message must be at the beginning"
            folded = fold_system(messages)
            if folded is messages:
                raise
            ids = tok.apply_chat_template(folded, tools=tools, add_generation_prompt=True,
                                          tokenize=tokenize, **req.template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input problem
        raise APIError(400, f"The chat template could not render these messages: {e}",
                       param="messages", code="invalid_messages") from None
    if not tokenize:
        return ids
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class TemplateStyle:
    """How a chat template expects an assistant turn that calls tools."""

    null_content: bool = False  # it tests ``content is none`` (DeepSeek V3): no content
    string_arguments: bool = False  # it writes ``arguments`` as is: a JSON string
    short_ids: bool = False  # it takes only 9-character call ids (Mistral's)


_IS_NONE = re.compile(r"(message(?:\['content'\]|\[\"content\"\]|\.content))\s+is\s+(not\s+)?none")
_ARGS_AS_IS = re.compile(r"(\[['\"]arguments['\"]\]|\.arguments)\s*\+")


def template_style(template: Optional[str]) -> tuple[Optional[str], TemplateStyle]:
    """Read how ``template`` renders tool-calling turns; returns the template to use
    and its style. transformers (>= 5) drops every None-valued message key before
    rendering, so a template that tests ``content is none`` (DeepSeek V3's renders tool
    calls only then) would never see one: such tests are rewritten to also hold for a
    missing key."""
    if not isinstance(template, str):
        return template, TemplateStyle()
    null = bool(_IS_NONE.search(template))
    if null:
        template = _IS_NONE.sub(lambda m: f"({m.group(1)} is defined and {m.group(1)} is not none)"
                                if m.group(2) else
                                f"({m.group(1)} is not defined or {m.group(1)} is none)", template)
    return template, TemplateStyle(null, bool(_ARGS_AS_IS.search(template))
                                   and "arguments is string" not in template,
                                   "length != 9" in template)


def short_id(call_id: Any) -> Any:
    """A call id as Mistral's templates take it (9 letters and digits; the same id
    always gives the same short one, so a call and its result still pair up)."""
    if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def for_template(messages: list[dict[str, Any]], style: Optional[TemplateStyle]
                 ) -> list[dict[str, Any]]:
    """Assistant turns with tool calls in the shape ``style`` says the template reads."""
    if style is None or not (style.null_content or style.string_arguments or style.short_ids):
        return messages
    out = []
    for m in messages:
        if style.short_ids and m.get("tool_call_id"):
            m = {**m, "tool_call_id": short_id(m["tool_call_id"])}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = dict(m)
            if style.null_content and not m.get("content"):
                m.pop("content", None)
            if style.string_arguments:
                m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": (
                    a if isinstance(a := tc["function"].get("arguments"), str)
                    else json.dumps(a, ensure_ascii=False))}} for tc in m["tool_calls"]]
            if style.short_ids:
                m["tool_calls"] = [{**tc, "id": short_id(tc.get("id"))} for tc in m["tool_calls"]]
        out.append(m)
    return out


def opening_system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages of a conversation's opening (before the model's first turn) go
    before its first user message. Claude Code sends its environment (working folder,
    skills, date: 9 KB) as a system message *after* the user's first question, so a new
    session asking something else shared its prompt with the last one only up to the
    question (81% of it); moved first, the question is the prompt's last part (>= 95%
    from cache). Templates that take one leading system message get this order anyway
    (``fold_system``); later system messages stay where they are, so a conversation's
    prefix never changes from turn to turn."""
    first_turn = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                      len(messages))
    opening = messages[:first_turn]
    system = [m for m in opening if m.get("role") == "system"]
    if not system or all(m.get("role") == "system" for m in opening[:len(system)]):
        return messages  # none, or they lead already
    return system + [m for m in opening if m.get("role") != "system"] + messages[first_turn:]


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message folded into one, first: what templates that take a single
    leading system message accept (Qwen3's raises on any other). Returns ``messages``
    itself when there is nothing to fold."""
    system = [m for m in messages if m.get("role") == "system"]
    if not system or (len(system) == 1 and messages[0] is system[0]):
        return messages
    text = "\n\n".join(_plain(m.get("content")) for m in system if m.get("content"))
    return [{"role": "system", "content": text}] + [m for m in messages
                                                     if m.get("role") != "system"]


def _plain(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


@dataclass
class OutputPlan:
    """How a chat request's output is constrained and split (tools, reasoning, JSON)."""

    grammar: Optional[Grammar] = None
    tool_format: Any = None  # a parsers.ToolFormat when tool calls are parsed
    think: Optional[tuple[str, str]] = None
    starts_in_reasoning: bool = False
    forced_tool: bool = False  # tool_choice required/named: the output is one JSON call
    custom_call: Optional[str] = None  # a forced freeform tool: the output is its input
    harmony: bool = False  # gpt-oss's channels: reasoning, content and calls in one format

    def splitter(self, tools: Any):
        from .parsers import OutputSplitter

        if self.harmony:
            from .parsers import HarmonySplitter

            return HarmonySplitter(tools)
        if self.tool_format is None and self.think is None:
            return None
        return OutputSplitter(self.tool_format, tools, self.think, self.starts_in_reasoning)


def output_plan(info: ModelInfo, req: GenRequest, prompt: list[int]) -> OutputPlan:
    """Grammar and parsers for a chat request; 400 for what cannot be honoured."""
    from .grammar import GrammarError, lark_grammar, schema_grammar, tool_call_schema
    from .parsers import think_markers, tool_format

    plan = OutputPlan()
    tok = info.tokenizer
    plan.think = think_markers(info.parsers.reasoning, tok)
    plan.harmony = info.parsers.tool_call == "harmony" and not req.forces_a_call
    if plan.think:
        tail = tok.decode(prompt[-8:]).rstrip()
        plan.starts_in_reasoning = tail.endswith(plan.think[0])
    choice = req.tool_choice
    schema = None
    if req.tools and req.forces_a_call:
        name = choice.get("name") if isinstance(choice, dict) else None
        try:
            schema = tool_call_schema(req.tools, name)
        except (GrammarError, KeyError, TypeError) as e:
            raise APIError(400, f"Invalid tools or tool_choice: {e}", param="tool_choice",
                           code="invalid_value") from None
        plan.forced_tool = True
    elif req.tools and choice != "none" and info.defaults.auto_tool_choice:
        picked = info.parsers.tool_call  # (hermes: the tokenizer's own parser, if any)
        plan.tool_format = tool_format(
            picked if picked != "hermes" else info.defaults.tool_call_parser, tok)
    elif req.forces_a_call:
        raise APIError(400, "tool_choice requires tools.", param="tool_choice",
                       code="invalid_value")
    if req.forced_grammar is not None:
        name, lark = req.forced_grammar
        try:
            plan.grammar = lark_grammar(lark, tok, info.vocab_size)
        except GrammarError as e:
            raise APIError(400, f"The grammar of tool '{name}' cannot be enforced: {e}",
                           param="tools", code="invalid_grammar") from None
        plan.forced_tool, plan.custom_call = True, name
        return plan
    schema = schema or req.response_schema
    if schema is not None:
        try:
            plan.grammar = schema_grammar(schema, tok, info.vocab_size)
        except (GrammarError, ValueError, TypeError) as e:
            raise APIError(400, f"The JSON schema cannot be enforced: {e}",
                           param="response_format" if not plan.forced_tool else "tools",
                           code="invalid_schema") from None
    return plan


def completion_prompts(info: ModelInfo, req: GenRequest) -> list[list[int]]:
    """One token list per prompt (a completion request may carry several)."""
    p = req.prompts or []
    prompts = [info.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="empty_prompt")
        bad = [t for t in ids if not 0 <= t < info.vocab_size or t in info.unknown_ids]
        if bad:
            raise APIError(400, f"Token id {bad[0]} in prompt {i} is outside the model's "
                           f"vocabulary (0..{info.vocab_size - 1}).", param="prompt",
                           code="invalid_token")
    return prompts


#: A request with no max_tokens, on a model whose context is unknown.
NO_CONTEXT_MAX_TOKENS = 32768


def sampling_params(info: ModelInfo, req: GenRequest,
                    prompts: list[list[int]]) -> SamplingParams:
    """Apply defaults and check token budgets against the model's limits and context."""
    d = info.defaults
    requested = req.max_tokens
    longest = max(len(p) for p in prompts)
    ctx = info.context_length
    if d.max_prompt_tokens is not None and longest > d.max_prompt_tokens:
        raise APIError(400, f"Your prompt has {longest} tokens; this server accepts at most "
                       f"{d.max_prompt_tokens}.", param=req.prompt_param,
                       code="prompt_too_long")
    if ctx is not None and longest >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. "
                       f"However, your prompt has {longest} tokens. Please shorten it.",
                       param=req.prompt_param, code="context_length_exceeded")
    # A max_tokens above what the model allows (the server's limit, or the context left
    # after the prompt) is lowered to it, as other servers do: agents ask for 32k-128k.
    limit = d.max_request_tokens
    if ctx is not None:
        limit = ctx - longest if limit is None else min(limit, ctx - longest)
    # No limit from the client: up to the context left (what OpenAI's and Anthropic's
    # clients assume; Codex and cn send none), bounded by max_request_tokens. A limit
    # of 512 cut their patches short.
    max_tokens = requested or d.max_tokens or limit or NO_CONTEXT_MAX_TOKENS
    asked = None
    if limit is not None and max_tokens > limit:
        asked = requested if requested is not None and requested > limit else None
        max_tokens = limit
    bias = req.logit_bias
    if bias:
        bad = [t for t in bias if t >= info.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is outside the model's "
                           f"vocabulary (0..{info.vocab_size - 1}).", param="logit_bias",
                           code="invalid_value")

    def pick(own, default):
        return own if own is not None else default

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(req.temperature, d.temperature),
        top_p=pick(req.top_p, d.top_p),
        top_k=max(pick(req.top_k, d.top_k), 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        logit_bias=bias or None,
        logprobs=req.logprobs,
        ignore_eos=req.ignore_eos,
        stop=list(req.stop),
        skip_special_tokens=req.skip_special_tokens,
        keep_leading_space=req.messages is None,
        asked_max_tokens=asked,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def now() -> int:
    return int(time.time())
