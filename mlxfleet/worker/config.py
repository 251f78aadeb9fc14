"""One worker's configuration: the one typed object a worker is started with.

The supervisor builds it from a manifest's spec and the server's defaults
(``supervisor/process.py: worker_config``); ``mlxfleet worker`` builds it from its
flags. The defaults written here are the only defaults: the manifest leaves a
field unset (None) to mean "the server's setting, else this default".
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WorkerConfig(BaseModel):
    """Everything one worker needs to serve one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="the model name clients send as `model`")
    source: str = Field(min_length=1, description="builtin:NAME, a directory or a HF repo id")
    revision: Optional[str] = None
    task: Literal["generate", "embedding", "vision"] = "generate"
    trust_remote_code: bool = False

    max_concurrency: int = Field(16, ge=1, le=1024,
                                 description="sequences decoded together in one batch")
    max_queue: int = Field(64, ge=0, description="requests beyond maxConcurrency that may "
                           "wait (for the model's load or for a batch slot) before new ones "
                           "get 503")
    prefill_batch_size: int = Field(8, ge=1, description="prompts prefilled in one pass")
    prefill_step_size: int = Field(512, ge=16, description="prompt tokens per prefill chunk")
    cache_bytes: int = Field(1 << 30, gt=0, description="KV memory budget: running "
                             "sequences plus retained prompt caches")
    disk_cache_bytes: int = Field(0, ge=0, description="the prompt cache's disk tier: "
                                  "entries leaving memory, and all of them when the worker "
                                  "stops, are kept on disk up to this size (0 = off)")
    disk_cache_dir: Optional[str] = Field(None, description="the disk tier's folder (one "
                                          "per model; a subfolder per checkpoint)")
    warm_prompts: list[list[dict]] = Field(default_factory=list, description="conversations "
                                           "prefilled into the prompt cache at load")
    paged_cache: bool = Field(False, description="retain prompts as shared 64-token KV blocks "
                              "(the block prefix cache) rather than whole")

    max_tokens: int = Field(512, ge=1, description="completion length when a request sets "
                            "no max_tokens (clipped to the context)")
    max_request_tokens: Optional[int] = Field(None, ge=1, description="the largest "
                                              "max_tokens a request may ask for (lowered "
                                              "to it above)")
    context_length: Optional[int] = Field(None, ge=16, description="the model's context, "
                                          "in tokens, instead of its config's (vLLM's "
                                          "--max-model-len, Ollama's num_ctx)")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="the longest prompt, in "
                                             "tokens (400 above)")

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    stream_interval: int = Field(1, ge=1, description="tokens per streamed chunk")
    tool_call_parser: Optional[str] = Field(None, description="tool-call format (None or "
                                            "auto: from the chat template)")
    reasoning_parser: Optional[str] = Field(None, description="qwen3 or deepseek_r1")
    auto_tool_choice: bool = Field(True, description="parse tool calls out of the output "
                                   "(vllm-mlx's --enable-auto-tool-choice); off, tools are "
                                   "shown to the model but its output stays text")
    drain_timeout: float = Field(30.0, ge=0, description="seconds SIGTERM waits for "
                                 "in-flight requests")
    stall_timeout: float = Field(300.0, gt=0, description="seconds the engine may hold work "
                                 "without completing a step before /health reports it")
    wired_limit_bytes: Optional[int] = Field(None, gt=0, description="macOS: Metal wired "
                                             "memory limit (mx.set_wired_limit); unset: "
                                             "the system's")

    allow_image_urls: bool = Field(False, description="fetch http(s) image URLs sent by "
                                   "clients (off: a server that fetches what clients name "
                                   "can be turned against the network it sits in)")
    max_image_bytes: int = Field(20 << 20, gt=0, description="largest image, encoded")
    max_image_pixels: int = Field(50_000_000, gt=0, description="largest image, width x "
                                  "height, checked before it is decoded")
    max_request_pixels: int = Field(64_000_000, gt=0, description="all the images of one "
                                    "request together, in pixels (decoded as RGB: 3 bytes "
                                    "each), checked before any is decoded")
    max_images: int = Field(16, ge=1, description="images in one request")
    image_fetch_timeout: float = Field(10.0, gt=0, description="seconds to fetch an image URL")
    dist_hosts: list[str] = Field(default_factory=list, description="a sharded model: every "
                                  "rank's host:port, rank 0 first (empty: not sharded)")
    dist_rank: int = Field(0, ge=0, description="this worker's rank; only rank 0 serves")
    dist_backend: Literal["ring", "jaccl", "any"] = "ring"
    dist_strategy: Literal["tensor", "pipeline"] = "tensor"

    @property
    def sharded(self) -> bool:
        return len(self.dist_hosts) > 1

    @model_validator(mode="after")
    def _parsers(self):
        from ..formats import REASONING_PARSERS, TOOL_PARSERS

        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose one "
                             f"of: {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one "
                             f"of: {', '.join(REASONING_PARSERS)}")
        return self


def default(field: str):
    """The default of a ``WorkerConfig`` field (for descriptions elsewhere)."""
    return WorkerConfig.model_fields[field].default


def cache_budget(memory_mb: Optional[int], memory_percent: Optional[float],
                 default_mb: Optional[int] = None) -> int:
    """KV budget in bytes from MiB or a share (0-1) of physical memory."""
    if memory_percent is not None:
        import psutil

        return int(psutil.virtual_memory().total * memory_percent)
    if memory_mb is not None:
        return memory_mb << 20
    return default_mb << 20 if default_mb is not None else default("cache_bytes")
