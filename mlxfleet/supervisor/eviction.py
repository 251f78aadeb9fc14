"""What to evict so a model fits the memory budget. Pure; no I/O (the scheduler asks).

A model's footprint is max(estimate, measured): the estimate is its weights on
disk + its KV cache budget + a per-worker overhead; the measurement is its
worker's resident memory once loaded. Eviction takes idle models first,
least recently used first, never pinned ones, lower priority first; a busy
model (generating or loading) is never evicted: the load waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..units import fmt_bytes


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
