"""Trust boundaries (docs/security-and-observability.md#trust-boundaries): nothing a
hub, a fleet peer, a client or a file sends writes outside its place, fills the disk,
stalls the server or reaches another key's data.

The hostile hub is ``tests/hub.py`` with its lying knobs; the lying peer is
``tests/peer.py``. Pulls run ``mlxfleet.store.pull`` in a fresh process, as a node or
``mlxfleet pull`` does.
"""

from __future__ import annotations

import pytest
from hub import Hub, Repo
from peer import LyingPeer, run_pull, written_under

from mlxfleet.builtin import ensure_builtin

KEY = "trust-key"


@pytest.fixture(scope="module")
def tiny_repo():
    return Repo.from_dir(ensure_builtin("tiny"))


@pytest.fixture()
def hub(tiny_repo):
    h = Hub({"acme/tiny": tiny_repo})
    yield h
    h.close()


def weights_name(repo: Repo) -> str:
    return next(n for n in repo.files if n.endswith(".safetensors"))


# ---- a hostile hub ------------------------------------------------------------------

@pytest.mark.parametrize("lie", ["oid", "path"])
def test_a_hub_listing_that_climbs_out_of_the_cache_writes_nothing_there(hub, tiny_repo,
                                                                         tmp_path, lie):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.incomplete").write_bytes(b"12345")  # a resume would append to it
    cache = tmp_path / "hf"
    name = weights_name(tiny_repo)
    up = "../" * 12 + str(victim).lstrip("/") + "/x"
    # (a path must look like a file a load needs, or it is not even asked for)
    hub.lie[name] = {"oid": up} if lie == "oid" else {"path": up + ".json"}
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "refused" in out, out
    assert written_under(victim) == ["x.incomplete"], written_under(victim)
    assert (victim / "x.incomplete").read_bytes() == b"12345"  # not resumed, not deleted
    # and nothing of it landed in the cache either
    assert not any("snapshots" in p for p in written_under(cache)), written_under(cache)


def test_a_hub_that_sends_more_than_it_listed_is_stopped_at_the_listed_size(hub, tiny_repo,
                                                                          tmp_path):
    name = weights_name(tiny_repo)
    size = len(tiny_repo.files[name])
    hub.overflow[name] = 64 << 20  # 64 MB more, with no Content-Length
    cache = tmp_path / "hf"
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "sent more than" in out, out
    on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert on_disk <= size + (1 << 20), on_disk  # (158 MB were written before)


def test_a_pull_that_would_fill_the_disk_is_refused_before_a_byte(hub, tiny_repo, tmp_path):
    name = weights_name(tiny_repo)
    hub.lie[name] = {"size": 900 << 30}  # 900 GB, more than this disk has free
    cache = tmp_path / "hf"
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "ERR 507" in out and "free" in out, out
    assert not any(p.name.endswith(".incomplete") for p in cache.rglob("*"))
    assert not any(m == "GET" and p.endswith(name) for m, p, _ in hub.log)


def test_a_hub_that_goes_silent_is_given_up_on_after_the_idle_timeout(hub, tmp_path):
    hub.stall = 30.0
    ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny", limits={"idle_timeout": 1.0},
                       timeout=25)
    assert not ok and "sent nothing for 1s" in out and "ERR 504" in out, out


def test_a_pull_past_its_deadline_stops_and_says_how_to_continue(hub, tmp_path):
    hub.throttle = 0.2  # 64 KiB per 0.2 s: the weights take several seconds
    ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny", limits={"timeout": 1.0},
                       timeout=60)
    assert not ok and "took longer than 1s" in out and "continue" in out, out


def test_a_pull_stopped_early_keeps_what_it_had_and_continues_from_there(hub, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    hub.throttle = 0.2  # 64 KiB per 0.2 s: the weights (under 1 MB) take a few seconds
    env = {**os.environ, **hub.env(tmp_path / "hf"), "MLXFLEET_SERVER": "http://127.0.0.1:9"}
    cli = [sys.executable, "-m", "mlxfleet", "pull", "acme/tiny"]
    first = subprocess.Popen(cli, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    parts = tmp_path / "hf" / "models--acme--tiny" / "blobs"
    deadline = time.monotonic() + 30
    while not any(p.stat().st_size >= 128 << 10 for p in parts.glob("*.incomplete")):
        assert time.monotonic() < deadline, "nothing was kept on disk as it came (it was " \
            "written in 1 MB pieces, so a smaller file kept nothing)"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    hub.throttle = 0.0
    hub.log.clear()
    assert subprocess.run(cli, env=env, capture_output=True, timeout=60).returncode == 0
    ranges = [r for m, p, r in hub.log if m == "GET" and p.endswith(".safetensors")]
    assert ranges and ranges[0] and ranges[0] != "bytes=0-", ranges


# ---- a lying peer -------------------------------------------------------------------

def test_a_peer_listing_that_climbs_out_of_the_cache_is_ignored(hub, tiny_repo, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    peer = LyingPeer(tiny_repo, KEY, "traversal", target=str(victim))
    try:
        ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny",
                           [{"name": "evil", "url": peer.url, "key": KEY}])
    finally:
        peer.close()
    assert ok, out  # from the hub, whose listing is the truth
    assert written_under(victim) == [], written_under(victim)
    assert "/mlxfleet/v1/store/file" not in peer.log  # nothing was taken from it


def test_weights_a_peer_substitutes_never_enter_the_cache(hub, tiny_repo, tmp_path):
    import hashlib

    peer = LyingPeer(tiny_repo, KEY, "substitute")
    cache = tmp_path / "hf"
    try:
        ok, out = run_pull(hub.env(cache), "acme/tiny",
                           [{"name": "evil", "url": peer.url, "key": KEY}])
    finally:
        peer.close()
    assert ok and "from node evil failed" in out, out
    name = weights_name(tiny_repo)
    got = next(cache.rglob(f"snapshots/*/{name}")).read_bytes()
    assert hashlib.sha256(got).digest() == hashlib.sha256(tiny_repo.files[name]).digest()


def test_with_the_hub_down_a_peer_is_not_taken_at_its_word(tiny_repo, tmp_path):
    peer = LyingPeer(tiny_repo, KEY, "honest")
    down = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_XET": "1"}
    try:
        ok, out = run_pull(down, "acme/tiny", [{"name": "b", "url": peer.url, "key": KEY}])
        assert not ok and "cannot reach the hub" in out and "nodes b were not asked" in out, out
        # an operator of an offline fleet may opt in: a listing signed with the fleet key
        ok, out = run_pull(down, "acme/tiny", [{"name": "b", "url": peer.url, "key": KEY}],
                           limits={"peer_without_hub": True})
        assert ok and "signed listing" in out, out
        # never one signed with another key
        ok, out = run_pull({**down, "HF_HUB_CACHE": str(tmp_path / "hf2")}, "acme/tiny",
                           [{"name": "b", "url": peer.url, "key": "other"}],
                           limits={"peer_without_hub": True})
        assert not ok, out
    finally:
        peer.close()


# ---- a client: other keys' prompts, logs, floods ------------------------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from served import Served, manifest

    f = Served(tmp_path_factory.mktemp("trust"), env={
        "MLXFLEET_API_KEY": "ka,kb,kc", "MLXFLEET_RATE_LIMIT": "30",
        "MLXFLEET_MAX_BODY_MB": "4", "MLXFLEET_MAX_PENDING_BODY_MB": "8"})
    f.write("tiny.yaml", manifest("tiny", cache={"diskMB": 16}))
    f.state.mkdir(parents=True)
    (f.state / "responses.sqlite3").write_bytes(b"not a database " * 100)  # a bad disk
    try:
        f.start()
        f.wait_ready("tiny")
        yield f
    finally:
        f.stop()


def _cached(f, key: str, text: str, **extra) -> int:
    from openai import OpenAI

    r = OpenAI(base_url=f.url + "/v1", api_key=key).chat.completions.create(
        model="tiny", max_tokens=1, temperature=0, extra_body=extra,
        messages=[{"role": "user", "content": text}])
    return r.usage.prompt_tokens_details.cached_tokens


def test_one_key_cannot_read_another_keys_prompt_from_the_cache(keyed):
    secret = ("The launch code for the vault is tangerine seven umbrella. " * 6)
    assert _cached(keyed, "ka", secret) == 0
    assert _cached(keyed, "ka", secret) > 32  # its own key reuses it
    assert _cached(keyed, "kb", secret) == 0  # another key learns nothing (was > 0)
    # cache_salt (vLLM's) splits one key's prompts further
    assert _cached(keyed, "ka", secret, cache_salt="s1") == 0
    assert _cached(keyed, "ka", secret, cache_salt="s1") > 32


def test_client_strings_cannot_forge_or_flood_log_lines(keyed):
    import httpx

    h = {"Authorization": "Bearer ka"}
    forged = "nope\n2026-01-01 00:00:00 INFO mlxfleet: FORGED admin login"
    r = httpx.post(keyed.url + "/v1/chat/completions", headers=h, timeout=10, json={
        "model": forged, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    r = httpx.post(keyed.url + "/v1/chat/completions", headers=h, timeout=30, json={
        "model": "m" * 3_000_000, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and len(r.content) < 10_000  # nor echoed back whole
    log = keyed.log_path.read_text(errors="replace")
    assert not any(ln.startswith("2026-01-01 00:00:00 INFO mlxfleet: FORGED")
                   for ln in log.splitlines())
    assert max(len(ln) for ln in log.splitlines()) < 5_000  # (3 MB a request before)


def test_every_route_that_costs_work_is_rate_limited(keyed):
    import httpx

    h = {"Authorization": "Bearer kc"}  # a key of its own: its own budget
    codes = [httpx.post(keyed.url + "/api/show", headers=h, json={"model": "tiny"},
                        timeout=10).status_code for _ in range(31)]
    assert codes[:30] == [200] * 30 and codes[30] == 429, codes
    r = httpx.post(keyed.url + "/api/generate", headers=h, timeout=10, json={
        "model": "tiny", "prompt": "x", "stream": False})
    assert r.status_code == 429 and r.headers["retry-after"]  # was served


def test_the_rate_limiter_forgets_the_oldest_clients_beyond_its_table():
    from mlxfleet.api.guard import RateLimiter

    rl = RateLimiter(2, max_clients=100)
    for i in range(20_000):
        assert rl.check(f"addr:10.0.{i >> 8}.{i & 255}") is None
    assert len(rl._hits) == 100
    assert rl.check("addr:x") is None and rl.check("addr:x") is None
    assert rl.check("addr:x") is not None  # the recent ones keep their window


def _raw(url: str, head: str, body: bytes = b""):
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(head.encode() + body)
    return s


def _status(s) -> int:
    data = s.recv(65536)
    return int(data.split(b" ", 2)[1])


def test_a_flood_of_large_bodies_is_refused_before_it_is_read(keyed):
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Authorization: Bearer kb\r\nContent-Type: application/json\r\n"
            f"Content-Length: {3 << 20}\r\n\r\n")
    held = [_raw(keyed.url, head, b"{" + b" " * (1 << 20)) for _ in range(2)]  # 6 MB of 8
    try:
        import time

        time.sleep(0.5)
        third = _raw(keyed.url, head)  # announces 3 MB more, sends nothing
        assert _status(third) == 503  # answered without a byte of its body
        third.close()
    finally:
        for s in held:
            s.close()


def test_a_compressed_transfer_coding_is_refused_not_ignored(keyed):
    s = _raw(keyed.url, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             "Authorization: Bearer kb\r\nContent-Type: application/json\r\n"
             "Transfer-Encoding: gzip, chunked\r\n\r\n", b"5\r\nxxxxx\r\n0\r\n\r\n")
    try:
        assert _status(s) == 501
    finally:
        s.close()


# ---- files: the Responses database and the prompt cache on disk ---------------------

def test_a_corrupt_responses_database_is_moved_aside_at_start(keyed):
    from openai import OpenAI

    aside = list(keyed.state.glob("responses.sqlite3.corrupt-*"))
    assert aside and aside[0].read_bytes().startswith(b"not a database")
    assert "moved aside" in keyed.logs()
    client = OpenAI(base_url=keyed.url + "/v1", api_key="ka")
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id  # (every stored response was a 500)


def test_a_locked_responses_database_never_costs_an_answer(keyed):
    import sqlite3
    import time

    from openai import OpenAI

    client = OpenAI(base_url=keyed.url + "/v1", api_key="ka")
    db = sqlite3.connect(str(keyed.state / "responses.sqlite3"), isolation_level=None)
    db.execute("begin exclusive")  # another process holds the lock (a backup, say)
    try:
        r = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
        assert r.output and r.id  # (a 500 after the generation, before)
        events = list(client.responses.create(model="tiny", input="hi",
                                              max_output_tokens=2, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")  # (was cut)
        streamed = events[-1].response.id
        assert client.responses.retrieve(r.id).id == r.id  # answered from memory
    finally:
        db.execute("rollback")
        db.close()
    time.sleep(2.5)  # the background retry writes both
    rows = sqlite3.connect(str(keyed.state / "responses.sqlite3")).execute(
        "select id from responses").fetchall()
    assert {r.id, streamed} <= {row[0] for row in rows}


def test_files_that_hold_conversations_are_private(keyed):
    import stat

    from openai import OpenAI

    OpenAI(base_url=keyed.url + "/v1", api_key="ka").chat.completions.create(
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": "private " * 40}])
    import httpx

    httpx.post(keyed.url + "/mlxfleet/v1/models/tiny/unload", timeout=60,
               headers={"Authorization": "Bearer ka"})  # the prompt cache goes to disk
    files = [keyed.state / "responses.sqlite3", *keyed.state.glob("prompt-cache/**/*")]
    assert any(p.suffix == ".safetensors" for p in files), files
    for p in [keyed.state, *files]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))  # were 0644/0755


def test_a_single_machine_serves_its_weights_to_no_client(keyed):
    import httpx

    for route in ("listing", "file"):
        r = httpx.get(f"{keyed.url}/mlxfleet/v1/store/{route}", timeout=10,
                      params={"source": "acme/tiny"}, headers={"Authorization": "Bearer ka"})
        assert r.status_code == 404, r.text  # (any client key was served)


def test_sighup_reads_the_folder_again_and_keeps_serving(keyed):
    import os
    import signal
    import time

    os.kill(keyed.proc.pid, signal.SIGHUP)  # (it killed the server without a drain)
    time.sleep(1)
    assert keyed.proc.poll() is None
    assert "SIGHUP: reading the manifests folder again" in keyed.logs()
    assert _cached(keyed, "kb", "still here") == 0


# ---- the fleet key: forward and poll, nothing else -----------------------------------

def test_a_node_may_forward_and_poll_but_changing_models_wants_the_admin_key():
    """Whoever held the fleet key (a captured one) could apply a manifest on any node:
    the key skipped the admin-key check. A signed node request may forward inference and
    poll; a change still needs the admin key, passed along from its client."""
    from mlxfleet.api.guard import Guard
    from mlxfleet.fleet_auth import sign
    from mlxfleet.wire import APIError

    g = Guard(["client"], 0, admin_keys=["admin"], fleet_key="fk", fleet=True,
              hosts=None)

    def check(method: str, path: str, auth: str | None = None):
        h = {k.lower(): v for k, v in sign("fk", "b", method, path).items()}
        if auth:
            h["authorization"] = f"Bearer {auth}"
        return g.check(path, method, h, "10.0.0.2", path)

    assert check("GET", "/mlxfleet/v1/node").sender == "b"
    assert check("POST", "/v1/chat/completions").sender == "b"  # forwarded inference
    for method, path in (("POST", "/mlxfleet/v1/manifests"),
                         ("DELETE", "/mlxfleet/v1/models/m"), ("POST", "/api/pull")):
        with pytest.raises(APIError) as e:
            check(method, path)
        assert e.value.status == 403 and e.value.code == "admin_key_required"
        with pytest.raises(APIError):
            check(method, path, "client")  # a client key is not enough either
        assert check(method, path, "admin").sender == "b"  # the admin's, passed along
