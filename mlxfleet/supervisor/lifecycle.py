"""A model's lifecycle as pure decisions: its phases, and the next step toward what is wanted.

``ModelRuntime`` (runtime.py) asks ``next_step`` what to do, does it, and asks
again; the decision itself has no clocks, processes or awaits, so it is tested
as a table (tests/test_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class ModelPhase(str, Enum):
    """The only phase vocabulary: what the CLI, the control API and /v1/models show."""

    UNLOADED = "Unloaded"  # no worker; loads on the next request (or preload)
    LOADING = "Loading"  # a first worker is starting
    READY = "Ready"  # a worker serves (a replacement may be starting beside it)
    UNLOADING = "Unloading"  # workers are draining and stopping
    BACKOFF = "CrashLoopBackOff"  # the worker crashed or failed to start; retrying later
    FAILED = "Failed"  # an on-demand load failed; the next request retries after the backoff
    TERMINATING = "Terminating"  # the manifest is gone: stopping for good
    STOPPED = "Stopped"
    UNSCHEDULABLE = "Unschedulable"  # fleets: no allowed node is healthy or big enough
    UNKNOWN = "Unknown"  # fleets: the node that runs it does not answer

    __str__ = str.__str__
    __format__ = str.__format__


class Step(Enum):
    IDLE = "idle"  # nothing to run: wait to be woken (load, spec change, removal)
    UNLOAD = "unload"  # not wanted but workers exist: drain and stop them
    SERVE = "serve"  # the serving worker runs the wanted spec: watch it
    START = "start"  # wanted, nothing serves: start a worker
    REPLACE = "replace"  # a worker serves an older spec: start one beside it, then swap
    BACKOFF = "backoff"  # a start or a worker failed recently: wait before trying again
    SHUTDOWN = "shutdown"  # removed: stop everything and end


@dataclass(frozen=True)
class Desired:
    loaded: bool  # the scheduler wants it in memory
    removed: bool  # its manifest is gone
    spec_hash: str  # the worker hash of the current manifest


@dataclass(frozen=True)
class Observed:
    serving_hash: Optional[str]  # the live serving worker's spec hash; None: none serves
    has_workers: bool  # any worker process exists (serving or starting)
    backoff_left: float = 0.0  # seconds before another start may be tried


def next_step(desired: Desired, observed: Observed) -> Step:
    """What the runtime does next to move ``observed`` toward ``desired``."""
    if desired.removed:
        return Step.SHUTDOWN
    if not desired.loaded:
        return Step.UNLOAD if observed.has_workers else Step.IDLE
    if observed.serving_hash == desired.spec_hash:
        return Step.SERVE
    if observed.backoff_left > 0:
        return Step.BACKOFF
    return Step.START if observed.serving_hash is None else Step.REPLACE


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
