"""The prompt cache's disk tier: entries that leave memory, kept as safetensors files.

Each entry is one file written with mlx-lm's ``save_prompt_cache``, its token key in
the file's metadata, written to a temporary name and renamed (a crash never leaves half
a file under a real name). At start only the headers are read (the keys); a cache is
loaded when a prompt matches it. The folder is per model and per checkpoint (a hash of
source and revision): a new source wipes the old entries. Bounded by bytes, oldest
first. A file that does not load is deleted and logged, never a crash.

Used on the engine thread only (loading makes MLX arrays).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("mlxfleet.engine")

TOKENS = "0.mlxfleet_tokens"  # where the key sits in the file's metadata (mlx-lm flattens)


def identity(source: str, revision: Optional[str], kv_bits: Optional[int] = None) -> str:
    """The checkpoint's folder name: entries from another checkpoint (or quantized to
    other bits) never load."""
    key = f"{source}\0{revision or ''}" + (f"\0kv{kv_bits}" if kv_bits else "") \
        + "\0scoped"  # keys carry their scope first (entries from before are wiped)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class DiskTier:
    def __init__(self, root: Path, ident: str, budget_bytes: int):
        from ..files import private_dir

        self.dir = root / ident
        self.budget = budget_bytes
        private_dir(root)  # prompts live here: the user's alone, like the logs
        for other in root.iterdir():  # another source's entries: gone
            if other.name != ident:
                shutil.rmtree(other, ignore_errors=True) if other.is_dir() else \
                    other.unlink(missing_ok=True)
        private_dir(self.dir)
        self.files: dict[tuple, Path] = {}  # least recently used first
        self._sizes: dict[tuple, int] = {}
        self.nbytes = 0  # the files' total size, kept as they come and go
        self.reads = self.writes = self.dropped = 0
        for f in sorted(self.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime):
            key = _read_key(f)
            if key is None:
                self._drop(f, "its header does not read")
            else:
                self._add(key, f)
        for tmp in self.dir.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)

    def keys(self) -> list[tuple]:
        return list(self.files)

    def write(self, tokens: tuple, cache: list[Any]) -> list[tuple]:
        """Keep ``cache`` for ``tokens``; returns the keys dropped to stay in budget."""
        from mlx_lm.models.cache import save_prompt_cache

        from .quantized_cache import portable

        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]
        path = self.dir / f"{name}.safetensors"
        tmp = self.dir / f"{name}.tmp.safetensors"
        try:
            save_prompt_cache(str(tmp), portable(cache),
                              {"mlxfleet_tokens": json.dumps(list(tokens))})
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a full disk must not stop the engine
            log.warning("prompt cache: could not write %s: %s", path.name, e)
            tmp.unlink(missing_ok=True)
            return []
        self.writes += 1
        self.remove(tokens, unlink=False)  # rewritten in place: its old size goes
        self._add(tokens, path)
        return self._fit()

    def read(self, tokens: tuple) -> Optional[list[Any]]:
        """The cache stored for ``tokens``, or None (a bad file is dropped)."""
        from mlx_lm.models.cache import load_prompt_cache

        from .quantized_cache import batchable

        path = self.files.get(tokens)
        if path is None:
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            cache = batchable(cache)
            if tuple(json.loads(meta["mlxfleet_tokens"])) != tokens:
                raise ValueError("its key does not match its name")
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, another format
            self.remove(tokens, unlink=False)
            self._drop(path, f"{type(e).__name__}: {e}")
            return None
        self.reads += 1
        path.touch()
        self.files[tokens] = self.files.pop(tokens)  # most recently used last
        return cache

    def remove(self, tokens: tuple, unlink: bool = True) -> None:
        path = self.files.pop(tokens, None)
        if path is not None:
            self.nbytes -= self._sizes.pop(tokens)
            if unlink:
                path.unlink(missing_ok=True)

    def _add(self, tokens: tuple, path: Path) -> None:
        self.files[tokens] = path
        self._sizes[tokens] = _size(path)
        self.nbytes += self._sizes[tokens]

    def _fit(self) -> list[tuple]:
        dropped = []
        while self.files and self.nbytes > self.budget:
            key = next(iter(self.files))
            self.remove(key)
            dropped.append(key)
        return dropped

    def _drop(self, path: Path, why: str) -> None:
        self.dropped += 1
        log.warning("prompt cache: dropping %s: %s", path.name, why)
        path.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {"entries": len(self.files), "bytes": self.nbytes, "budget_bytes": self.budget,
                "reads": self.reads, "writes": self.writes, "dropped": self.dropped}


def _read_key(path: Path) -> Optional[tuple]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            return tuple(json.loads((f.metadata() or {})[TOKENS]))
    except Exception:  # noqa: BLE001 - anything unreadable is dropped by the caller
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
