"""Speculative decoding inside continuous batching gives the tokens plain decoding gives.

Real engines on real tiny models, one with speculation off and one with it on. Drafting
normally happens only when it pays (``Speculator._width``); most tests force it on every
step that has a draft, so that the trained demo model (whose answers repeat little)
rejects many drafts and accepts some: both paths run. tiny-10m's random weights repeat
one token, so its drafts are accepted whole and end inside a draft.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from mlxfleet.worker.engine import Engine
from mlxfleet.worker.sampling import SamplingParams
from mlxfleet.worker.speculative import (
    Lookup,
    Order,
    Row,
    Speculator,
    _gains,
    accept_sampled,
    cut_back,
)
from mlxfleet.worker_settings import WorkerConfig

QUESTIONS = ["Please repeat these words: apple river stone apple river stone cloud",
             "What is the capital of France?", "Hello! How are you?",
             "Repeat: red green blue red green blue", "What is 12 plus 7?",
             "Give me a JSON object with a name and an age."]


@pytest.fixture
def always(monkeypatch):
    """Draft on every step where some row has a draft, whatever it is expected to pay."""
    monkeypatch.setattr(Speculator, "_width",
                        lambda self, rows, drafts: max(len(d) for d in drafts))


@pytest.fixture
def relocations(monkeypatch) -> list[bool]:
    """What each ``relocate`` call returned (True: it cut the batch back)."""
    from mlxfleet.worker import speculative

    out: list[bool] = []
    real = speculative.relocate
    monkeypatch.setattr(speculative, "relocate", lambda *a: out.append(real(*a)) or out[-1])
    return out


def mlx_lm_cut_back(cache: Any, discard: list[int]) -> None:
    """The cut-back as mlx-lm's own roll does it: the reference."""
    least = min(discard)
    cache.trim(least)
    cache.prepare(right_padding=[d - least for d in discard])
    cache.finalize()


async def engine(source: str, mode: str, **kw) -> Engine:
    e = Engine(WorkerConfig(name="t", source=source, speculative=mode, max_concurrency=8,
                            **kw))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    assert e.state == "ready", e.error
    return e


async def answer(e: Engine, prompt: list[int], **params) -> dict:
    gen = e.submit([prompt], SamplingParams(**{"max_tokens": 40, **params}))
    events = []
    while not (events and events[-1].finish_reason):
        events.append(await asyncio.wait_for(gen.events.get(), 120))
    return {"tokens": [ev.token for ev in events], "text": "".join(ev.text for ev in events),
            "finish": events[-1].finish_reason, "stop": events[-1].stop_sequence,
            "logprobs": [ev.logprob for ev in events],
            "top": [ev.top_logprobs for ev in events]}


async def both(source: str, run, **kw) -> tuple:
    """``run(engine)`` with speculation off, then on; and the speculative engine's stats."""
    results = []
    for mode in ("off", "auto"):
        e = await engine(source, mode, **kw)
        try:
            results.append(await run(e))
            e._publish(force=True)
            stats = e.report["speculation"]
        finally:
            await asyncio.to_thread(e.stop)
    return results[0], results[1], stats


def chat(e: Engine, text: str) -> list[int]:
    return e.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True)


async def test_drafts_give_plain_decodings_tokens_alone_and_batched(always):
    async def run(e):
        prompts = [chat(e, q) for q in QUESTIONS]
        alone = [await answer(e, p) for p in prompts]
        together = await asyncio.gather(*(answer(e, p) for p in prompts))
        return [a["tokens"] for a in alone], [t["tokens"] for t in together]

    off, on, stats = await both("builtin:demo", run)
    assert on == off
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], stats  # both paths ran


async def test_a_draft_cut_short_by_the_length_or_a_stop_string_ends_where_plain_does(
        always):
    async def run(e):
        prompt = chat(e, "Say something.")
        plain = await answer(e, prompt, max_tokens=13, ignore_eos=True)
        stop = e.tokenizer.decode(plain["tokens"][:3])  # inside the first accepted draft
        stopped = await answer(e, prompt, max_tokens=30, ignore_eos=True, stop=[stop])
        # The next turn starts from the cache the cut-back draft left behind.
        turn = prompt + plain["tokens"] + chat(e, "Again.")
        nxt = await answer(e, turn, max_tokens=21, ignore_eos=True)
        return plain, stopped, nxt

    off, on, stats = await both("builtin:tiny-10m", run)
    assert on == off
    assert len(on[0]["tokens"]) == 13 and on[0]["finish"] == "length"
    assert on[1]["finish"] == "stop" and on[1]["stop"]
    assert stats["accepted_tokens"] >= 20, stats


async def test_the_next_turns_after_rows_cut_back_by_moving_positions_read_their_caches_in_order(
        always, relocations):
    """Rows decoded together reject different numbers of draft tokens, so their caches
    are cut back by moving positions (``relocate``); each conversation's next turn then
    starts from its stored cache, which must hold its positions in order: the prompt
    cache cuts it to the shared prefix from the end."""
    async def run(e):
        prompts = [chat(e, q) for q in QUESTIONS]
        together = await asyncio.gather(*(answer(e, p, max_tokens=24, ignore_eos=True)
                                          for p in prompts))
        nxt, cached = [], []
        for p, t in zip(prompts, together):
            gen = e.submit([p + t["tokens"][:-1] + chat(e, "Again.")],
                           SamplingParams(max_tokens=12, ignore_eos=True))
            events = [await asyncio.wait_for(gen.events.get(), 120) for _ in range(12)]
            nxt.append([ev.token for ev in events])
            cached.append(gen.cached_tokens)
        return [t["tokens"] for t in together], nxt, cached

    (off, off_next, _), (on, on_next, cached), _ = await both("builtin:demo", run)
    assert any(relocations), "no batch was cut back by moving positions"
    assert on == off and on_next == off_next
    assert all(c > 20 for c in cached), cached  # each next turn started from its cache


async def test_rows_that_sample_or_use_penalties_decode_beside_drafting_rows(always):
    async def run(e):
        prompts = [chat(e, q) for q in QUESTIONS[:3]]
        return await asyncio.gather(
            answer(e, prompts[0], ignore_eos=True),
            answer(e, prompts[1], temperature=1.0, seed=7, ignore_eos=True),
            answer(e, prompts[2], repetition_penalty=1.3, ignore_eos=True),
            answer(e, prompts[0], logprobs=2, ignore_eos=True))

    off, on, stats = await both("builtin:tiny-10m", run)
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
    assert on[0]["text"] == off[0]["text"]
    assert stats["accepted_tokens"] > 0, stats
    # logprobs of tokens that came out of an accepted draft: the model's, as plain
    for a, b in zip(on[3]["logprobs"], off[3]["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert [[t for t, _ in top] for top in on[3]["top"]] == \
        [[t for t, _ in top] for top in off[3]["top"]]


async def test_drafting_that_does_not_pay_stops_and_does_without_forcing():
    """Left to itself, a model whose answers repeat little hardly drafts (the demo); one
    that repeats drafts and gains (tiny-10m: fewer steps than tokens)."""
    async def run(e):
        prompts = [chat(e, q) for q in QUESTIONS]
        return [(await answer(e, p))["tokens"] for p in prompts], e.stats.steps

    off, on, stats = await both("builtin:demo", run)
    assert on[0] == off[0]
    assert stats["steps"] <= 6, stats  # a probe or so, then plain steps

    async def loop(e):
        out = await answer(e, chat(e, "Say something."), max_tokens=60, ignore_eos=True)
        return out["tokens"], e.stats.steps

    off, on, stats = await both("builtin:tiny-10m", loop)
    assert on[0] == off[0]
    # Steps taken for the same 60 tokens. How wide it drafts depends on the step costs it
    # measures (a loaded machine drafts less), so the bound is loose: drafting paid.
    assert on[1] < off[1] * 3 / 4, (on[1], off[1])


async def test_a_prediction_drafts_the_answer_and_the_answer_stays_the_models(always):
    # (``always``: on a busy machine one slow wide step can make drafting look dear for
    # the rest of this short answer; CI saw 1 step of 5 drafted tokens, then none)
    async def run(e):
        prompt = chat(e, QUESTIONS[2])
        plain = await answer(e, prompt)
        predicted = await answer(e, prompt, prediction=plain["tokens"][:-1])
        wrong = await answer(e, prompt, prediction=e.tokenizer.encode("No idea, sorry!"))
        return plain["tokens"], predicted["tokens"], wrong["tokens"]

    off, on, stats = await both("builtin:demo", run)
    assert on == off and on[1] == on[0] == on[2]
    assert stats["accepted_tokens"] >= len(on[0]) // 2, stats  # the prediction was used


@pytest.mark.parametrize("draft", [None, "builtin:scripted"])
async def test_sampled_rows_draft_and_keep_what_the_model_says(always, monkeypatch,
                                                                 tmp_path, draft):
    """The scripted model puts all its probability on the script's next token: sampled
    at temperature 1, every accepted draft token must still be the script's (drafts
    by prompt lookup, or by a draft model)."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [{"when": "Repeat: (?P<t>[^<]*)<",
                                             "say": "\\g<t>"}]}))
    monkeypatch.setenv("MLXFLEET_SCRIPT", str(script))
    text = "one fish two fish red fish blue fish, " * 4

    async def run(e):
        outs = await asyncio.gather(*(answer(e, chat(e, f"Repeat: {text}{i}"), max_tokens=200,
                                             temperature=1.0, top_p=0.9) for i in range(3)))
        return [o["text"] for o in outs]

    off, on, stats = await both("builtin:scripted", run,
                                **({"draft_model": draft} if draft else {}))
    assert off == [f"{text}{i}" for i in range(3)], off
    assert on == off
    assert stats["accepted_tokens"] >= 40, stats


async def test_rows_cut_back_by_moving_slots_keep_a_position_reading_models_answers(
        always, relocations, monkeypatch, tmp_path):
    """The scripted model reads each row's whole sequence from its cache, by position:
    rows decoded together that reject different numbers of draft tokens (their slots
    moved by ``relocate``) still get the script's answers."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [{"when": "Repeat: (?P<t>[^<]*)<",
                                             "say": "\\g<t>"}]}))
    monkeypatch.setenv("MLXFLEET_SCRIPT", str(script))
    texts = ["one fish two fish red fish blue fish, " * 3, "a b c a b d a b e a b f " * 3,
             "red green blue red green blue red " * 3, "the cat sat on the mat " * 3]

    async def run(e):
        outs = await asyncio.gather(*(answer(e, chat(e, f"Repeat: {t}"), max_tokens=200)
                                      for t in texts))
        return [o["text"] for o in outs]

    off, on, _ = await both("builtin:scripted", run)
    assert off == texts
    assert on == off
    assert any(relocations), "no batch was cut back by moving slots"


def test_speculative_sampling_keeps_the_target_distribution():
    import mlx.core as mx

    mx.random.seed(3)
    target = mx.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    # Rows verified together, each with its own target and draft (one with none).
    others = [mx.array([[0.1, 0.1, 0.8], [0.7, 0.2, 0.1]]), mx.array([[0.3, 0.6, 0.1]])]
    n, first, second = 3000, [0, 0, 0], [0, 0, 0]
    firsts = [[0, 0, 0], [0, 0, 0]]
    for _ in range(n):
        [(accepted, nxt), *rest] = accept_sampled([target, *others], [[0, 1], [2], []])
        out = ([0, 1][:accepted] + [nxt])
        first[out[0]] += 1
        if out[0] == 0 and len(out) > 1:
            second[out[1]] += 1
        for counts, (a, t), d in zip(firsts, rest, [[2], []]):
            counts[(d[:a] + [t])[0]] += 1
    assert [round(c / n, 2) for c in first] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    assert [c / sum(second) for c in second] == pytest.approx([0.1, 0.6, 0.3], abs=0.04)
    assert [c / n for c in firsts[0]] == pytest.approx([0.1, 0.1, 0.8], abs=0.03)
    assert [c / n for c in firsts[1]] == pytest.approx([0.3, 0.6, 0.1], abs=0.03)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_distribution_drafts_are_judged_against_is_the_samplers_for_raw_logits(top_p):
    """``probs`` takes the model's raw logits (it normalizes only for top-p and friends):
    the same distribution as for log-probs, and for top-p the filter's."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    from mlxfleet.worker.sampling import SharedSampler

    sampler = SharedSampler(SamplingParams(max_tokens=8, temperature=0.7, top_p=top_p))
    logits = mx.random.normal((3, 50), key=mx.random.key(1)) * 3 + 100  # exp overflows
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = mx.softmax((apply_top_p(logprobs, top_p) if top_p < 1 else logprobs) / 0.7,
                      axis=-1)
    assert mx.allclose(sampler.probs(logits), want, atol=1e-6).item()
    assert mx.allclose(sampler.probs(logprobs), want, atol=1e-6).item()
    if top_p < 1:
        assert (sampler.probs(logits) == 0).sum().item() > 0  # the filter cut the tail


def test_prompt_lookup_follows_the_last_occurrence_and_keeps_a_repeats_period():
    rng = random.Random(5)
    for _ in range(50):  # built at once or token by token: the same index
        toks = [rng.randrange(4) for _ in range(rng.randrange(12))]
        grown = Lookup()
        grown.extend(toks)
        assert Lookup(toks)._ends == grown._ends and Lookup(toks).tokens == toks
    lk = Lookup([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert lk.follow([5, 1, 2, 3], 3) == [4, 5, 1]  # after the last earlier 1, 2, 3
    assert lk.follow([8, 8], 2) == []
    loop = Lookup([5, 6, 7, 5, 6, 7, 5])
    assert loop.follow([6, 7, 5], 7) == [6, 7, 5, 6, 7, 5, 6]  # period 3 carried on
    assert loop.follow([6, 7, 5, 6], 4, pending=6) == [7, 5, 6, 7]  # pending counted
    prediction = Lookup([10, 11, 12, 13])
    row = Row(Lookup([1, 10, 11]), prediction)
    assert row.draft(3, pending=12) == [13]  # the prediction, not a period of its own


def test_a_row_that_stops_paying_stops_drafting_and_resumes_when_shadow_drafts_hit():
    spec = Speculator(max_draft=8)
    for _ in range(8):  # a plain step costs 10 ms, each token read 5 ms more
        spec.cost.add(1, 0.010 + 0.005)
        spec.cost.add(9, 0.010 + 0.045)
    assert spec.cost(5) == pytest.approx(0.035, rel=0.01)
    row = Row(Lookup([1, 2, 3]))
    row.accept = 0.1
    assert spec._width([row], [[4] * 8]) == 0  # 1.1 tokens for 1.5 x a step: no
    row.shadow = [9] + [4] * 8  # the pending token, then a draft not sent
    for _ in range(3):
        row.emitted([9, 4, 4, 4, 4, 4, 4, 4, 4])
        row.shadow = [9] + [4] * 8
    assert row.accept > 0.9
    assert spec._width([row], [[4] * 8]) == 8  # nine tokens for 2.4 steps' time


def test_a_cost_fit_that_judges_wide_steps_too_dear_is_measured_again_by_a_probe():
    """A burst's rows grow beside its prefill, and those plain steps' times can fit as
    all cost per token read, no fixed cost: then no width ever pays, however well the
    drafts are accepted, and only a wide step could show otherwise."""
    spec = Speculator(max_draft=8)
    for n in range(8, 129, 8):  # 0.3 ms per row, nothing fixed
        spec.cost.add(n, 0.0003 * n)
    rows = [Row(Lookup([1, 2, 3])) for _ in range(128)]
    for row in rows:
        row.accept = 0.99  # shadow drafts: nearly every one would have been accepted
    drafts = [[4] * 8] * 128
    assert spec._width(rows, drafts) == 0
    widths = [spec._width(rows, drafts) or spec._probe(rows, drafts) for _ in range(15)]
    assert widths == [0] * 15
    # A step that rows join also pays for merging their caches: neither timed nor probed.
    batch = SimpleNamespace(uids=[7], tokens=[[1, 2, 3]])
    spec._rows(batch)
    assert spec._joined and spec._probe(rows, drafts) == 0
    spec._rows(batch)  # the same rows: an ordinary step again
    assert not spec._joined and spec._probe(rows, drafts) == 2  # the 16th: a probe
    spec.cost.add(128 * 3, 1.5 * spec.cost(128))  # three tokens a row for 1.5 x a step
    assert spec._width(rows, drafts) == 8  # then it drafts wide, as it pays
    # Where acceptance is what says no, there is no probe (shadow drafts measure it).
    for row in rows:
        row.accept = 0.1
    assert not any(spec._probe(rows, drafts) for _ in range(64))


def test_a_batch_decoding_at_one_size_does_not_fit_wide_steps_as_free():
    """Plain steps at 30-32 rows say nothing of what reading 10 tokens a row costs; their
    least-squares slope is noise (0 as often as not), which made a 9-wide step look
    as cheap as a plain one: 32 streams of chat took one that cost 5.5 plain steps for
    1.4 steps' tokens. The slope stays near the prior's until the sizes vary."""
    spec = Speculator(max_draft=8)
    jitter = random.Random(3)
    for i in range(300):  # 85 ms a step, +-10 ms whatever the rows
        spec.cost.add(30 + i % 3, 0.085 + jitter.gauss(0, 0.010))
    assert spec.cost(300) > 1.5 * spec.cost(30)  # (the prior alone: 3.4 x; the fit: 1 x)
    rows = [Row(Lookup([1, 2, 3])) for _ in range(30)]
    for row, p in zip(rows, [0.8, 0.7, 0.7, 0.66, 0.64, 0.61, 0.57, 0.56] + [0.3] * 22):
        row.accept = p
    # A short draft at most (the prior's view; such a step then measures wider ones)
    assert spec._width(rows, [[4] * 8] * 30) <= 2
    # Steps of other sizes say what a token read costs: then the fit decides.
    for i in range(40):
        spec.cost.add(30 * (1 + i % 4), 0.030 + 0.002 * 30 * (1 + i % 4))
    assert spec.cost(300) == pytest.approx(0.030 + 0.002 * 300, rel=0.05)


def test_the_gains_of_every_width_are_each_rows_expected_tokens_summed():
    rows = [Row(Lookup([1])) for _ in range(3)]
    for row, p in zip(rows, (0.9, 0.5, 0.1)):
        row.accept = p
    drafts = [[4] * 8, [4] * 2, []]  # each row's draft caps what it can add
    want = [sum(sum(r.accept ** j for j in range(1, min(k, len(d)) + 1))
                for r, d in zip(rows, drafts)) for k in range(1, 9)]
    assert list(_gains(rows, drafts)) == pytest.approx(want)
    assert len(_gains(rows, [[], [], []])) == 0  # no drafts: no width to weigh


@pytest.mark.parametrize("size", [300, 256])  # a buffer with room past the write index; full
def test_cutting_rows_back_keeps_what_mlx_lms_roll_keeps(size):
    """Rows cut back by different amounts: every position a row still attends to holds
    what mlx-lm's own roll (prepare + finalize) puts there, with the same offsets and
    left padding, so the next pass reads the same keys and values."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    def cache(seed: int) -> BatchKVCache:
        c = BatchKVCache([0, 3, 1, 7])
        mx.random.seed(seed)
        k, v = (mx.random.normal((4, 2, size, 8)) for _ in range(2))
        c.update_and_fetch(k[..., :size - 20, :], v[..., :size - 20, :])
        c.update_and_fetch(k[..., size - 20:, :], v[..., size - 20:, :])  # (a step's write)
        return c

    discard = [2, 0, 5, 3]
    ours, theirs = cache(1), cache(1)
    cut_back([ours], discard)
    mlx_lm_cut_back(theirs, discard)
    assert ours._idx == theirs._idx == size - min(discard)
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist() == [2, 3, 6, 10]
    for row, lp in enumerate(theirs.left_padding.tolist()):
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert mx.array_equal(a[row, :, lp:ours._idx], b[row, :, lp:theirs._idx]).item()
    mask = ours.make_mask(1, return_array=True)
    assert mx.array_equal(mask, theirs.make_mask(1, return_array=True)).item()


def test_rows_cut_back_by_moving_their_oldest_positions_hold_the_same_keys_in_order():
    """Cut back with rows to track it, a row's rejected slots take its oldest positions:
    the slots it attends to hold the same keys and values as mlx-lm's roll leaves (in
    another order, which its ``Order`` undoes), with the same offsets, padding and mask,
    step after step."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    def cache() -> BatchKVCache:
        c = BatchKVCache([0, 3, 1, 7])
        mx.random.seed(3)
        c.update_and_fetch(mx.random.normal((4, 2, 40, 8)), mx.random.normal((4, 2, 40, 8)))
        return c

    ours, theirs = cache(), cache()
    rows = [Row(Lookup([1])) for _ in range(4)]
    for step, discard in enumerate(([2, 0, 5, 3], [1, 4, 0, 4], [3, 3, 3, 0])):
        mx.random.seed(10 + step)
        k, v = mx.random.normal((4, 2, 6, 8)), mx.random.normal((4, 2, 6, 8))
        ours.update_and_fetch(k, v)
        theirs.update_and_fetch(k, v)
        cut_back([ours], discard, rows)
        mlx_lm_cut_back(theirs, discard)
        assert ours._idx == theirs._idx
        assert ours.offset.tolist() == theirs.offset.tolist()
        assert ours.left_padding.tolist() == theirs.left_padding.tolist()
        assert mx.array_equal(ours.make_mask(1, return_array=True),
                              theirs.make_mask(1, return_array=True)).item()
        for i, lp in enumerate(theirs.left_padding.tolist()):
            n = ours._idx - lp
            slots = rows[i].order.slots(n)
            ix = mx.array(slots if slots is not None else list(range(n)))
            for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert mx.array_equal(a[i, :, lp:ours._idx][:, ix], b[i, :, lp:ours._idx]).item()
    assert rows[2].order.slots(ours._idx - ours.left_padding.tolist()[2]) is not None


def test_a_rows_order_follows_its_rotations_and_the_positions_it_gains():
    o = Order()
    assert o.slots(5) is None  # never moved: in order
    o.rotate(5, 2)  # slots hold 2 3 4 0 1
    assert o.slots(5) == [3, 4, 0, 1, 2]
    assert o.slots(7) == [3, 4, 0, 1, 2, 5, 6]  # two decoded since: 2 3 4 0 1 5 6
    o.rotate(7, 3)  # 0 1 5 6 2 3 4
    assert o.slots(7) == [0, 1, 4, 5, 6, 2, 3]
    o.rotate(7, 4)  # 2 3 4 0 1 5 6
    assert o.slots(7) == [3, 4, 0, 1, 2, 5, 6]
    o = Order()
    o.rotate(4, 1)  # 1 2 3 0
    o.rotate(4, 3)  # 0 1 2 3: in order again, one run
    assert o.slots(4) is None and o.runs == deque([[0, 4]])


def test_only_a_step_that_drafts_waits_for_the_step_in_flight():
    """The pending tokens are read (waiting for the pass computing them) only when the
    step drafts: a plain step keeps mlx-lm's overlap of the next pass with this one."""
    from mlx_lm.sample_utils import greedy_sampler

    class InFlight:
        def tolist(self):
            raise AssertionError("a plain step waited for the step in flight")

    spec = Speculator(max_draft=8)
    gb = SimpleNamespace(uids=[0], tokens=[[1, 2, 3, 1, 2, 3, 1, 2]], samplers=None,
                         logits_processors=None, fallback_sampler=greedy_sampler,
                         _next_tokens=InFlight())
    rows = spec._rows(gb)
    rows[0].accept = 0.01  # its drafts are rarely accepted: no width pays
    assert spec._plan(gb, rows) is None
    assert rows[0].shadow == [3, 1, 2, 3, 1, 2, 3, 1, 2]  # judged on what comes instead
    rows[0].shadow, rows[0].accept = [], 0.99
    gb._next_tokens = SimpleNamespace(tolist=lambda: [3])  # the pending token: 3
    assert spec._plan(gb, rows) == [[1, 2, 3, 1, 2, 3, 1, 2]]  # the draft after it


def test_a_worker_with_a_draft_model_serves_the_openai_sdk_and_says_so(start_worker):
    w = start_worker("--speculative", "auto", "--draft-model", "builtin:tiny",
                     source="builtin:tiny-10m", name="tiny")
    assert w.status()["paths"]["speculation"].startswith("draft model builtin:tiny")
    # the KV budget admits by both caches a sequence grows: the model's and the draft's
    from mlx_lm import load

    from mlxfleet.sources import resolve_source
    from mlxfleet.worker.model_facts import kv_cost

    each = [kv_cost(load(str(resolve_source(s)))[0]).per_token
            for s in ("builtin:tiny-10m", "builtin:tiny")]
    assert w.status()["paths"]["kv"]["bytes_per_token"] == sum(each) > max(each)
    import openai

    r = openai.OpenAI(base_url=w.base_url + "/v1", api_key="unused").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30
    assert w.status()["speculation"]["draft_tokens"] > 0


def test_the_openai_sdk_sends_a_prediction_and_a_bad_one_is_a_400(start_worker):
    """The HTTP path: the official SDK's ``prediction`` reaches the engine (drafts are
    accepted, the answer is the model's), and a malformed one is OpenAI's 400."""
    import openai

    w = start_worker("--speculative", "auto", source="builtin:demo", name="demo")
    client = openai.OpenAI(base_url=w.base_url + "/v1", api_key="unused")
    ask = [{"role": "user", "content": QUESTIONS[2]}]
    plain = client.chat.completions.create(model="demo", messages=ask, temperature=0,
                                           max_tokens=40).choices[0].message.content
    before = w.status()["speculation"]["accepted_tokens"]
    predicted = client.chat.completions.create(
        model="demo", messages=ask, temperature=0, max_tokens=40,
        prediction={"type": "content", "content": plain}).choices[0].message.content
    assert predicted == plain
    # the prediction drafted most of the answer (plain decoding of it drafted little)
    assert w.status()["speculation"]["accepted_tokens"] - before >= 5, before
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=ask, max_tokens=4,
                                       prediction={"type": "text", "content": 3})
    assert e.value.body["param"] == "prediction"


async def test_a_draft_model_drafts_for_rows_that_come_and_go_and_changes_no_token(always):
    """``spec.speculative.draftModel``: the draft model keeps its own batched cache in
    step with the rows (new ones prefilled while others decode, finished ones dropped,
    each cut back to what the model accepted). A perfect draft (the model itself) is
    accepted whole; another model's drafts are mostly rejected: both give the tokens of
    plain decoding."""

    async def run(e):
        prompts = [chat(e, q) for q in QUESTIONS]
        alone = [(await answer(e, p))["tokens"] for p in prompts[:2]]
        first = [asyncio.create_task(answer(e, p, max_tokens=20 + 7 * i))
                 for i, p in enumerate(prompts[:3])]
        await asyncio.sleep(0.3)  # they are decoding: three more join the batch
        later = [asyncio.create_task(answer(e, p, max_tokens=25)) for p in prompts[3:]]
        return alone, [r["tokens"] for r in await asyncio.gather(*first, *later)]

    off, on, stats = await both("builtin:demo", run, draft_model="builtin:demo")
    assert on == off
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 50, stats

    async def mixed(e):
        prompts = [chat(e, q) for q in QUESTIONS[:3]]
        return [r["tokens"] for r in await asyncio.gather(
            answer(e, prompts[0], ignore_eos=True),
            answer(e, prompts[1], temperature=1.0, seed=7, ignore_eos=True),
            answer(e, prompts[2], repetition_penalty=1.3, ignore_eos=True),
            answer(e, prompts[2], ignore_eos=True, max_tokens=9))]

    off, on, stats = await both("builtin:tiny-10m", mixed, draft_model="builtin:tiny")
    assert on == off
    assert stats["accepted_tokens"] < stats["draft_tokens"], stats


async def test_a_draft_model_with_another_tokenizer_is_refused_saying_why():
    e = Engine(WorkerConfig(name="t", source="builtin:demo", speculative="auto",
                            draft_model="builtin:tiny"))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    try:
        assert e.state == "failed" and "another tokenizer" in e.error, e.error
    finally:
        await asyncio.to_thread(e.stop)


async def test_drafts_over_a_quantized_kv_cache_change_no_token(always):
    """``kvBits`` and speculation together: the quantized batch cache is cut back per row
    like the plain one."""
    async def run(e):
        assert e.paths["kv_cache"].startswith("quantized to 4 bits"), e.paths
        prompts = [chat(e, q) for q in QUESTIONS[:4]]
        return [r["tokens"] for r in await asyncio.gather(
            *(answer(e, p, max_tokens=9 + 5 * i, ignore_eos=True)
              for i, p in enumerate(prompts)))]

    off, on, stats = await both("builtin:tiny-10m", run, kv_bits=4)
    assert on == off
    assert stats["accepted_tokens"] > 20, stats
