"""The folder-level reconcile decision: which models to create, update, replace, delete.

Pure: no processes, no clocks, no I/O. The supervisor is level-triggered: each
pass compares the desired state (parsed manifests) with the models it runs and
acts on the difference, so a missed event is corrected by the next pass. What
happens to one model's workers afterwards is ``lifecycle.next_step``'s decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Optional


class Action(str, Enum):
    CREATE = "create"    # desired, no worker yet
    KEEP = "keep"        # same worker spec: update in place (aliases, keep-alive...)
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
