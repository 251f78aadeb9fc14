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
from served import Served, in_parallel, manifest, wait_for


@pytest.fixture
def served(tmp_path):
    f = Served(tmp_path)
    yield f
    f.stop()


def test_files_added_edited_and_deleted_drive_the_models(served):
    served.write("a.yaml", manifest("alpha", aliases=["default", "gpt-4o-mini"]))
    served.start()
    a = served.wait_ready("alpha")
    assert served.chat("alpha").usage.completion_tokens == 4
    assert served.chat("gpt-4o-mini").model == "alpha"  # aliases route

    # Adding a file adds a model; the first one keeps its process.
    served.write("b.yaml", manifest("beta"))
    b = served.wait_ready("beta")
    assert served.chat("beta").model == "beta"
    assert served.status("alpha")["pid"] == a["pid"]

    # Two models answer at the same time.
    def ask(m):
        return served.chat(m, max_tokens=50).usage.completion_tokens

    assert in_parallel(ask, [("alpha",), ("beta",)]) == [50, 50]

    # Editing beta's spec replaces beta only.
    served.write("b.yaml", manifest("beta", defaults={"maxTokens": 7}))
    b2 = served.wait_ready("beta", pid_not=b["pid"])
    assert b2["observedGeneration"] == b2["generation"] == 2
    assert served.openai().chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "x"}]).usage.completion_tokens == 7
    assert served.status("alpha")["pid"] == a["pid"]
    assert not psutil.pid_exists(b["pid"]) or wait_for(
        lambda: not psutil.pid_exists(b["pid"]), 20)

    # An alias-only change reroutes without a restart.
    served.write("a.yaml", manifest("alpha", aliases=["chat"]))
    assert wait_for(lambda: served.status("alpha")["aliases"] == ["chat"], 10)
    assert served.chat("chat").model == "alpha"
    assert served.status("alpha")["pid"] == a["pid"]
    with pytest.raises(openai.NotFoundError):
        served.chat("gpt-4o-mini")

    # Deleting a file stops that model: 404 afterwards, naming what exists.
    os.unlink(served.dir / "b.yaml")
    assert wait_for(lambda: served.status("beta") is None, 10)
    with pytest.raises(openai.NotFoundError) as e:
        served.chat("beta")
    assert "alpha" in str(e.value)
    assert wait_for(lambda: not psutil.pid_exists(b2["pid"]), 20)
    models = httpx.get(served.url + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [("alpha", "alpha"), ("chat", "alpha")]
    retrieved = served.openai().models.retrieve("chat")  # the SDK's models.retrieve
    assert retrieved.id == "chat" and retrieved.model_extra["root"] == "alpha"
    with pytest.raises(openai.NotFoundError):
        served.openai().models.retrieve("beta")


def _sigterm_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM waiting (a stopped process keeps it pending)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def test_spec_change_mid_stream_loses_nothing(served):
    served.write("m.yaml", manifest("slow", source="builtin:tiny-10m"))
    served.env["MLXFLEET_DRAIN_TIMEOUT"] = "120"
    # The old worker is frozen below while the new one starts: its missed health
    # checks must not get it killed.
    served.env["MLXFLEET_HEALTH_FAILURES"] = "1000"
    served.start()
    old = served.wait_ready("slow")
    got = {}
    started = threading.Event()

    def stream():
        chunks = []
        for c in served.openai().chat.completions.create(
                model="slow", messages=[{"role": "user", "content": "go"}], max_tokens=300,
                temperature=0, stream=True, stream_options={"include_usage": True}):
            chunks.append(c)
            started.set()
        got["usage"] = chunks[-1].usage
        got["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    # Frozen mid-stream (a real SIGSTOP), the old worker's stream surely spans the
    # rollout however fast the machine decodes or slowly it starts the new worker.
    os.kill(old["pid"], signal.SIGSTOP)
    try:
        served.write("m.yaml", manifest("slow", source="builtin:tiny-10m",
                                       defaults={"temperature": 0.5}))
        new = served.wait_ready("slow", pid_not=old["pid"])
        # Traffic moved, and the old worker is not told to stop while its stream is open.
        assert served.chat("slow").model == "slow"
        assert not _sigterm_pending(old["pid"])
    finally:
        os.kill(old["pid"], signal.SIGCONT)
    t.join(120)
    assert got["finish"] == "length" and got["usage"].completion_tokens == 300
    assert wait_for(lambda: not psutil.pid_exists(old["pid"]), 20)
    assert served.status("slow")["pid"] == new["pid"]


def test_broken_yaml_keeps_the_last_good_spec_serving(served):
    served.write("a.yaml", manifest("alpha"))
    served.start()
    a = served.wait_ready("alpha")
    served.write("a.yaml", "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: alpha\n")
    errs = wait_for(lambda: served.models()["_errors"], 10)
    assert errs and "invalid YAML" in json.dumps(errs)
    st = served.status("alpha")
    assert st["pid"] == a["pid"] and st["ready"]
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["ManifestValid"]["status"] == "False"
    assert served.chat("alpha").usage.completion_tokens == 4
    # A valid file with a bad field is an error too, and names it.
    served.write("a.yaml", manifest("alpha", batching={"maxConcurrency": "lots"}))
    assert wait_for(lambda: "maxConcurrency" in json.dumps(served.models()["_errors"]), 10)
    out = served.cli("get", "models")
    assert "maxConcurrency" in out.stderr and "alpha" in out.stdout
    assert served.status("alpha")["pid"] == a["pid"]
    # Fixing the file clears the error, still without a restart.
    served.write("a.yaml", manifest("alpha"))
    assert wait_for(lambda: not served.models()["_errors"], 10)
    assert served.status("alpha")["pid"] == a["pid"]


def test_killed_worker_restarts_with_backoff(served):
    served.write("a.yaml", manifest("alpha"))
    served.start()
    a = served.wait_ready("alpha")
    os.kill(a["pid"], signal.SIGKILL)
    b = served.wait_ready("alpha", pid_not=a["pid"])
    assert b["restarts"] == 1
    assert any(e["reason"] == "WorkerCrashed" for e in b["events"])
    assert len(served.sockets()) == 1  # the dead worker's socket file went with it
    assert served.chat("alpha").usage.completion_tokens == 4


def test_a_frozen_worker_is_restarted_and_requests_end_at_their_deadline(tmp_path):
    f = Served(tmp_path, env={"MLXFLEET_HEALTH_INTERVAL": "1", "MLXFLEET_TIMEOUT": "4"})
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


def test_serve_on_a_busy_port_fails_fast_with_one_line(served):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", served.port))
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "mlxfleet", "serve", "--manifests",
                            str(served.dir), "--port", str(served.port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{served.port}" in r.stderr


def test_a_model_that_cannot_load_backs_off_instead_of_looping(served, tmp_path):
    served.write("bad.yaml", manifest("broken", source=str(tmp_path / "nowhere")))
    served.write("ok.yaml", manifest("fine"))
    served.start()
    served.wait_ready("fine")
    st = wait_for(lambda: (s := served.status("broken"))["phase"] == "CrashLoopBackOff" and s)
    assert st and "config.json" in st["lastError"]
    time.sleep(4)
    restarts = served.status("broken")["restarts"]
    # Backoff 0.5s doubling: in ~5s at most a handful of attempts, never a tight loop.
    assert 1 <= restarts <= 4, restarts
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"model": "broken", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert "config.json" in r.json()["error"]["message"]
    assert served.chat("fine").usage.completion_tokens == 4  # others are unaffected


def test_a_deep_socket_dir_and_the_longest_name_still_serve(tmp_path):
    # A socket path over 104 bytes cannot be bound on macOS: the worker crash-looped on
    # "AF_UNIX path too long" when the model's name went into it under a deep folder.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    name = "m" * 63  # the longest name a manifest allows
    f = Served(tmp_path / "f", env={"XDG_RUNTIME_DIR": str(deep)})
    f.write("m.yaml", manifest(name))
    try:
        f.start()
        f.wait_ready(name)
        assert f.chat(name).usage.completion_tokens == 4
        assert "too deep for socket paths" in f.logs()
    finally:
        f.stop()


def test_killing_the_supervisor_leaves_no_orphans(served):
    served.write("a.yaml", manifest("alpha"))
    served.write("b.yaml", manifest("beta"))
    served.start()
    pids = [served.wait_ready(n)["pid"] for n in ("alpha", "beta")]
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait()
    gone = wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                    != psutil.STATUS_ZOMBIE for p in pids), timeout=10)
    assert gone, [p for p in pids if psutil.pid_exists(p)]
    # Its socket folder is left behind; the next start removes it.
    old = list(served.run_dir.glob("mlxfleet-*"))
    assert len(old) == 1
    served.start()
    served.wait_ready("alpha")
    served.wait_ready("beta")
    new = list(served.run_dir.glob("mlxfleet-*"))
    assert len(new) == 1 and new != old
    assert len(served.sockets()) == 2
    served.stop()
    assert not list(served.run_dir.glob("mlxfleet-*"))


def test_sigterm_drains_and_stops_workers(served):
    served.write("a.yaml", manifest("alpha", source="builtin:tiny-10m"))
    served.start()
    pid = served.wait_ready("alpha")["pid"]
    got = {}

    def stream():
        chunks = list(served.openai().chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "go"}], max_tokens=400,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        got["tokens"] = chunks[-1].usage.completion_tokens

    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: served.status("alpha")["inflight"] == 1, 10)
    served.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert served.proc.wait(60) == 0
    assert got["tokens"] == 400
    assert not psutil.pid_exists(pid)


def test_worker_crash_mid_stream_ends_with_an_error_event(served):
    served.write("a.yaml", manifest("alpha", source="builtin:tiny-10m"))
    served.start()
    pid = served.wait_ready("alpha")["pid"]
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=30,
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
    pid = served.wait_ready("alpha", pid_not=pid)["pid"]  # and it comes back
    # The Responses API's error event takes the next sequence_number, as its SDKs expect
    with httpx.stream("POST", served.url + "/v1/responses", timeout=30,
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
    served.wait_ready("alpha", pid_not=pid)


def test_cli_get_describe_logs_apply_delete(served, tmp_path):
    served.start()
    assert "No models." in served.cli("get", "models").stdout
    f = tmp_path / "new.yaml"
    f.write_text("# my model\n" + manifest("gamma", aliases=["g"]))
    r = served.cli("apply", "-f", str(f))
    assert r.returncode == 0 and "model/gamma created" in r.stdout, r.stderr
    assert (served.dir / "gamma.yaml").read_text().startswith("# my model")
    served.wait_ready("gamma")
    out = served.cli("get", "models").stdout
    assert out.split("\n")[0].split() == ["NAME", "SOURCE", "STATE", "READY", "RESTARTS",
                                          "MEMORY", "AGE"]
    assert "gamma" in out and "Ready" in out and "1/1" in out
    d = served.cli("describe", "model", "gamma").stdout
    assert "Phase:         Ready" in d and "WorkerReady" in d and "Events:" in d
    logs = served.cli("logs", "gamma", "--tail", "50").stdout
    assert "loaded builtin:tiny" in logs
    # Re-applying an unchanged file is a no-op; a changed one configures in place.
    assert "unchanged" in served.cli("apply", "-f", str(f)).stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest("delta", bogus=1))
    r = served.cli("apply", "-f", str(bad))
    assert r.returncode != 0 and "spec.bogus" in r.stderr and "unknown field" in r.stderr
    clash = tmp_path / "clash.yaml"
    clash.write_text(manifest("delta", aliases=["g"]))
    r = served.cli("apply", "-f", str(clash))
    assert r.returncode != 0 and "already used" in r.stderr
    r = served.cli("delete", "model", "gamma")
    assert r.returncode == 0 and "deleted" in r.stdout
    assert not (served.dir / "gamma.yaml").exists()
    assert wait_for(lambda: served.status("gamma") is None, 10)
    r = served.cli("describe", "model", "gamma")
    assert r.returncode != 0 and "No model named 'gamma'" in r.stderr


def test_cli_without_a_server_says_so(tmp_path):
    f = Served(tmp_path)  # never started
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


def test_logs_follow_streams_new_lines(served):
    import subprocess
    import sys

    served.write("a.yaml", manifest("alpha"))
    served.start()
    served.wait_ready("alpha")
    proc = subprocess.Popen([sys.executable, "-m", "mlxfleet", "logs", "alpha", "-f",
                             "--tail", "1"], stdout=subprocess.PIPE, text=True,
                            env=served.env)
    try:
        proc.stdout.readline()  # the tail
        # A request makes the worker log a line; -f must show it as it is written.
        served.chat("alpha", extra_headers={"X-Request-Id": "follow-me"})
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
