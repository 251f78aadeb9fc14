"""Tool-call and reasoning parsers: split generated text into content, reasoning and calls.

Each tool-call family is a start marker, an end marker (or none: until the end
of the output) and a function that turns the text between them into calls.
mlx_lm's parsers are used where it has the family (hermes/qwen JSON, mistral,
kimi, glm47, pythonic); the others are small regex/JSON parsers written here
because mlx_lm has no equivalent.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from ..formats import REASONING_PARSERS, TOOL_PARSERS

Call = dict[str, Any]  # {"name": str, "arguments": dict}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: Optional[str]  # None: the whole output is a call (e.g. xLAM's JSON array)
    end: Optional[str]  # None or "": the call runs to the end of the output
    parse: Callable[[str, Any], list[Call]]


def _as_list(x) -> list[Call]:
    items = x if isinstance(x, list) else [x]
    out = []
    for c in items:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError(f"not a tool call: {c!r}")
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        out.append({"name": c["name"], "arguments": args if isinstance(args, dict) else {}})
    return out


def json_calls(text: str, tools=None) -> list[Call]:
    """One JSON object, a JSON array, or several objects separated by ``;``/newlines."""
    text = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    if fence:
        text = fence.group(1)
    try:
        obj = json.loads(text)
    except ValueError:
        dec, pos, objs = json.JSONDecoder(), 0, []
        while pos < len(text):
            while pos < len(text) and text[pos] in " \t\r\n;,":
                pos += 1
            if pos >= len(text):
                break
            o, pos = dec.raw_decode(text, pos)
            objs.append(o)
        obj = objs
    if isinstance(obj, dict) and "tool_calls" in obj:  # {"tool_calls": [...]}
        obj = obj["tool_calls"]
    return _as_list(obj)


def _mlx(module: str) -> ToolFormat:
    import importlib

    m = importlib.import_module(f"mlx_lm.tool_parsers.{module}")

    def parse(text: str, tools=None) -> list[Call]:
        return _as_list(m.parse_tool_call(text, tools))

    return ToolFormat(module, m.tool_call_start, m.tool_call_end or None, parse)


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<a>[^\n<]+?)(?:\n```json\n(?P<b>.*?)\n```"
    r"|<｜tool▁sep｜>(?P<c>.*?))<｜tool▁call▁end｜>", re.S)


def _deepseek(text: str, tools=None) -> list[Call]:
    out = []
    for m in _DEEPSEEK_CALL.finditer(text):
        name = m.group("a").strip()
        if "<｜tool▁sep｜>" in name:  # v3.1: name<sep>args
            name = name.split("<｜tool▁sep｜>")[0]
        out.append({"name": name, "arguments": json.loads(m.group("b") or m.group("c"))})
    if not out:
        raise ValueError("no deepseek tool call found")
    return out


_FUNCTIONARY = re.compile(
    r"(?:<function=|>>>)\s*([\w.-]+)>?\s*\n?(\{.*?\})(?=\s*(?:</function>|>>>|$))", re.S)


def _functionary(text: str, tools=None) -> list[Call]:
    # v3.1: <function=NAME>{args}</function>; v3: >>>NAME\n{args}
    out = []
    for m in _FUNCTIONARY.finditer(text):
        out.append({"name": m.group(1), "arguments": json.loads(m.group(2))})
    if not out:
        raise ValueError("no functionary tool call found")
    return out


_FORMATS: dict[str, Callable[[], ToolFormat]] = {
    "hermes": lambda: _mlx("json_tools"),
    "qwen": lambda: _mlx("json_tools"),
    "mistral": lambda: _mlx("mistral"),
    "kimi": lambda: _mlx("kimi_k2"),
    "glm47": lambda: _mlx("glm47"),
    "pythonic": lambda: _mlx("pythonic"),
    "qwen3_coder": lambda: _mlx("qwen3_coder"),
    "llama": lambda: ToolFormat("llama", "<|python_tag|>", None, json_calls),
    "deepseek": lambda: ToolFormat("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                   _deepseek),
    "granite": lambda: ToolFormat("granite", "<|tool_call|>", None, json_calls),
    "nemotron": lambda: ToolFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", json_calls),
    "xlam": lambda: ToolFormat("xlam", None, None, json_calls),
    "functionary": lambda: ToolFormat("functionary", None, None, _functionary),
}
_FORMATS["harmony"] = lambda: HARMONY  # read by HarmonySplitter, not by markers


def tool_format(name: Optional[str], tokenizer: Any) -> ToolFormat:
    """The format for ``parsers.toolCall``; ``auto`` (or unset) asks the tokenizer."""
    if name and name != "auto":
        if name not in _FORMATS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of: "
                             + ", ".join(TOOL_PARSERS))
        return _FORMATS[name]()
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser:
        start, end, fn = tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
        return ToolFormat("auto", start, end or None,
                          lambda text, tools=None: _as_list(fn(text, tools)))
    return _FORMATS["hermes"]()


def parse_calls(fmt: ToolFormat, text: str, tools: Any) -> Optional[list[Call]]:
    """Calls in ``text`` (the part between markers), or None if it is not a valid call."""
    try:
        calls = fmt.parse(text, tools)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    return calls or None


def first_call_only(pieces: list[tuple[str, Any]], seen: bool) -> list[tuple[str, Any]]:
    """Drop every call after the first (``parallel_tool_calls: false``)."""
    out = []
    for kind, value in pieces:
        if kind == "call":
            if seen:
                continue
            seen = True
        out.append((kind, value))
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputSplitter:
    """Streams text into ("content" | "reasoning", text) pieces and completed tool calls.

    Markers are matched on text (robust to how they tokenize); text that might be
    the start of a marker is held back until it is known not to be one.
    """

    def __init__(self, tools: Optional[ToolFormat], tool_defs: Any,
                 think: Optional[tuple[str, str]], starts_in_reasoning: bool = False):
        self.fmt, self.tool_defs, self.think = tools, tool_defs, think
        self.state = "reasoning" if (think and starts_in_reasoning) else "content"
        self.buf = ""
        self.tool_text = ""
        self.calls: list[Call] = []
        self.whole = tools is not None and tools.start is None  # xLAM-style output
        self._whole_text = ""

    def _markers(self) -> list[tuple[str, str]]:
        """(marker, next state) pairs that apply in the current state."""
        out = []
        if self.state == "content":
            if self.think:
                out.append((self.think[0], "reasoning"))
            if self.fmt and self.fmt.start:
                out.append((self.fmt.start, "tool"))
        elif self.state == "reasoning":
            out.append((self.think[1], "content"))
            if self.fmt and self.fmt.start:
                out.append((self.fmt.start, "tool"))
        elif self.state == "tool" and self.fmt.end:
            out.append((self.fmt.end, "content"))
        return out

    def feed(self, text: str) -> list[tuple[str, Any]]:
        """New pieces: ("content", str), ("reasoning", str) or ("call", Call)."""
        if self.whole and self.state == "content":
            self._whole_text += text
            return []
        self.buf += text
        out: list[tuple[str, Any]] = []
        while self.buf:
            markers = self._markers()
            hit = min(((self.buf.find(m), m, nxt) for m, nxt in markers if m in self.buf),
                      default=None)
            if hit is not None:
                pos, marker, nxt = hit
                self._emit(out, self.buf[:pos])
                self.buf = self.buf[pos + len(marker):]
                self._switch(out, nxt)
                continue
            keep = max((_partial(self.buf, m) for m, _ in markers), default=0)
            self._emit(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.whole and self.state == "content":
            calls = parse_calls(self.fmt, self._whole_text, self.tool_defs) \
                if self._whole_text.strip() else None
            if calls:
                out += [("call", c) for c in calls]
                self.calls += calls
            elif self._whole_text:
                out.append(("content", self._whole_text))
            return out
        self._emit(out, self.buf)
        self.buf = ""
        if self.state == "tool":  # a call that runs to the end of the output
            self._switch(out, "content")
        return out

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        if self.state == "tool":
            self.tool_text += text
        else:
            out.append((self.state, text))

    def _switch(self, out: list, nxt: str) -> None:
        if self.state == "tool":
            calls = parse_calls(self.fmt, self.tool_text, self.tool_defs)
            if calls:
                out += [("call", c) for c in calls]
                self.calls += calls
            else:  # not a valid call: show what the model wrote rather than lose it
                out.append(("content", f"{self.fmt.start}{self.tool_text}{self.fmt.end or ''}"))
            self.tool_text = ""
        self.state = nxt


def _partial(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


def think_markers(name: Optional[str], tokenizer: Any) -> Optional[tuple[str, str]]:
    if not name or name == "harmony":  # (harmony's channels: HarmonySplitter)
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                         + ", ".join(REASONING_PARSERS))
    start = getattr(tokenizer, "think_start", None) or "<think>"
    end = getattr(tokenizer, "think_end", None) or "</think>"
    return start, end


def arguments_json(call: Call) -> str:
    return json.dumps(call["arguments"], ensure_ascii=False)


HARMONY = ToolFormat("harmony", None, None, lambda text, tools=None: [])
_H_START, _H_MESSAGE, _H_ENDS = "<|start|>", "<|message|>", ("<|end|>", "<|call|>",
                                                              "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonySplitter:
    """gpt-oss's harmony output as (content | reasoning) pieces and calls: each message
    is a header (``<|channel|>analysis``, ``to=functions.NAME``...) then ``<|message|>``
    and its body, ending at ``<|end|>`` (or ``<|call|>``/``<|return|>``, end-of-sequence
    tokens the text usually lacks). The analysis channel is reasoning; a message to
    ``functions.NAME`` is a call whose body is the JSON arguments; the rest is content.
    Same interface as ``OutputSplitter``."""

    def __init__(self, tool_defs: Any = None):
        self.tool_defs = tool_defs
        self.state = "header"  # the output starts after the prompt's <|start|>assistant
        self.header = self.buf = self.args = ""
        self.kind, self.name = "content", None
        self.calls: list[Call] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while self.buf:
            markers = [_H_MESSAGE] if self.state == "header" else [*_H_ENDS, _H_START]
            hit = min(((self.buf.find(m), m) for m in markers if m in self.buf), default=None)
            if hit is None:
                keep = max(_partial(self.buf, m) for m in markers)
                self._take(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            pos, marker = hit
            self._take(out, self.buf[:pos])
            self.buf = self.buf[pos + len(marker):]
            if marker == _H_MESSAGE:
                self._open()
            else:
                self._close(out)
                self.state = "header"
        return out

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._take(out, self.buf)
        self.buf = ""
        if self.state == "header" and self.header.strip():
            # never reached <|message|>: not harmony after all; show it rather than lose it
            out.append(("content", self.header))
        self._close(out)
        return out

    def _take(self, out: list, text: str) -> None:
        if not text:
            return
        if self.state == "header":
            self.header += text
        elif self.kind == "call":
            self.args += text
        else:
            out.append((self.kind, text))

    def _open(self) -> None:
        channel = _CHANNEL.search(self.header)
        to = _RECIPIENT.search(self.header)
        self.name = to.group(1) if to else None
        self.kind = "call" if to else "reasoning" if channel and \
            channel.group(1) == "analysis" else "content"
        self.state, self.header, self.args = "body", "", ""

    def _close(self, out: list) -> None:
        if self.state == "body" and self.kind == "call":
            try:
                args = json.loads(self.args) if self.args.strip() else {}
                call = {"name": self.name, "arguments": args if isinstance(args, dict) else {}}
                out.append(("call", call))
                self.calls.append(call)
            except ValueError:  # not JSON: show what the model wrote
                out.append(("content", self.args))
        self.state, self.header, self.kind = "header", "", "content"
