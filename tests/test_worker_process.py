"""Worker process behaviour: disconnects, SIGTERM drain, Unix sockets, model sources."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from served import in_parallel, wait_for

MSGS = [{"role": "user", "content": "Tell me a long story."}]


def test_disconnected_clients_free_their_slots(start_worker):
    # The 10M model is slow enough that 1900 tokens outlast the test's reads.
    w = start_worker("--max-concurrency", "4", source="builtin:tiny-10m")
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 1900, "temperature": 0,
            "stream": True}
    # Four clients fill every slot, read a little, then hang up.
    clients = []
    for _ in range(4):
        c = w.client()
        resp = c.send(c.build_request("POST", "/v1/chat/completions", json=body),
                      stream=True)
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        clients.append((c, resp, lines))  # dropping `lines` would hang up now
    assert wait_for(lambda: w.status()["num_running"] == 4), w.status()
    for c, resp, _ in clients:
        resp.close()
        c.close()
    st = wait_for(lambda: (s := w.status())["num_running"] == 0 and s, timeout=5)
    assert st, w.status()
    assert st["cancelled_total"] == 4
    assert st["generation_tokens_total"] < 4 * 1900 / 2  # they did not run to the end

    # The next four requests get the whole batch again.
    client = openai.OpenAI(base_url=w.base_url + "/v1", api_key="x", max_retries=0)
    before = w.status()
    results = in_parallel(lambda: client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, temperature=0).usage.completion_tokens, 4)
    assert results == [200] * 4
    steps = w.status()["steps_executed"] - before["steps_executed"]
    assert steps < 2 * 200, steps  # ran together (sequentially it would take 800 steps)


def test_sigterm_drains_in_flight_requests(start_worker):
    w = start_worker()
    lines: list[str] = []
    with w.client() as c:
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": "tiny", "messages": MSGS, "max_tokens": 600,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
            for ln in r.iter_lines():
                if ln and not lines:  # the stream has begun: ask the worker to stop
                    w.proc.send_signal(signal.SIGTERM)
                lines += [ln] if ln else []
    assert w.proc.wait(30) == 0
    assert "terminate called" not in w.logs()  # no abort on the way out (issue #46: CUDA)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 600  # the stream ran to the end


def test_unix_socket_bind_with_openai_sdk(start_worker):
    w = start_worker(uds=True)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=w.uds))
    client = openai.OpenAI(base_url="http://worker/v1", api_key="x", http_client=http,
                           max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5)
    assert r.usage.completion_tokens == 5
    bench = subprocess.run([sys.executable, "-m", "mlxfleet", "bench", "--uds", w.uds,
                            "--model", "tiny", "-c", "2", "-n", "3", "--max-tokens", "4",
                            "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(bench.stdout)
    assert report["errors"] == 0 and report["output_tokens"] == 12, bench.stderr
    w.stop()
    assert not __import__("os").path.exists(w.uds)  # the socket is cleaned up


def test_make_model_writes_a_loadable_checkpoint(tmp_path, start_worker):
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "mlxfleet", "make-model", "builtin:tiny",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file()
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<tool_call>" in cfg["chat_template"] and "tools" in cfg["chat_template"]
    # A local directory is a model source; it serves like any other.
    w = start_worker(source=str(out), name="local")
    with w.client() as c:
        r = c.post("/v1/chat/completions",
                   json={"model": "local", "messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "local"

    bad = subprocess.run([sys.executable, "-m", "mlxfleet", "make-model", "builtin:nope",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "builtin:tiny" in bad.stderr


def test_unloadable_source_reports_error_and_503(start_worker, tmp_path):
    w = start_worker(source=str(tmp_path / "missing"), name="broken", wait=False)

    def failed():
        try:
            with w.client() as c:
                h = c.get("/health")
            return h.status_code == 503 and h.json()["state"] == "failed" and h.json()
        except httpx.TransportError:
            return False

    h = wait_for(failed, timeout=30)
    assert h, w.logs()
    assert "config.json" in h["error"]
    with w.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "broken", "messages": MSGS})
    assert r.status_code == 503
    assert "not available" in r.json()["error"]["message"]


def test_hub_source_offline_fails_cleanly(start_worker, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    w = start_worker(source="mlx-community/definitely-not-cached", name="hub", wait=False)
    h = wait_for(lambda: _health(w).get("state") == "failed" and _health(w), timeout=60)
    assert h, w.logs()


def _health(w) -> dict:
    try:
        with w.client() as c:
            return c.get("/health").json()
    except httpx.TransportError:
        return {}


@pytest.mark.parametrize("text", ["東京 café 🙂 naïve", "plain ascii", "✓ — “quotes”"])
def test_streaming_detokenizer_never_splits_utf8(text):
    """Feed a real tokenizer's tokens one at a time: no chunk holds half a character."""
    from mlx_lm import load

    from mlxfleet.builtin import ensure_builtin
    from mlxfleet.worker.decode import SequenceDecoder, special_token_ids

    _, tok = load(str(ensure_builtin("tiny")))
    ids = tok.encode(text)
    assert len(ids) > 1
    dec = SequenceDecoder(tok, [], special_token_ids(tok))
    chunks = [dec.feed(t, "length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)


def test_bytes_that_are_not_utf8_stream_at_once_instead_of_at_the_end():
    """A model that emits bytes that never form a character (untrained, or a small model
    gone astray) must not stall its stream: mlx-lm's detokenizer held them to the end.
    A character split over two tokens still comes out whole."""
    from mlx_lm import load
    from mlx_lm.tokenizer_utils import _byte_decoder

    from mlxfleet.builtin import ensure_builtin
    from mlxfleet.worker.decode import SequenceDecoder, special_token_ids

    _, tok = load(str(ensure_builtin("tiny")))
    char = {b: c for c, b in _byte_decoder().items()}
    ids = {b: tok.convert_tokens_to_ids(char[b]) for b in (0x80, 0xBF, 0xC3, 0xA9)}
    dec = SequenceDecoder(tok, [], special_token_ids(tok))
    feed = [(0x80, "\ufffd"), (0xBF, "\ufffd"), (0x80, "\ufffd"),  # stray continuations
            (0xC3, ""), (0xA9, "é"),  # é = C3 A9, split over two tokens
            (0x80, "\ufffd"), (0xC3, ""), (0xC3, "\ufffd"), (0xA9, "é")]
    got = [dec.feed(ids[b], None) for b, _ in feed]
    assert got == [want for _, want in feed]


def test_fast_blas_gives_the_same_greedy_tokens(start_worker, monkeypatch):
    """OpenBLAS (auto) and MLX's bundled BLAS (off) must agree on greedy output."""
    import sys as _sys

    if not _sys.platform.startswith("linux"):
        pytest.skip("the BLAS preload only exists on Linux")
    outputs = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv("MLXFLEET_BLAS", mode)
        w = start_worker(source="builtin:tiny-10m", name="blas")
        with w.client() as c:
            h = c.get("/health").json()
            outputs[mode] = (h["blas"], [c.post("/v1/completions", json={
                "model": "blas", "prompt": p, "max_tokens": 24, "temperature": 0,
                "logprobs": 0}).json()["choices"][0] for p in ("Hello world", "The capital of")])
        w.stop()
    (off_blas, off), (auto_blas, auto) = outputs["off"], outputs["auto"]
    assert off_blas == "bundled"
    assert auto_blas != "bundled", "no OpenBLAS found: scripts/setup.sh installs it"
    for a, b in zip(off, auto):
        assert a["text"] == b["text"]
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]


def test_openblas_threads_spin_briefly_unless_the_user_says_otherwise():
    """A worker's OpenBLAS threads sleep soon after a matmul (they spun ~0.1 s after each,
    keeping every core busy while the worker ran Python); a user's own setting is kept,
    and nothing is set when no OpenBLAS is loaded."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the BLAS preload only exists on Linux")
    code = ("from mlxfleet.blas import preload_blas; b = preload_blas(); import os; "
            "print(b, os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")

    def run(**env: str) -> list[str]:
        base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
        return subprocess.run([sys.executable, "-c", code], env={**base, **env},
                              capture_output=True, text=True, check=True).stdout.split()

    blas, timeout = run(MLXFLEET_BLAS="auto")
    assert blas != "bundled", "no OpenBLAS found: scripts/setup.sh installs it"
    assert timeout == "20"
    assert run(MLXFLEET_BLAS="auto", OPENBLAS_THREAD_TIMEOUT="22")[1] == "22"
    assert run(MLXFLEET_BLAS="off") == ["bundled", "None"]


def test_stop_strings_end_the_sequence_where_the_tokens_are_made():
    """The engine-side decoder cuts a stop string that spans tokens and says which one."""
    from mlx_lm import load

    from mlxfleet.builtin import ensure_builtin
    from mlxfleet.worker.decode import SequenceDecoder, special_token_ids

    _, tok = load(str(ensure_builtin("tiny")))
    ids = tok.encode("the cat sat on the mat and more")
    dec = SequenceDecoder(tok, ["on the", "zebra"], special_token_ids(tok))
    out = ""
    for t in ids:
        out += dec.feed(t, None)
        if dec.finish_reason:
            break
    assert out == "the cat sat " and dec.finish_reason == "stop"
    assert dec.stop_sequence == "on the"


def test_a_text_worker_does_not_load_torch(worker):
    """transformers imports torch whenever it is installed (this test environment has
    it, for the embeddings reference): 3 s of every cold start and 180 MiB per worker
    (benchmarks/cold_start.py). A text worker never computes with it."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: nothing to hide")
    with worker.client() as c:  # the model is loaded and has answered
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                   "max_tokens": 2}).is_success
    maps = Path(f"/proc/{worker.proc.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc here")
    assert "libtorch" not in maps.read_text()


def test_the_warm_up_runs_before_ready_and_leaves_no_trace(start_worker):
    """Before Ready the engine runs a lone prompt and a small batch, so that kernels MLX
    builds on first use are not built in a user's first burst (issue #46). None of it is
    a user's: nothing counted, cached or measured, and the first answer is the one a
    worker without the warm-up gives."""
    w = start_worker()
    assert "warmed up in" in w.logs()
    st = w.status()
    counts = ("requests_total", "steps_executed", "generation_tokens_total",
              "prompt_tokens_total")
    assert [st[k] for k in counts] == [0, 0, 0, 0], st
    assert st["prompt_cache"]["entries"] == 0 and st["prompt_cache"]["misses"] == 0
    assert st["speculation"]["steps"] == 0 and st["speculation"]["draft_tokens"] == 0
    cold = start_worker("--config", json.dumps({"source": "builtin:tiny", "warmup": False}))
    assert "warmed up" not in cold.logs()
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "The quick brown fox jumps"}]}
    answers = [x.client().post("/v1/chat/completions", json=body).json() for x in (w, cold)]
    assert answers[0]["choices"][0]["message"]["content"] \
        == answers[1]["choices"][0]["message"]["content"]
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
