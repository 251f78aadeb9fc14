"""The prompt cache's lookups and budget, on real mlx_lm KV caches (no model needed)."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from served import wait_for

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


# ---- the block ("paged") cache -----------------------------------------------------

def test_blocks_share_a_common_system_prompt_across_conversations():
    from mlxfleet.worker.block_cache import BLOCK_TOKENS, BlockCache

    system = list(range(4 * BLOCK_TOKENS))  # 256 tokens every conversation starts with
    convs = [system + list(range(1000 * i, 1000 * i + 100)) for i in (1, 2, 3)]
    bc, lru = BlockCache(1 << 30), PromptCache(1 << 30)
    for conv in convs:
        bc.store(conv, kv(len(conv)), room=1 << 30)
        lru.store(conv, kv(len(conv)), room=1 << 30)
    block = 2 * 1 * 2 * BLOCK_TOKENS * 8 * 4
    assert len(bc) == 4 + 3 * (100 // BLOCK_TOKENS)  # the system prompt's blocks once
    assert bc.nbytes == len(bc) * block and bc.nbytes < lru.nbytes / 2
    cache, rest, kind = bc.fetch(system + [7] * 10)  # a new conversation
    assert kind == "prefix" and rest == [7] * 10
    assert cache[0].offset == 256 and cache[0].keys.shape == (1, 2, 256, 8)


def test_block_hit_kinds():
    from mlxfleet.worker.block_cache import BLOCK_TOKENS as B
    from mlxfleet.worker.block_cache import BlockCache

    seq = list(range(3 * B + 10))
    bc = BlockCache(1 << 30)
    bc.store(seq, kv(len(seq)), room=1 << 30)  # three full blocks kept
    assert bc.fetch(seq[:2 * B + 1])[2] == "exact"  # all but the last token cached
    cache, rest, kind = bc.fetch(seq[:2 * B + 20])  # a prompt the cached one extends
    assert kind == "supersequence" and len(rest) == 20 and cache[0].offset == 2 * B
    assert bc.fetch(seq[:2 * B] + [seq[2 * B], -5, -6])[2] == "lcp"
    assert bc.fetch(seq[:2 * B] + [-1] * 5)[2] == "prefix"
    assert bc.fetch([-1] * (3 * B))[0] is None
    assert bc.status()["hits"] == {"exact": 1, "prefix": 1, "supersequence": 1, "lcp": 1}


def test_blocks_evict_least_recently_used_leaves_first():
    from mlxfleet.worker.block_cache import BLOCK_TOKENS as B
    from mlxfleet.worker.block_cache import BlockCache

    block = 2 * 1 * 2 * B * 8 * 4
    bc = BlockCache(4 * block)
    a, b = list(range(2 * B)), list(range(B)) + list(range(5000, 5000 + B))
    bc.store(a, kv(len(a)), room=bc.budget)  # blocks a0, a1
    bc.store(b, kv(len(b)), room=bc.budget)  # a0 shared, b1
    c = list(range(9000, 9000 + 2 * B))
    bc.store(c, kv(len(c)), room=bc.budget)  # c0, c1: 5 blocks > 4, a leaf goes
    assert len(bc) == 4 and bc.nbytes == 4 * block and bc.stats.evictions == 1
    assert bc.fetch(a + [1])[2] is not None or bc.fetch(b + [1])[2] is not None
    assert bc.fetch(list(range(B)) + [1])[2] is not None  # the shared root survived


def test_a_worker_with_the_block_cache_reuses_a_shared_system_prompt(start_worker):
    w = start_worker("--use-paged-cache", source="builtin:tiny")
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    with w.client() as c:
        got = []
        for q in ("first question", "another one"):
            r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                      "messages": [system, {"role": "user",
                                                                            "content": q}]})
            got.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        st = c.get("/v1/status").json()
    assert got[0] == 0 and got[1] >= 128  # the second conversation reused the blocks
    assert st["prompt_cache"]["type"] == "paged" and st["cache"]["type"] == "paged"


def test_a_cancelled_request_leaves_its_prefill_for_the_retry(start_worker):
    """An agent's long prompt, cancelled (the client hung up or timed out) after its
    prefill: the retry starts from the cache instead of prefilling it all again."""

    w = start_worker(source="builtin:tiny-10m", name="tiny")
    long = "please remember these words " * 120
    body = {"model": "tiny", "messages": [{"role": "user", "content": long}],
            "max_tokens": 500, "ignore_eos": True, "stream": True}
    with w.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            # the first token came: the prompt is prefilled (the role chunk before it
            # is sent at once, before the prefill ends)
            while not (line := next(lines)).startswith("data: {") \
                    or "role" in json.loads(line[6:])["choices"][0]["delta"]:
                pass
        # hung up mid-generation. The worker hears of it a moment later; a client's
        # retry (after its backoff) sends the same prompt again
        assert wait_for(lambda: w.status()["num_running"] == 0, timeout=30), w.status()
        again = c.post("/v1/chat/completions", json={**body, "stream": False,
                                                     "max_tokens": 1}).json()
    usage = again["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1, usage


def test_the_trie_search_answers_as_mlx_lms_without_walking_every_entry():
    """The bounded search gives mlx_lm's exact, shorter and common prefix, and a stored
    extension for ``longer`` (any: they reuse the same prefix), visiting only the path
    to it: mlx_lm's walked every stored token below the point where the prompt leaves
    the trie, on every lookup."""
    import random

    from mlx_lm.models.cache import PromptTrie

    from mlxfleet.worker.prompt_cache import _trie

    rng = random.Random(7)
    ours, theirs = _trie(), PromptTrie()
    stored = []
    opening = [1, 2, 3, 4]  # a chat template's opening, shared by every prompt
    for _ in range(300):
        toks = opening + [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        stored.append(toks)
        ours.add("s", toks, "v")
        theirs.add("s", toks, "v")
    for _ in range(500):
        q = rng.choice(stored)[:rng.randrange(1, 16)] + [rng.randrange(6)
                                                         for _ in range(rng.randrange(3))]
        a, b = ours.search("s", q), theirs.search("s", q)
        assert (a.exact, a.shorter, a.common_prefix) == (b.exact, b.shorter, b.common_prefix)
        assert (a.longer is None) == (b.longer is None)
        if a.longer is not None:
            assert a.longer in stored and a.longer[:a.common_prefix] == q[:a.common_prefix]

    class Counting(dict):  # how many trie nodes a lookup reads
        reads = 0

        def __getitem__(self, k):
            Counting.reads += 1
            return dict.__getitem__(self, k)

    deep = _trie()
    deep._trie["s"] = root = Counting()
    for i in range(2000):  # 2,000 prompts of 40 tokens, all past a shared opening
        node = root
        for tok in [1, 2, 3, i] + list(range(100, 136)):
            node = node.setdefault(tok, Counting())
        node["__value__"] = "v"
    Counting.reads = 0
    found = deep.search("s", [1, 2, 3, 99999])
    assert found.longer is not None and found.common_prefix == 3
    assert Counting.reads < 100  # (mlx_lm's reads all 80,000)
