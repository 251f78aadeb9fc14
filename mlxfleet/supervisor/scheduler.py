"""Memory-aware load decisions: what to evict so a model fits. Pure; no I/O.

A model's footprint is max(estimate, measured): the estimate is its weights on
disk + its KV cache budget + a per-worker overhead; the measurement is its
worker's resident memory once loaded. Eviction takes idle models first,
least recently used first, never pinned ones, lower priority first; a busy
model (generating or loading) is never evicted: the load waits for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_memory(value: str | int | float, total: int) -> int:
    """``12GB``, ``512MiB``, a byte count, ``70%`` or a fraction ``0.7`` of ``total``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(total * value) if 0 < value <= 1 else int(value)
    s = str(value).strip().lower().replace(" ", "")
    if s.endswith("%"):
        return int(total * float(s[:-1]) / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{value!r} is not a memory size (e.g. 12GB, 512MiB, 70%)")
    n = float(m.group(1))
    if not m.group(2) and 0 < n <= 1:
        return int(total * n)
    return int(n * _UNITS[m.group(2)])


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Candidate:
    """A model as the scheduler sees it."""

    name: str
    footprint: int
    loaded: bool  # holds (or is acquiring) memory: loaded, loading or unloading
    busy: bool = False  # generating, or still loading
    pinned: bool = False
    priority: int = 0
    last_used: float = 0.0


@dataclass
class LoadPlan:
    ok: bool  # fits once ``evict`` are unloaded
    evict: list[str] = field(default_factory=list)
    wait: bool = False  # does not fit now, but would once busy models go idle
    message: str = ""


def plan_load(target: Candidate, others: list[Candidate], budget: int,
              max_loaded: int = 0) -> LoadPlan:
    """Decide how ``target`` can be loaded next to ``others``."""
    loaded = [c for c in others if c.loaded and c.name != target.name]
    used = sum(c.footprint for c in loaded)
    free = budget - used
    need_bytes = target.footprint - free
    need_slots = len(loaded) + 1 - max_loaded if max_loaded > 0 else 0
    if need_bytes <= 0 and need_slots <= 0:
        return LoadPlan(True)
    if target.footprint > budget:
        return LoadPlan(False, message=f"'{target.name}' needs {fmt_bytes(target.footprint)} "
                        f"but the whole memory budget is {fmt_bytes(budget)}")
    idle = sorted((c for c in loaded if not c.busy and not c.pinned),
                  key=lambda c: (c.priority, c.last_used))
    evict: list[str] = []
    for c in idle:
        if need_bytes <= 0 and need_slots <= 0:
            break
        evict.append(c.name)
        need_bytes -= c.footprint
        need_slots -= 1
    if need_bytes <= 0 and need_slots <= 0:
        return LoadPlan(True, evict)
    # Busy models will go idle; pinned ones never leave.
    busy = [c for c in loaded if c.busy and not c.pinned]
    could = need_bytes - sum(c.footprint for c in busy) <= 0 and need_slots - len(busy) <= 0
    holders = ", ".join(
        f"{c.name}: {'pinned' if c.pinned else 'busy' if c.busy else 'idle'} "
        f"({fmt_bytes(c.footprint)})" for c in sorted(loaded, key=lambda c: c.name))
    what = (f"needs {fmt_bytes(target.footprint)}, {fmt_bytes(max(free, 0))} free of "
            f"{fmt_bytes(budget)}")
    if max_loaded > 0 and len(loaded) + 1 > max_loaded:
        what += f"; at most {max_loaded} models may be loaded"
    return LoadPlan(False, wait=could,
                    message=f"'{target.name}' {what}; {holders or 'nothing else is loaded'}")


def expires_at(last_used: Optional[float], keep_alive: float, busy: bool) -> Optional[float]:
    """When an idle model unloads (None: busy, never used, or kept forever)."""
    if busy or last_used is None or keep_alive == float("inf"):
        return None
    return last_used + keep_alive
