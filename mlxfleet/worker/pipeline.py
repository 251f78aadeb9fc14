"""The one generation pipeline: a prepared request in, protocol-neutral events out.

Every protocol (OpenAI chat and completions, Anthropic Messages, the next ones)
converts its request to a ``GenRequest``, gets a ``Pipeline`` from the worker
app, and formats its events: text and reasoning deltas, tool calls, each
choice's finish, and usage at the end. Splitting reasoning and tool calls out
of the text, pacing (``stream_interval``) and logprobs happen here, once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..wire import APIError
from .engine import Engine, EngineError, Generation, TokenEvent
from .parsers import ToolFormat, call_id, first_call_only, json_calls, parse_calls
from .prompts import OutputPlan, usage

#: With tool_choice required/named the grammar makes the output one JSON call.
_FORCED = ToolFormat("forced", None, None, json_calls)


@dataclass
class TextDelta:
    index: int
    text: str
    logprobs: list[TokenEvent] = field(default_factory=list)  # the tokens behind it


@dataclass
class ReasoningDelta:
    index: int
    text: str


@dataclass
class ToolCall:
    """A complete tool call (parsers see whole calls): its start and its arguments."""

    index: int
    call_index: int
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Finish:
    index: int
    reason: str  # stop, length or tool_calls
    stop_sequence: Optional[str] = None


@dataclass
class Done:
    usage: dict[str, Any]


Event = Union[TextDelta, ReasoningDelta, ToolCall, Finish, Done]


@dataclass
class ChoiceResult:
    """One choice, complete (for non-streaming answers)."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenEvent] = field(default_factory=list)
    finish: Optional[Finish] = None


class _Choice:
    def __init__(self, splitter: Any):
        self.splitter = splitter
        self.tokens = 0
        self.token_ids: list[int] = []  # every token generated, shown or not
        self.raw = ""  # the whole output, for a forced tool call
        self.pending = ""  # text not yet emitted (stream_interval)
        self.pending_lp: list[TokenEvent] = []
        self.count = 0
        self.calls = 0
        self.done = False


def _coalesce(events: list[Event]) -> list[Event]:
    """Text deltas of one choice that arrived together, joined: a speculative step gives a
    row up to a dozen tokens at once, and one chunk for them instead of one per token is
    a twelfth of the framing in the worker, the relay in the gateway and the parsing in the
    client (as vLLM streams a step's tokens). ``stream_interval`` stays a minimum; a delta
    is joined only to the choice's last event, so a choice's events keep their order."""
    out: list[Event] = []
    last: dict[int, int] = {}  # choice -> position in out of its latest event
    for ev in events:
        j = last.get(getattr(ev, "index", -1))
        prev = out[j] if j is not None else None
        if isinstance(ev, TextDelta) and isinstance(prev, TextDelta):
            out[j] = TextDelta(ev.index, prev.text + ev.text, prev.logprobs + ev.logprobs)
            continue
        if not isinstance(ev, Done):
            last[ev.index] = len(out)
        out.append(ev)
    return out


class Pipeline:
    """One request in flight: its generation and what its choices have produced."""

    def __init__(self, engine: Engine, gen: Generation, plan: OutputPlan,
                 tools: Any, prompt_tokens: int, interval: int, single_call: bool):
        self.engine, self.gen, self.plan, self.tools = engine, gen, plan, tools
        self.prompt_tokens = prompt_tokens
        self.interval = interval
        self.single_call = single_call
        self.choices = [_Choice(plan.splitter(tools)) for _ in range(gen.num_sequences)]
        self.open = len(self.choices)
        self.weight = 1  # the worker's in-flight slots this request holds
        self.headers: dict[str, str] = {}  # notices for the response's headers

    async def events(self) -> AsyncIterator[list[Event]]:
        """Event batches as tokens arrive, ending with ``Done``; an engine failure is
        an ``APIError`` (503)."""
        q = self.gen.events
        while self.open:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            out: list[Event] = []
            for ev in batch:
                if isinstance(ev, EngineError) and ev.status == 400:
                    raise APIError(400, ev.message, code="invalid_input")
                if isinstance(ev, EngineError) and ev.status == 500:
                    raise APIError(500, ev.message, type="server_error",
                                   code="structured_output_failed")
                if isinstance(ev, EngineError):
                    raise APIError(503, f"Generation failed: {ev.message}",
                                   type="server_error", code="engine_error",
                                   headers={"Retry-After": "1"})
                out.extend(self._feed(ev))
            if out:
                yield _coalesce(out)
        yield [Done(self.usage())]

    async def collect(self) -> list[ChoiceResult]:
        """Run to the end; every choice, complete."""
        results = [ChoiceResult() for _ in self.choices]
        async for batch in self.events():
            for ev in batch:
                if isinstance(ev, Done):
                    continue
                r = results[ev.index]
                if isinstance(ev, TextDelta):
                    r.text += ev.text
                    r.logprobs.extend(ev.logprobs)
                elif isinstance(ev, ReasoningDelta):
                    r.reasoning += ev.text
                elif isinstance(ev, ToolCall):
                    r.calls.append(ev)
                elif isinstance(ev, Finish):
                    r.finish = ev
        return results

    def _feed(self, ev: TokenEvent) -> list[Event]:
        ch = self.choices[ev.index]
        if ch.done:
            return []
        ch.tokens += 1
        ch.token_ids.append(ev.token)
        if ev.logprob is not None:
            ch.pending_lp.append(ev)
        out: list[Event] = []
        pieces = self._split(ch, ev.text)
        if ev.finish_reason is not None:
            pieces += self._finish_pieces(ch)
        if self.single_call:  # parallel_tool_calls: false
            pieces = first_call_only(pieces, ch.calls > 0)
        for kind, value in pieces:
            if kind == "content":
                ch.pending += value
            else:
                out += self._flush(ev.index, ch)
                if kind == "reasoning":
                    out.append(ReasoningDelta(ev.index, value))
                else:
                    out.append(ToolCall(ev.index, ch.calls, value.get("id") or call_id(),
                                        value["name"], value["arguments"]))
                    ch.calls += 1
        ch.count += 1
        if ev.finish_reason is not None:
            out += self._flush(ev.index, ch)
            ch.done = True
            self.open -= 1
            reason = "tool_calls" if ch.calls and ev.finish_reason == "stop" \
                else ev.finish_reason
            out.append(Finish(ev.index, reason, ev.stop_sequence))
        elif ch.count >= self.interval:
            out += self._flush(ev.index, ch)
        return out

    def _flush(self, index: int, ch: _Choice) -> list[Event]:
        ch.count = 0
        if not ch.pending and not ch.pending_lp:
            return []
        out = TextDelta(index, ch.pending, ch.pending_lp)
        ch.pending, ch.pending_lp = "", []
        return [out]

    def _split(self, ch: _Choice, text: str) -> list[tuple[str, Any]]:
        if not text:
            return []
        if self.plan.forced_tool:
            ch.raw += text  # the whole output is one JSON call, parsed when it ends
            return []
        return ch.splitter.feed(text) if ch.splitter else [("content", text)]

    def _finish_pieces(self, ch: _Choice) -> list[tuple[str, Any]]:
        if self.plan.custom_call:  # the grammar made the whole answer the tool's input
            return [("call", {"name": self.plan.custom_call, "arguments": {"input": ch.raw}})]
        if self.plan.forced_tool:
            calls = parse_calls(_FORCED, ch.raw, self.tools)
            return [("call", c) for c in calls] if calls else [("content", ch.raw)]
        return ch.splitter.finish() if ch.splitter else []

    def close(self) -> None:
        """Free whatever is still running (client disconnected, error)."""
        if self.open > 0:
            self.engine.cancel(self.gen)

    def token_ids(self) -> dict[str, Any]:
        """vLLM's ``return_token_ids`` fields: each prompt's ids and each choice's."""
        prompts = [list(p) for p in self.gen.prompts]
        return {"prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts,
                "token_ids": [c.token_ids for c in self.choices]}

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.gen.cached_tokens)
