"""Mutual TLS between the nodes of a fleet (`mlxfleet fleet init` / `join`), driven as an
operator would: two `mlxfleet serve --node` processes on loopback whose Node manifests
have https:// urls, a join over the network with the printed token and CA hash, a model
served on one node and asked through the other; then what is refused: a client without
a fleet certificate on the node port, a signed request on the plain client port, a
certificate that names another node, a bad token, a wrong CA pin, a plain-http fleet."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import ollama
import pytest
import yaml
from hub import Hub, Repo
from served import Served, free_port, manifest, wait_for

from mlxfleet import fleet_auth, fleet_tls
from mlxfleet.builtin import ensure_builtin

ENV = {"MLXFLEET_FLEET_GRACE": "6", "MLXFLEET_FLEET_POLL_INTERVAL": "0.5"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxfleet", *args], capture_output=True,
                          text=True, timeout=60)


def node_doc(name: str, url: str) -> str:
    return yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Node",
                           "metadata": {"name": name}, "spec": {"url": url, "memory": "4GB"}},
                          sort_keys=False)


@pytest.fixture(scope="module")
def hub():
    h = Hub({"acme/tiny": Repo.from_dir(ensure_builtin("tiny"))})
    yield h
    h.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("tls")
    ns = Served.nodes(root, "ab", ENV)
    for n, f in ns.items():
        f.env.update(hub.env(root / f"hf-{n}"))  # each node its own cache
    ports = {n: free_port() for n in ns}
    urls = {n: f"https://127.0.0.1:{p}" for n, p in ports.items()}
    ns["a"].write("nodes.yaml", "---\n".join(node_doc(n, urls[n]) for n in ns))
    ns["a"].write("models.yaml", "---\n".join([
        manifest("on-b", placement={"nodes": ["b"]}),
        manifest("on-a", placement={"nodes": ["a"]}), manifest("free")]))
    made = cli("fleet", "init", "a", "--state-dir", str(ns["a"].state))
    assert made.returncode == 0, made.stderr
    token = re.search(r"--token (\S+)", made.stdout).group(1)
    pin = re.search(r"--ca-hash (\S+)", made.stdout).group(1)
    ns["a"].start()
    joined = cli("fleet", "join", ns["a"].url, "b", "--token", token, "--ca-hash", pin,
                 "--state-dir", str(ns["b"].state))
    assert joined.returncode == 0, joined.stderr + ns["a"].logs()
    ns["b"].start()
    yield ns, urls, token, pin
    for n in ns.values():
        n.stop()
    for n in ns.values():  # both listeners drained and closed: a clean exit
        assert n.proc.returncode == 0 and "Traceback" not in n.logs(), n.logs()


PLACED = {"on-b": "b", "on-a": "a", "free": "a"}


def folder(node: Served) -> Path:
    return node.state / "fleet"


def where(node: Served) -> dict:
    data = httpx.get(node.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["node"] for m in data}


def test_nodes_that_joined_serve_each_others_models_over_mutual_tls(fleet):
    ns, urls, _, _ = fleet
    a, b = ns["a"], ns["b"]
    for n in (a, b):
        assert wait_for(lambda n=n: where(n) == PLACED, 40), \
            (where(n), n.logs())
    # asked on a, served by b's worker, forwarded over TLS; and the other way round
    assert a.wait_ready("on-b", timeout=120)["node"] == "b"
    via_a = a.chat("on-b", max_tokens=5).choices[0].message.content
    assert via_a and via_a == b.chat("on-b", max_tokens=5).choices[0].message.content
    assert b.chat("on-a", max_tokens=3).choices[0].message.content
    nodes = httpx.get(a.url + "/mlxfleet/v1/nodes", timeout=10).json()["items"]
    assert {n["name"]: n["status"] for n in nodes} == {"a": "Ready", "b": "Ready"}, nodes
    # the joined node got the fleet key and its certificate, private to its user
    assert (folder(a) / "key").read_text() == (folder(b) / "key").read_text()
    for f in ("node.key", "key", "ca.pem", "node.pem"):
        assert (folder(b) / f).stat().st_mode & 0o077 == 0, f
    assert not (folder(b) / "ca.key").exists()  # the CA key never left node a
    assert "joined the fleet" in a.logs()


def test_weights_are_copied_between_nodes_over_tls(fleet, hub):
    ns = fleet[0]
    assert ollama.Client(host=ns["a"].url).pull("acme/tiny", stream=False).status == "success"
    statuses = [e.status for e in ollama.Client(host=ns["b"].url).pull("acme/tiny",
                                                                        stream=True)]
    assert "pulling from node a" in statuses and statuses[-1] == "success", statuses
    assert sum(1 for m, p, _ in hub.log if m == "GET" and p.endswith(".safetensors")) == 1


def signed(node: str, key: str, path: str) -> dict:
    return fleet_auth.sign(key, node, "GET", path)


def test_the_node_port_wants_a_fleet_certificate_and_the_client_port_no_node(fleet):
    ns, urls, _, _ = fleet
    a, b = ns["a"], ns["b"]
    key = (folder(a) / "key").read_text()
    tls_a = fleet_tls.FleetTLS.load(folder(a), "a")
    # no client certificate (a client that trusts the CA, even): the handshake fails
    anon = ssl.create_default_context(cafile=str(tls_a.ca))
    with pytest.raises(httpx.HTTPError), httpx.Client(verify=anon, timeout=5) as c:
        c.get(urls["b"] + "/v1/models", extensions={"sni_hostname": fleet_tls.node_dns("b")})
    # with a's certificate, and signed as a: the node route answers (what polls do)
    with httpx.Client(verify=tls_a.client_context(), timeout=10) as c:
        r = c.get(urls["b"] + "/mlxfleet/v1/node", headers=signed("a", key, "/mlxfleet/v1/node"),
                  extensions={"sni_hostname": fleet_tls.node_dns("b")})
        assert r.status_code == 200 and r.json()["name"] == "b", r.text
        # signed as another node than its certificate names: refused
        r = c.get(urls["b"] + "/mlxfleet/v1/node", headers=signed("z", key, "/mlxfleet/v1/node"),
                  extensions={"sni_hostname": fleet_tls.node_dns("b")})
        assert r.status_code == 401 and "names node 'a'" in r.text, r.text
        # a client's request (no signature) on the node port: refused
        r = c.get(urls["b"] + "/v1/models", extensions={"sni_hostname": fleet_tls.node_dns("b")})
        assert r.status_code == 401, r.text
    # the server must be the node asked for: b's certificate does not pass for a's
    with pytest.raises(httpx.ConnectError, match="not valid for 'a.node.mlxfleet'"), \
            httpx.Client(verify=tls_a.client_context(), timeout=10) as c:
        c.get(urls["b"] + "/mlxfleet/v1/node", extensions={
            "sni_hostname": fleet_tls.node_dns("a")})
    # a signed request on the plain client port, even with the right key: refused
    r = httpx.get(b.url + "/mlxfleet/v1/node", headers=signed("a", key, "/mlxfleet/v1/node"),
                  timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "fleet_tls_required", r.text


def test_a_join_needs_the_token_and_the_pinned_ca(fleet, tmp_path):
    ns, _, token, pin = fleet
    a = ns["a"]
    tid = token.split(".")[0]
    bad = cli("fleet", "join", a.url, "c", "--token", f"{tid}.{'0' * 32}", "--ca-hash", pin,
              "--fleet-dir", str(tmp_path / "c1"))
    assert bad.returncode == 1 and "401" in bad.stderr and "MACed" in bad.stderr, bad.stderr
    assert not (tmp_path / "c1" / "node.pem").exists()
    wrong_pin = "sha256:" + "0" * 64
    bad = cli("fleet", "join", a.url, "c", "--token", token, "--ca-hash", wrong_pin,
              "--fleet-dir", str(tmp_path / "c2"))
    assert bad.returncode == 1 and "not the pinned" in bad.stderr, bad.stderr
    assert not (tmp_path / "c2").exists()  # nothing written
    # hostile join requests: a clear 4xx in the protocol's shape, never a 500
    good = fleet_tls.join_request(token, "c")[0]
    for bad_body, status in [({**good, "mac": "é" * 64}, 401), ({**good, "nonce": "zz" * 16}, 401),
                             ({**good, "node": "../../x"}, 400), ({**good, "csr": 7}, 400),
                             ({"node": "c"}, 400), ([1, 2], 400)]:
        r = httpx.post(a.url + fleet_tls.JOIN_ROUTE, json=bad_body, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == "join_refused", \
            (bad_body, r.status_code, r.text)
    r = httpx.post(a.url + fleet_tls.JOIN_ROUTE, content=b"not json", timeout=10)
    assert r.status_code == 400, r.text
    # a node that does not hold the CA cannot sign joins
    r = httpx.post(ns["b"].url + fleet_tls.JOIN_ROUTE, json=fleet_tls.join_request(
        token, "c")[0], timeout=10)
    assert r.status_code == 404, r.text


def test_a_fleet_in_plain_http_beyond_loopback_refuses_to_start(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "nodes.yaml").write_text("---\n".join([
        node_doc("x", "http://127.0.0.1:18001"), node_doc("y", "http://10.9.9.9:8000")]))
    r = cli("serve", "--manifests", str(d), "--node", "x", "--port", str(free_port()),
            "--state-dir", str(tmp_path / "s"), "--fleet-key", "k")
    assert r.returncode != 0 and "plain http:// beyond loopback" in r.stderr + r.stdout, \
        r.stderr
    assert "y" in r.stderr and "fleet init" in r.stderr
    # a machine that joined a TLS fleet refuses http:// urls in it
    fleet_tls.init(tmp_path / "s" / "fleet", "x")
    r = cli("serve", "--manifests", str(d), "--node", "x", "--port", str(free_port()),
            "--state-dir", str(tmp_path / "s"))
    assert r.returncode != 0 and "every Node url is https://" in r.stderr, r.stderr


def test_a_node_of_another_fleet_says_so_and_takes_no_model(fleet, tmp_path):
    """A node whose certificate is of another CA (it ran its own `fleet init`) is refused
    by every node's TLS, both ways: it says so and takes none of the fleet's models
    (with the most memory, it would have taken the unpinned one); the others see it
    refuse them, and their placement does not change."""
    ns, _, _, _ = fleet
    a = ns["a"]
    d = Served(tmp_path / "d", ENV, manifests=a.dir, args=("--node", "d"))
    fleet_tls.init(d.state / "fleet", "d")
    d.write("node-d.yaml", yaml.safe_dump({
        "apiVersion": "mlxfleet/v1", "kind": "Node", "metadata": {"name": "d"},
        "spec": {"url": f"https://127.0.0.1:{free_port()}", "memory": "64GB"}}))
    try:
        d.start()

        def seen_by(node: Served) -> dict:
            rows = httpx.get(node.url + "/mlxfleet/v1/nodes", timeout=10).json()["items"]
            return {r["name"]: r for r in rows}

        assert wait_for(lambda: seen_by(d)["d"]["status"] == "Rejected", 20), \
            (seen_by(d), d.logs())
        assert "certificate" in seen_by(d)["a"]["error"], seen_by(d)["a"]
        assert "every other node of the fleet refuses this node's certificate" in d.logs()
        assert not seen_by(d)["d"]["models"]
        assert wait_for(lambda: seen_by(a)["d"]["status"] == "RejectsOurKey", 20), seen_by(a)
        assert "certificate" in seen_by(a)["d"]["error"]
        assert where(a) == PLACED
    finally:
        d.stop()
        (a.dir / "node-d.yaml").unlink()
