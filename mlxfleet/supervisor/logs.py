"""A model's worker log (``<stateDir>/logs/<name>.log``): its tail, and following it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path


def tail_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a file, reading backwards in blocks."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    return [ln.decode(errors="replace") for ln in data.splitlines()[-n:]] if n else []


async def log_lines(path: Path, tail: int, follow: bool) -> AsyncIterator[str]:
    """The last ``tail`` lines, then (``follow``) what is written after, rotation included."""
    yield "".join(ln + "\n" for ln in tail_lines(path, max(tail, 0)))
    pos = path.stat().st_size if path.exists() else 0
    while follow:
        await asyncio.sleep(0.3)
        size = path.stat().st_size if path.exists() else 0
        if size < pos:  # rotated
            pos = 0
        if size > pos:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read(size - pos)
            pos = size
            yield chunk.decode(errors="replace")
