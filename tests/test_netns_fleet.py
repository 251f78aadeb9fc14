"""A fleet of three nodes in network namespaces, over mutual TLS, every link between
them with 20 ms of delay and 1% loss (a userspace forwarder: tests/netfleet.py), as an
operator of three Macs would try it: a node that goes silent (SIGSTOP, then its cable
pulled), a node cut off, a one-way partition, a process without the fleet's certificate
at a node's address. Each test prints what it measured (`pytest -s`); docs/fleet.md
has the figures. Needs root (skipped otherwise, with the reason)."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from netfleet import Forwarder, Net, NsServed, can_make_namespaces
from served import Served, free_port, manifest, wait_for

from mlxfleet import fleet_tls

why_not = can_make_namespaces()
pytestmark = pytest.mark.skipif(why_not is not None, reason=why_not or "")

GRACE = 5.0
ENV = {"MLXFLEET_FLEET_GRACE": str(GRACE), "MLXFLEET_FLEET_POLL_INTERVAL": "0.5",
       "MLXFLEET_NODE_BIND": "0.0.0.0"}
PLACED = {"on-a": "a", "on-c": "c", "free": "c"}


def measured(what: str, value: str) -> None:
    print(f"\nmeasured: {what}: {value}", file=sys.stderr)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("netns")
    net = Net("abc")
    fwd = Forwarder(net)
    fwd.delay, fwd.loss = 0.020, 0.01
    shared = root / "manifests"
    shared.mkdir()
    ns = {n: NsServed(root / n, ENV, shared, n, net, fwd) for n in "abc"}
    ports = {n: free_port() for n in ns}
    for n, p in ports.items():
        fwd.node_port(n, p)
        ns[n].node_port = p
    docs = [yaml.safe_dump({"apiVersion": "mlxfleet/v1", "kind": "Node", "metadata": {"name": n},
                            "spec": {"url": f"https://{net.hub}:{ports[n]}",
                                     "memory": "8GB" if n == "c" else "4GB"}})
            for n in ns]
    ns["a"].write("nodes.yaml", "---\n".join(docs))
    token, pin = fleet_tls.init(ns["a"].state / "fleet", "a")
    for n in "bc":  # the join exchange, in process (test_fleet_tls drives the CLI's)
        sent, key = fleet_tls.join_request(token, n)
        answer = fleet_tls.answer_join(ns["a"].state / "fleet", sent)
        fleet_tls.finish_join(ns[n].state / "fleet", token, pin, sent, key, answer)
    try:
        for n in ns.values():
            n.launch()
        for n in ns.values():
            assert wait_for(n._up, timeout=40), n.logs()
        # The models come once every node sees the others (a node slower to boot than the
        # grace would see its share placed elsewhere, correctly, and kept there).
        Served.wait_fleet(ns)
        ns["a"].write("models.yaml", "---\n".join([
            manifest("on-a", placement={"nodes": ["a"]}),
            manifest("on-c", placement={"nodes": ["c"]}), manifest("free")]))
        for n in ns.values():
            assert wait_for(lambda n=n: where(n) == PLACED, 40), (where(n), n.logs())
        for m, n in PLACED.items():
            ns[n].wait_ready(m, timeout=120)
        yield ns, net, fwd
    finally:
        for n in ns.values():
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
            n.stop()
        net.close()


def where(node) -> dict:
    try:
        data = httpx.get(node.url + "/v1/models", timeout=5).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {m["id"]: m["node"] for m in data}


def ask(node, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(node.url + "/v1/chat/completions", timeout=timeout, json={
        "model": model, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]})


def statuses(node) -> dict:
    nodes = httpx.get(node.url + "/mlxfleet/v1/nodes", timeout=5).json()["items"]
    return {n["name"]: n["status"] for n in nodes}


def back_to_normal(ns) -> None:
    """Every node Ready and every node placing every model alike (where the models ran
    before a partition, or where they moved: they stay where they run)."""
    Served.wait_fleet(ns, timeout=30)
    agree = lambda: len({json.dumps(where(n), sort_keys=True) for n in ns.values()}) == 1 \
        and None not in where(ns["a"]).values() and len(where(ns["a"])) == 3  # noqa: E731
    assert wait_for(agree, 30), {n.node: where(n) for n in ns.values()}


def test_every_node_serves_every_model_over_a_slow_lossy_link(fleet):
    ns, _, _ = fleet
    for n in ns.values():
        for m in PLACED:
            r = ask(n, m)
            assert r.status_code == 200, (n.node, m, r.text)
    direct, hop = [], []
    for _ in range(15):  # interleaved: on-c asked on c itself, and through a
        for out, node in ((direct, ns["c"]), (hop, ns["a"])):
            t = time.perf_counter()
            assert ask(node, "on-c").status_code == 200
            out.append(time.perf_counter() - t)
    extra = (statistics.median(hop) - statistics.median(direct)) * 1000
    measured("a 1-token request through another node (20 ms delay, 1% loss each way), "
             "median of 15", f"{statistics.median(direct) * 1000:.0f} ms on the node, "
             f"{statistics.median(hop) * 1000:.0f} ms through a (+{extra:.0f} ms)")
    assert extra > 30  # the forwarder's delay is in the path (two crossings of 20 ms)


def _silent(ns, fwd, go_silent, come_back, what: str) -> None:
    """``c`` goes silent while a request streams from it through ``a``: that request and
    the new ones end with a 503 naming c within seconds; then it comes back.

    Without the forwarder's loss meanwhile: a chunk it holds for a "retransmission"
    lets everything behind it queue in the forwarder, past the cable, without a TCP
    window's limit; a fast machine made all 1,500 tokens in that 0.2 s, and the stream
    then ended whole with the cable already pulled (CI, 2026-12-06)."""
    a = ns["a"]
    loss, fwd.loss = fwd.loss, 0.0

    def stream(ended: dict) -> None:
        t = None
        try:
            with httpx.stream("POST", a.url + "/v1/chat/completions", timeout=120, json={
                    "model": "on-c", "max_tokens": 1500, "stream": True, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "count"}]}) as r:
                for line in r.iter_lines():
                    if t is None:
                        ended["first"] = time.monotonic()
                        t = True
                    if '"error"' in line:
                        ended["error"] = line
        except httpx.HTTPError as e:
            ended["error"] = repr(e)
        ended["at"] = time.monotonic()

    # A stream in flight. (Its 1,500 tokens take seconds, but a forwarder that held a
    # chunk for a retransmission delivers what queued behind it at once: on busy cores
    # one stream was whole by the time its first line was read. Then another is asked.)
    for _ in range(3):
        ended: dict = {}
        th = threading.Thread(target=stream, args=(ended,))
        th.start()
        assert wait_for(lambda e=ended: "first" in e, 30), ended
        if "at" not in ended:
            break
        th.join()
    t0 = time.monotonic()
    first_503 = None
    try:
        go_silent()  # (in the try: c comes back whatever fails, for the tests after)
        assert "at" not in ended, ended  # (still streaming)
        while time.monotonic() - t0 < GRACE - 0.5:
            r = ask(a, "on-c", timeout=GRACE)
            if r.status_code == 503:
                first_503 = time.monotonic()
                assert r.json()["error"]["code"] == "node_unreachable", r.text
                assert "'c'" in r.json()["error"]["message"], r.text
                assert r.headers.get("retry-after")
                break
        th.join(GRACE)
    finally:
        come_back()
        fwd.loss = loss
    t1 = time.monotonic()
    th.join(60)
    assert first_503 is not None, "no 503 before the grace period ended"
    assert "at" in ended and ended["at"] - t0 < GRACE, ended
    assert "error" in ended, ended  # the stream says why it ended, not a silent cut
    back_to_normal(ns)
    measured(what, f"the stream in flight ended {ended['at'] - t0:.1f} s after, the first "
             f"new request got 503 node_unreachable {first_503 - t0:.1f} s after; back "
             f"(every node Ready, placement as before) {time.monotonic() - t1:.1f} s after "
             "it answered again")


def test_a_node_stopped_with_sigstop_is_routed_around_in_seconds(fleet):
    ns, _, fwd = fleet
    pid = ns["c"].proc.pid
    _silent(ns, fwd, lambda: ns["c"].proc.send_signal(signal.SIGSTOP),
            lambda: ns["c"].proc.send_signal(signal.SIGCONT), "c stopped (SIGSTOP)")
    assert ns["c"].proc.pid == pid and ns["c"].proc.poll() is None


def test_a_node_whose_cable_is_pulled_is_routed_around_in_seconds(fleet):
    ns, net, fwd = fleet
    _silent(ns, fwd, lambda: net.link("c", False), lambda: net.link("c", True),
            "c's link down (ip link set down)")


def running(node, model: str) -> bool:
    """Whether ``node`` runs a worker for ``model`` itself."""
    s = node.status(model)
    return bool(s and s.get("node") == node.node and s.get("pid") and s.get("ready"))


def test_a_node_cut_off_keeps_what_it_holds_the_others_take_the_rest(fleet):
    ns, _, fwd = fleet
    a, c = ns["a"], ns["c"]
    pid_c = c.status("free")["pid"]
    t0 = time.monotonic()
    fwd.partition("c", "a")
    fwd.partition("c", "b")
    try:
        # a and b: past the grace period the unpinned model answers from one of them
        assert wait_for(lambda: ask(a, "free", timeout=10).status_code == 200
                        and where(a)["free"] in ("a", "b"), 40), (where(a), a.logs())
        moved = time.monotonic() - t0
        r = ask(a, "on-c", timeout=10)  # pinned to the node cut off: the reason
        assert r.status_code == 503 and "down: c" in r.text, r.text
        # c: keeps serving what it holds, places nothing that is pinned elsewhere, and
        # does not evict and reload (it did, every 3-5 s, for the whole partition)
        assert ask(c, "free").status_code == 200 and ask(c, "on-c").status_code == 200
        assert ask(c, "on-a", timeout=10).status_code == 503
        time.sleep(2)
        assert c.status("free")["pid"] == pid_c, c.logs()
    finally:
        fwd.heal()
    t1 = time.monotonic()
    copies = lambda: sum(running(n, "free") for n in ns.values())  # noqa: E731
    assert wait_for(lambda: copies() == 1, 30, interval=0.1), \
        [n.status("free") for n in ns.values()]
    single = time.monotonic() - t1
    back_to_normal(ns)
    measured("c cut off from a and b", f"'free' answered from a or b {moved:.1f} s after "
             f"the cut (grace {GRACE:g} s); after healing, one copy of it within "
             f"{single:.1f} s")


def test_a_one_way_partition_loses_no_request_through_the_node_that_sees_both(fleet):
    ns, _, fwd = fleet
    a, b, c = ns["a"], ns["b"], ns["c"]
    fwd.partition("a", "c")  # a and c cannot see each other; b sees both
    outcomes: dict[tuple[str, str], list[int]] = {}
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < GRACE + 4:
            for via in (a, b, c):
                for m in ("on-a", "on-c"):
                    outcomes.setdefault((via.node, m), []).append(
                        ask(via, m, timeout=15).status_code)
    finally:
        fwd.heal()
    failed = {k: sum(s != 200 for s in v) for k, v in outcomes.items()}
    total = sum(len(v) for v in outcomes.values())
    measured("one-way partition (a and c cannot see each other, b sees both), "
             f"{GRACE + 4:g} s", f"{total} requests, failed per (through, model): "
             + json.dumps({f"{k[0]}->{k[1]}": v for k, v in failed.items()}))
    # through b, and for each node's own model: never a failure; through a for c's
    # model (and the other way round): the one request in flight when the link went
    # silent may end 503 node_unreachable, the next ones go through b (they all failed,
    # 503 node_unreachable then model_unschedulable, for the whole partition)
    for key in (("b", "on-a"), ("b", "on-c"), ("a", "on-a"), ("c", "on-c")):
        assert failed[key] == 0, (key, outcomes[key])
    for key in (("a", "on-c"), ("c", "on-a")):
        assert failed[key] <= 1 and outcomes[key][-1] == 200, (key, outcomes[key])
    back_to_normal(ns)


IMPOSTOR = r"""
import socket, ssl, sys, tempfile, os
from mlxfleet import fleet_tls
d = tempfile.mkdtemp()
fleet_tls.init(d, "c")  # its own CA: a certificate that names c, but not the fleet's
ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
ctx.load_cert_chain(os.path.join(d, "node.pem"), os.path.join(d, "node.key"))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
out = open(sys.argv[2], "ab")
print("listening", flush=True)
while True:
    conn, _ = s.accept()
    try:
        t = ctx.wrap_socket(conn, server_side=True)
        out.write(b"HANDSHAKE OK\n"); out.flush()
        t.settimeout(2)
        out.write(t.recv(65536)); out.flush()
    except Exception as e:
        out.write(f"refused: {e}\n".encode()); out.flush()
    conn.close()
"""


def test_a_process_at_a_nodes_address_learns_nothing_and_gets_no_request(fleet, tmp_path):
    ns, net, _ = fleet
    a, c = ns["a"], ns["c"]
    port = c.node_port
    c.proc.kill()
    c.proc.wait()
    seen = tmp_path / "seen.bin"
    imp = subprocess.Popen(["ip", "netns", "exec", net.ns["c"], sys.executable, "-c", IMPOSTOR,
                            str(port), str(seen)], stdout=subprocess.PIPE, text=True)
    try:
        assert imp.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        got = wait_for(lambda: (r := ask(a, "on-c", timeout=10)).status_code == 503 and r, 20)
        assert got, "requests for c's model kept waiting"
        assert got.json()["error"]["code"] in ("node_unreachable", "model_unschedulable"), \
            got.text
        took = time.monotonic() - t0
        time.sleep(2)  # more polls reach it
        data = seen.read_bytes() if seen.exists() else b""
        assert b"HANDSHAKE OK" not in data  # a's client refused its certificate
        assert b"X-Mlxfleet" not in data and b"hi" not in data
        assert statuses(a)["c"] != "Ready"
        measured("a process without the fleet's certificate at c's address",
                 f"c's model answered 503 {took:.1f} s after (c was killed -9), the process "
                 f"saw {data.count(b'refused')} TLS handshakes refused and no request")
    finally:
        imp.kill()
