"""The worker's configuration for a manifest, with the server's defaults filled in."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..manifest import Manifest
from ..worker_settings import SETTINGS, WorkerConfig, cache_budget


def worker_config(m: Manifest, server: Any = None,
                  rank: Optional[tuple[int, tuple[str, ...]]] = None) -> WorkerConfig:
    """The worker's configuration for a manifest: the spec's values, else the server's
    defaults (``server`` settings), else the worker's own. ``rank``: (this worker's rank,
    every rank's host:port) for a sharded model."""
    s = m.spec
    fields: dict[str, Any] = {"name": m.name, "source": s.source}
    for row in SETTINGS:  # the table: the manifest's value, else the server's setting
        own = _at(s, row.manifest) if row.manifest else None
        if own is None and row.server:
            own = getattr(server, row.server, None)
        if own is not None:
            fields[row.field] = own
    # What the table cannot say: settings computed from several fields or in other units.
    fields.update({
        "cache_bytes": cache_budget(
            s.cache.memory_mb, s.cache.memory_percent
            if s.cache.memory_mb is not None or s.cache.memory_percent is not None
            else getattr(server, "default_cache_percent", None),
            getattr(server, "default_cache_mb", None)),
        "auto_tool_choice": True if s.parsers.tool_call else getattr(
            server, "enable_auto_tool_choice", None),
        "wired_limit_bytes": getattr(server, "wired_limit_bytes", lambda: None)(),
        "max_image_bytes": (server.max_image_mb << 20) if server is not None else None,
    })
    if s.cache.disk_mb and server is not None:
        fields["disk_cache_bytes"] = s.cache.disk_mb << 20
        fields["disk_cache_dir"] = str(Path(server.state_dir).expanduser() / "prompt-cache"
                                       / m.name)
    if isinstance(s.cache.warm_prompts, str):  # a file: the worker reads it (never here,
        fields["warm_prompts_file"] = warm_prompts_path(s.cache.warm_prompts, server)
    else:  # on the event loop: it may be a FIFO)
        fields["warm_prompts"] = warm_prompts(s.cache.warm_prompts)
    if rank is not None and s.distributed is not None:
        fields.update(dist_rank=rank[0], dist_hosts=list(rank[1]),
                      dist_backend=s.distributed.backend, dist_strategy=s.distributed.strategy)
    return WorkerConfig(**{k: v for k, v in fields.items() if v is not None})


def _at(spec: Any, path: str) -> Any:
    for part in path.split("."):
        spec = getattr(spec, part)  # a path the manifest does not have is a bug: raise
    return spec


def warm_prompts(value: Any) -> Optional[list]:
    """``cache.warmPrompts`` written in the manifest: the conversations."""
    if value is None:
        return None
    return [[m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
             for m in conv] for conv in value]


def warm_prompts_path(value: str, server: Any = None) -> str:
    """``cache.warmPrompts`` naming a JSON file: its path (relative to the manifests
    folder), which the worker reads when it loads."""
    path = Path(value).expanduser()
    if not path.is_absolute() and server is not None:
        path = Path(server.manifests_dir) / path
    return str(path)
