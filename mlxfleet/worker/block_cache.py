"""The block ("paged") prefix cache: vllm-mlx's ``--use-paged-cache`` on MLX.

KV is kept in blocks of ``BLOCK_TOKENS`` tokens, each keyed by a hash of the whole prefix
up to its end (the hash of its parent block and its own tokens), so every prompt that
starts with the same tokens shares the same blocks: a long system prompt is stored once,
not once per conversation as in the whole-prompt LRU (``prompt_cache.py``). A hit
concatenates the matched blocks into fresh KV caches for the batch (MLX arrays are
immutable, so a block in use by a running sequence is never changed under it and needs
no pinning); blocks are evicted least recently used, leaves first (a block whose
children are still cached is what makes them reachable). Only models whose layers all
use plain ``KVCache`` can be cut into blocks; others keep the whole-prompt LRU.
Used only on the engine thread.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

from .prompt_cache import MIN_REUSE_TOKENS, CacheStats

BLOCK_TOKENS = 64


@dataclass
class _Block:
    parent: Optional[bytes]
    tokens: tuple[int, ...]
    layers: list[tuple[Any, Any]]  # per layer: keys, values for this block's tokens
    nbytes: int
    children: set[bytes] = field(default_factory=set)


def _chain(tokens: list[int], n_blocks: int, scope: str = "") -> list[bytes]:
    """The hash of each block's whole prefix, within ``scope`` (prompts of another scope
    never share a block: see ``prompt_cache``)."""
    out, h = [], scope.encode()
    for i in range(n_blocks):
        piece = tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, piece)).encode(),
                            digest_size=16).digest()
        out.append(h)
    return out


def blockable(cache: list[Any]) -> bool:
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(c) is KVCache and c.keys is not None for c in cache)


class BlockCache:
    """Prefix-shared KV blocks under ``budget_bytes`` (the ``PromptCache`` interface)."""

    kind = "paged"

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def fetch(self, tokens: list[int], scope: str = ""
              ) -> tuple[Optional[list[Any]], list[int], Optional[str]]:
        """(cache or None, tokens still to prefill, hit kind or None), as PromptCache."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        usable = (len(tokens) - 1) // BLOCK_TOKENS  # leave at least one token to prefill
        matched, chain = 0, []
        for where in (scope, "") if scope else ("",):  # the public scope is everyone's
            chain = _chain(tokens, usable, where)
            matched = 0
            for h in chain:
                if h not in self._blocks:
                    break
                matched += 1
            if matched:
                break
        keep = matched * BLOCK_TOKENS
        if keep < MIN_REUSE_TOKENS:
            self.stats.misses += 1
            return None, tokens, None
        for h in chain[:matched]:
            self._blocks.move_to_end(h)
        blocks = [self._blocks[h] for h in chain[:matched]]
        cache = []
        for layer in range(len(blocks[0].layers)):
            c = KVCache()
            c.keys = mx.concatenate([b.layers[layer][0] for b in blocks], axis=2)
            c.values = mx.concatenate([b.layers[layer][1] for b in blocks], axis=2)
            c.offset = keep
            cache.append(c)
        rest = tokens[keep:]
        kind = self._kind(blocks[-1], rest)
        self.stats.hits[kind] += 1
        self.stats.cached_tokens_total += keep
        return cache, tokens[keep:], kind

    def _kind(self, last: _Block, rest: list[int]) -> str:
        """How the prompt relates to what is cached: all of it (but the last token), a
        prefix of it, a prompt a cached sequence extends, or a shared start only."""
        if len(rest) <= 1:
            return "exact"
        nxt = [self._blocks[c].tokens for c in last.children if c in self._blocks]
        if any(t[:len(rest)] == tuple(rest) for t in nxt):
            return "supersequence"
        if any(t[0] == rest[0] for t in nxt):
            return "lcp"
        return "prefix"

    def store(self, tokens: list[int], cache: list[Any], room: int, scope: str = "") -> None:
        """Keep ``cache``'s full blocks (the ones not already kept), then fit ``room``."""
        import mlx.core as mx

        if not tokens or room <= 0 or not blockable(cache):
            return
        n = min(len(tokens), cache[0].offset) // BLOCK_TOKENS
        parent = None
        for i, h in enumerate(_chain(tokens, n, scope)):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                lo, hi = i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS
                # Copies (+ 0): a slice would pin the whole batch buffer it came from.
                layers = [(mx.contiguous(c.keys[..., lo:hi, :] + 0),
                           mx.contiguous(c.values[..., lo:hi, :] + 0)) for c in cache]
                mx.eval(*[a for kv in layers for a in kv])
                size = sum(k.nbytes + v.nbytes for k, v in layers)
                self._blocks[h] = _Block(parent, tuple(tokens[lo:hi]), layers, size)
                self.nbytes += size
                if parent is not None:
                    self._blocks[parent].children.add(h)
            parent = h
        self.trim(room)

    def trim(self, room: int) -> None:
        """Drop least recently used leaf blocks until the cache fits in ``room`` bytes."""
        room = max(0, min(room, self.budget))
        while self._blocks and self.nbytes > room:
            leaf = next((h for h, b in self._blocks.items() if not b.children), None)
            if leaf is None:
                break
            b = self._blocks.pop(leaf)
            self.nbytes -= b.nbytes
            if b.parent is not None and b.parent in self._blocks:
                self._blocks[b.parent].children.discard(leaf)
            self.stats.evictions += 1

    def flush(self) -> None:
        """Nothing to keep: the block cache has no disk tier (``PromptCache.flush``)."""

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"type": "paged", "block_tokens": BLOCK_TOKENS, "entries": len(self),
                "bytes": self.nbytes, "budget_bytes": self.budget, "hits": dict(s.hits),
                "misses": s.misses, "cached_tokens_total": s.cached_tokens_total,
                "evictions": s.evictions}
