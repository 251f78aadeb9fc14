"""The prompt cache's lookups and budget, on real mlx_lm KV caches (no model needed)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxfleet.worker.prompt_cache import MIN_REUSE_TOKENS, PromptCache


def kv(tokens: int) -> list[KVCache]:
    c = KVCache()
    x = mx.zeros((1, 2, tokens, 8))
    c.update_and_fetch(x, x)
    return [c]


def test_exact_prefix_and_common_prefix_hits():
    pc = PromptCache(1 << 30)
    conv = list(range(100))
    pc.store(conv, kv(100), room=1 << 30)
    cache, rest, kind = pc.fetch(conv)
    assert kind == "exact" and rest == conv[-1:] and cache[0].offset == 99
    cache, rest, kind = pc.fetch(conv + [500, 501])
    assert kind == "prefix" and rest == [500, 501] and cache[0].offset == 100
    cache, rest, kind = pc.fetch(conv[:60] + [777])
    assert kind == "lcp" and rest == [777] and cache[0].offset == 60
    assert pc.fetch(conv)[0][0].offset == 99  # a hit hands out a copy: the entry is intact
    cache, rest, kind = pc.fetch(conv[:80])  # the prompt is a prefix of a cached sequence
    assert kind == "supersequence" and rest == [79] and cache[0].offset == 79
    assert pc.status()["hits"] == {"exact": 2, "prefix": 1, "supersequence": 1, "lcp": 1}


def test_tiny_reuse_and_strangers_are_misses():
    pc = PromptCache(1 << 30)
    pc.store(list(range(100)), kv(100), room=1 << 30)
    assert pc.fetch(list(range(MIN_REUSE_TOKENS - 1)) + [999])[2] is None
    assert pc.fetch([5000, 5001])[0] is None
    assert pc.status()["misses"] == 2


def test_budget_evicts_least_recently_used_and_prefixes_are_replaced():
    one = 2 * 1 * 2 * 100 * 8 * 4  # keys and values of 100 tokens, exactly (no padding)
    pc = PromptCache(2 * one + one * 3 // 100)  # room for two entries (and 3 tokens more)
    a, b, c = (list(range(s, s + 100)) for s in (0, 1000, 2000))
    pc.store(a, kv(100), room=2 * one)
    pc.store(b, kv(100), room=2 * one)
    pc.fetch(a)  # a is now the most recently used
    pc.store(c, kv(100), room=2 * one)
    assert pc.fetch(b)[2] is None and pc.fetch(a)[2] == "exact"
    assert len(pc) == 2 and pc.nbytes == 2 * one and pc.status()["evictions"] == 1
    pc.store(a + [1, 2, 3], kv(103), room=pc.budget)  # the longer one replaces its prefix
    assert len(pc) == 2 and pc.fetch(a)[2] == "supersequence"


def test_a_stored_cache_does_not_pin_the_batch_buffer_it_came_from():
    import gc

    batch = mx.zeros((16, 2, 1024, 8))  # the running batch's KV buffer (1 MiB)
    mx.eval(batch)
    c = KVCache()
    c.keys, c.values, c.offset = batch[3:4, :, :1024], batch[5:6, :, :100], 100
    base = mx.get_active_memory()
    pc = PromptCache(1 << 30)
    pc.store(list(range(100)), [c], room=1 << 30)
    del batch, c
    gc.collect()
    # What remains is the entry's own 100 tokens, as counted, not the 1 MiB buffer.
    assert mx.get_active_memory() <= base - batch_bytes() + 2 * pc.nbytes
    assert pc.nbytes == 2 * 1 * 2 * 100 * 8 * 4


def batch_bytes() -> int:
    return 16 * 2 * 1024 * 8 * 4
