"""Resolve a model ``source`` to a local checkpoint directory.

Three kinds of source:

- ``builtin:NAME``: a tiny model mlxfleet writes itself (see ``builtin.py``);
- a local directory in Hugging Face / MLX layout;
- a Hugging Face repo id (``mlx-community/Qwen3-0.6B-4bit``), downloaded with
  ``huggingface_hub`` (progress bars on stderr; ``HF_HUB_OFFLINE=1`` means only
  the local cache is used).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

BUILTIN_PREFIX = "builtin:"


class SourceError(ValueError):
    """The source cannot be turned into a model directory."""


def source_kind(source: str) -> str:
    """``builtin``, ``path`` or ``hf`` (a Hugging Face repo id)."""
    if source.startswith(BUILTIN_PREFIX):
        return "builtin"
    expanded = os.path.expanduser(source)
    if source.startswith((".", "/", "~")) or os.path.exists(expanded):
        return "path"
    return "hf"


def resolve_source(source: str, revision: Optional[str] = None) -> Path:
    """Return a local directory holding the checkpoint for ``source``."""
    kind = source_kind(source)
    if kind == "builtin":
        from .builtin import ensure_builtin

        return ensure_builtin(source[len(BUILTIN_PREFIX):])
    if kind == "path":
        path = Path(os.path.expanduser(source)).resolve()
        if not (path / "config.json").is_file():
            raise SourceError(f"{path} is not a model directory (no config.json)")
        return path
    parts = source.split("/")
    if len(parts) != 2 or not all(parts):
        raise SourceError(f"{source!r} is neither a local directory, a builtin: model, "
                          "nor a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return Path(snapshot_download(source, revision=revision,
                                  allow_patterns=DEFAULT_ALLOW_PATTERNS))
