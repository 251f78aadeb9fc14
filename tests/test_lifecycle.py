"""The lifecycle decision as a table, and ModelRuntime + admission against fake workers.

No process and no model here: ``tests/fakes.py`` stands in for workers (said
there), so these tests pin the control plane's decisions: load, unload, crash
and backoff, rolling replace, eviction, queue bounds, the one retry.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeNode, until

from mlxfleet.settings import ServerSettings
from mlxfleet.supervisor.admission import AdmissionError
from mlxfleet.supervisor.handle import WorkerHandle, WorkerUnreachable
from mlxfleet.supervisor.lifecycle import ModelPhase


def test_phase_is_the_vocabulary():
    assert ModelPhase.BACKOFF == "CrashLoopBackOff" and f"{ModelPhase.READY}" == "Ready"


@pytest.fixture
async def node(tmp_path):
    f = FakeNode(tmp_path)
    yield f
    await f.close()


def test_fake_is_a_worker_handle(tmp_path):
    async def check():
        f = FakeNode(tmp_path)
        f.write("a")
        await f.sup.reload()
        assert isinstance(f.sup.new_worker(f.sup.models["a"]), WorkerHandle)
        await f.close()

    asyncio.run(check())


async def _loaded(f: FakeNode, name: str):
    rt = f.sup.models[name]
    load = asyncio.create_task(rt.load(time.monotonic() + 5))
    w = await until(lambda: rt.starting)
    w.become_ready()
    await load
    return rt, w


async def _preloaded(f: FakeNode, name: str):
    """A preloaded model whose first worker is ready: (runtime, worker)."""
    f.write(name, preload=True)
    await f.sup.reload()
    rt = f.sup.models[name]
    (await until(lambda: rt.starting)).become_ready()
    return rt, await until(lambda: rt.current if rt.ready else None)


async def test_load_on_demand_then_unload(node):
    node.write("a")
    await node.sup.reload()
    rt = node.sup.models["a"]
    assert rt.phase is ModelPhase.UNLOADED and not node.workers
    rt, w = await _loaded(node, "a")
    assert rt.phase is ModelPhase.READY and rt.current is w
    await rt.unload()
    assert rt.phase is ModelPhase.UNLOADED and rt.current is None
    assert node.effects("a") == ["spawn", "ready", "stop"]


async def test_crash_backs_off_then_restarts(tmp_path):
    # The backoff is the window in which the phase can be seen: 3 s, so that a stalled
    # event loop on a loaded CI machine (a collection pass, say) cannot miss it.
    f = FakeNode(tmp_path, backoff_base=3, backoff_cap=3)
    try:
        rt, w1 = await _preloaded(f, "a")
        w1.crash()
        await until(lambda: rt.phase is ModelPhase.BACKOFF)
        assert "exited unexpectedly" in rt.last_error and rt.starting is None
        w2 = await until(lambda: rt.starting)  # after the backoff
        w2.become_ready()
        await until(lambda: rt.ready)
        assert rt.restarts == 1 and rt.current is w2
        assert f.effects("a") == ["spawn", "ready", "crash", "spawn", "ready"]
    finally:
        await f.close()


async def test_request_during_backoff_is_503_with_retry_after(tmp_path):
    f = FakeNode(tmp_path, backoff_base=30, backoff_cap=30)
    try:
        f.write("a", preload=True)
        await f.sup.reload()
        rt = f.sup.models["a"]
        (await until(lambda: rt.starting)).become_ready()
        await until(lambda: rt.ready)
        rt.current.crash()
        await until(lambda: rt.phase is ModelPhase.BACKOFF)
        with pytest.raises(AdmissionError) as e:
            await f.sup.find("a").lease(time.monotonic() + 5)
        assert e.value.status == 503 and e.value.code == "model_unavailable"
        assert 20 < e.value.retry_after <= 30 and "Retry-After" in e.value.headers
    finally:
        await f.close()


async def test_rolling_replace_keeps_serving_until_the_new_worker_is_ready(node):
    rt, old = await _preloaded(node, "a")
    node.write("a", preload=True, defaults={"temperature": 0.5})
    await node.sup.reload()
    new = await until(lambda: rt.starting)
    assert rt.ready and rt.current is old  # the old one serves meanwhile
    lease = await node.sup.find("a").lease(time.monotonic() + 5)
    assert lease.worker is old
    new.become_ready()
    await until(lambda: rt.current is new)
    await until(lambda: old.stopping)
    await asyncio.sleep(0.05)
    assert old.returncode is None  # draining waits for the lease
    lease.release()
    await until(lambda: old.returncode == 0)
    assert rt.observed_generation == rt.generation == 2


async def test_a_burst_of_edits_starts_one_worker_for_the_last_spec(tmp_path):
    f = FakeNode(tmp_path, spec_settle_ms=1000)  # well above the gaps, even on a slow box
    try:
        rt, old = await _preloaded(f, "a")
        for i in range(10):  # saves 30 ms apart, as an editor's autosave would
            f.write("a", preload=True, defaults={"temperature": i / 10})
            await f.sup.reload()
            await asyncio.sleep(0.03)
        new = await until(lambda: rt.starting)
        new.become_ready()
        await until(lambda: rt.current is new)
        assert f.effects("a").count("spawn") == 2  # the first worker and one replacement
        assert new.spec_hash == rt.manifest.worker_hash()  # the last save
        assert rt.manifest.spec.defaults.temperature == 0.9
        assert rt.observed_generation == rt.generation
    finally:
        await f.close()


async def test_failed_replacement_leaves_the_old_worker_serving(node):
    rt, old = await _preloaded(node, "a")
    node.write("a", preload=True, defaults={"temperature": 0.5})
    await node.sup.reload()
    (await until(lambda: rt.starting)).fail_load("bad weights")
    await until(lambda: rt.conditions.get("Progressing", {}).get("reason") == "NewWorkerFailed")
    assert rt.ready and rt.current is old and rt.phase is ModelPhase.READY


async def test_idle_model_is_evicted_to_make_room_but_a_busy_one_is_not(tmp_path):
    f = FakeNode(tmp_path, memory_budget="1GB", busy_wait_timeout=0.2)
    try:
        f.write("a", cache={"memoryMB": 600})
        f.write("b", cache={"memoryMB": 600})
        await f.sup.reload()
        rt_a, _ = await _loaded(f, "a")
        lease = await f.sup.find("a").lease(time.monotonic() + 5)  # a is busy now
        with pytest.raises(AdmissionError) as e:
            await f.sup.find("b").lease(time.monotonic() + 5)
        assert e.value.code == "insufficient_memory" and rt_a.ready
        lease.release()  # a is idle: b evicts it
        rt_b = f.sup.models["b"]
        load = asyncio.create_task(rt_b.load(time.monotonic() + 5))
        (await until(lambda: rt_b.starting)).become_ready()
        await load
        assert rt_b.ready and not rt_a.holds_memory and rt_a.evictions == 1
    finally:
        await f.close()


async def test_waiters_share_one_load_and_the_queue_is_bounded(node):
    node.write("a", batching={"maxConcurrency": 1, "maxQueue": 1})
    await node.sup.reload()
    rt = node.sup.models["a"]
    waiting = [asyncio.ensure_future(node.sup.find("a").lease(time.monotonic() + 5))
               for _ in range(2)]
    await until(lambda: rt.waiters == 2)
    with pytest.raises(AdmissionError) as e:
        await node.sup.find("a").lease(time.monotonic() + 5)
    assert e.value.status == 503 and e.value.code == "queue_full"
    (await until(lambda: rt.starting)).become_ready()
    leases = await asyncio.gather(*waiting)
    assert rt.inflight == 2 and len(node.workers) == 1  # one load served both
    for lease in leases:
        lease.release()
    assert rt.inflight == 0 and rt.waiters == 0


async def test_a_failed_load_reaches_every_waiter(node):
    node.write("a")
    await node.sup.reload()
    rt = node.sup.models["a"]
    waiting = [asyncio.ensure_future(node.sup.find("a").lease(time.monotonic() + 5))
               for _ in range(3)]
    await until(lambda: rt.waiters == 3 and rt.starting)
    rt.starting.fail_load("no such weights")
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, AdmissionError) and r.code == "model_load_failed"
               and "no such weights" in r.message for r in results)
    assert rt.phase is ModelPhase.FAILED and rt.waiters == 0


async def test_unknown_model_is_404_and_deadline_is_504(node):
    node.write("a", aliases=["fast"])
    await node.sup.reload()
    with pytest.raises(AdmissionError) as e:
        await node.sup.find("nope").lease(time.monotonic() + 5)
    assert e.value.status == 404 and "a, fast" in e.value.message
    with pytest.raises(AdmissionError) as e:  # loads, but never becomes ready in time
        await node.sup.find("fast").lease(time.monotonic() + 0.1)
    assert e.value.status == 504 and e.value.code == "timeout"


async def test_lease_retries_once_when_the_worker_died_before_the_request(node):
    rt, w1 = await _preloaded(node, "a")

    def died():
        w1.crash()
        raise WorkerUnreachable("connection refused")

    w1.forward_effects.append(died)
    async with await node.sup.find("a").lease(time.monotonic() + 5) as lease:
        send = asyncio.create_task(lease.send("POST", "/v1/chat/completions", b"{}", {}))
        w2 = await until(lambda: rt.starting)
        w2.become_ready()
        assert await send == "ok"
        assert lease.worker is w2 and w2.inflight == 1 and w1.inflight == 0
    assert w2.inflight == 0
    assert node.effects("a")[-3:] == ["spawn", "ready", "forward /v1/chat/completions"]


async def test_keep_alive_zero_unloads_after_the_request(node):
    node.write("a")
    await node.sup.reload()
    rt = node.sup.models["a"]
    task = asyncio.ensure_future(node.sup.find("a").lease(time.monotonic() + 5, keep_alive=0))
    (await until(lambda: rt.starting)).become_ready()
    lease = await task
    assert rt.ready
    lease.release()
    await until(lambda: rt.phase is ModelPhase.UNLOADED)


async def test_a_new_file_cannot_take_over_a_running_models_name_or_alias(node):
    node.write("demo", file="m.yaml", aliases=["default"])
    node.write("tiny", file="t.yaml")
    await node.sup.reload()
    # Newcomers that sort first reuse a running name and a running alias.
    node.write("tiny", file="0-dup.yaml", source="/elsewhere")
    node.write("default", file="0-alias.yaml")
    await node.sup.reload()
    assert node.sup.models["tiny"].manifest.spec.source == "/nonexistent/tiny"
    assert node.sup.models["tiny"].file.endswith("t.yaml")
    assert node.sup.resolve("default").name == "demo" and "default" not in node.sup.models
    errors = {f.rsplit("/", 1)[-1]: " ".join(map(str, e))
              for f, e in node.sup.file_errors.items()}
    assert set(errors) == {"0-dup.yaml", "0-alias.yaml"}
    assert "'tiny' is already used by" in errors["0-dup.yaml"]
    assert "'default' is already used by" in errors["0-alias.yaml"]


async def test_max_queue_zero_serves_up_to_max_concurrency_and_refuses_the_rest(node):
    node.write("a", batching={"maxConcurrency": 1, "maxQueue": 0})
    await node.sup.reload()
    _, w = await _loaded(node, "a")
    lease = await node.sup.find("a").lease(time.monotonic() + 5)
    with pytest.raises(AdmissionError) as e:
        await node.sup.find("a").lease(time.monotonic() + 5)
    assert e.value.code == "queue_full" and e.value.headers["Retry-After"]
    lease.release()
    (await node.sup.find("a").lease(time.monotonic() + 5)).release()


async def test_a_crash_looping_model_does_not_hold_memory(tmp_path):
    f = FakeNode(tmp_path, memory_budget="1GB", backoff_base=30, backoff_cap=30,
                  busy_wait_timeout=0.2)
    try:
        f.write("bad", preload=True, cache={"memoryMB": 600})
        f.write("good", cache={"memoryMB": 600})
        await f.sup.reload()
        bad = f.sup.models["bad"]
        (await until(lambda: bad.starting)).fail_load("corrupt weights")
        await until(lambda: bad.phase is ModelPhase.BACKOFF)
        assert not bad.holds_memory
        rt, _ = await _loaded(f, "good")  # fits: the failing model's 600 MB are free
        assert rt.ready and f.sup.memory_status()["loaded"] == ["good"]
    finally:
        await f.close()


async def test_a_worker_that_stops_answering_is_killed_and_replaced(node):
    rt, w1 = await _preloaded(node, "a")
    w1.healthy = False
    await until(lambda: rt.starting)
    assert not rt.ready and w1.returncode == -9
    assert "stopped answering its health check (3 times" in rt.last_error
    (await until(lambda: rt.starting)).become_ready()
    await until(lambda: rt.ready)
    assert rt.current is not w1 and rt.restarts == 1


async def test_loader_changing_env_is_refused_unless_the_server_allows_it(tmp_path):
    for allowed, runs in (([], False), (["PYTHON*"], True)):
        f = FakeNode(tmp_path / str(runs), allow_worker_env=allowed)
        try:
            f.write("a", env={"PYTHONPATH": "/tmp/evil", "OMP_NUM_THREADS": "2"})
            f.write("b", env={"LD_PRELOAD": "/tmp/evil.so"})
            await f.sup.reload()
            assert ("a" in f.sup.models) is runs and "b" not in f.sup.models
            errors = " ".join(str(e) for es in f.sup.file_errors.values() for e in es)
            assert "LD_PRELOAD changes how the worker loads code" in errors
        finally:
            await f.close()


async def test_a_missing_manifests_folder_stops_nothing(node):
    import shutil

    node.write("a")
    await node.sup.reload()
    shutil.rmtree(node.dir)
    await node.sup.reload()
    assert "a" in node.sup.models and not node.sup.models["a"].removed
    node.dir.mkdir()
    await node.sup.reload()  # back, and empty: now the model goes
    assert "a" not in node.sup.models


def test_the_default_budget_says_where_it_comes_from(tmp_path, monkeypatch):
    import psutil

    from mlxfleet import accelerator
    from mlxfleet.accelerator import Accelerator, detect

    s = ServerSettings(manifests_dir=tmp_path)
    total = psutil.virtual_memory().total
    cpu = Accelerator("cpu", "cpu")
    monkeypatch.setattr(accelerator, "this_node", lambda: cpu)  # Linux, Intel Mac
    assert s.memory_budget_bytes() == (int(total * 0.7), "70% of physical memory")
    # On Apple Silicon, what Metal recommends. (No Metal here: its answer is simulated.)
    metal = Accelerator("metal", "Apple M2 Max", 48 << 30, "Metal recommended working set")
    monkeypatch.setattr(accelerator, "this_node", lambda: metal)
    assert s.memory_budget_bytes() == (48 << 30, "Metal recommended working set")
    # On an NVIDIA GPU, its memory (nvidia-smi's answer, simulated: no GPU here), not RAM:
    # the auto budget and a share alike
    h100 = detect("cuda", [("NVIDIA H100 80GB HBM3", 81559 << 20)])
    monkeypatch.setattr(accelerator, "this_node", lambda: h100)
    assert s.memory_budget_bytes() == (int((81559 << 20) * 0.9),
                                       "90% of NVIDIA H100 80GB HBM3's memory")
    share = ServerSettings(manifests_dir=tmp_path, memory_budget="50%")
    assert share.memory_budget_bytes()[0] == pytest.approx((81559 << 20) / 2, rel=1e-6)
    monkeypatch.setattr(accelerator, "this_node", lambda: cpu)
    s = ServerSettings(manifests_dir=tmp_path, memory_budget="12GB", wired_limit="50%")
    assert s.memory_budget_bytes() == (12 << 30, "set: 12GB")
    assert s.wired_limit_bytes() == total // 2
    with pytest.raises(ValueError):
        ServerSettings(manifests_dir=tmp_path, wired_limit="lots")


async def test_glob_aliases_route_what_no_exact_name_claims(node):
    node.write("local", aliases=["claude-*", "gpt-4o"])
    node.write("special", aliases=["claude-special"])
    await node.sup.reload()
    node.write("greedy", aliases=["claude-3*"])  # overlaps the running claude-*: an error
    await node.sup.reload()
    assert node.sup.resolve("claude-sonnet-4-5").name == "local"
    assert node.sup.resolve("claude-special").name == "special"  # exact beats a pattern
    assert node.sup.resolve("gpt-4o").name == "local"
    assert node.sup.resolve("gpt-5") is None
    assert "greedy" not in node.sup.models
    (err,) = node.sup.file_errors[str(node.dir / "greedy.yaml")]
    assert "overlaps" in err.message and "claude-*" in err.message
