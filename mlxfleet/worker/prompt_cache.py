"""Prefix reuse across requests, within the worker's KV memory budget.

An LRU of retained KV caches keyed by token prefix, on mlx_lm's ``PromptTrie``
and its cache trimming helpers. It is written here rather than used as
mlx_lm's ``LRUPromptCache`` because serving needs to look before it copies: a
lookup that classifies the hit (exact, prefix, longest common prefix) without
deep-copying a cache, so that tiny reuses are skipped, and only public API
(``LRUPromptCache`` keeps its trie private). Same semantics otherwise: an exact
hit, a stored prefix, or a longer entry trimmed back to the common prefix.

Every entry belongs to a **scope** (a trie root of its own): with API keys configured,
the gateway scopes each key's prompts apart (and a request's ``cache_salt`` further), so
one key can never learn another's prompt from how many of its tokens came from cache.
The public scope ``""`` (requests when no key is configured, and the operator's warm
prompts) is read by every scope. Keys of the LRU and the disk tier are
``(scope, *tokens)``.
Used only on the engine thread (the caches are MLX arrays).
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field
from typing import Any, Optional

Key = tuple  # (scope, *tokens)
#: Reusing a few shared tokens (a chat template's preamble) costs more than it saves:
#: the cache is copied, trimmed and merged into the batch. Below this, prefill afresh.
MIN_REUSE_TOKENS = 32


@dataclass
class CacheStats:
    hits: dict[str, int] = field(default_factory=lambda: {
        "exact": 0, "prefix": 0, "supersequence": 0, "lcp": 0})
    misses: int = 0
    cached_tokens_total: int = 0
    evictions: int = 0
    disk_hits: int = 0  # hits served by reading an entry back from disk


@dataclass
class _Entry:
    cache: list[Any]
    nbytes: int


def compact(c: Any) -> Any:
    """A finished sequence's KV cache, copied out of the batch's buffers. What the batch
    hands back are views: kept as they are, each would pin the whole batch's (much
    larger) buffer in memory while counting only its own bytes."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    if type(c) is not KVCache or c.keys is None:  # rotating, quantized...: as they come
        return c
    keys, values, offset = c.keys, c.values, c.offset
    c.keys = mx.contiguous(keys[..., :offset, :] + 0)  # + 0: a copy even of a whole block
    c.values = mx.contiguous(values[..., :offset, :] + 0)
    mx.eval(c.keys, c.values)
    return c


#: The trie's value for an entry that is only on disk (see ``DiskTier``).
ON_DISK = _Entry([], 0)


def _trie() -> Any:
    """mlx_lm's ``PromptTrie``, whose search for a stored prompt that extends a new one is
    bounded: mlx_lm walks the whole subtree below the point where the new prompt leaves the
    trie, to find the shortest extension. Every stored prompt shares the chat template's
    opening, so that was every token of every entry, on each lookup, on the engine thread:
    throughput at 32 streams fell from 3.6k to 1.5k tok/s as 700 entries piled up. Any
    extension reuses the same common prefix; the first found going down costs only its
    own length (and is the most recently stored of its branch, children in dict order)."""
    from mlx_lm.models.cache import PromptTrie, PromptTrieResult

    class BoundedTrie(PromptTrie):
        def search(self, model: Any, tokens: list[int]) -> Any:
            if model not in self._trie:
                return PromptTrieResult(model, None, None, None, 0)
            current = self._trie[model]
            if not tokens and "__value__" in current:
                return PromptTrieResult(model, [], None, None, 0)
            last, index = -1, 0
            while index < len(tokens) and tokens[index] in current:
                current = current[tokens[index]]
                if "__value__" in current:
                    last = index
                index += 1
            if last == len(tokens) - 1 >= 0:
                return PromptTrieResult(model, tokens, None, None, 0)
            shorter = tokens[:last + 1] if last > 0 else None
            longer = None
            if index > 0:
                extra: list[int] = []
                while "__value__" not in current and current:
                    tok = next(reversed(current))  # the newest branch
                    extra.append(tok)
                    current = current[tok]
                longer = tokens[:index] + extra if "__value__" in current else None
            return PromptTrieResult(model, None, shorter, longer, index)

    return BoundedTrie()


class PromptCache:
    """Retained KV caches keyed by token prefix, kept under ``budget_bytes``; with a
    ``disk`` tier, entries leaving memory go to disk and come back on a hit."""

    def __init__(self, budget_bytes: int, disk: Any = None):
        self.budget = budget_bytes
        self._trie = _trie()
        self._lru: collections.OrderedDict[Key, _Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()
        self.disk = disk
        for key in disk.keys() if disk else []:
            if key and isinstance(key[0], str):
                self._trie.add(key[0], list(key[1:]), ON_DISK)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: list[int], scope: str = ""
              ) -> tuple[Optional[list[Any]], list[int], Optional[str]]:
        """(cache or None, tokens still to prefill, hit kind or None), from ``scope``'s
        entries only.

        The rest is never empty: the model must see at least the last prompt
        token to produce logits, so an exact hit is trimmed back by one token.
        """
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        found = [(c, scope) for c in self._candidates(tokens, scope)]
        if scope:  # the public scope's too (warm prompts), the longest reuse first
            found = sorted(found + [(c, "") for c in self._candidates(tokens, "")],
                           key=lambda f: -f[0][2])
        for (kind, key, keep), where in found:
            trim = len(key) - keep
            if keep == len(tokens):  # exact: leave the last token to prefill
                trim, keep = trim + 1, keep - 1
            if keep < MIN_REUSE_TOKENS:
                continue
            k = (where, *key)
            entry = self._lru.get(k) or self._from_disk(k)
            # A cache that cannot be cut back (recurrent state, a sliding window past its
            # size) serves only a prompt it is a prefix of: try the next candidate.
            if entry is None or (trim and not can_trim_prompt_cache(entry.cache)):
                continue
            self._lru.move_to_end(k)
            cache = copy.deepcopy(entry.cache)
            if trim:
                trim_prompt_cache(cache, trim)
            self.stats.hits[kind] += 1
            self.stats.cached_tokens_total += keep
            return cache, tokens[keep:], kind
        self.stats.misses += 1
        return None, tokens, None

    def _candidates(self, tokens: list[int], scope: str) -> list[tuple[str, list[int], int]]:
        """Stored entries that could serve ``tokens``, best first: (kind, key, tokens of
        the prompt it covers)."""
        found = self._trie.search(scope, tokens)
        if found.exact is not None:  # else the longest stored prefix of all but the last
            below = self._trie.search(scope, tokens[:-1]) if len(tokens) > 1 else None
            prefix = below and (below.exact or below.shorter)
            return [("exact", found.exact, len(tokens))] + (
                [("prefix", prefix, len(prefix))] if prefix else [])
        out = []
        short = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > short:
            # A cached sequence that extends the whole prompt (a regenerate, a retry) is a
            # supersequence; one that shares only a prefix with it, a longest common prefix.
            kind = "supersequence" if found.common_prefix >= len(tokens) else "lcp"
            out.append((kind, found.longer, min(len(tokens) - 1, found.common_prefix)))
        if short:
            out.append(("prefix", found.shorter, short))
        return out

    def store(self, tokens: list[int], cache: list[Any], room: int, scope: str = "") -> None:
        """Keep ``cache`` for ``tokens`` in ``scope``, then fit the whole cache into
        ``room`` bytes."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if not tokens or room <= 0:
            return
        key = (scope, *tokens)
        cache = [compact(c) for c in cache]
        entry = _Entry(cache, sum(c.nbytes for c in cache))
        old = self._trie.add(scope, list(tokens), entry)
        if old is not None:
            self.nbytes -= old.nbytes
            self._lru.pop(key, None)
        self._lru[key] = entry
        self.nbytes += entry.nbytes
        if can_trim_prompt_cache(cache):  # stored prefixes are now redundant
            for n, prefix in self._trie.pop_prefixes(scope, list(tokens)):
                self.nbytes -= prefix.nbytes
                self._lru.pop(key[:n + 1], None)
                if prefix is ON_DISK:
                    self.disk.remove(key[:n + 1])
        self.trim(room)

    def trim(self, room: int) -> None:
        """Drop least recently used entries until the cache fits in ``room`` bytes (to
        the disk tier, when there is one)."""
        room = max(0, min(room, self.budget))
        while self._lru and self.nbytes > room:
            key, entry = self._lru.popitem(last=False)
            self.nbytes -= entry.nbytes
            self.stats.evictions += 1
            if self.disk is None:
                self._trie.pop(key[0], list(key[1:]))
                continue
            self._trie.add(key[0], list(key[1:]), ON_DISK)
            self._forget(self.disk.write(key, entry.cache))

    def flush(self) -> None:
        """Write every entry in memory to the disk tier (the worker is stopping)."""
        if self.disk is not None:
            self.trim(0)

    def _from_disk(self, key: Key) -> Optional[_Entry]:
        """A disk entry read back into memory (None if it is not there or does not load)."""
        if self.disk is None or key not in self.disk.files:
            return None
        cache = self.disk.read(key)
        if cache is None:
            self._forget([key])
            return None
        entry = _Entry(cache, sum(c.nbytes for c in cache))
        self._trie.add(key[0], list(key[1:]), entry)
        self._lru[key] = entry
        self.nbytes += entry.nbytes
        self.stats.disk_hits += 1
        return entry

    def _forget(self, keys: list[Key]) -> None:
        for key in keys:
            try:
                if self._trie.get(key[0], list(key[1:])) is ON_DISK:
                    self._trie.pop(key[0], list(key[1:]))
            except KeyError:
                pass

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"entries": len(self), "bytes": self.nbytes, "budget_bytes": self.budget,
                "hits": dict(s.hits), "misses": s.misses,
                "cached_tokens_total": s.cached_tokens_total, "evictions": s.evictions,
                "disk_hits": s.disk_hits,
                "disk": self.disk.status() if self.disk is not None else None}
