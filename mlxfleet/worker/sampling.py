"""Per-sequence generation settings, and the MLX samplers and logits processors they make.

The objects are built on the engine thread (they hold MLX arrays); the
parameters are plain values made on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .grammar import Grammar


@dataclass
class SamplingParams:
    """Per-sequence generation settings, built into MLX objects on the engine thread."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    logprobs: Optional[int] = None  # None: off; k: the sampled token plus top k
    ignore_eos: bool = False
    grammar: Optional[Grammar] = None  # the compiled grammar the output must follow
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the engine thread
    skip_special_tokens: bool = True  # hide special tokens from the text (vLLM's default)
    keep_leading_space: bool = False  # a completion's text is exactly its tokens' text
    asked_max_tokens: Optional[int] = None  # what the client asked, when it was lowered
    prediction: Optional[list[int]] = None  # the client's expected output, as draft tokens

    def sampler_key(self) -> tuple:
        return (self.temperature, self.top_p, self.min_p, self.top_k)


class Samplers:
    """Samplers shared by parameter value, so the batch samples in one call."""

    def __init__(self) -> None:
        self._shared: dict[tuple, Any] = {}

    def get(self, p: SamplingParams, index: int):
        if p.temperature == 0:
            return None  # the batch's greedy fallback
        if p.seed is not None:
            return SeededSampler(p, p.seed + index)
        key = p.sampler_key()
        s = self._shared.get(key)
        if s is None:
            s = self._shared[key] = SharedSampler(p)
        return s


def _filters(p: SamplingParams) -> list:
    """mlx-lm's ``make_sampler`` filters, in its order (top-p, min-p, top-k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    out = []
    if 0 < p.top_p < 1:
        out.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p:
        out.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        out.append(lambda x: apply_top_k(x, p.top_k))
    return out


class SharedSampler:
    """mlx-lm's sampler for these settings, and the distribution it draws from
    (``probs``: what speculative decoding accepts drafts against)."""

    def __init__(self, p: SamplingParams):
        from mlx_lm.sample_utils import make_sampler

        self._sample = make_sampler(p.temperature, top_p=p.top_p, min_p=p.min_p,
                                    top_k=p.top_k)
        self._filters = _filters(p)
        self._temp = p.temperature

    def __call__(self, logprobs):
        return self._sample(logprobs)

    def probs(self, logits):
        """The distribution the sampler draws from, for raw ``logits`` (or log-probs). They
        are normalized only for the filters, which read probabilities: a softmax needs no
        normalized input, and on a CPU each pass over a 152k vocabulary at every draft
        position costs more than the rest of a verify step (MLX's ``exp`` is scalar on
        x86)."""
        import mlx.core as mx

        if self._filters:
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            for f in self._filters:
                logits = f(logits)
        return mx.softmax(logits * (1 / self._temp), axis=-1)


def logits_processors(p: SamplingParams, tokenizer: Any, vocab_size: int) -> list:
    """One list per sequence: a grammar processor holds that sequence's parse state."""
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.grammar:
        from .grammar import GrammarProcessor

        budget = p.max_tokens if p.grammar.closes else None  # the closer knows JSON only
        procs.append(GrammarProcessor(p.grammar, tokenizer, vocab_size, budget))
    return procs


class SeededSampler:
    """A sampler with its own PRNG key, so ``seed`` is reproducible inside a batch.

    mlx_lm's ``make_sampler`` draws from the global PRNG, which every sequence
    in the batch shares; a seeded request needs a private key stream.
    """

    def __init__(self, p: SamplingParams, seed: int):
        import mlx.core as mx

        self._mx = mx
        self._key = mx.random.key(seed % (1 << 32))  # any int64 seed; MLX keys are 32-bit
        self._temp = p.temperature
        self._filters = _filters(p)

    def __call__(self, logprobs):
        mx = self._mx
        self._key, sub = mx.random.split(self._key)
        for f in self._filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1 / self._temp), key=sub)
