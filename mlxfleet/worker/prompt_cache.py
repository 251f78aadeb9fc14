"""Prefix reuse across requests, within the worker's KV memory budget.

A thin layer over mlx_lm's ``LRUPromptCache`` (trie lookup, LRU eviction,
trimming) that adds what serving needs: hit kinds for status, the exact-hit
pitfall handled, and a byte budget shared with the KV of running sequences.
Used only on the engine thread (the caches are MLX arrays).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

_KEY = "model"  # one model per worker: a single trie root
#: Reusing a few shared tokens (a chat template's preamble) costs more than it saves:
#: the cache is copied, trimmed and merged into the batch. Below this, prefill afresh.
MIN_REUSE_TOKENS = 32


@dataclass
class CacheStats:
    hits: dict[str, int] = field(default_factory=lambda: {"exact": 0, "prefix": 0, "lcp": 0})
    misses: int = 0
    cached_tokens_total: int = 0
    evictions: int = 0


class PromptCache:
    """Retained KV caches keyed by token prefix, kept under ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        from mlx_lm.models.cache import LRUPromptCache

        self.budget = budget_bytes
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=budget_bytes)
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: list[int]) -> tuple[Optional[list[Any]], list[int], Optional[str]]:
        """(cache or None, tokens still to prefill, hit kind or None).

        The rest is never empty: the model must see at least the last prompt
        token to produce logits, so an exact hit is trimmed back by one token.
        """
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        found = self._lru._trie.search(_KEY, tokens)  # classify the hit for status
        reusable = len(tokens) if found.exact is not None else max(
            found.common_prefix if found.longer is not None else 0, len(found.shorter or []))
        if reusable < MIN_REUSE_TOKENS:
            self.stats.misses += 1
            return None, tokens, None
        cache, rest = self._lru.fetch_nearest_cache(_KEY, tokens)
        if cache is None:
            self.stats.misses += 1
            return None, tokens, None
        if not rest:
            if not can_trim_prompt_cache(cache):
                self.stats.misses += 1
                return None, tokens, None
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        if found.exact is not None:
            kind = "exact"
        elif found.longer is not None and len(tokens) - len(rest) > len(found.shorter or []):
            kind = "lcp"
        else:
            kind = "prefix"
        self.stats.hits[kind] += 1
        self.stats.cached_tokens_total += len(tokens) - len(rest)
        return cache, rest, kind

    def store(self, tokens: list[int], cache: list[Any], room: int) -> None:
        """Keep ``cache`` for ``tokens``, then fit the whole cache into ``room`` bytes."""
        if not tokens or room <= 0:
            return
        self._lru.insert_cache(_KEY, list(tokens), cache)
        self.trim(room)

    def trim(self, room: int) -> None:
        """Drop least recently used entries until the cache fits in ``room`` bytes."""
        before = len(self._lru)
        self._lru.trim_to(n_bytes=max(0, min(room, self.budget)))
        self.stats.evictions += before - len(self._lru)

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"entries": len(self), "bytes": self.nbytes, "budget_bytes": self.budget,
                "hits": dict(s.hits), "misses": s.misses,
                "cached_tokens_total": s.cached_tokens_total, "evictions": s.evictions}
