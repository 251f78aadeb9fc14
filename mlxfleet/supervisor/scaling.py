"""How many copies a model with ``replicas: {min, max}`` runs: scaled by load.

One node decides (the first by name among those that answer each other: any could, one
does, so decisions never race), and its report carries the counts to the others, whose
placement then adds or removes a copy as for any change. Pure: the decision is a
function of what the copies report and the time.

- Up: while requests wait longer than the target for their first token (the median of
  the last minute on some copy, ``targetWait``, 2 s by default: a busy copy queues them
  behind its batch), three checks running, one more copy, up to ``max``.
- Down: once every copy has been idle (nothing in flight or waiting) for the model's
  keep-alive, one copy fewer, down to ``min`` (at least one stays placed: ``min: 0``
  means that one loads on demand and unloads after its keep-alive, as any model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HOT_CHECKS = 3  # checks in a row past the target before a copy is added
DEFAULT_TARGET = 2.0  # seconds


@dataclass
class ScaleState:
    """What one model's scaling remembers between checks."""

    hot: int = 0  # checks in a row above the target
    idle_since: Optional[float] = None


def decide(current: int, bounds: tuple[int, int], waits: list[float], busy: bool,
           target: float, keep_alive: float, state: ScaleState, now: float
           ) -> tuple[int, Optional[str]]:
    """The new number of copies, and why it changed (None: it did not)."""
    low, high = max(1, bounds[0]), bounds[1]
    worst = max(waits, default=0.0)
    if busy and worst > target:
        state.hot, state.idle_since = state.hot + 1, None
        if state.hot >= HOT_CHECKS and current < high:
            state.hot = 0
            return current + 1, (f"scaled up to {current + 1} replicas: requests waited "
                                 f"{worst:.1f}s for their first token (target {target:g}s)")
        return current, None
    state.hot = 0
    if busy:
        state.idle_since = None
        return current, None
    if state.idle_since is None:
        state.idle_since = now
    if current > low and now - state.idle_since >= keep_alive:
        state.idle_since = now
        return current - 1, (f"scaled down to {current - 1} replica"
                             f"{'s' if current > 2 else ''}: idle for {keep_alive:g}s")
    return current, None
