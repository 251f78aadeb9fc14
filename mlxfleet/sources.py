"""Model sources: where a checkpoint lives, and how big its weights are.

Three kinds of source:

- ``builtin:NAME``: a tiny model mlxfleet writes itself (``builtin.py``);
- a local directory in Hugging Face / MLX layout;
- a Hugging Face repo id (``mlx-community/Qwen3-0.6B-4bit``), downloaded with
  ``huggingface_hub`` (progress bars on stderr; ``HF_HUB_OFFLINE=1`` means only
  the local cache is used).

Shared by the worker (to load) and the supervisor (to budget memory); it imports
nothing heavy at module level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .builtin import BUILTIN_PREFIX

#: What ``mlx_lm.load`` reads of a checkpoint: mlx_lm.utils.DEFAULT_ALLOW_PATTERNS, copied
#: because importing mlx_lm (transformers with it) costs the control plane ~3 s and
#: ~100 MB; tests/test_store.py checks the two stay equal.
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


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
    """Return a local directory holding the checkpoint for ``source`` (may download)."""
    kind = source_kind(source)
    if kind == "builtin":
        from .builtin import ensure_builtin

        return ensure_builtin(source[len(BUILTIN_PREFIX):])
    if kind == "path":
        path = Path(os.path.expanduser(source)).resolve()
        if not (path / "config.json").is_file():
            raise SourceError(f"{path} is not a model directory (no config.json)")
        return path
    _check_repo_id(source)
    here = local_dir(source, revision)
    if here is not None:  # pulled already: no call to the hub (`mlxfleet pull` updates)
        return here
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision, allow_patterns=ALLOW_PATTERNS))


def _check_repo_id(source: str) -> None:
    from .names import loggable, repo_id

    try:
        repo_id(source)
    except ValueError as e:
        raise SourceError(f"{loggable(source)} is neither a local directory, a builtin: "
                          f"model, nor a Hugging Face repo id: {e}") from None


def local_dir(source: str, revision: Optional[str] = None) -> Optional[Path]:
    """The checkpoint directory if it is already on disk; never downloads or writes."""
    kind = source_kind(source)
    if kind == "builtin":
        from .builtin import builtin_dir

        d = builtin_dir(source[len(BUILTIN_PREFIX):])
        return d if d.is_dir() else None
    if kind == "path":
        d = Path(os.path.expanduser(source))
        return d if d.is_dir() else None
    try:
        _check_repo_id(source)
        from huggingface_hub import snapshot_download

        # the files a load needs (as pulled); huggingface_hub 2.x calls a snapshot
        # without the repo's other files (README, images) incomplete otherwise
        d = Path(snapshot_download(source, revision=revision, local_files_only=True,
                                   allow_patterns=ALLOW_PATTERNS))
    except Exception:  # noqa: BLE001 - not cached (or not a repo id): unknown
        return None
    # a snapshot left half-written by an interrupted download is not "on disk"
    return d if (d / "config.json").is_file() and any(d.glob("*.safetensors")) else None


def weight_bytes(source: str, revision: Optional[str] = None) -> Optional[int]:
    """Size of the safetensors weights, if the checkpoint is on disk."""
    d = local_dir(source, revision)
    if d is None:
        return None
    files = list(d.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def is_vision_checkpoint(path: Path) -> bool:
    """A checkpoint with a vision tower (Hugging Face's ``vision_config``)."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict)



#: RoPE scalings whose factor stretches the trained context (vLLM's rule); "llama3" and
#: "longrope" configs already state the stretched length in max_position_embeddings.
_STRETCHING = {"yarn", "linear", "dynamic"}


def config_context_length(config: dict) -> Optional[int]:
    """The longest sequence a checkpoint's ``config.json`` allows: its positions, stretched
    by a RoPE scaling such as YaRN (Qwen3's 32k x 4 = 128k). The worker (after loading) and
    the gateway (``/api/show``, from the file) both ask this."""
    text = config.get("text_config") or {}
    for key in ("max_position_embeddings", "max_sequence_length", "max_seq_len",
                "n_positions", "seq_length"):
        v = config.get(key) or text.get(key)
        if isinstance(v, int) and v > 0:
            scaling = config.get("rope_scaling") or text.get("rope_scaling") or {}
            kind = scaling.get("rope_type") or scaling.get("type")
            factor = scaling.get("factor")
            if kind in _STRETCHING and isinstance(factor, (int, float)) and factor > 1:
                base = scaling.get("original_max_position_embeddings") or v
                return max(v, int(base * factor))
            return v
    return None
