"""When the engine starts waiting requests: gathering bursts and the KV budget. Pure.

The engine thread asks these questions between decode steps; nothing here
touches MLX, clocks or queues, so it is tested without a model
(tests/test_engine_policy.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

KV_BLOCK = 256  # mlx_lm grows a sequence's KV cache in steps of this many tokens


@dataclass(frozen=True)
class AdmissionPolicy:
    """Gathering and admission rules for one engine.

    Gathering: arrivals are spread out by HTTP parsing, tokenizing and the
    gateway hop; prefilling a burst in full batches beats one prompt per
    forward pass (measured on a 50M model with 32 clients: aggregate
    throughput from 0.66x to about 0.9x of the raw loop, docs/performance.md).
    """

    budget: int  # KV bytes: running sequences plus retained prompt caches
    kv_per_token: int  # bytes of K and V one token adds across all layers
    prefill_batch: int  # prompts prefilled in one pass
    #: (bytes per token, window) of layers that keep only the last ``window`` tokens
    kv_windows: tuple[tuple[int, int], ...] = ()
    kv_fixed: int = 0  # bytes of state a sequence holds whatever its length (SSM, conv)
    #: prompt tokens per prefill chunk: a sliding layer holds its window plus one chunk
    prefill_step: int = 0
    batch_wait: float = 0.02  # seconds an idle engine gathers a burst, at most
    batch_gap: float = 0.005  # ...as long as requests arrive closer together than this
    admit_wait: float = 0.05  # while decoding, how long new arrivals may gather
    #: An arrival this soon after the previous one is a burst. Short: an idle engine means
    #: the previous request is done, and a client that sends its next request as soon as
    #: it has the answer (an agent loop) must not wait ``batch_wait`` each time (it did,
    #: at 50 ms: ~18 ms more time to first token per turn on small models).
    burst_window: float = 0.005

    def gathers(self, announced: int, since_previous: float) -> bool:
        """Whether an idle engine should wait for company before starting the request
        that woke it: only when others are on their way (being prepared on the event
        loop) or requests are arriving close together. A lone request, the common case
        of one person typing, starts at once."""
        return announced > 0 or since_previous < self.burst_window

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV bytes one sequence may grow to."""
        longest = -(-(prompt_tokens + max_tokens) // KV_BLOCK) * KV_BLOCK
        return self.kv_fixed + self.kv_per_token * longest + sum(
            per * min(longest, window + self.prefill_step) for per, window in self.kv_windows)

    def gather_timeout(self, pending: int, now: float, deadline: float) -> Optional[float]:
        """After an idle spell: how long to wait for the next arrival, or None to stop
        gathering (a full prefill batch, or ``batch_wait`` spent)."""
        left = deadline - now
        if pending >= self.prefill_batch or left <= 0:
            return None
        return min(left, self.batch_gap)

    @staticmethod
    def gather_on_quiet(announced: int) -> bool:
        """No arrival within ``batch_gap``: keep gathering only while requests are still
        being prepared on the event loop (``announced``)."""
        return announced > 0

    def hold(self, running: int, pending: int, oldest_age: float) -> bool:
        """While decoding, let stragglers of a burst gather so that they are prefilled
        together instead of one forward pass each."""
        return running > 0 and 0 < pending < self.prefill_batch \
            and oldest_age < self.admit_wait

    def prefill_group(self, in_progress: Sequence[int], waiting: Iterable[int]) -> int:
        """How many prompts the next prefill pass holds: those mid-prefill, then as many
        waiting ones (their token counts, queue order) as fit the tokens of
        ``prefill_batch`` full chunks, and never fewer than ``prefill_batch`` prompts.

        Each pass also runs a decode step for the running batch, so a burst of short
        prompts in groups of ``prefill_batch`` paid one (speculative, wide) decode step per
        group for every group behind it; packed by tokens, no pass reads more prompt
        tokens than a full group of chunks did (docs/performance.md, "A burst of 128").
        """
        step = self.prefill_step
        if not step:
            return self.prefill_batch
        budget = self.prefill_batch * step
        n, tokens = len(in_progress), sum(min(t, step) for t in in_progress)
        for t in waiting:
            t = min(t, step)
            if n >= self.prefill_batch and tokens + t > budget:
                break
            n, tokens = n + 1, tokens + t
        return max(n, self.prefill_batch)

    @staticmethod
    def first_tokens_first(groups_behind: int, decode_s: float, prefill_s: float) -> bool:
        """Whether the step after a group of prompts finished prefilling decodes alone
        (handing that group its first tokens before the next prefill pass) or also
        prefills the next group. Alone, the group's first tokens come one prefill pass
        (``prefill_s``) sooner, and every group still waiting pays one more decode step
        (``decode_s``) before its own: worth it while the waiting groups' cost is less.
        (Always alone, 256 streams of a tiny model spent a third of the burst in decode
        steps between prefills; never, 32 streams of a 50M one got their first tokens a
        whole prefill, 4 s, later.) Before a prefill is measured (``inf``): alone."""
        return groups_behind * decode_s <= prefill_s

    def admit(self, running: int, reserved: int, needs: Sequence[int]) -> int:
        """How many of the waiting requests (their KV ``needs``, head first) start now.

        They start while their KV fits the budget; with nothing running, the head
        always starts, so one oversized request cannot wedge the worker.
        """
        n = 0
        for need in needs:
            if (running or n) and reserved + need > self.budget:
                break
            reserved += need
            n += 1
        return n
