"""OpenAI request schemas (chat and text completions), validated once in the worker.

A request that passes builds a generation; one that fails becomes a 400 in
OpenAI's shape that names the offending field (``wire.from_validation_error``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)


class _Model(BaseModel):
    # Unknown fields are kept (clients send vendor extras) and reported by the
    # worker's log rather than rejected, as vLLM and OpenAI-compatible servers do.
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "input_text"]
    text: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image"]


class ToolCallFunction(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        """The content as plain text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def has_image(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(p, ImagePart) for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(_Model):
    """Fields common to chat and text completions."""

    model: str = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[StrictFloat] = Field(default=None, ge=0, le=2)
    top_p: Optional[StrictFloat] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)
    min_p: Optional[StrictFloat] = Field(default=None, ge=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=10)
    logit_bias: Optional[dict[str, float]] = None
    n: StrictInt = Field(default=1, ge=1, le=16)
    user: Optional[str] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stream_interval: Optional[StrictInt] = Field(default=None, ge=1, le=1024,
                                           description="tokens per streamed chunk, at "
                                           "least (tokens that arrive together share one)")
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    skip_special_tokens: StrictBool = True  # vLLM's: hide special tokens from the text
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and each choice's token ids

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"bias for token {k} must be between -100 and 100")
        return v

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: enable_thinking, ...
    prediction: Optional[dict[str, Any]] = None  # predicted output: drafts for speculation


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=5)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


