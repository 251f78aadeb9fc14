"""Models on disk: pull with progress (Ollama's /api/pull, `mlxfleet pull`), resume,
verification, the store's listing and removal, /api/copy, /api/create, /api/push.

The Hugging Face Hub cannot be reached here: ``tests/hub.py`` answers the routes
``huggingface_hub`` calls, through ``HF_ENDPOINT``. Everything else is real: the server,
``snapshot_download``, the cache on disk, the worker loading what was pulled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import ollama
import pytest
from hub import Hub, Repo
from served import Served, manifest, wait_for

from mlxfleet.builtin import ensure_builtin


@pytest.fixture(scope="module")
def hub():
    h = Hub({"acme/tiny": Repo.from_dir(ensure_builtin("tiny")),
             "acme/slow": Repo.from_dir(ensure_builtin("tiny-10m")),
             "acme/applied": Repo.from_dir(ensure_builtin("tiny-10m"), commit="f" * 40)})
    yield h
    h.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("store")
    f = Served(root, env=hub.env(root / "hf"))
    f.write("local.yaml", manifest("local"))
    try:  # stopped even when it never got ready: no server outlives the module
        f.start()
        f.wait_ready("local")
        yield f
    finally:
        f.stop()


def test_ollama_pull_streams_progress_then_the_model_serves(served, hub):
    client = ollama.Client(host=served.url)
    events = list(client.pull("acme/tiny", stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert "verifying sha256 digest" in statuses
    weights = [e for e in events if e.total and e.digest.startswith("sha256:")]
    assert weights and weights[-1].completed == weights[-1].total > 700_000
    # pulled once: a second pull downloads nothing
    gets = sum(1 for m, p, _ in hub.log if m == "GET" and "/resolve/" in p)
    assert client.pull("acme/tiny", stream=False).status == "success"
    assert sum(1 for m, p, _ in hub.log if m == "GET" and "/resolve/" in p) == gets
    # a manifest naming it loads from the store
    served.write("pulled.yaml", manifest("pulled", source="acme/tiny"))
    served.wait_ready("pulled")
    r = served.openai().chat.completions.create(model="pulled", max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content
    # a model's name pulls its source (`ollama pull pulled`), here already on disk
    assert client.pull("pulled", stream=False).status == "success"
    assert sum(1 for m, p, _ in hub.log if m == "GET" and "/resolve/" in p) == gets
    # and the store lists it, with the model that uses it
    out = served.cli("get", "sources").stdout
    row = next(ln for ln in out.splitlines() if ln.startswith("acme/tiny"))
    assert "pulled" in row and "KB" in row or "MB" in row, out


def test_the_files_pulled_are_those_mlx_lm_loads():
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from mlxfleet.sources import ALLOW_PATTERNS

    assert ALLOW_PATTERNS == list(DEFAULT_ALLOW_PATTERNS)


def test_pull_errors_are_clear(served):
    r = httpx.post(served.url + "/api/pull", json={"model": "acme/nope"}, timeout=30)
    assert r.status_code == 404 and "not found" in r.json()["error"], r.text
    r = httpx.post(served.url + "/api/pull", json={"model": "llama3.2"}, timeout=30)
    assert r.status_code == 404 and "owner/name" in r.json()["error"], r.text
    r = httpx.post(served.url + "/api/push", json={"model": "local"}, timeout=30)
    assert r.status_code == 501 and "hf upload" in r.json()["error"], r.text


def test_a_killed_pull_resumes_and_a_corrupted_byte_is_refetched(served, hub):
    hub.throttle = 0.05  # ~1.3 MB/s: slow enough to stop midway
    env = {**served.env, "MLXFLEET_SERVER": "http://127.0.0.1:9"}  # no server: pull here
    cli = [sys.executable, "-m", "mlxfleet", "pull", "acme/slow"]
    first = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    blobs = served.state.parent / "hf" / "models--acme--slow" / "blobs"
    assert wait_for(lambda: any(p.stat().st_size > 200_000
                                for p in blobs.glob("*.incomplete")), 60)
    first.kill()
    first.wait()
    hub.throttle = 0.0
    hub.corrupt.add("model.safetensors")
    hub.log.clear()
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    gets = [(p, rng) for m, p, rng in hub.log if m == "GET" and p.endswith("model.safetensors")]
    # resumed from where it stopped (a Range request, which brought a flipped byte), then
    # fetched once more, whole, after the file failed its SHA-256
    assert gets[0][1] and gets[0][1].startswith("bytes=") and gets[0][1] != "bytes=0-", gets
    assert len(gets) == 2 and gets[1][1] in (None, "bytes=0-"), gets
    assert "verifying sha256 digest" in done.stdout and "did not match" not in done.stdout
    assert "success" in done.stdout


def test_copy_makes_an_alias_and_create_quantizes_a_local_checkpoint(served):
    client = ollama.Client(host=served.url)
    client.copy("local", "my-local")
    assert wait_for(lambda: "my-local" in httpx.get(served.url + "/mlxfleet/v1/models/local",
                                                    timeout=10).json()["aliases"], 10)
    r = served.openai().chat.completions.create(model="my-local", max_tokens=2,
                                               messages=[{"role": "user", "content": "x"}])
    assert r.model == "local"
    src = str(ensure_builtin("tiny"))
    events = list(client.create(model="tiny-q4", from_=src, quantize="q4_K_M", stream=True))
    assert events[-1].status == "success", events
    cfg = json.loads((served.state / "models" / "tiny-q4" / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4
    r = served.openai().chat.completions.create(model="tiny-q4", max_tokens=3,
                                               messages=[{"role": "user", "content": "x"}])
    assert r.usage.completion_tokens > 0  # loaded on demand, like a model Ollama created
    r = httpx.post(served.url + "/api/create", json={"model": "x", "from": src,
                                                     "template": "{{ .Prompt }}"})
    assert r.status_code == 400 and "template" in r.json()["error"]


def test_names_from_clients_are_checked_before_any_path_is_built(served, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    for name in (str(victim), "x/../../../../../../../.." + str(victim), "evil\n", "ｔｉｎｙ"):
        r = httpx.post(served.url + "/api/create", json={
            "model": name, "from": "builtin:tiny", "quantize": "q4", "stream": False},
            timeout=60)
        assert r.status_code == 400 and "DNS label" in r.json()["error"], (name, r.text)
    assert (victim / "keep.txt").read_text() == "mine"  # (it was emptied and written)
    assert not (served.state / "models" / "evil").exists()
    r = httpx.post(served.url + "/api/pull", json={"model": "a/.."}, timeout=30)
    assert r.status_code == 400 and "repo id" in r.json()["error"], r.text  # (was 502)
    r = httpx.post(served.url + "/api/copy", json={"source": "local",
                                                  "destination": "tiny\u200b"}, timeout=30)
    assert r.status_code == 400 and "U+200B" in r.json()["error"], r.text


def test_copy_refuses_to_replace_a_model_and_copies_a_model_kept_forever(served):
    served.write("keeper.yaml", manifest("keeper", keepAlive="forever", preload=False))
    assert wait_for(lambda: served.status("keeper"), 20)
    r = httpx.post(served.url + "/api/copy", json={"source": "keeper",
                                                  "destination": "keeper-2"}, timeout=30)
    assert r.status_code == 200, r.text  # (was 400 "inf is not a duration")
    assert "keeper-2" in served.status("keeper")["aliases"]
    assert "keepAlive: forever" in (served.dir / "keeper.yaml").read_text()
    r = httpx.post(served.url + "/api/copy", json={"source": "keeper",
                                                  "destination": "local"}, timeout=30)
    assert r.status_code == 409 and "force" in r.json()["error"], r.text
    assert "builtin:tiny" in (served.dir / "local.yaml").read_text()  # not replaced


def test_delete_removes_a_stored_source_but_not_one_in_use(served):
    client = ollama.Client(host=served.url)
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("pulled")  # its model is loaded
    assert e.value.status_code == 409
    (served.dir / "pulled.yaml").unlink()
    assert wait_for(lambda: served.cli("get", "sources").stdout.count("pulled") == 0, 20)
    client.delete("acme/tiny")
    assert "acme/tiny" not in served.cli("get", "sources").stdout
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("acme/tiny")
    assert e.value.status_code == 404


def test_two_clients_pulling_the_same_source_share_one_download(served, hub):
    hub.log.clear()
    hub.throttle = 0.01
    got: list = []

    def one():
        got.append([e.status for e in ollama.Client(host=served.url).pull("acme/tiny",
                                                                          stream=True)])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    hub.throttle = 0.0
    assert [s[-1] for s in got] == ["success", "success"], got
    gets = [p for m, p, _ in hub.log if m == "GET" and p.endswith("model.safetensors")]
    assert len(gets) == 1, gets


def test_a_manifest_whose_weights_are_not_here_is_pulled_when_applied(served, hub):
    hub.throttle = 0.02
    served.write("applied.yaml", manifest("applied", source="acme/applied", preload=False))
    assert wait_for(lambda: (served.status("applied") or {}).get("pull"), 20)
    out = served.cli("describe", "model", "applied").stdout
    assert "Pulling:" in out and "Pulling" in out.split("Events:")[1], out
    # meanwhile the other models serve
    assert served.chat("local").choices[0].message.content is not None
    hub.throttle = 0.0
    assert wait_for(lambda: not served.status("applied")["pull"], 60)
    reasons = [e["reason"] for e in served.status("applied")["events"]]
    assert reasons[-2:] == ["Pulling", "Pulled"], reasons
    # it was not loaded by the pull (preload: false), and loads from disk on demand
    assert served.status("applied")["phase"] == "Unloaded"
    gets = len([1 for m, p, _ in hub.log if m == "GET" and "/applied/" in p])
    assert served.chat("applied").usage.completion_tokens > 0
    assert len([1 for m, p, _ in hub.log if m == "GET" and "/applied/" in p]) == gets, hub.log[-6:]


def test_the_dashboard_shows_a_download_in_progress(served, hub, browser, tmp_path):
    hub.throttle = 0.05
    pull = threading.Thread(target=lambda: list(ollama.Client(host=served.url).pull(
        "acme/slow2", stream=True)), daemon=True)
    hub.repos["acme/slow2"] = Repo.from_dir(ensure_builtin("tiny-10m"), commit="e" * 40)
    pull.start()
    pg = browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(served.url + "/#models")
    row = pg.wait_for_selector("#downloads-table tr[data-source='acme/slow2']", timeout=20000)
    assert "MiB" in row.inner_text() and pg.is_visible("#downloads progress")
    pg.screenshot(path=str(tmp_path / "downloads.png"), full_page=True)
    hub.throttle = 0.0
    pull.join(60)
    pg.wait_for_selector("#downloads", state="hidden", timeout=20000)
    assert not errors, errors


def test_a_source_that_cannot_be_pulled_leaves_the_serving_worker_serving(served):
    served.write("moving.yaml", manifest("moving", preload=False))
    assert wait_for(lambda: served.status("moving"), 10)  # the folder was read
    assert served.chat("moving").choices  # loaded on demand
    pid = served.status("moving")["pid"]
    served.write("moving.yaml", manifest("moving", source="acme/nope", preload=False))
    assert wait_for(lambda: "LoadFailed" in [e["reason"] for e in
                                             served.status("moving")["events"]], 30)
    st = served.status("moving")
    assert st["phase"] == "Ready" and st["pid"] == pid, st
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Progressing"]["reason"] == "NewWorkerFailed", cond
    assert served.chat("moving").choices
    (served.dir / "moving.yaml").unlink()


def test_slow_pulls_never_hold_up_the_control_plane(served, hub):
    import time

    hub.throttle = 0.5  # 128 KB/s: each pull takes minutes
    for i in range(6):
        hub.repos[f"acme/crawl{i}"] = Repo.from_dir(ensure_builtin("tiny-10m"),
                                                    commit=f"{i}" * 40)
    try:
        for i in range(6):  # six at once filled the default thread pool (6 threads here)
            threading.Thread(target=lambda i=i: httpx.post(
                served.url + "/api/pull", json={"model": f"acme/crawl{i}", "stream": False},
                timeout=120), daemon=True).start()
        assert wait_for(lambda: len(httpx.get(served.url + "/mlxfleet/v1/sources",
                                              timeout=10).json()["pulls"]) == 6, 20)
        t0 = time.monotonic()
        served.write("during.yaml", manifest("during", preload=False))
        r = httpx.post(served.url + "/mlxfleet/v1/manifests", timeout=10,
                       content=manifest("applied-now", preload=False),
                       headers={"Content-Type": "application/yaml"})
        assert r.status_code == 200, r.text
        assert httpx.get(served.url + "/mlxfleet/v1/sources", timeout=10).status_code == 200
        assert served.chat("local").choices[0].message.content is not None
        assert time.monotonic() - t0 < 8  # (timed out for minutes before)
        pulls = httpx.get(served.url + "/mlxfleet/v1/sources", timeout=10).json()["pulls"]
        assert sorted(p["status"] == "queued" for p in pulls).count(True) == 4, pulls
    finally:
        hub.throttle = 0.0
        (served.dir / "during.yaml").unlink(missing_ok=True)
        httpx.delete(served.url + "/mlxfleet/v1/models/applied-now", timeout=10)
