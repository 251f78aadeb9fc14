"""Keep-alive, on-demand loading, memory-aware eviction and prompt-cache budgets."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from served import Served, in_parallel, manifest, wait_for

from mlxfleet.supervisor.scheduler import Candidate, plan_load
from mlxfleet.units import parse_memory

MSG = [{"role": "user", "content": "hi"}]
MB = 1 << 20


# ---- the pure decision ---------------------------------------------------------

def c(name, mb, loaded=True, busy=False, pinned=False, priority=0, last_used=0.0):
    return Candidate(name, mb * MB, loaded, busy, pinned, priority, last_used)


def test_plan_load_fits_without_eviction():
    assert plan_load(c("x", 100), [c("a", 100)], 300 * MB).evict == []


def test_plan_load_evicts_idle_lru_lower_priority_first():
    others = [c("old", 100, last_used=1), c("new", 100, last_used=2),
              c("vip", 100, last_used=0, priority=5)]
    p = plan_load(c("x", 150), others, 300 * MB)
    assert p.ok and p.evict == ["old", "new"]
    assert plan_load(c("x", 50), others, 300 * MB).evict == ["old"]


def test_plan_load_never_evicts_busy_or_pinned():
    p = plan_load(c("x", 100), [c("busy", 100, busy=True), c("pin", 100, pinned=True)],
                  250 * MB)
    assert not p.ok and p.wait  # the busy one will go idle
    assert "busy: busy" in p.message and "pin: pinned" in p.message
    assert "needs 100.0 MB" in p.message and "50.0 MB free" in p.message
    p = plan_load(c("x", 100), [c("pin", 200, pinned=True)], 250 * MB)
    assert not p.ok and not p.wait


def test_plan_load_respects_max_loaded_models_and_unloaded_models():
    others = [c("a", 1, last_used=2), c("b", 1, last_used=1), c("off", 1, loaded=False)]
    assert plan_load(c("x", 1), others, 1000 * MB, max_loaded=2).evict == ["b"]
    assert plan_load(c("x", 1), others, 1000 * MB, max_loaded=3).evict == []


def test_plan_load_too_big_for_the_budget():
    p = plan_load(c("x", 500), [], 400 * MB)
    assert not p.ok and "whole memory budget" in p.message


@pytest.mark.parametrize("value,expected", [
    ("12GB", 12 << 30), ("512MiB", 512 << 20), ("50%", 500), ("0.25", 250), (2048, 2048),
    ("1.5g", int(1.5 * (1 << 30)))])
def test_parse_memory(value, expected):
    assert parse_memory(value, 1000) == expected


# ---- end to end ------------------------------------------------------------------

@pytest.fixture
def served(tmp_path):
    f = Served(tmp_path, env={"MLXFLEET_REQUEST_WAIT_TIMEOUT": "20"})
    yield f
    f.stop()


def _phase(served, name):
    return served.status(name)["phase"]


def _long_stream(served, model: str, max_tokens: int, got: dict) -> threading.Thread:
    """Start a greedy streaming request in a thread; its token count lands in got."""

    def run():
        chunks = list(served.openai().chat.completions.create(
            model=model, messages=MSG, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        got["tokens"] = chunks[-1].usage.completion_tokens

    t = threading.Thread(target=run)
    t.start()
    return t


def test_keep_alive_unloads_when_idle_but_never_mid_stream(served):
    # (no speculation: tiny-10m repeats one token, which drafts would finish at once)
    served.write("a.yaml", manifest("slow", source="builtin:tiny-10m", keepAlive="1s",
                                   speculative={"mode": "off"}))
    served.start()
    pid = served.wait_ready("slow")["pid"]
    got = {}
    t0 = time.monotonic()
    t = _long_stream(served, "slow", 500, got)
    # Well past the 1s keep-alive, the model is still loaded while it streams.
    while t.is_alive() and time.monotonic() - t0 < 3:
        assert served.status("slow")["pid"] == pid
        time.sleep(0.2)
    assert time.monotonic() - t0 >= 2.5, "stream too short to test keep-alive"
    t.join(120)
    assert got["tokens"] == 500
    st = wait_for(lambda: (s := served.status("slow"))["phase"] == "Unloaded" and s, 10)
    assert st and st["pid"] is None and not st["loaded"]
    assert wait_for(lambda: not psutil.pid_exists(pid), 10)
    assert any(e["reason"] == "Unloading" and "keepAlive" in e["message"]
               for e in st["events"])
    # A request brings it back.
    assert served.chat("slow").usage.completion_tokens == 4


def test_keep_alive_zero_forever_and_per_request(served):
    served.write("a.yaml", manifest("zero", keepAlive=0, preload=False))
    served.write("b.yaml", manifest("always", keepAlive="forever", preload=False))
    served.start()
    assert _phase(served, "zero") == "Unloaded"  # not preloaded: loads on demand
    assert served.chat("zero").usage.completion_tokens == 4
    assert wait_for(lambda: _phase(served, "zero") == "Unloaded", 10)
    assert served.chat("always").usage.completion_tokens == 4
    # (that a forever model is never unloaded by a timer is test_scheduler.py's table)
    st = served.status("always")
    assert st["ready"] and st["expiresAt"] is None
    # A request's keep_alive (Ollama's semantics) sets the model's keep-alive.
    served.chat("zero", extra_body={"keep_alive": "1h"})
    st = wait_for(lambda: (s := served.status("zero"))["keepAlive"] == 3600 and s, 10)
    assert st and st["ready"] and st["expiresAt"]
    served.chat("always", extra_body={"keep_alive": 0})
    assert wait_for(lambda: _phase(served, "always") == "Unloaded", 10)
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"model": "zero", "messages": MSG, "keep_alive": "soonish"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_concurrent_first_requests_share_one_load(served):
    served.write("a.yaml", manifest("lazy", preload=False))
    served.start()
    results = in_parallel(lambda: served.chat("lazy").usage.completion_tokens, 10)
    assert results == [4] * 10
    st = served.status("lazy")
    spawns = [e for e in st["events"] if e["reason"] == "Loading"]
    assert len(spawns) == 1, st["events"]
    assert st["restarts"] == 0
    log = (served.state / "logs" / "lazy.log").read_text()
    assert log.count("starting worker lazy") == 1


def test_streaming_request_for_an_unloaded_model_waits_and_streams(tmp_path):
    f = Served(tmp_path, env={"MLXFLEET_SSE_KEEPALIVE_INTERVAL": "0.1"})
    f.write("a.yaml", manifest("lazy", preload=False))
    f.start()
    try:
        with httpx.stream("POST", f.url + "/v1/chat/completions", timeout=60, json={
                "model": "lazy", "messages": MSG, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        # Comment lines keep the connection alive while the worker starts (over a second).
        assert lines[0] == ": loading model lazy"
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert data[-1]["usage"]["completion_tokens"] == 6 and lines[-1] == "data: [DONE]"
        chunks = list(f.openai().chat.completions.create(  # the SDK skips the comments
            model="lazy", messages=MSG, max_tokens=3, stream=True))
        assert chunks
    finally:
        f.stop()


def test_a_failed_load_answers_every_waiter_with_its_error(served, tmp_path):
    served.write("a.yaml", manifest("broken", source=str(tmp_path / "nope"), preload=False))
    served.start()
    def ask():
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                       json={"model": "broken", "messages": MSG})
        return r.status_code, r.json()["error"]["message"], r.headers

    codes = in_parallel(ask, 3)
    assert len(codes) == 3
    for status, message, headers in codes:
        assert status == 503 and "config.json" in message and "Retry-After" in headers
    assert served.status("broken")["phase"] == "Failed"


def test_full_load_queue_gets_503_with_retry_after(served):
    served.write("a.yaml", manifest("lazy", source="builtin:tiny-10m", preload=False,
                                   batching={"maxConcurrency": 1, "maxQueue": 1}))
    served.start()
    out = in_parallel(lambda: httpx.post(
        served.url + "/v1/chat/completions", timeout=60,
        json={"model": "lazy", "messages": MSG, "max_tokens": 2}), 6)
    full = [r for r in out if r.status_code == 503]
    assert full and all(r.json()["error"]["code"] == "queue_full" and
                        r.headers["Retry-After"] for r in full)
    assert any(r.status_code == 200 for r in out)


def test_memory_budget_evicts_lru_idle_never_busy_or_pinned(tmp_path):
    # Each model is budgeted at 300 MB overhead + 200 MB cache (+ tiny weights):
    # 1.2 GB holds two of them, not three.
    f = Served(tmp_path, env={"MLXFLEET_MEMORY_BUDGET": "1200MB",
                             "MLXFLEET_WORKER_OVERHEAD_MB": "300",
                             "MLXFLEET_BUSY_WAIT_TIMEOUT": "3",
                             "MLXFLEET_HEALTH_FAILURES": "1000"})  # (b is frozen below)
    spec = dict(preload=False, cache={"memoryMB": 200}, keepAlive="forever")
    f.write("a.yaml", manifest("a", **spec))
    f.write("b.yaml", manifest("b", source="builtin:tiny-10m", speculative={"mode": "off"},
                               **spec))  # (b's streams must last: no drafts, see above)
    f.write("c.yaml", manifest("c", **spec))
    f.start()
    try:
        f.chat("a")
        f.chat("b")
        b_pid = f.status("b")["pid"]
        # c needs room: a is the least recently used idle model.
        f.chat("c")
        assert wait_for(lambda: f.status("a")["phase"] == "Unloaded", 10)
        assert f.status("b")["pid"] == b_pid and f.status("c")["ready"]
        assert any("evicted to make room for 'c'" in e["message"]
                   for e in f.status("a")["events"])
        mem = f.models()  # noqa: F841 - the list call must work with memory info
        listing = httpx.get(f.url + "/mlxfleet/v1/models").json()["memory"]
        assert listing["budgetBytes"] == 1200 * MB and listing["usedBytes"] <= 1200 * MB

        # b streams a long answer; a request for a must evict idle c, not busy b. (b is
        # frozen mid-stream meanwhile, so it is surely busy however fast it decodes.)
        got = {}
        t = _long_stream(f, "b", 500, got)
        assert wait_for(lambda: f.status("b")["inflight"] == 1, 10)
        os.kill(b_pid, signal.SIGSTOP)
        try:
            f.chat("a")
        finally:
            os.kill(b_pid, signal.SIGCONT)
        assert f.status("c")["phase"] == "Unloaded"
        assert f.status("b")["pid"] == b_pid
        t.join(120)
        assert got["tokens"] == 500  # the stream completed intact

        # Pin a; keep b busy: nothing can make room for c -> 503 that explains.
        f.write("a.yaml", manifest("a", **{**spec, "pinned": True}))
        assert wait_for(lambda: f.status("a")["pinned"], 10)
        t = _long_stream(f, "b", 500, got)
        assert wait_for(lambda: f.status("b")["inflight"] == 1, 10)
        # Frozen mid-stream (SIGSTOP), b is surely still busy when c asks, however fast
        # this machine decodes.
        os.kill(b_pid, signal.SIGSTOP)
        try:
            r = httpx.post(f.url + "/v1/chat/completions", timeout=60,
                           json={"model": "c", "messages": MSG})
        finally:
            os.kill(b_pid, signal.SIGCONT)
        t.join(120)
        assert r.status_code == 503 and r.headers["Retry-After"]
        msg = r.json()["error"]["message"]
        assert "needs" in msg and "free" in msg, msg
        assert "a: pinned" in msg and "b: busy" in msg, msg
        # Once b is idle, c may evict it (a stays: pinned).
        f.chat("c")
        assert f.status("a")["ready"] and f.status("b")["phase"] == "Unloaded"
        # The table shows the memory picture.
        out = f.cli("get", "models", "-o", "wide").stdout
        assert "memory:" in out and "budget (set: 1200MB)" in out and "EXPIRES" in out
    finally:
        f.stop()


def test_explicit_load_and_unload(served):
    served.write("a.yaml", manifest("lazy", preload=False))
    served.start()
    r = served.cli("load", "lazy")
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr
    assert served.status("lazy")["ready"]
    r = served.cli("unload", "lazy")
    assert r.returncode == 0 and "unloaded" in r.stdout
    assert served.status("lazy")["phase"] == "Unloaded"
    r = served.cli("load", "nope")
    assert r.returncode != 0 and "No model named" in r.stderr


def test_prompt_cache_hits_and_stays_within_budget(start_worker):
    w = start_worker("--cache-mb", "1")
    client = openai.OpenAI(base_url=w.base_url + "/v1", api_key="x", max_retries=0)
    long = "The quick brown fox jumps over the lazy dog. " * 30
    first = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": long}])
    again = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": long}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    budget = 1 << 20
    for i in range(60):  # about six entries fit: many evictions
        client.completions.create(model="tiny", prompt=f"{i} {long} {i}", max_tokens=2)
        if i % 10 == 0:
            pc = w.status()["prompt_cache"]
            assert pc["bytes"] <= budget, pc
    pc = w.status()["prompt_cache"]
    assert pc["bytes"] <= budget and pc["evictions"] > 0
    assert sum(pc["hits"].values()) >= 1 and pc["misses"] >= 1
    assert json.dumps(pc)  # reported in the worker's status
