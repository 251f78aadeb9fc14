"""Replicas as decisions: where the copies go (placement) and which copy takes a request
(cache affinity with bounded load), and the affinity key a request carries."""

from __future__ import annotations

import math
from collections import Counter

from mlxfleet.api.affinity import affinity_key
from mlxfleet.supervisor.placement import ModelView, NodeView, place
from mlxfleet.supervisor.replicas import BOUND, Replica, pick, ranking

GB = 1 << 30
KEYS = [f"session-{i}" for i in range(64)]


def test_copies_go_to_distinct_nodes_stay_put_and_say_when_they_are_too_few():
    nodes = [NodeView(n, capacity=8 * GB) for n in "abc"]
    p = place([ModelView("m", GB, replicas=2)], nodes)["m"]
    assert p.replicas and len(set(p.nodes)) == 2 and not p.reason
    # a node with a copy keeps it when another (emptier) node comes
    held = [NodeView("a", capacity=8 * GB, holds=frozenset({"m"})),
            NodeView("b", capacity=8 * GB), NodeView("c", capacity=64 * GB),
            NodeView("d", capacity=64 * GB)]
    p = place([ModelView("m", GB, replicas=2)], held)["m"]
    assert "a" in p.nodes and len(p.nodes) == 2
    # fewer healthy nodes than copies: degraded, serving from what it has, and why
    down = [NodeView("a", capacity=8 * GB), NodeView("b", capacity=8 * GB, healthy=False)]
    p = place([ModelView("m", GB, replicas=3)], down)["m"]
    assert p.nodes == ("a",) and "1 of 3 replicas" in p.reason and "only 1" in p.reason
    # none fits: unschedulable, as one copy
    p = place([ModelView("m", 16 * GB, replicas=2)], nodes)["m"]
    assert p.nodes == () and "more than any allowed node can hold" in p.reason
    # resident copies take room: the third node is full of residents
    full = [NodeView("a", capacity=8 * GB), NodeView("b", capacity=8 * GB),
            NodeView("c", capacity=8 * GB)]
    out = place([ModelView("big", 7 * GB, nodes=("c",), resident=True),
                 ModelView("m", 2 * GB, replicas=3, resident=True)], full)
    assert set(out["m"].nodes) == {"a", "b"} and "no room" in out["m"].reason


def test_each_session_goes_to_its_copy_and_every_node_picks_the_same():
    reps = [Replica(n, 0) for n in "abc"]
    first = {k: pick(k, reps) for k in KEYS}
    assert first == {k: pick(k, list(reversed(reps))) for k in KEYS}  # order-free
    assert set(first.values()) == {"a", "b", "c"}  # spread
    assert all(first[k] == ranking(k, ["a", "b", "c"])[0] for k in KEYS)


def test_a_copy_going_away_moves_only_its_sessions():
    reps = [Replica(n, 0) for n in "abc"]
    before = {k: pick(k, reps) for k in KEYS}
    after = {k: pick(k, [Replica("a", 0), Replica("b", 0, up=False), Replica("c", 0)])
             for k in KEYS}
    for k in KEYS:
        assert after[k] == before[k] if before[k] != "b" else after[k] in "ac"
    assert pick("x", [Replica("a", 0, up=False)]) is None


def test_no_copy_takes_more_than_its_bounded_share():
    """All sessions in flight at once, added one by one: a copy's load never passes
    ceil(1.25 x the average), however the sessions hash."""
    for n in (2, 3):
        loads = Counter({chr(97 + i): 0 for i in range(n)})
        for i, k in enumerate(KEYS[:24]):
            node = pick(k, [Replica(x, loads[x]) for x in loads])
            loads[node] += 1
            assert max(loads.values()) <= math.ceil(BOUND * (i + 1) / n), (n, i, loads)


def test_sessions_stay_on_their_copy_split_within_the_bound_and_spill_when_full():
    """Node a routes 8 sessions to copies on b and c: within the bound (at most 5 of 8),
    each session always to the same copy; a full copy sends one request elsewhere
    without moving its session; a copy going away moves only its sessions."""
    from types import SimpleNamespace

    from mlxfleet.manifest import NodeManifest
    from mlxfleet.supervisor.fleet import Peer
    from mlxfleet.supervisor.replicas import ReplicaRouter

    def peer(holds=("m",), inflight=0):
        node = NodeManifest.model_validate({"apiVersion": "mlxfleet/v1", "kind": "Node",
                                            "metadata": {"name": "n"},
                                            "spec": {"url": "http://n:8000"}})
        return Peer(node, last_ok=1.0, report={
            "holds": list(holds), "models": [{"name": "m", "inflight": inflight}]})

    fleet = SimpleNamespace(me="a", peers={"b": peer(), "c": peer()})
    router = ReplicaRouter(fleet)
    model = SimpleNamespace(name="m", manifest=object(), file="m.yaml")
    router._remote_copy = lambda m, node: node  # (the node, not a RemoteModel)
    keys = [f"s{i}" for i in range(8)]
    first = {k: router.route(model, ("b", "c"), k, None, 16) for k in keys}
    assert max(Counter(first.values()).values()) <= math.ceil(BOUND * 8 / 2), first
    assert all(router.route(model, ("b", "c"), k, None, 16) == first[k] for k in keys)
    on_b = [k for k in keys if first[k] == "b"]
    fleet.peers["b"] = peer(inflight=16)  # b's batch is full
    assert router.route(model, ("b", "c"), on_b[0], None, 16) == "c"
    fleet.peers["b"] = peer()
    assert router.route(model, ("b", "c"), on_b[0], None, 16) == "b"  # still its home
    fleet.peers["c"].failures = 2  # c goes silent: its sessions to b, the others stay
    assert all(router.route(model, ("b", "c"), k, None, 16) == "b" for k in keys)
    fleet.peers["b"] = peer(holds=())  # a copy b does not say it holds: not sent to
    assert router.route(model, ("b", "c"), "new", None, 16) is model


def test_the_affinity_key_follows_the_clients_session_hints_else_the_opening():
    conv = [{"role": "system", "content": "you code"}, {"role": "user", "content": "fix a"}]
    turn2 = conv + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "b"}]
    other = [conv[0], {"role": "user", "content": "fix c"}]
    assert affinity_key({"messages": conv}, {}) == affinity_key({"messages": turn2}, {})
    assert affinity_key({"messages": conv}, {}) != affinity_key({"messages": other}, {})
    assert affinity_key({"prompt_cache_key": "s1", "user": "u", "messages": conv}, {}) \
        == "cache:s1"
    assert affinity_key({"metadata": {"user_id": "user_x_session_1"}, "messages": conv},
                        {"x-claude-code-session-id": "h"}) == "meta:user_x_session_1"
    assert affinity_key({"messages": conv}, {"x-claude-code-session-id": "h"}) == "session:h"
    assert affinity_key({"user": "u", "messages": conv}, {}) == "user:u"
    responses = {"instructions": "be brief", "input": [{"role": "user", "content": "q"}]}
    assert affinity_key(responses, {}).startswith("prefix:")


def test_copies_are_added_while_requests_wait_and_removed_after_idle():
    from mlxfleet.supervisor.scaling import HOT_CHECKS, ScaleState, decide

    st = ScaleState()
    n, t = 1, 0.0
    for _ in range(HOT_CHECKS - 1):  # waiting past the target, but not for long yet
        n, why = decide(n, (1, 3), [3.0], True, 2.0, 60, st, t)
        assert (n, why) == (1, None)
    n, why = decide(n, (1, 3), [3.0, 0.1], True, 2.0, 60, st, t)
    assert n == 2 and "waited 3.0s" in why and "target 2s" in why
    for _ in range(10 * HOT_CHECKS):  # never past max
        n, _ = decide(n, (1, 3), [9.0], True, 2.0, 60, st, t)
    assert n == 3
    assert decide(n, (1, 3), [0.5], True, 2.0, 60, st, t) == (3, None)  # busy, under
    n, why = decide(n, (1, 3), [0.0], False, 2.0, 60, st, 100.0)  # idle from now
    assert why is None
    n, why = decide(n, (1, 3), [0.0], False, 2.0, 60, st, 160.0)
    assert n == 2 and "idle for 60s" in why
    n, _ = decide(n, (1, 3), [0.0], False, 2.0, 60, st, 220.0)
    assert decide(n, (1, 3), [0.0], False, 2.0, 60, st, 900.0) == (1, None)  # min
    assert decide(1, (0, 2), [0.0], False, 2.0, 1, ScaleState(), 0.0)[0] == 1  # min 0: 1
