"""Which tool-call and reasoning formats a model writes, from its architecture and chat
template: what the worker parses and what ``/v1/models``, ``/api/show`` and
``mlxfleet describe`` show. A leaf module (no MLX): the gateway reads checkpoints on
disk with it, without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Tool-call formats (``spec.parsers.toolCall``); ``auto`` picks one from the model.
TOOL_PARSERS = sorted(["hermes", "qwen", "mistral", "kimi", "glm47", "pythonic",
                       "qwen3_coder", "llama", "deepseek", "granite", "nemotron", "xlam",
                       "functionary", "harmony", "auto"])
#: Reasoning formats (``spec.parsers.reasoning``); harmony's analysis channel is one.
REASONING_PARSERS = ["qwen3", "deepseek_r1", "harmony"]

# (text in the chat template, tool-call format), first match wins: the marker each
# format's calls start with, as the template writes them (mlx-lm's table, and ours).
_BY_TEMPLATE = [
    ("<|channel|>", "harmony"),
    ("<｜tool▁calls▁begin｜>", "deepseek"),
    ("<tool_call>\n<function=", "qwen3_coder"),
    ("<tool_call>\\n<function=", "qwen3_coder"),
    ("<|tool_calls_section_begin|>", "kimi"),
    ("<arg_key>", "glm47"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama"),
    ("<|tool_call_start|>", "pythonic"),
    ("<|tool_list_start|>", "pythonic"),
    ("<TOOLCALL>", "nemotron"),
    ("<|tool_call|>", "granite"),
    ("<tool_call>", "hermes"),
]
_BY_MODEL_TYPE = {"gpt_oss": "harmony", "deepseek_v3": "deepseek", "kimi_k2": "kimi",
                  "lfm2": "pythonic", "nemotron_h": "nemotron"}

#: Markers the parsers read in the text: shown even where the tokenizer marks them
#: special (hidden by ``skip_special_tokens``), since a parser cannot find a marker that
#: was never written out. Parsed output never shows them.
MARKERS = frozenset({
    "<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
    "<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_end|>", "<|tool_call_argument_begin|>", "<|tool_call_start|>",
    "<TOOLCALL>", "</TOOLCALL>", "<|tool_call|>",
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>",
})


@dataclass(frozen=True)
class Parsers:
    tool_call: str
    reasoning: Optional[str]
    chosen: bool  # picked from the model (True) or named by the manifest (False)

    def as_dict(self) -> dict:
        return {"tool_call": self.tool_call, "reasoning": self.reasoning,
                "source": "model" if self.chosen else "manifest"}


def pick_parsers(model_type: Optional[str], template: Optional[str],
                 tool_call: Optional[str] = None, reasoning: Optional[str] = None) -> Parsers:
    """The formats to parse: the manifest's when it names them, else the model's."""
    template = template or ""
    named = tool_call not in (None, "auto")
    if not named:
        tool_call = next((name for marker, name in _BY_TEMPLATE if marker in template),
                         None) or _BY_MODEL_TYPE.get(model_type or "", "hermes")
    if reasoning is None and tool_call == "harmony":
        reasoning = "harmony"
    elif reasoning is None and ("<think>" in template or "enable_thinking" in template):
        reasoning = "deepseek_r1" if model_type in ("deepseek_v3",) else "qwen3"
    return Parsers(tool_call, reasoning, not named)
