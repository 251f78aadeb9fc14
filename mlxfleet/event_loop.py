"""The event loop of every mlxfleet process: uvloop where it is installed, else asyncio's.

The gateway relays every token and the worker frames it; both spend their event loop's
time per chunk, and uvloop's is cheaper (docs/performance.md: for the worker at 128
streams, a lower TTFT and less CPU than on asyncio's loop). Not on Windows, and only from
Python 3.11 (``asyncio.Runner``'s loop factory).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` to its end on a new event loop and return its result."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None or sys.version_info < (3, 11):
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
