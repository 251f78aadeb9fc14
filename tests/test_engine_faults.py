"""The engine thread under faults this machine cannot produce for real: an allocation
failure (MLX raises when memory runs out; on a 2-core Linux box with swap it never does) and
a step that hangs. Both are simulated by replacing the batch generator's ``next`` on a real
engine with a real tiny model; everything else is real."""

from __future__ import annotations

import asyncio
import time

import pytest

from mlxfleet.worker.engine import STEP_FAILURES_FATAL, Engine
from mlxfleet.worker.generation import EngineError, TokenEvent
from mlxfleet.worker.sampling import SamplingParams
from mlxfleet.worker_settings import WorkerConfig


@pytest.fixture
async def engine():
    e = Engine(WorkerConfig(name="t", source="builtin:tiny-10m", stall_timeout=0.5))
    e.start(asyncio.get_running_loop())
    await e.wait_ready()
    assert e.state == "ready", e.error
    yield e
    await asyncio.to_thread(e.stop)


async def events_of(gen) -> list:
    """A generation's events until it ends (tokens, or an EngineError)."""
    out = []
    while True:
        ev = await asyncio.wait_for(gen.events.get(), 30)
        out.append(ev)
        if isinstance(ev, EngineError) or (isinstance(ev, TokenEvent) and ev.finish_reason):
            return out


async def run(e: Engine, max_tokens: int = 4) -> list:
    """Submit one prompt; the events until it ends."""
    return await events_of(e.submit([[1, 2, 3]], SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True)))


def out_of_memory(*_a, **_k):
    raise RuntimeError("[metal::malloc] Attempting to allocate 99 GB (simulated)")


async def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    assert engine.memory_limit and engine.report["mlx_memory"]["limit_bytes"]
    engine._bg.next = out_of_memory  # the batch running now fails once
    events = await run(engine)
    assert isinstance(events[-1], EngineError) and "malloc" in events[-1].message
    events = await run(engine)  # a fresh batch serves the next request
    assert [type(e) for e in events] == [TokenEvent] * 4
    await asyncio.sleep(0.2)  # the engine publishes its counters when it goes idle
    assert engine.problem() is None and engine.report["kv_reserved_bytes"] == 0


async def test_failures_in_a_row_take_the_engine_down(engine, monkeypatch):
    monkeypatch.setattr(Engine, "_new_batch", lambda self: None)  # keeps the broken batch
    engine._bg.next = out_of_memory
    for _ in range(STEP_FAILURES_FATAL):
        assert isinstance((await run(engine))[-1], EngineError)
    await asyncio.sleep(0.2)
    assert engine.state == "failed" and "malloc" in engine.error


async def test_a_stuck_step_is_reported_then_clears(engine):
    real = engine._bg.next

    def stuck(*a, **k):
        time.sleep(1.5)
        return real(*a, **k)

    engine._bg.next = stuck
    task = asyncio.ensure_future(run(engine, max_tokens=2))
    await asyncio.sleep(1.0)
    assert "not made progress" in (engine.problem() or "")
    engine._bg.next = real
    await task
    await asyncio.sleep(0.1)
    assert engine.problem() is None


async def test_a_sequence_that_fails_fails_alone_with_its_traceback_logged(engine, caplog):
    """A failure one sequence causes (its detokenizer cannot read a token, say) ends that
    request only; before, every request in the batch got the error."""
    import logging

    caplog.set_level(logging.ERROR, logger="mlxfleet.engine")
    p = SamplingParams(max_tokens=200, ignore_eos=True)
    a, b = engine.submit([[1, 2, 3]], p), engine.submit([[4, 5, 6, 7]], p)
    deadline = time.monotonic() + 30
    while not (a.uids and b.uids and all(u in engine._seqs for u in a.uids)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)

    def unreadable(*_a, **_k):
        raise IndexError("list index out of range (simulated: a token it has no text for)")

    engine._seqs[a.uids[0]].decoder.feed = unreadable

    got_a, got_b = await asyncio.gather(events_of(a), events_of(b))
    assert isinstance(got_a[-1], EngineError) and "IndexError" in got_a[-1].message
    assert all(isinstance(e, TokenEvent) for e in got_b) and len(got_b) == 200
    assert got_b[-1].finish_reason == "length"
    assert any(r.exc_info for r in caplog.records), "the log has the traceback"
    await asyncio.sleep(0.2)
    assert engine.problem() is None and engine.report["kv_reserved_bytes"] == 0


async def test_a_long_answer_reserves_its_kv_as_it_grows_and_gives_it_all_back(engine):
    """A sequence reserves KV for RESERVE_TOKENS of output at a time (an agent asking
    for 32k tokens no longer holds that budget from its first token): past it, the
    reservation grows; at the end all of it is handed back."""
    from mlxfleet.worker.engine import RESERVE_TOKENS

    gen = engine.submit([[1, 2, 3]], SamplingParams(max_tokens=RESERVE_TOKENS + 300,
                                                     ignore_eos=True))
    seen: list[int] = []

    async def watch():
        while True:
            seq = engine._seqs.get(gen.uids[0]) if gen.uids else None
            if seq is not None:
                seen.append(seq.reserved)
            await asyncio.sleep(0.002)

    w = asyncio.ensure_future(watch())
    events = await events_of(gen)
    w.cancel()
    assert len(events) == RESERVE_TOKENS + 300 and events[-1].finish_reason == "length"
    start = engine.policy.need(3, RESERVE_TOKENS)
    assert seen and seen[0] == start and max(seen) > start, (seen[:3], max(seen), start)
    await asyncio.sleep(0.2)
    assert engine.report["kv_reserved_bytes"] == 0
