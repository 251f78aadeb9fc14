"""Hardening II, probe by probe: a hostile manifest, an attacker's page, schema floods,
client keys that unload, stored responses across keys and restarts, structured output
the grammar engine cannot hold, a folder that disappears, slow clients and workers
killed mid-request. Real servers, real files, a real browser, real signals."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import threading
import time

import anthropic
import httpx
import pytest
from served import Served, in_parallel, manifest, wait_for

MSG = [{"role": "user", "content": "hi"}]

#: Under 800 bytes of YAML that stand for 10^8 strings once its aliases are followed.
_LEVELS = ", ".join([f"&l0 [{', '.join(['lol'] * 10)}]"]
                    + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 8)])
LAUGHS = ("apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: laughs}\nspec:\n"
          "  source: builtin:tiny\n"
          f"  cache: {{warmPrompts: [[{{role: user, content: [{_LEVELS}]}}]]}}\n")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("hard"), env={
        "MLXFLEET_DEFAULT_CACHE_MB": "256", "MLXFLEET_HEADER_TIMEOUT": "2",
        "MLXFLEET_ALLOWED_ORIGINS": "http://localhost:3000"})
    f.write("tiny.yaml", manifest("tiny", keepAlive="forever"))
    f.write("slow.yaml", manifest("slow", source="builtin:tiny-10m", keepAlive="forever"))
    f.start()
    f.wait_ready("tiny")
    f.wait_ready("slow")
    yield f
    f.stop()


def chat(f: Served, **body) -> httpx.Response:
    return httpx.post(f.url + "/v1/chat/completions", timeout=120, headers=f.headers,
                      json={"model": "tiny", "messages": MSG, "max_tokens": 8, **body})


def schema_chat(f: Served, schema, **body) -> httpx.Response:
    return chat(f, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **body)


# ---- 1, 9: manifests ----------------------------------------------------------


def test_a_billion_laughs_manifest_is_refused_and_stalls_nothing(srv):
    assert len(LAUGHS) < 800
    streamed: list[str] = []

    def stream():
        with srv.openai().chat.completions.create(
                model="slow", messages=MSG, max_tokens=40, stream=True,
                extra_body={"ignore_eos": True}) as s:
            streamed.extend(c.choices[0].finish_reason or "" for c in s if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    srv.write("laughs.yaml", LAUGHS)
    # the server answers while it reads the file (it froze for 97 s, at 3.3 GB)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    errors = wait_for(lambda: srv.models()["_errors"].get(str(srv.dir / "laughs.yaml")), 20)
    assert errors and "anchors and aliases" in errors[0], srv.models()["_errors"]
    t.join(120)
    assert streamed and streamed[-1] == "length"  # the other model's stream was not cut
    r = httpx.post(srv.url + "/mlxfleet/v1/manifests", content=LAUGHS, timeout=10,
                   headers={"Content-Type": "application/yaml"})
    assert r.status_code == 400 and "anchors and aliases" in r.text
    (srv.dir / "laughs.yaml").unlink()
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_apply_refuses_what_the_folder_reader_refuses(srv):
    def apply(text: str) -> httpx.Response:
        return httpx.post(srv.url + "/mlxfleet/v1/manifests", content=text, timeout=30,
                          headers={"Content-Type": "application/yaml"})

    big = manifest("big") + "# " + "x" * (1 << 20) + "\n"  # over max_manifest_bytes
    r = apply(big)
    assert r.status_code == 400 and "at most" in r.text, r.text  # was 200 "created"
    r = apply(manifest("preloaded", env={"LD_PRELOAD": "/tmp/x.so"}))
    assert r.status_code == 400 and "LD_PRELOAD" in r.text
    r = apply(manifest("warm", cache={"warmPrompts": [["not a message"]]}))
    assert r.status_code == 400 and "warmPrompts" in r.text
    assert not any(p.name.startswith(("big", "preloaded", "warm"))
                   for p in srv.dir.iterdir())


# ---- 2: other sites' pages -----------------------------------------------------


@pytest.fixture
def evil_origin(tmp_path):
    """Another origin on this machine serving an attacker's page."""
    (tmp_path / "index.html").write_text("<html><body>cat pictures</body></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_another_sites_page_cannot_change_models(srv, browser, evil_origin):
    pid = srv.status("tiny")["pid"]
    page = browser.new_page()
    page.goto(evil_origin + "/index.html")
    attack = """async ([base, yaml]) => {
        const post = (path, body, type) => fetch(base + path, {method: "POST", mode: "no-cors",
            body, headers: type ? {"Content-Type": type} : {}}).catch(() => null);
        await post("/mlxfleet/v1/manifests", yaml, "text/plain");
        await post("/mlxfleet/v1/models/tiny/unload", "");
        await post("/api/generate", JSON.stringify({model: "tiny", keep_alive: 0}),
                   "text/plain");
        await post("/api/chat", JSON.stringify({model: "tiny", keep_alive: 0}));
        return true;
    }"""
    assert page.evaluate(attack, [srv.url, manifest("planted")])
    page.close()
    time.sleep(1)
    assert not (srv.dir / "planted.yaml").exists()
    s = srv.status("tiny")
    assert s["ready"] and s["pid"] == pid and s["phase"] == "Ready", s


def test_trusted_origins_and_apps_may_infer_but_never_change_models(srv):
    def post(path: str, origin: str, **kw) -> int:
        return httpx.post(srv.url + path, timeout=60, headers={
            "Origin": origin, "Sec-Fetch-Site": "cross-site"}, **kw).status_code

    chat = {"json": {"model": "tiny", "messages": MSG, "max_tokens": 1}}
    assert post("/v1/chat/completions", "http://evil.example", **chat) == 403
    assert post("/v1/chat/completions", "http://localhost:3000", **chat) == 200  # allowed
    assert post("/v1/chat/completions", "vscode-webview://abc123", **chat) == 200  # an app
    assert post("/mlxfleet/v1/models/tiny/load", "http://localhost:3000") == 403
    assert post("/mlxfleet/v1/models/tiny/load", "vscode-webview://abc123") == 403


def test_a_rebound_dns_name_gets_no_answer(srv):
    r = httpx.get(srv.url + "/v1/models", headers={"Host": "attacker.example:80"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Host": "attacker.example"},
                   json={"model": "tiny", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 403
    for host in ("localhost", f"127.0.0.1:{srv.port}", f"localhost:{srv.port}"):
        assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_control_writes_take_json_or_yaml_only(srv):
    r = httpx.post(srv.url + "/mlxfleet/v1/manifests", content=manifest("formed"),
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and not (srv.dir / "formed.yaml").exists()
    r = httpx.post(srv.url + "/mlxfleet/v1/models/tiny/load", timeout=60)  # no body: fine
    assert r.status_code == 200


# ---- 3, 6, 11: schemas -----------------------------------------------------


def test_a_flood_of_huge_schemas_is_refused_and_the_worker_stays_up(srv):
    pid = srv.status("tiny")["pid"]
    flood = {"enum": [f"value-{i}" for i in range(200_000)]}

    def one(_):
        return schema_chat(srv, flood).status_code

    results: list = []
    t = threading.Thread(target=lambda: results.extend(in_parallel(one, [(i,) for i in
                                                                         range(20)])))
    t.start()
    ok = chat(srv, max_tokens=16)  # another client meanwhile
    t.join(300)
    assert ok.status_code == 200
    assert results == [400] * 20
    r = schema_chat(srv, flood)
    assert "bytes" in r.json()["error"]["message"]
    s = srv.status("tiny")
    assert s["ready"] and s["pid"] == pid and s["restarts"] == 0, s


RECURSIVE_NEXT = {"$defs": {"n": {"type": "object", "required": ["next"], "properties": {
    "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"}


@pytest.mark.parametrize("schema,says", [
    ({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
     "no finite JSON value"),
    ({"$defs": {"n": {"type": "object", "required": ["kids"], "properties": {"kids": {
        "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}}}},
      "$ref": "#/$defs/n"}, "no finite JSON value"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "lexer"),
], ids=["recursive-required", "recursive-min-items", "huge-regex"])
def test_schemas_the_engine_cannot_hold_are_400s_that_say_so(srv, schema, says):
    r = schema_chat(srv, schema, max_tokens=30)
    assert r.status_code == 400, r.text  # were 200s that did not parse
    assert says in r.json()["error"]["message"] and r.json()["error"]["code"] == \
        "invalid_schema"


@pytest.mark.parametrize("max_tokens", [20, 90, 200])
def test_a_recursive_schema_it_can_hold_always_parses(srv, max_tokens):
    r = schema_chat(srv, RECURSIVE_NEXT, max_tokens=max_tokens)
    assert r.status_code == 200
    value = json.loads(r.json()["choices"][0]["message"]["content"])
    assert "next" in value


def test_a_wide_any_of_parses_or_is_refused(srv):
    r = schema_chat(srv, {"anyOf": [{"const": f"v{i}"} for i in range(5000)]})
    if r.status_code == 200:
        assert json.loads(r.json()["choices"][0]["message"]["content"]).startswith("v")
    else:
        assert r.status_code == 400


def test_anthropic_tool_choice_any_with_a_recursive_schema_calls_the_tool(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    m = client.messages.create(model="tiny", max_tokens=80, messages=MSG,
                               tools=[{"name": "walk", "input_schema": RECURSIVE_NEXT}],
                               tool_choice={"type": "any"})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "walk" and "next" in calls[0].input, m.content


def test_a_json_schema_without_schema_is_a_400(srv):
    r = chat(srv, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"].endswith("schema")


# ---- 11: slow clients and killed workers ---------------------------------------


def test_a_slow_request_head_is_timed_out(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        data = s.recv(4096)  # the rest of the head never comes (header_timeout: 2 s)
    assert data.startswith(b"HTTP/1.1 408"), data


def test_a_worker_killed_during_a_non_streamed_request_is_a_502(srv):
    pid = srv.status("slow")["pid"]
    got: list = []
    t = threading.Thread(target=lambda: got.append(httpx.post(
        srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "slow", "messages": MSG, "max_tokens": 2000, "ignore_eos": True})))
    t.start()
    assert wait_for(lambda: httpx.get(srv.url + "/v1/status").json()["num_running"] > 0, 30)
    os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert got[0].status_code == 502, got[0].text  # the docs say 502; it was 503
    assert got[0].json()["error"]["code"] == "worker_unavailable"
    srv.wait_ready("slow", pid_not=pid, timeout=120)


# ---- 8: the folder comes back ------------------------------------------------------


def test_the_watcher_sees_edits_after_the_folder_is_removed_and_restored(srv, tmp_path):
    saved = tmp_path / "saved"
    shutil.copytree(srv.dir, saved)
    shutil.rmtree(srv.dir)
    time.sleep(2)
    assert srv.status("tiny")["ready"]  # models keep running without their folder
    shutil.copytree(saved, srv.dir)  # a new folder (a new inode) with the same files
    time.sleep(2)
    srv.write("late.yaml", manifest("late"))
    srv.wait_ready("late", timeout=60)  # was never seen


# ---- 4, 5: keys: keep-alive and stored responses -----------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("keyed"), env={
        "MLXFLEET_API_KEY": "ka,kb", "MLXFLEET_ADMIN_KEY": "admin",
        "MLXFLEET_DEFAULT_CACHE_MB": "256"})
    f.write("tiny.yaml", manifest("tiny", keepAlive="forever"))
    f.write("loose.yaml", manifest("loose", clientKeepAlive=True))
    f.start()
    f.wait_ready("tiny")
    f.wait_ready("loose")
    yield f
    f.stop()


def key(k: str) -> dict:
    return {"Authorization": f"Bearer {k}"}


def test_a_client_key_extends_keep_alive_but_never_unloads(keyed):
    pid = keyed.status("tiny")["pid"]
    r = httpx.post(keyed.url + "/api/generate", headers=key("ka"), timeout=30,
                   json={"model": "tiny", "keep_alive": 0})
    assert r.status_code == 403 and "admin" in r.json()["error"]
    r = httpx.post(keyed.url + "/api/generate", headers=key("ka"), timeout=60, json={
        "model": "tiny", "prompt": "hi", "keep_alive": "1s", "stream": False,
        "options": {"num_predict": 2}})
    assert r.status_code == 200
    time.sleep(3)  # the manifest says forever: a client's 1s does not shorten it
    s = keyed.status("tiny")
    assert s["ready"] and s["pid"] == pid, s
    # clientKeepAlive: true lets client keys unload that model
    r = httpx.post(keyed.url + "/api/generate", headers=key("ka"), timeout=60,
                   json={"model": "loose", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    # the admin key may unload any model
    r = httpx.post(keyed.url + "/api/generate", headers=key("admin"), timeout=60,
                   json={"model": "tiny", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert wait_for(lambda: not keyed.status("tiny")["ready"], 30)


def test_stored_responses_belong_to_their_key_and_survive_a_kill(keyed):
    from openai import NotFoundError, OpenAI

    a = OpenAI(base_url=keyed.url + "/v1", api_key="ka", max_retries=0)
    b = OpenAI(base_url=keyed.url + "/v1", api_key="kb", max_retries=0)
    first = a.responses.create(model="tiny", input="remember this", max_output_tokens=4)
    streamed = [ev.response for ev in a.responses.create(
        model="tiny", input="and this", max_output_tokens=4, stream=True)
        if ev.type in ("response.completed", "response.incomplete")][0]
    for client, rid in ((b, first.id), (b, streamed.id)):
        with pytest.raises(NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(NotFoundError):
            client.responses.create(model="tiny", input="more", previous_response_id=rid,
                                    max_output_tokens=2)
        with pytest.raises(NotFoundError):
            client.responses.delete(rid)
        with pytest.raises(NotFoundError):
            client.responses.input_items.list(rid)
    keyed.proc.send_signal(signal.SIGKILL)  # nothing acknowledged may be lost
    keyed.proc.wait(30)
    keyed._log.close()
    keyed.start()
    assert a.responses.retrieve(first.id).output_text == first.output_text
    assert a.responses.retrieve(streamed.id).id == streamed.id
    items = a.responses.input_items.list(first.id)
    assert items.data[0].content[0].text == "remember this"
    follow = a.responses.create(model="tiny", input="go on", previous_response_id=first.id,
                                max_output_tokens=2)
    assert follow.previous_response_id == first.id
    a.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        a.responses.retrieve(first.id)


# ---- 10: a fleet node without a fleet key --------------------------------------


def test_a_forged_forwarded_header_does_not_skip_the_rate_limit(tmp_path):
    f = Served.nodes(tmp_path, ["solo"], env={"MLXFLEET_RATE_LIMIT": "3"})["solo"]
    f.write("node.yaml", "apiVersion: mlxfleet/v1\nkind: Node\nmetadata: {name: solo}\n"
                         f"spec: {{url: '{f.url}'}}\n")
    f.start()
    try:
        forged = {"X-Mlxfleet-Forwarded-By": "other"}
        codes = [httpx.get(f.url + "/v1/models", headers=forged, timeout=10).status_code
                 for _ in range(5)]
        assert 429 in codes, codes  # were all 200
    finally:
        f.stop()
