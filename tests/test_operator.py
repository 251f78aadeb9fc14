"""The operator end to end: a real supervisor, real manifest files, real signals."""

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
from fleet import Fleet, in_parallel, manifest, wait_for


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.stop()


def test_files_added_edited_and_deleted_drive_the_models(fleet):
    fleet.write("a.yaml", manifest("alpha", aliases=["default", "gpt-4o-mini"]))
    fleet.start()
    a = fleet.wait_ready("alpha")
    assert fleet.chat("alpha").usage.completion_tokens == 4
    assert fleet.chat("gpt-4o-mini").model == "alpha"  # aliases route

    # Adding a file adds a model; the first one keeps its process.
    fleet.write("b.yaml", manifest("beta"))
    b = fleet.wait_ready("beta")
    assert fleet.chat("beta").model == "beta"
    assert fleet.status("alpha")["pid"] == a["pid"]

    # Two models answer at the same time.
    def ask(m):
        return fleet.chat(m, max_tokens=50).usage.completion_tokens

    assert in_parallel(ask, [("alpha",), ("beta",)]) == [50, 50]

    # Editing beta's spec replaces beta only.
    fleet.write("b.yaml", manifest("beta", defaults={"maxTokens": 7}))
    b2 = fleet.wait_ready("beta", pid_not=b["pid"])
    assert b2["observedGeneration"] == b2["generation"] == 2
    assert fleet.openai().chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "x"}]).usage.completion_tokens == 7
    assert fleet.status("alpha")["pid"] == a["pid"]
    assert not psutil.pid_exists(b["pid"]) or wait_for(
        lambda: not psutil.pid_exists(b["pid"]), 20)

    # An alias-only change reroutes without a restart.
    fleet.write("a.yaml", manifest("alpha", aliases=["chat"]))
    assert wait_for(lambda: fleet.status("alpha")["aliases"] == ["chat"], 10)
    assert fleet.chat("chat").model == "alpha"
    assert fleet.status("alpha")["pid"] == a["pid"]
    with pytest.raises(openai.NotFoundError):
        fleet.chat("gpt-4o-mini")

    # Deleting a file stops that model: 404 afterwards, naming what exists.
    os.unlink(fleet.dir / "b.yaml")
    assert wait_for(lambda: fleet.status("beta") is None, 10)
    with pytest.raises(openai.NotFoundError) as e:
        fleet.chat("beta")
    assert "alpha" in str(e.value)
    assert wait_for(lambda: not psutil.pid_exists(b2["pid"]), 20)
    models = httpx.get(fleet.url + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [("alpha", "alpha"), ("chat", "alpha")]
    retrieved = fleet.openai().models.retrieve("chat")  # the SDK's models.retrieve
    assert retrieved.id == "chat" and retrieved.model_extra["root"] == "alpha"
    with pytest.raises(openai.NotFoundError):
        fleet.openai().models.retrieve("beta")


def test_spec_change_mid_stream_loses_nothing(fleet):
    # tiny-10m is slow enough on CPU that a 1500-token stream spans the rollout.
    fleet.write("m.yaml", manifest("slow", source="builtin:tiny-10m"))
    # The old worker drains its stream for as long as the stream takes: on a loaded
    # 2-core machine that can pass the fleet's usual 20 s.
    fleet.env["MLXFLEET_DRAIN_TIMEOUT"] = "120"
    fleet.start()
    old = fleet.wait_ready("slow")
    got = {}

    def stream():
        chunks = list(fleet.openai().chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "go"}], max_tokens=1500,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        got["usage"] = chunks[-1].usage
        got["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: fleet.status("slow")["inflight"] == 1, 10)
    fleet.write("m.yaml", manifest("slow", source="builtin:tiny-10m",
                                   defaults={"temperature": 0.5}))
    new = fleet.wait_ready("slow", pid_not=old["pid"])
    # Traffic moved while the old stream is still running on the old worker.
    assert psutil.pid_exists(old["pid"])
    assert fleet.chat("slow").model == "slow"
    t.join(120)
    assert got["finish"] == "length" and got["usage"].completion_tokens == 1500
    assert wait_for(lambda: not psutil.pid_exists(old["pid"]), 20)
    assert fleet.status("slow")["pid"] == new["pid"]


def test_broken_yaml_keeps_the_last_good_spec_serving(fleet):
    fleet.write("a.yaml", manifest("alpha"))
    fleet.start()
    a = fleet.wait_ready("alpha")
    fleet.write("a.yaml", "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: alpha\n")
    errs = wait_for(lambda: fleet.models()["_errors"], 10)
    assert errs and "invalid YAML" in json.dumps(errs)
    st = fleet.status("alpha")
    assert st["pid"] == a["pid"] and st["ready"]
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["ManifestValid"]["status"] == "False"
    assert fleet.chat("alpha").usage.completion_tokens == 4
    # A valid file with a bad field is an error too, and names it.
    fleet.write("a.yaml", manifest("alpha", batching={"maxConcurrency": "lots"}))
    assert wait_for(lambda: "maxConcurrency" in json.dumps(fleet.models()["_errors"]), 10)
    out = fleet.cli("get", "models")
    assert "maxConcurrency" in out.stderr and "alpha" in out.stdout
    assert fleet.status("alpha")["pid"] == a["pid"]
    # Fixing the file clears the error, still without a restart.
    fleet.write("a.yaml", manifest("alpha"))
    assert wait_for(lambda: not fleet.models()["_errors"], 10)
    assert fleet.status("alpha")["pid"] == a["pid"]


def test_killed_worker_restarts_with_backoff(fleet):
    fleet.write("a.yaml", manifest("alpha"))
    fleet.start()
    a = fleet.wait_ready("alpha")
    os.kill(a["pid"], signal.SIGKILL)
    b = fleet.wait_ready("alpha", pid_not=a["pid"])
    assert b["restarts"] == 1
    assert any(e["reason"] == "WorkerCrashed" for e in b["events"])
    assert len(fleet.sockets()) == 1  # the dead worker's socket file went with it
    assert fleet.chat("alpha").usage.completion_tokens == 4


def test_a_frozen_worker_is_restarted_and_requests_end_at_their_deadline(tmp_path):
    f = Fleet(tmp_path, env={"MLXFLEET_HEALTH_INTERVAL": "1", "MLXFLEET_TIMEOUT": "4"})
    try:
        f.write("a.yaml", manifest("alpha"))
        f.start()
        a = f.wait_ready("alpha")
        os.kill(a["pid"], signal.SIGSTOP)  # alive, but answers nothing
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            f.chat("alpha")
        assert e.value.status_code in (503, 504) and time.monotonic() - t0 < 10
        b = f.wait_ready("alpha", pid_not=a["pid"], timeout=60)
        assert any("stopped answering its health check" in ev["message"]
                   for ev in b["events"])
        assert f.chat("alpha").usage.completion_tokens == 4
    finally:
        f.stop()


def test_serve_on_a_busy_port_fails_fast_with_one_line(fleet):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", fleet.port))
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "mlxfleet", "serve", "--manifests",
                            str(fleet.dir), "--port", str(fleet.port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{fleet.port}" in r.stderr


def test_a_model_that_cannot_load_backs_off_instead_of_looping(fleet, tmp_path):
    fleet.write("bad.yaml", manifest("broken", source=str(tmp_path / "nowhere")))
    fleet.write("ok.yaml", manifest("fine"))
    fleet.start()
    fleet.wait_ready("fine")
    st = wait_for(lambda: (s := fleet.status("broken"))["phase"] == "CrashLoopBackOff" and s)
    assert st and "config.json" in st["lastError"]
    time.sleep(4)
    restarts = fleet.status("broken")["restarts"]
    # Backoff 0.5s doubling: in ~5s at most a handful of attempts, never a tight loop.
    assert 1 <= restarts <= 4, restarts
    r = httpx.post(fleet.url + "/v1/chat/completions",
                   json={"model": "broken", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert "config.json" in r.json()["error"]["message"]
    assert fleet.chat("fine").usage.completion_tokens == 4  # others are unaffected


def test_a_deep_runtime_dir_and_the_longest_name_still_serve(tmp_path):
    # A socket path over 104 bytes cannot be bound on macOS: the worker crash-looped on
    # "AF_UNIX path too long" when the model's name went into it under a deep folder.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    name = "m" * 63  # the longest name a manifest allows
    f = Fleet(tmp_path / "f", env={"XDG_RUNTIME_DIR": str(deep)})
    f.write("m.yaml", manifest(name))
    try:
        f.start()
        f.wait_ready(name)
        assert f.chat(name).usage.completion_tokens == 4
        assert "too deep for socket paths" in f.logs()
    finally:
        f.stop()


def test_killing_the_supervisor_leaves_no_orphans(fleet):
    fleet.write("a.yaml", manifest("alpha"))
    fleet.write("b.yaml", manifest("beta"))
    fleet.start()
    pids = [fleet.wait_ready(n)["pid"] for n in ("alpha", "beta")]
    fleet.proc.send_signal(signal.SIGKILL)
    fleet.proc.wait()
    gone = wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                    != psutil.STATUS_ZOMBIE for p in pids), timeout=10)
    assert gone, [p for p in pids if psutil.pid_exists(p)]
    # Its socket folder is left behind; the next start removes it.
    old = list(fleet.run_dir.glob("mlxfleet-*"))
    assert len(old) == 1
    fleet.start()
    fleet.wait_ready("alpha")
    fleet.wait_ready("beta")
    new = list(fleet.run_dir.glob("mlxfleet-*"))
    assert len(new) == 1 and new != old
    assert len(fleet.sockets()) == 2
    fleet.stop()
    assert not list(fleet.run_dir.glob("mlxfleet-*"))


def test_sigterm_drains_and_stops_workers(fleet):
    fleet.write("a.yaml", manifest("alpha", source="builtin:tiny-10m"))
    fleet.start()
    pid = fleet.wait_ready("alpha")["pid"]
    got = {}

    def stream():
        chunks = list(fleet.openai().chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "go"}], max_tokens=400,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        got["tokens"] = chunks[-1].usage.completion_tokens

    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: fleet.status("alpha")["inflight"] == 1, 10)
    fleet.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert fleet.proc.wait(60) == 0
    assert got["tokens"] == 400
    assert not psutil.pid_exists(pid)


def test_worker_crash_mid_stream_ends_with_an_error_event(fleet):
    fleet.write("a.yaml", manifest("alpha", source="builtin:tiny-10m"))
    fleet.start()
    pid = fleet.wait_ready("alpha")["pid"]
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", timeout=30,
                      json={"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 1500, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        os.kill(pid, signal.SIGKILL)
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][len("data: "):])
    assert err["error"]["code"] == "worker_failed"
    pid = fleet.wait_ready("alpha", pid_not=pid)["pid"]  # and it comes back
    # The Responses API's error event takes the next sequence_number, as its SDKs expect
    with httpx.stream("POST", fleet.url + "/v1/responses", timeout=30,
                      json={"model": "alpha", "input": "x", "max_output_tokens": 1500,
                            "stream": True}) as r:
        lines = r.iter_lines()
        events = []
        while len(events) < 6:
            ln = next(lines)
            if ln.startswith("data: "):
                events.append(json.loads(ln[len("data: "):]))
        os.kill(pid, signal.SIGKILL)
        events += [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "worker_failed", events[-1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    fleet.wait_ready("alpha", pid_not=pid)


def test_cli_get_describe_logs_apply_delete(fleet, tmp_path):
    fleet.start()
    assert "No models." in fleet.cli("get", "models").stdout
    f = tmp_path / "new.yaml"
    f.write_text("# my model\n" + manifest("gamma", aliases=["g"]))
    r = fleet.cli("apply", "-f", str(f))
    assert r.returncode == 0 and "model/gamma created" in r.stdout, r.stderr
    assert (fleet.dir / "gamma.yaml").read_text().startswith("# my model")
    fleet.wait_ready("gamma")
    out = fleet.cli("get", "models").stdout
    assert out.split("\n")[0].split() == ["NAME", "SOURCE", "STATE", "READY", "RESTARTS",
                                          "MEMORY", "AGE"]
    assert "gamma" in out and "Ready" in out and "1/1" in out
    d = fleet.cli("describe", "model", "gamma").stdout
    assert "Phase:         Ready" in d and "WorkerReady" in d and "Events:" in d
    logs = fleet.cli("logs", "gamma", "--tail", "50").stdout
    assert "loaded builtin:tiny" in logs
    # Re-applying an unchanged file is a no-op; a changed one configures in place.
    assert "unchanged" in fleet.cli("apply", "-f", str(f)).stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest("delta", bogus=1))
    r = fleet.cli("apply", "-f", str(bad))
    assert r.returncode != 0 and "spec.bogus" in r.stderr and "unknown field" in r.stderr
    clash = tmp_path / "clash.yaml"
    clash.write_text(manifest("delta", aliases=["g"]))
    r = fleet.cli("apply", "-f", str(clash))
    assert r.returncode != 0 and "already used" in r.stderr
    r = fleet.cli("delete", "model", "gamma")
    assert r.returncode == 0 and "deleted" in r.stdout
    assert not (fleet.dir / "gamma.yaml").exists()
    assert wait_for(lambda: fleet.status("gamma") is None, 10)
    r = fleet.cli("describe", "model", "gamma")
    assert r.returncode != 0 and "No model named 'gamma'" in r.stderr


def test_cli_without_a_server_says_so(tmp_path):
    f = Fleet(tmp_path)  # never started
    r = f.cli("get", "models")
    assert r.returncode != 0 and "no mlxfleet server at" in r.stderr


def test_serve_source_quick_start(tmp_path):
    import subprocess
    import sys

    from conftest import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlxfleet", "serve", "builtin:tiny",
                             "--port", str(port), "--state-dir", str(tmp_path / "s")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)

        def ready():
            try:
                return [m.id for m in client.models.list().data if m.model_extra["ready"]
                        and m.model_extra["root"] == m.id]
            except openai.APIConnectionError:
                return None

        assert wait_for(ready, 60) == ["tiny"]
        for name in ("tiny", "default"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()


def test_logs_follow_streams_new_lines(fleet):
    import subprocess
    import sys

    fleet.write("a.yaml", manifest("alpha"))
    fleet.start()
    fleet.wait_ready("alpha")
    proc = subprocess.Popen([sys.executable, "-m", "mlxfleet", "logs", "alpha", "-f",
                             "--tail", "1"], stdout=subprocess.PIPE, text=True,
                            env=fleet.env)
    try:
        proc.stdout.readline()  # the tail
        # A request makes the worker log a line; -f must show it as it is written.
        fleet.chat("alpha", extra_headers={"X-Request-Id": "follow-me"})
        seen = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "request follow-me:" in line:
                break
        assert any("request follow-me:" in ln for ln in seen), seen
    finally:
        proc.kill()
        proc.wait()
