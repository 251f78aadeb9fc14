"""What the engine hands back: a generation's handle, its token events, and counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from .sampling import SamplingParams


class EngineState(str, Enum):
    """A model engine's life (generation or embeddings): pending -> loading -> ready |
    failed; stopped. What ``/health`` and ``/v1/status`` say as ``state``."""

    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:  # (a str-mixin enum prints its name before Python 3.11)
        return self.value


@dataclass
class TokenEvent:
    """One generated token of one sequence (``index`` = choice index), with the text it
    made visible and, on the last token, why the sequence ended."""

    index: int
    token: int
    text: str
    finish_reason: Optional[str]
    stop_sequence: Optional[str] = None
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None


@dataclass
class EngineError:
    """Delivered instead of tokens when the engine could not run a request: 503 when
    the engine failed, 400 when the model refused this input (``Rejected``)."""

    message: str
    status: int = 503


class Rejected(ValueError):
    """The model cannot take this input (e.g. more images than its architecture reads)."""


class Generation:
    """A handle on one request's sequences; tokens arrive on ``events``."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, n: int):
        self.prompts = prompts
        self.params = params
        self.n = n
        self.events: asyncio.Queue = asyncio.Queue()
        self.uids: list[int] = []
        self.submitted_at = time.monotonic()
        self.cancelled = False
        self.cached_tokens = 0  # prompt tokens served from the prompt cache
        self.cache_hit: Optional[str] = None
        # Written by the engine thread, read by /v1/status: queued -> prefill -> generation.
        self.phase = "queued"
        self.started_at: Optional[float] = None
        self.first_token_at: Optional[float] = None
        self.generated = 0
        self.vision: Optional[Any] = None  # an images.VisionPrompt (set by Engine.submit)
        self.cache_scope = ""  # whose prompt cache it uses (set by Engine.submit)
        #: set once the engine has looked its prompt up in the cache (``cached_tokens`` is
        #: known) or it ended: what Anthropic's ``message_start`` usage waits for
        self.admitted = asyncio.Event()

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class EngineStats:
    steps: int = 0
    running: int = 0
    waiting: int = 0
    peak_running: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cancelled_total: int = 0
    ttft_p50_s: float = 0.0  # median time to first token over the last minute
