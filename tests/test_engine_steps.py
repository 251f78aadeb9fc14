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
    gens = [engine.submit([[5 + i] * 40], params) for i in range(4)]  # two groups of 2
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
