"""Pure decisions of the control plane: no processes, no clocks, no I/O.

The supervisor is level-triggered: each pass compares the desired state (parsed
manifests) with the actual state (worker processes) and acts on the difference,
so a missed event is corrected by the next pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Optional


class Action(str, Enum):
    CREATE = "create"    # desired, no worker yet
    KEEP = "keep"        # running the desired spec: leave the process alone
    REPLACE = "replace"  # spec changed: roll to a new worker, then stop the old
    DELETE = "delete"    # no longer desired: drain and stop


def plan(desired: Mapping[str, str], actual: Mapping[str, Optional[str]]) -> dict[str, Action]:
    """Decide per model name.

    ``desired`` maps name -> worker hash of its manifest; ``actual`` maps name ->
    the worker hash it runs (or is starting), ``None`` when it has no worker.
    """
    out: dict[str, Action] = {}
    for name, want in desired.items():
        have = actual.get(name)
        if have is None:
            out[name] = Action.CREATE
        elif have == want:
            out[name] = Action.KEEP
        else:
            out[name] = Action.REPLACE
    for name in actual:
        if name not in desired:
            out[name] = Action.DELETE
    return out


def backoff_delay(consecutive_failures: int, base: float, cap: float) -> float:
    """Delay before restart number ``consecutive_failures`` (1-based): base * 2^(n-1), capped."""
    if consecutive_failures <= 0:
        return 0.0
    return min(cap, base * (2 ** min(consecutive_failures - 1, 30)))


def failures_after_exit(previous_failures: int, ready_seconds: float,
                        stable_period: float) -> int:
    """Consecutive failures after a crash: a worker that stayed Ready for the stable
    period starts the count afresh."""
    return 1 if ready_seconds >= stable_period else previous_failures + 1
