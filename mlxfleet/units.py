"""Durations, memory sizes and times: parsing and formatting, in one place.

Used by the manifest schema, the server settings, the scheduler and the CLI.
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone
from typing import Any, Optional

_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_BYTES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


#: The longest finite duration accepted (ten years); longer is a mistake, use -1 / forever.
MAX_DURATION = 10 * 365 * 86400.0


def parse_duration(v: Any) -> float:
    """``30s``, ``5m``, ``1h30m``, a number of seconds, ``0``; ``-1``/``forever`` = infinity.
    NaN, infinities and anything over ten years are errors."""
    if isinstance(v, bool):
        raise ValueError("expected a duration such as 30s, 5m, 1h, 0 or -1")
    if isinstance(v, (int, float)):
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"{v!r} is not a duration (use -1 or forever for no limit)")
        if v > MAX_DURATION:
            raise ValueError(f"{v!r} seconds is longer than ten years (use -1 or forever)")
        return math.inf if v < 0 else float(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("-1", "forever", "inf", "infinite", "never"):
            return math.inf
        try:
            number = float(s)
        except ValueError:
            number = None
        if number is not None:
            return parse_duration(number)
        parts = _DURATION_RE.findall(s)
        if parts and "".join(n + u for n, u in parts) == s:
            return parse_duration(sum(float(n) * _SECONDS[u] for n, u in parts))
    raise ValueError(f"{v!r} is not a duration (use e.g. 30s, 5m, 1h30m, 0, -1 or forever)")


def parse_memory(value: str | int | float, total: int) -> int:
    """``12GB``, ``512MiB``, a byte count, ``70%`` or a fraction ``0.7`` of ``total``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(total * value) if 0 < value <= 1 else int(value)
    s = str(value).strip().lower().replace(" ", "")
    if s.endswith("%"):
        return int(total * float(s[:-1]) / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
    if not m or m.group(2) not in _BYTES:
        raise ValueError(f"{value!r} is not a memory size (e.g. 12GB, 512MiB, 70%)")
    n = float(m.group(1))
    if not m.group(2) and 0 < n <= 1:
        return int(total * n)
    return int(n * _BYTES[m.group(2)])


def fmt_bytes(n: Optional[int]) -> str:
    """``1.5 GB``; ``-`` for unknown."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_age(seconds: float) -> str:
    """kubectl's AGE column: ``45s``, ``3m``, ``2h``, ``5d``."""
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def iso(t: Optional[float] = None) -> str:
    """A UTC timestamp as ``2026-01-31T12:00:00Z`` (now when ``t`` is None)."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc) \
        .strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_opt(t: Optional[float]) -> Optional[str]:
    return None if t is None else iso(t)
