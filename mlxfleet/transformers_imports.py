"""transformers' import structure, kept on disk between processes.

``import transformers`` (which mlx-lm's loader does) walks every model folder it ships,
about 450 of them, reading each module's source for its exports
(``define_import_structure``): 0.8 s of the 1.3 s the import takes, measured on this
project's CI machine, on every worker start and so on every model loaded on demand.
What it finds changes only when transformers does, so the first process writes it
down and the next ones read it back (a few milliseconds).

The result is keyed by the folder walked and a fingerprint of the installation: the
names and modification times of the folder's entries and of the files that do the
walking. (transformers' top-level ``models`` folder is walked twice, from the package
and from ``models/__init__.py``; a model's own small folder once, when it is used.)
Installing another transformers version rewrites those folders (new entries), so its
fingerprint differs and the walk runs again. The cache is JSON in the user's cache
directory (0600 files in a 0700 folder). It holds names only, never code: a damaged
file is walked past and written again, and one forged by someone who can write the
user's cache could at worst hide or misname transformers' own modules.

``install()`` must run before transformers is first imported; it hooks the import of
``transformers.utils.import_utils`` to wrap the function as it is defined. Where
anything goes wrong, transformers' own walk runs, as if this module did not exist.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

MODULE = "transformers.utils.import_utils"


def cache_dir() -> Path:
    from .builtin import builtin_cache_dir

    return builtin_cache_dir().parent / "transformers-imports"


def fingerprint(folder: Path, walker: Path) -> str:
    """What changes when the installation at ``folder`` does."""
    h = hashlib.sha256(f"{folder}\n{sys.version}\n".encode())
    for p in (walker, folder.parent / "__init__.py", folder / "__init__.py"):
        with contextlib.suppress(OSError):  # (a file it lacks: left out)
            h.update(f"{p}:{p.stat().st_mtime_ns}\n".encode())
    with os.scandir(folder) as entries:
        for e in sorted(entries, key=lambda e: e.name):
            h.update(f"{e.name}:{e.stat(follow_symlinks=False).st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _encode(structure: dict) -> list:
    return [[sorted(backends), {m: sorted(names) for m, names in modules.items()}]
            for backends, modules in structure.items()]


def _decode(data: list) -> dict:
    return {frozenset(backends): {m: set(names) for m, names in modules.items()}
            for backends, modules in data}


def cached(define: Callable[..., dict], walker: Path,
           where: Optional[Path] = None) -> Callable[..., dict]:
    """``define`` (transformers' ``define_import_structure``), reading and writing its
    answers under ``where`` (default: ``cache_dir()``)."""

    @functools.lru_cache  # (as transformers' own: the caller mutates what it gets)
    def define_import_structure(module_path: Any, prefix: Optional[str] = None) -> dict:
        try:  # (given a file, transformers walks the folder it is in)
            folder = Path(module_path)
            name = "" if folder.is_dir() else folder.name
            folder = folder if not name else folder.parent
            d = where or cache_dir()
            path = d / f"{fingerprint(folder, walker)}-{name}-{prefix or ''}.json"
            try:
                return _decode(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # not written yet, or unreadable: walk, and write it (again)
            structure = define(module_path, prefix)
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(_encode(structure), f)
            os.replace(tmp, path)
            return structure  # (the walk's own: the caller may mutate it, as it does)
        except Exception:  # noqa: BLE001 - a cache must never stop transformers loading
            log.debug("transformers' import-structure cache failed", exc_info=True)
            return define(module_path, prefix)

    return define_import_structure


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps ``define_import_structure`` when ``transformers.utils.import_utils`` runs,
    before ``transformers/__init__.py`` imports it by name."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.origin is None:
            return spec
        run = spec.loader.exec_module
        walker = Path(spec.origin)

        def exec_module(module: Any) -> None:
            run(module)
            define = getattr(module, "define_import_structure", None)
            if define is not None:
                module.define_import_structure = cached(getattr(define, "__wrapped__", define),
                                                        walker)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Cache transformers' import structure in this process (no-op once transformers
    is imported, or when MLXFLEET_TRANSFORMERS_IMPORT_CACHE=0)."""
    if MODULE in sys.modules or os.environ.get("MLXFLEET_TRANSFORMERS_IMPORT_CACHE") == "0":
        return
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
