"""A model's lifecycle vocabulary: its phases, and the crash backoff. Pure.

The node's scheduler (scheduler.py) is the one that sets phases.
"""

from __future__ import annotations

from enum import Enum


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
