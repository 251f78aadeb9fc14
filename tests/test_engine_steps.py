"""The order of the engine's work on a real tiny model: which step hands out what.

mlx-lm's ``BatchGenerator`` returns a sequence's first token from the generation step of
the call after its prefill ends, and that call would also prefill the next group of
waiting prompts: on a CPU, seconds before the first group hears anything. The engine makes
that call a generation step only. Its ``next`` is wrapped to record each call; nothing is
simulated."""

from __future__ import annotations

import asyncio

import pytest

from mlxfleet.worker.engine import Engine
from mlxfleet.worker.generation import TokenEvent
from mlxfleet.worker.sampling import SamplingParams
from mlxfleet.worker_settings import WorkerConfig


@pytest.fixture
async def engine():
    e = Engine(WorkerConfig(name="t", source="builtin:tiny-10m", prefill_batch_size=2,
                            max_concurrency=8))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    assert e.state == "ready", e.error
    yield e
    await asyncio.to_thread(e.stop)


async def finish(gen) -> list[TokenEvent]:
    out = []
    while not (out and out[-1].finish_reason):
        out.append(await asyncio.wait_for(gen.events.get(), 60))
    return out


async def test_a_prefilled_group_gets_its_first_tokens_before_the_next_group_is_prefilled(
        engine):
    calls = []
    real = engine._bg.next

    def recorded():
        prompts, tokens = real()
        calls.append(([(r.uid, r.end_of_prompt) for r in prompts], [r.uid for r in tokens]))
        return prompts, tokens

    engine._bg.next = recorded
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # two groups of 2: a pass holds 2 x 512 prompt tokens (``prefill_group``)
    gens = [engine.submit([[5 + i] * 400], params) for i in range(4)]
    results = await asyncio.gather(*(finish(g) for g in gens))
    assert all(len(r) == 3 for r in results)
    first = {u for g in gens[:2] for u in g.uids}
    second = {u for g in gens[2:] for u in g.uids}
    joined = next(i for i, (p, _) in enumerate(calls)
                  if any(end for u, end in p if u in first))
    prompts, tokens = calls[joined + 1]
    assert first <= set(tokens), calls  # the first group's first tokens...
    assert not prompts, calls  # ...in a step that prefilled nothing else
    later = [u for p, _ in calls[joined + 2:] for u, _ in p]
    assert second & set(later), calls  # the second group was prefilled after that


@pytest.mark.parametrize("step", [2048, 16])
async def test_a_lone_prompt_is_read_in_one_pass_and_gives_mlx_lm_tokens(engine, step):
    """A request alone in an idle engine: its prompt goes through the model once (in
    chunks of ``prefill_step_size`` when longer), not once for all but its last token and
    again for the last, and its tokens are mlx-lm's."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    assert engine.paths["lone_prompt"].startswith("one pass"), engine.paths
    engine.config = engine.config.model_copy(update={"prefill_step_size": step})
    body = engine._model.model
    base, passes = type(body), []

    class Counted(base):
        def __call__(self, x, *args, **kwargs):
            passes.append(x.shape[1])
            return base.__call__(self, x, *args, **kwargs)

    body.__class__ = Counted
    prompt = [(7 * i) % 1800 + 10 for i in range(40)]
    try:
        events = await finish(engine.submit([prompt], SamplingParams(max_tokens=4,
                                                                     ignore_eos=True)))
    finally:
        body.__class__ = base
    assert passes[:1 + 40 // step] == ([40] if step > 40 else [16, 16, 8]), passes
    model, _ = load(engine.model_path)
    alone = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=4,
                                              sampler=lambda x: mx.argmax(x, axis=-1))]
    assert [e.token for e in events] == alone


def test_a_model_whose_body_is_not_its_model_attribute_keeps_two_passes():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxfleet.worker.last_position import supported

    class Backbone(nn.Module):  # (Nemotron-H's body is ``backbone``)
        def __init__(self):
            super().__init__()
            self.backbone = nn.Embedding(8, 4)
            self.layers = []

        def __call__(self, x, cache=None):
            return self.backbone(x) @ mx.ones((4, 8))

    class Pooled(Backbone):  # a ``model`` attribute whose output is not per position
        def __init__(self):
            super().__init__()
            self.model = lambda x, cache=None: self.backbone(x).sum(axis=1)

        def __call__(self, x, cache=None):
            return (self.model(x) @ mx.ones((4, 8)))[:, None]

    assert not supported(Backbone()) and not supported(Pooled())


async def test_a_burst_of_short_prompts_is_prefilled_in_passes_packed_by_tokens(engine):
    """Eight 40-token prompts fit one pass of 2 x 512 tokens: one prefill pass for all
    (by prompt count, ``prefill_batch_size: 2``, four passes and a decode step each)."""
    passes = []
    real = engine._bg.next

    def recorded():
        prompts, tokens = real()
        passes.append(sum(1 for r in prompts if not r.end_of_prompt))
        return prompts, tokens

    engine._bg.next = recorded
    # (one request of eight prompts: eight requests would race the engine's gathering)
    gen = engine.submit([[5 + i] * 40 for i in range(8)],
                        SamplingParams(max_tokens=3, ignore_eos=True))
    tokens: dict[int, int] = {}
    done: set[int] = set()
    while len(done) < 8:
        ev = await asyncio.wait_for(gen.events.get(), 60)
        assert isinstance(ev, TokenEvent), ev
        tokens[ev.index] = tokens.get(ev.index, 0) + 1
        if ev.finish_reason:
            done.add(ev.index)
    assert tokens == {i: 3 for i in range(8)}
    assert [n for n in passes if n] == [8], passes


async def test_the_chat_template_is_compiled_before_ready():
    """Jinja compiles a chat template on its first use: the warm-up renders it, so that a
    first chat request after Ready does not pay for it (builtin:tiny's: 42 ms against
    11 ms for the next ones)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    _compile_jinja_template.cache_clear()
    e = Engine(WorkerConfig(name="t", source="builtin:tiny-10m", max_concurrency=2))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    try:
        assert _compile_jinja_template.cache_info().currsize >= 1
        misses = _compile_jinja_template.cache_info().misses
        e.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True)
        assert _compile_jinja_template.cache_info().misses == misses  # compiled already
    finally:
        await asyncio.to_thread(e.stop)


async def test_an_idle_engine_collects_the_garbage_a_burst_left(monkeypatch):
    """Workers make full garbage collections rare while they work (``GC_GEN0``); going
    idle, the engine collects in full, so the cycles a burst left (MLX arrays among them)
    are freed then, not whenever the next burst allocates."""
    import gc
    import weakref

    from mlxfleet.worker import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_GC_S", 0.2)
    e = Engine(WorkerConfig(name="t", source="builtin:tiny-10m", max_concurrency=2))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    gc.disable()  # only the engine's own collection can free the cycle
    try:
        class Node:
            pass

        node = Node()
        node.me = node
        gone = weakref.ref(node)
        del node
        await finish(e.submit([[5, 6, 7, 8]], SamplingParams(max_tokens=2)))  # busy, idle
        for _ in range(50):
            if gone() is None:
                break
            await asyncio.sleep(0.1)
        assert gone() is None
    finally:
        gc.enable()
        await asyncio.to_thread(e.stop)
