"""Peer copy: a node of a fleet takes the weights another node holds, over the fleet's
authenticated channel, before asking the hub (``tests/hub.py`` stands in for it, as in
test_store.py). Three real nodes on this machine, each with its own Hugging Face cache."""

from __future__ import annotations

import signal
import threading

import httpx
import ollama
import pytest
import yaml
from hub import Hub, Repo
from served import Served, wait_for

from mlxfleet.builtin import ensure_builtin

KEY = "peer-key"


@pytest.fixture(scope="module")
def hub():
    h = Hub({"acme/tiny": Repo.from_dir(ensure_builtin("tiny")),
             "acme/big": Repo.from_dir(ensure_builtin("tiny-10m"), commit="b" * 40)})
    yield h
    h.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("peers")
    ns = Served.nodes(root, "abc", {"MLXFLEET_FLEET_KEY": KEY})
    for n, f in ns.items():
        f.env.update(hub.env(root / f"hf-{n}"))  # each node its own cache
    ns["c"].env["MLXFLEET_PEER_COPY_RATE_MB"] = "4"  # c copies slowly: caught midway below
    ns["a"].write("nodes.yaml", "---\n".join(
        yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Node", "metadata": {"name": n},
                        "spec": {"url": f.url, "memory": "4GB"}}) for n, f in ns.items()))
    try:  # stopped even when one never came up: no server outlives the module
        Served.start_all(ns)
        yield ns
    finally:
        for f in ns.values():
            f.stop()


def weight_gets(hub) -> int:
    return sum(1 for m, p, _ in hub.log if m == "GET" and p.endswith(".safetensors"))


def test_a_node_copies_weights_from_the_node_that_has_them(nodes, hub):
    a, c = nodes["a"], nodes["c"]
    assert ollama.Client(host=a.url).pull("acme/tiny", stream=False).status == "success"
    assert weight_gets(hub) == 1
    events = list(ollama.Client(host=c.url).pull("acme/tiny", stream=True))
    statuses = [e.status for e in events]
    assert "pulling from node a" in statuses and statuses[-1] == "success", statuses
    assert weight_gets(hub) == 1  # the hub was not asked for the weights again
    listed = httpx.get(c.url + "/mlxfleet/v1/sources", timeout=10).json()["items"]
    assert any(s["source"] == "acme/tiny" for s in listed)
    # a byte flipped in a's copy is caught on c: the copy fails over to the hub
    big = max((a.state.parent.parent / "hf-a").glob("models--acme--tiny/blobs/*"),
              key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[100] ^= 0xFF
    big.write_bytes(bytes(data))
    httpx.delete(c.url + "/mlxfleet/v1/sources", params={"source": "acme/tiny"}, timeout=10)
    statuses = [e.status for e in ollama.Client(host=c.url).pull("acme/tiny", stream=True)]
    assert any(s.startswith("from node a failed") for s in statuses), statuses
    assert statuses[-1] == "success" and weight_gets(hub) == 2, statuses


def test_the_peer_routes_need_the_fleet_key(nodes):
    from urllib.parse import urlencode

    from mlxfleet.fleet_auth import sign

    r = httpx.get(nodes["a"].url + "/mlxfleet/v1/store/listing",
                  params={"source": "acme/tiny"}, timeout=10)
    assert r.status_code == 401
    target = "/mlxfleet/v1/store/file?" + urlencode({
        "source": "acme/tiny", "commit": "0" * 40, "name": "../../../etc/passwd"})
    r = httpx.get(nodes["a"].url + target, headers=sign(KEY, "b", "GET", target), timeout=10)
    assert r.status_code == 404


def test_a_copy_killed_midway_continues_where_it_stopped(nodes, hub):
    a, c = nodes["a"], nodes["c"]
    assert ollama.Client(host=a.url).pull("acme/big", stream=False).status == "success"
    gets = weight_gets(hub)

    def first_pull():
        try:
            httpx.post(c.url + "/api/pull", timeout=120, json={"model": "acme/big"})
        except httpx.HTTPError:
            pass  # node c is killed under it

    threading.Thread(target=first_pull, daemon=True).start()
    blobs = c.state.parent.parent / "hf-c" / "models--acme--big" / "blobs"
    assert wait_for(lambda: any(p.stat().st_size > 8 << 20
                                for p in blobs.glob("*.incomplete")), 60)
    c.proc.send_signal(signal.SIGKILL)  # the machine lost power, say
    c.proc.wait()
    c.start()
    assert ollama.Client(host=c.url).pull("acme/big", stream=False).status == "success"
    assert weight_gets(hub) == gets  # all of it from node a, none from the hub
    served = [ln for ln in a.logs().splitlines()
              if "'acme/big' 'model.safetensors' from byte" in ln]
    assert served[0].split("from byte ")[1].startswith("0 "), served
    resumed = int(served[-1].split("from byte ")[1].split()[0])
    assert resumed > 8 << 20, served
