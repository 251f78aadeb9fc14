"""One worker's settings: the one typed object a worker is started with, and the table
of where each setting comes from.

A leaf module (the manifest, the supervisor, the worker and the CLI all read it). Each
``WorkerConfig`` field is declared once, with its default, its description and where
it is set (``_from``): the manifest's spec field, the server setting (flag
``--NAME`` / ``MLXFLEET_NAME``) that fills it when the manifest leaves it unset, and
the ``mlxfleet worker`` flag. ``SETTINGS`` is that table; the supervisor's
``worker_config`` and the CLI's worker flags are built from it. The defaults written
here are the only defaults: a manifest field left unset (None) means "the server's
setting, else this default".
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _from(manifest: Optional[str] = None, server: Optional[str] = None,
          flag: Optional[str] = "") -> dict:
    """Where a field is set: ``manifest`` (a dotted path under ``spec``), ``server`` (a
    server setting's name), ``flag`` (``mlxfleet worker``'s flag: "" = ``--field-name``,
    None = none)."""
    return {"manifest": manifest, "server": server, "flag": flag}


class WorkerConfig(BaseModel):
    """Everything one worker needs to serve one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="the model name clients send as `model`")
    source: str = Field(min_length=1, description="builtin:NAME, a directory or a HF repo id")
    revision: Optional[str] = Field(None, description="Hugging Face revision (branch, tag or "
                                    "commit)", json_schema_extra=_from("revision"))
    task: Literal["generate", "embedding", "vision"] = Field(
        "generate", description="embedding: /v1/embeddings with an encoder model; vision: a "
        "vision-language model (found from the checkpoint when unset)",
        json_schema_extra=_from("task"))
    trust_remote_code: bool = Field(False, description="run Python code shipped with the "
                                    "checkpoint", json_schema_extra=_from("trust_remote_code"))

    max_concurrency: int = Field(16, ge=1, le=1024,
                                 description="sequences decoded together in one batch",
        json_schema_extra=_from("batching.max_concurrency"))
    max_queue: int = Field(64, ge=0, description="requests beyond maxConcurrency that may "
                           "wait (for the model's load or for a batch slot) before new ones "
                           "get 503",
        json_schema_extra=_from("batching.max_queue"))
    prefill_batch_size: int = Field(8, ge=1, description="prompts prefilled in one pass",
        json_schema_extra=_from("batching.prefill_batch_size"))
    prefill_step_size: int = Field(512, ge=16, description="prompt tokens per prefill chunk",
        json_schema_extra=_from("batching.prefill_step_size"))
    warmup: bool = Field(True, description="before Ready, run a few short generations "
                         "(a lone prompt, then a batch) so that kernels built on first use "
                         "are built at load, not in the first requests",
        json_schema_extra=_from("batching.warmup", flag=None))
    cache_bytes: int = Field(1 << 30, gt=0, description="KV memory budget: running "
                             "sequences plus retained prompt caches",
        json_schema_extra=_from(flag=None))
    disk_cache_bytes: int = Field(0, ge=0, description="the prompt cache's disk tier: "
                                  "entries leaving memory, and all of them when the worker "
                                  "stops, are kept on disk up to this size (0 = off)",
        json_schema_extra=_from(flag=None))
    disk_cache_dir: Optional[str] = Field(None, description="the disk tier's folder (one "
                                          "per model; a subfolder per checkpoint)",
        json_schema_extra=_from(flag=None))
    warm_prompts: list[list[dict]] = Field(default_factory=list, description="conversations "
                                           "prefilled into the prompt cache at load",
        json_schema_extra=_from(flag=None))
    volatile: list[str] = Field(default_factory=list, description="regular expressions of "
                                "prompt text that changes from request to request and "
                                "means nothing to the model: removed from system messages "
                                "so it does not defeat the prompt cache (besides the "
                                "built-in ones: worker/volatile.py)",
        json_schema_extra=_from("cache.volatile", flag=None))
    warm_prompts_file: Optional[str] = Field(None, description="a JSON file of more such "
                                             "conversations, read by the worker at load "
                                             "(a regular file of at most 32 MiB)",
        json_schema_extra=_from(flag=None))
    kv_bits: Optional[Literal[4, 8]] = Field(None, description="keys and values kept "
                                             "quantized to this many bits (none: full "
                                             "precision)",
        json_schema_extra=_from("cache.kv_bits"))
    paged_cache: bool = Field(False, description="retain prompts as shared 64-token KV blocks "
                              "(the block prefix cache) rather than whole",
        json_schema_extra=_from("cache.paged", "use_paged_cache", "--use-paged-cache"))

    speculative: Literal["auto", "off"] = Field("auto", description="speculative "
                                                "decoding: auto drafts by prompt lookup "
                                                "(and the client's prediction) when it pays; "
                                                "off decodes one token per step",
        json_schema_extra=_from("speculative.mode", "speculative"))
    draft_tokens: int = Field(8, ge=1, le=32, description="the most draft tokens a sequence "
                              "sends in one step",
        json_schema_extra=_from("speculative.draft_tokens"))
    draft_model: Optional[str] = Field(None, min_length=1, description="a smaller model "
                                       "with the same tokenizer that drafts for every "
                                       "sequence (builtin:NAME, a directory or a HF repo "
                                       "id; its weights count in the model's memory)",
        json_schema_extra=_from("speculative.draft_model"))

    max_tokens: Optional[int] = Field(None, ge=1, description="completion length when a "
                                      "request sets no max_tokens (unset: the context left "
                                      "after the prompt, bounded by max_request_tokens, as "
                                      "OpenAI and Anthropic clients assume)",
        json_schema_extra=_from("defaults.max_tokens", "max_tokens"))
    max_request_tokens: Optional[int] = Field(None, ge=1, description="the largest "
                                              "max_tokens a request may ask for (lowered "
                                              "to it above)",
        json_schema_extra=_from("limits.max_request_tokens", "max_request_tokens"))
    context_length: Optional[int] = Field(None, ge=16, description="the model's context, "
                                          "in tokens, instead of its config's (vLLM's "
                                          "--max-model-len, Ollama's num_ctx)",
        json_schema_extra=_from("limits.context_length"))
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="the longest prompt, in "
                                             "tokens (400 above)",
        json_schema_extra=_from("limits.max_prompt_tokens", "max_prompt_tokens"))

    temperature: float = Field(1.0, ge=0, le=2,
        json_schema_extra=_from("defaults.temperature", "default_temperature"))
    top_p: float = Field(1.0, gt=0, le=1,
        json_schema_extra=_from("defaults.top_p", "default_top_p"))
    top_k: int = Field(0, ge=0, description="0 = off",
        json_schema_extra=_from("defaults.top_k"))
    stream_interval: int = Field(1, ge=1, description="tokens per streamed chunk, at least "
        "(tokens that arrive together share one)",
        json_schema_extra=_from("defaults.stream_interval", "stream_interval"))
    tool_call_parser: Optional[str] = Field(None, description="tool-call format (None or "
                                            "auto: from the chat template)",
        json_schema_extra=_from("parsers.tool_call", "tool_call_parser"))
    reasoning_parser: Optional[str] = Field(None, description="qwen3 or deepseek_r1",
        json_schema_extra=_from("parsers.reasoning", "reasoning_parser"))
    auto_tool_choice: bool = Field(True, description="parse tool calls out of the output "
                                   "(vllm-mlx's --enable-auto-tool-choice); off, tools are "
                                   "shown to the model but its output stays text",
        json_schema_extra=_from(flag=None))
    drain_timeout: float = Field(30.0, ge=0, description="seconds SIGTERM waits for "
                                 "in-flight requests",
        json_schema_extra=_from(server="drain_timeout"))
    stall_timeout: float = Field(300.0, gt=0, description="seconds the engine may hold work "
                                 "without completing a step before /health reports it",
        json_schema_extra=_from(flag=None))
    wired_limit_bytes: Optional[int] = Field(None, gt=0, description="macOS: Metal wired "
                                             "memory limit (mx.set_wired_limit); unset: "
                                             "the system's",
        json_schema_extra=_from(flag=None))

    allow_image_urls: bool = Field(False, description="fetch http(s) image URLs sent by "
                                   "clients (off: a server that fetches what clients name "
                                   "can be turned against the network it sits in)",
        json_schema_extra=_from(server="allow_image_urls"))
    max_image_bytes: int = Field(20 << 20, gt=0, description="largest image, encoded",
        json_schema_extra=_from(flag=None))
    max_image_pixels: int = Field(50_000_000, gt=0, description="largest image, width x "
                                  "height, checked before it is decoded",
        json_schema_extra=_from(server="max_image_pixels", flag=None))
    max_request_pixels: int = Field(64_000_000, gt=0, description="all the images of one "
                                    "request together, in pixels (decoded as RGB: 3 bytes "
                                    "each), checked before any is decoded",
        json_schema_extra=_from(server="max_request_pixels", flag=None))
    max_images: int = Field(16, ge=1, description="images in one request",
        json_schema_extra=_from(server="max_images", flag=None))
    image_fetch_timeout: float = Field(10.0, gt=0, description="seconds to fetch an image URL",
        json_schema_extra=_from(flag=None))
    dist_hosts: list[str] = Field(default_factory=list, description="a sharded model: every "
                                  "rank's host:port, rank 0 first (empty: not sharded)",
        json_schema_extra=_from(flag=None))
    dist_rank: int = Field(0, ge=0, description="this worker's rank; only rank 0 serves",
        json_schema_extra=_from(flag=None))
    dist_backend: Literal["ring", "jaccl", "any"] = Field("ring", json_schema_extra=_from(
        flag=None))
    dist_strategy: Literal["tensor", "pipeline"] = Field("tensor", json_schema_extra=_from(
        flag=None))

    @property
    def sharded(self) -> bool:
        return len(self.dist_hosts) > 1

    @model_validator(mode="after")
    def _parsers(self):
        from .formats import REASONING_PARSERS, TOOL_PARSERS

        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose one "
                             f"of: {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one "
                             f"of: {', '.join(REASONING_PARSERS)}")
        return self


@dataclass(frozen=True)
class Setting:
    """One row of the table: a ``WorkerConfig`` field and where it is set."""

    field: str
    default: Any
    help: str
    manifest: Optional[str]  # dotted path under the manifest's spec
    server: Optional[str]  # the server setting that fills it when the manifest does not
    flag: Optional[str]  # mlxfleet worker's flag
    type: Any  # the flag's value type; bool: a switch; a tuple: its choices


def _flag_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return tuple(args)
    return _flag_type(args[0]) if args else annotation


def _table() -> list[Setting]:
    rows = []
    for name, f in WorkerConfig.model_fields.items():
        where = f.json_schema_extra or {}
        flag = where.get("flag", None) if where else None
        rows.append(Setting(name, f.default, f.description or "", where.get("manifest"),
                            where.get("server"),
                            "--" + name.replace("_", "-") if flag == "" else flag,
                            _flag_type(f.annotation)))
    return rows


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


#: Every worker setting, in ``WorkerConfig``'s order.
SETTINGS: list[Setting] = _table()
