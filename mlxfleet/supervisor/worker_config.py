"""The worker's configuration for a manifest, with the server's defaults filled in."""

from __future__ import annotations

from typing import Any

from ..manifest import Manifest
from ..worker.config import WorkerConfig, cache_budget


def worker_config(m: Manifest, server: Any = None) -> WorkerConfig:
    """The worker's configuration for a manifest: the spec's values, else the server's
    defaults (``server`` settings), else the worker's own."""
    s = m.spec

    def pick(own, setting: str):
        return own if own is not None else getattr(server, setting, None)

    fields = {
        "name": m.name, "source": s.source, "revision": s.revision, "task": s.task,
        "trust_remote_code": s.trust_remote_code,
        "max_concurrency": s.batching.max_concurrency, "max_queue": s.batching.max_queue,
        "prefill_batch_size": s.batching.prefill_batch_size,
        "prefill_step_size": s.batching.prefill_step_size,
        "cache_bytes": cache_budget(
            s.cache.memory_mb, s.cache.memory_percent
            if s.cache.memory_mb is not None or s.cache.memory_percent is not None
            else getattr(server, "default_cache_percent", None),
            getattr(server, "default_cache_mb", None)),
        "paged_cache": pick(s.cache.paged, "use_paged_cache"),
        "max_tokens": pick(s.defaults.max_tokens, "max_tokens"),
        "max_request_tokens": pick(s.limits.max_request_tokens, "max_request_tokens"),
        "max_prompt_tokens": pick(s.limits.max_prompt_tokens, "max_prompt_tokens"),
        "temperature": pick(s.defaults.temperature, "default_temperature"),
        "top_p": pick(s.defaults.top_p, "default_top_p"),
        "top_k": s.defaults.top_k,
        "stream_interval": pick(s.defaults.stream_interval, "stream_interval"),
        "tool_call_parser": pick(s.parsers.tool_call, "tool_call_parser"),
        "reasoning_parser": pick(s.parsers.reasoning, "reasoning_parser"),
        "auto_tool_choice": True if s.parsers.tool_call else getattr(
            server, "enable_auto_tool_choice", None),
        "drain_timeout": getattr(server, "drain_timeout", None),
        "wired_limit_bytes": getattr(server, "wired_limit_bytes", lambda: None)(),
        "allow_image_urls": getattr(server, "allow_image_urls", None),
        "max_image_bytes": (server.max_image_mb << 20) if server is not None else None,
        "max_image_pixels": getattr(server, "max_image_pixels", None),
        "max_images": getattr(server, "max_images", None),
    }
    return WorkerConfig(**{k: v for k, v in fields.items() if v is not None})
