"""A fleet of three nodes on loopback: one manifests folder, three `mlxfleet serve --node`
processes (each with its own port and state), real workers, real SIGKILL of a node."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from typing import Optional

import anthropic
import httpx
import openai
import pytest
import yaml
from served import Served, manifest, wait_for

KEY = "fleet-secret"
ENV = {"MLXFLEET_FLEET_KEY": KEY, "MLXFLEET_FLEET_GRACE": "6",
       "MLXFLEET_FLEET_POLL_INTERVAL": "0.5"}


def node_doc(name: str, url: str, memory: str, **labels) -> str:
    return yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Node",
                           "metadata": {"name": name, "labels": labels},
                           "spec": {"url": url, "memory": memory}}, sort_keys=False)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    ns = Served.nodes(tmp_path_factory.mktemp("fleet"), "abc", ENV)
    # c is the biggest: both unpinned models go there (most free memory)
    ns["a"].write("nodes.yaml", "---\n".join([
        node_doc("a", ns["a"].url, "4GB", tier="small"),
        node_doc("b", ns["b"].url, "4GB", tier="small"),
        node_doc("c", ns["c"].url, "8GB", chip="m2")]))
    # The models come once every node sees the others: on a loaded machine a node can
    # take longer to boot than the fleet's grace, and the others would place its share
    # without it (correctly; the boot grace is tested by the fleets that start with models).
    Served.start_all(ns)
    Served.wait_fleet(ns)
    ns["a"].write("models.yaml", models_yaml())
    yield ns
    for n in ns.values():
        n.stop()


def where(node: Served) -> dict:
    """model -> node, as ``/v1/models`` on ``node`` says."""
    data = httpx.get(node.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["node"] for m in data if m["id"] == m["root"]}  # not the aliases


EXPECTED = {"free1": "c", "free2": "c", "pinned-b": "b", "sel-c": "c", "huge": None}


def test_every_node_places_the_same_and_routes_every_model(nodes):
    for n in nodes.values():
        assert wait_for(lambda n=n: where(n) == EXPECTED, 30), (where(n), n.logs())
    for n in nodes.values():
        for model in ("free1", "second", "pinned-b", "sel-c"):
            r = n.chat(model, max_tokens=3)
            assert r.choices[0].message.content, (n.url, model)
    # streaming through a node that does not run the model, with Anthropic's SDK
    client = anthropic.Anthropic(base_url=nodes["a"].url, api_key="x", max_retries=0)
    with client.messages.stream(model="sel-c", max_tokens=5,
                                messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
    assert text
    direct = nodes["c"].chat("sel-c", max_tokens=5).choices[0].message.content
    via_a = nodes["a"].chat("sel-c", max_tokens=5).choices[0].message.content
    assert via_a == direct  # greedy: the same worker answers either way
    # the request id goes through to the node that runs the model and comes back
    r = httpx.post(nodes["a"].url + "/v1/chat/completions", headers={"X-Request-Id": "rid-7"},
                   json={"model": "pinned-b", "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-7"
    # a protocol error from the remote worker keeps its shape and status
    r = httpx.post(nodes["a"].url + "/v1/messages", json={"model": "pinned-b",
                   "max_tokens": -1, "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_cli_shows_nodes_and_where_models_run(nodes):
    a = nodes["a"]
    out = a.cli("get", "nodes").stdout
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert set(lines) == {"a", "b", "c"}, out
    assert all("Ready" in ln for ln in lines.values()), out
    assert "8.0 GB" in lines["c"] and "chip=m2" in lines["c"], out
    out = a.cli("describe", "node", "c").stdout
    assert "free1" in out and "sel-c" in out and "Ready" in out, out
    out = a.cli("get", "models", "-o", "wide").stdout
    table = [re.split(r"\s{2,}", ln) for ln in out.split("\n\n")[0].splitlines()]
    col = table[0].index("NODE")
    rows = {r[0]: r for r in table[1:]}
    assert rows["pinned-b"][col] == "b" and rows["sel-c"][col] == "c", out
    assert rows["huge"][2] == "Unschedulable", out
    # describe and load work on a model another node runs
    out = a.cli("describe", "model", "pinned-b").stdout
    assert "Node:          b" in out, out
    assert a.cli("load", "pinned-b").returncode == 0
    # its log, tailed and followed through a node that does not run it
    assert "loaded builtin:tiny" in a.cli("logs", "pinned-b", "--tail", "50").stdout
    out = a.dir.parent / "a" / "follow.log"
    with open(out, "w") as f:
        follow = subprocess.Popen([sys.executable, "-m", "mlxfleet", "logs", "-f", "pinned-b",
                                   "--tail", "50"], stdout=f, text=True, env=a.env)
    try:
        loaded = lambda: out.read_text().count("loaded builtin:tiny")  # noqa: E731
        seen = wait_for(loaded, 20)
        assert seen, out.read_text()
        assert a.cli("unload", "pinned-b").returncode == 0
        assert a.cli("load", "pinned-b").returncode == 0  # a new worker logs as it loads
        assert wait_for(lambda: loaded() > seen, 30), out.read_text()
    finally:
        follow.kill()
    # Ollama's empty requests unload and load it on its node, asked of another node
    ask = lambda keep: httpx.post(a.url + "/api/generate", timeout=60,  # noqa: E731
                                  json={"model": "pinned-b", "keep_alive": keep}).json()
    status = lambda: httpx.get(nodes["b"].url + "/mlxfleet/v1/models/pinned-b",  # noqa: E731
                               timeout=10).json()
    assert ask(0)["done_reason"] == "unload" and status()["phase"] == "Unloaded"
    assert ask("1h")["done_reason"] == "load"
    st = status()
    assert st["phase"] == "Ready" and st["keepAlive"] == 3600, st
    # and every node lists how its worker parses output, wherever it runs
    parsers = lambda: next(m for m in httpx.get(a.url + "/v1/models",  # noqa: E731
                                                timeout=10).json()["data"]
                           if m["id"] == "pinned-b")["parsers"]
    assert wait_for(parsers, 20), "node a never heard how pinned-b parses output"
    assert parsers()["tool_call"] and parsers()["source"] == "model", parsers()


def test_the_dashboard_shows_the_nodes_and_where_models_run(nodes, browser, tmp_path):
    from PIL import Image

    pg = browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(nodes["b"].url + "/#nodes")
    pg.wait_for_selector("#nodes-table tr[data-node='c']")
    for n in "abc":
        assert pg.inner_text(f"#nodes-table tr[data-node='{n}'] td.phase") == "Ready"
    assert "(this)" in pg.inner_text("#nodes-table tr[data-node='b']")
    assert "free1" in pg.inner_text("#nodes-table tr[data-node='c']")
    pg.screenshot(path=str(tmp_path / "nodes.png"), full_page=True)
    assert len(Image.open(tmp_path / "nodes.png").convert("RGB").getcolors(1 << 20)) > 20
    pg.goto(nodes["b"].url + "/#models")
    pg.wait_for_selector("#models-table tr[data-model='sel-c']")
    assert pg.inner_text("#models-table tr[data-model='sel-c'] td:nth-child(5)") == "c"
    assert pg.inner_text("#models-table tr[data-model='huge'] td.phase") == "Unschedulable"
    pg.close()
    assert not errors, errors


def test_a_stored_response_is_answered_by_any_node(nodes):
    """Created through node a for a model that node c runs: a stores it under an id that
    names a, and b reads, continues and deletes it by asking a."""
    a = openai.OpenAI(base_url=nodes["a"].url + "/v1", api_key="x", max_retries=0)
    b = openai.OpenAI(base_url=nodes["b"].url + "/v1", api_key="x", max_retries=0)
    first = a.responses.create(model="free1", input="hello", max_output_tokens=3)
    assert first.id.endswith("_a"), first.id
    assert b.responses.retrieve(first.id).output_text == first.output_text
    assert b.responses.input_items.list(first.id).data
    follow = b.responses.create(model="free1", input="and then", max_output_tokens=3,
                                previous_response_id=first.id)
    assert follow.id.endswith("_b") and follow.previous_response_id == first.id
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_a_model_that_fits_nowhere_is_refused_with_the_reason(nodes):
    with pytest.raises(openai.APIStatusError) as e:
        nodes["b"].chat("huge")
    assert e.value.status_code == 503
    assert "cannot run on any node" in e.value.message and "the largest, c" in \
        e.value.message, e.value.message


def test_the_fleet_key_is_required_between_nodes(nodes):
    from mlxfleet.fleet_auth import AUTH_HEADER, answer_ok, sign

    url = nodes["a"].url
    assert httpx.get(url + "/mlxfleet/v1/node", timeout=5).status_code == 401
    r = httpx.get(url + "/mlxfleet/v1/node", timeout=5,
                  headers=sign("wrong", "b", "GET", "/mlxfleet/v1/node"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_fleet_key"
    signed = sign(KEY, "b", "GET", "/mlxfleet/v1/node")
    r = httpx.get(url + "/mlxfleet/v1/node", headers=signed, timeout=5)
    assert r.status_code == 200 and r.json()["name"] == "a"
    # the answer is signed back; the key itself never crossed the wire
    assert answer_ok(KEY, signed, 200, r.content, r.headers.get(AUTH_HEADER))
    assert KEY not in str(signed) and KEY not in str(r.headers)
    # a replayed request (a captured one, sent again) is refused
    r = httpx.get(url + "/mlxfleet/v1/node", headers=signed, timeout=5)
    assert r.status_code == 401 and "replayed" in r.json()["error"]["message"]
    # a signature for one route does not open another
    r = httpx.get(url + "/mlxfleet/v1/store/listing?source=acme/x", timeout=5,
                  headers=sign(KEY, "b", "GET", "/mlxfleet/v1/node"))
    assert r.status_code == 401
    # a request that claims to come from a node without the key is refused, not served
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Mlxfleet-Forwarded-By": "b"},
                   json={"model": "free1", "messages": [{"role": "user", "content": "x"}]},
                   timeout=10)
    assert r.status_code == 401


def test_a_node_whose_view_differs_passes_a_request_on_once_never_back(nodes):
    """While two nodes' placements disagree (a one-way partition: a cannot see c, b sees
    both), a request that a forwards to b for a model b sees on c goes on to c: it was a
    503 model_moved for as long as the partition lasted. Never back to its sender, and
    never more than once (no circles). Here a's side of the disagreement is a request
    signed as a's, for a model every node sees on c."""
    from mlxfleet.fleet_auth import sign

    def forwarded(sender: str, hops: Optional[int] = None) -> httpx.Response:
        body = json.dumps({"model": "sel-c", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        headers = {**sign(KEY, sender, "POST", "/v1/chat/completions", body),
                   "Content-Type": "application/json"}
        if hops is not None:
            headers["X-Mlxfleet-Hops"] = str(hops)
        return httpx.post(nodes["b"].url + "/v1/chat/completions", content=body,
                          headers=headers, timeout=60)

    r = forwarded("a")
    assert r.status_code == 200, r.text  # b passed it on to c, which answered
    assert r.json()["usage"]["completion_tokens"] == 2
    r = forwarded("c")  # c sent it: never back to c
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_moved", r.text
    assert r.headers["x-mlxfleet-moved"]  # (what tells a sending node to ask again)
    r = forwarded("a", hops=2)  # forwarded twice already: no further
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_moved", r.text


def test_a_node_without_its_manifest_or_key_refuses_to_start(nodes, tmp_path):
    def serve(*args, env=None):
        return subprocess.run([sys.executable, "-m", "mlxfleet", "serve", "--manifests",
                               str(nodes["a"].dir), "--port", "0", "--state-dir",
                               str(tmp_path), *args], capture_output=True, text=True,
                              timeout=60, env=env)

    r = serve("--node", "zz")
    assert r.returncode != 0 and "no kind: Node manifest named 'zz'" in r.stderr, r.stderr
    assert "a, b, c" in r.stderr
    r = serve("--node", "a", "--host", "0.0.0.0", "--api-key", "k")
    assert r.returncode != 0 and "fleet key" in r.stderr, r.stderr


def models_yaml(pinned_to: str = "b") -> str:
    return "---\n".join([
        manifest("free1"), manifest("free2", aliases=["second"]),
        manifest("pinned-b", placement={"nodes": [pinned_to]}),
        manifest("sel-c", placement={"nodeSelector": {"chip": "m2"}}),
        manifest("huge", cache={"memoryMB": 20000})])


def test_editing_placement_moves_a_model_and_only_that_one(nodes):
    a, b = nodes["a"], nodes["b"]
    pids = {m: s["pid"] for m, s in a.models().items() if m != "_errors"}
    a.write("models.yaml", models_yaml(pinned_to="a"))
    moved = dict(EXPECTED, **{"pinned-b": "a"})
    for n in nodes.values():
        assert wait_for(lambda n=n: where(n) == moved, 30), (where(n), n.logs())
    assert b.chat("pinned-b").choices[0].message.content  # served by a now, asked on b
    assert a.wait_ready("pinned-b")["node"] == "a"
    st = a.models()
    for m in ("free1", "free2", "sel-c"):  # the others kept their workers
        assert st[m]["pid"] == pids[m], m
    a.write("models.yaml", models_yaml())
    for n in nodes.values():
        assert wait_for(lambda n=n: where(n) == EXPECTED, 30), (where(n), n.logs())


def test_a_node_with_another_key_says_so_and_takes_no_model(nodes, tmp_path):
    """A node started with a mistyped fleet key placed every model on itself and served
    them, silently. Now it sees every other node refuse it: it says so (log, get nodes)
    and takes none of the fleet's models; the others see it refuse them."""
    a = nodes["a"]
    d = Served(tmp_path / "d", {**ENV, "MLXFLEET_FLEET_KEY": "a-typo"}, manifests=a.dir,
              args=("--node", "d"))
    d.write("node-d.yaml", node_doc("d", d.url, "64GB"))
    try:
        d.start()

        def own() -> dict:
            rows = httpx.get(d.url + "/mlxfleet/v1/nodes", timeout=10).json()["items"]
            return {r["name"]: r for r in rows}

        assert wait_for(lambda: own()["d"]["status"] == "Rejected", 20), (own(), d.logs())
        assert own()["a"]["status"] == "RejectsOurKey" and "fleet key" in own()["a"]["error"]
        assert "every other node of the fleet refuses this node's fleet key" in d.logs()
        assert not own()["d"]["models"]  # (it took them all: 64 GB, the most room)
        seen = {r["name"]: r for r in httpx.get(a.url + "/mlxfleet/v1/nodes",
                                                timeout=10).json()["items"]}
        assert wait_for(lambda: {r["name"]: r for r in httpx.get(
            a.url + "/mlxfleet/v1/nodes", timeout=10).json()["items"]}["d"]["status"]
            == "RejectsOurKey", 20), seen
        assert where(a) == EXPECTED  # the fleet's placement did not change
    finally:
        d.stop()
        (a.dir / "node-d.yaml").unlink(missing_ok=True)
    for n in nodes.values():
        assert wait_for(lambda n=n: where(n) == EXPECTED, 30), where(n)


def test_a_silent_node_is_given_up_on_in_seconds_naming_why(nodes):
    """A stopped node (SIGSTOP: its kernel still accepts connections) left a forwarded
    request waiting for its whole timeout (300 s, then a 504). Now a request waiting on
    it ends once the node misses two polls, and a new one is refused at once: 503
    node_unreachable, saying why; the node answers again when it is back."""
    import threading
    import time

    a, b = nodes["a"], nodes["b"]
    assert wait_for(lambda: where(a) == EXPECTED, 30), where(a)
    got: dict = {}

    def long_request():
        t0 = time.monotonic()
        r = httpx.post(a.url + "/v1/chat/completions", timeout=60, json={
            "model": "pinned-b", "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]})
        got.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    # Stop b first, then ask: a still believes b is up (two polls must be missed), so it
    # forwards and waits. (Stopping b 0.5 s into a 1,500-token answer raced a fast
    # machine: the answer was done in 0.7 s.)
    b.proc.send_signal(signal.SIGSTOP)
    t = threading.Thread(target=long_request)
    t.start()
    try:
        t.join(30)
        assert got.get("status") == 503, got
        err = got["body"]["error"]
        assert err["code"] == "node_unreachable" and "'b' stopped answering" in \
            err["message"], err
        assert got["seconds"] < 15, got  # (300 s before)
        with pytest.raises(openai.APIStatusError) as e:
            a.chat("pinned-b")
        assert e.value.status_code == 503 and "stopped answering" in e.value.message
    finally:
        b.proc.send_signal(signal.SIGCONT)

    def answers() -> bool:
        try:
            return a.chat("pinned-b").choices[0].message.content is not None
        except openai.APIStatusError:
            return False

    assert wait_for(answers, 20)


def test_a_dead_node_loses_its_models_and_gets_back_the_pinned_ones(nodes):
    """Last: kills node c. Its unpinned models move; the one only c may run answers 503
    naming c; when c is back, the moved models stay where they are (no flapping)."""
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    assert where(a) == EXPECTED
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait()
    # within the grace period: the node is named as unreachable
    with pytest.raises(openai.APIStatusError) as e:
        a.chat("free1")
    assert e.value.status_code == 503 and "'c'" in e.value.message, e.value.message
    moved = wait_for(lambda: (lambda w: w if w["free1"] in ("a", "b") and
                              w["free2"] in ("a", "b") else None)(where(a)), 30)
    assert moved, (where(a), a.logs())
    assert moved["sel-c"] is None and moved["pinned-b"] == "b"
    assert wait_for(lambda: where(b) == moved, 10)
    for n in (a, b):
        assert n.chat("free1").choices[0].message.content
        assert n.chat("free2").choices[0].message.content
    with pytest.raises(openai.APIStatusError) as e:
        a.chat("sel-c")
    assert e.value.status_code == 503 and "down: c" in e.value.message, e.value.message
    lines = {ln.split()[0]: ln for ln in a.cli("get", "nodes").stdout.splitlines()[1:]}
    assert "Lost" in lines["c"]
    rows = {r["name"]: r for r in httpx.get(a.url + "/mlxfleet/v1/nodes",
                                            timeout=10).json()["items"]}
    assert rows["c"]["memory"]["usedBytes"] is None  # not its last figure, as if alive
    # c comes back: sel-c returns to it, the moved models stay
    c.start()
    back = dict(moved, **{"sel-c": "c"})
    for n in (a, b, c):
        assert wait_for(lambda n=n: where(n) == back, 30), (where(n), n.logs())
    assert a.chat("sel-c").choices[0].message.content
    assert c.chat("free1").choices[0].message.content
