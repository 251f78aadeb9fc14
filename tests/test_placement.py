"""Placement as a table: the pure function every node of a fleet computes the same way."""

import pytest

from mlxfleet.supervisor.placement import ModelView, NodeView, place

GB = 1 << 30


def nodes(*specs):
    """``("a", 16)``, ``("b", 8, {"chip": "m2"})``, ``("c", 8, {}, False)`` (down),
    ``("d", 8, {}, True, {"x"})`` (holds x)."""
    out = []
    for s in specs:
        name, cap, labels, healthy, holds = (list(s) + [None, {}, True, set()][len(s) - 1:])[:5]
        out.append(NodeView(name, labels or {}, None if cap is None else cap * GB, healthy,
                            frozenset(holds)))
    return out


CASES = [
    # (what, models, nodes, expected {model: nodes or reason fragment})
    ("most free memory wins",
     [ModelView("x", 4 * GB)], nodes(("a", 8), ("b", 16)), {"x": ("b",)}),
    ("ties by name", [ModelView("x", GB)], nodes(("b", 8), ("a", 8)), {"x": ("a",)}),
    ("spread: biggest first, then the emptier node",
     [ModelView("s", 1 * GB), ModelView("l", 6 * GB)], nodes(("a", 8), ("b", 8)),
     {"l": ("a",), "s": ("b",)}),
    ("allowed nodes", [ModelView("x", GB, nodes=("a",))], nodes(("a", 8), ("b", 64)),
     {"x": ("a",)}),
    ("node selector", [ModelView("x", GB, selector={"chip": "m3"})],
     nodes(("a", 64, {"chip": "m1"}), ("b", 8, {"chip": "m3"})), {"x": ("b",)}),
    ("nodes and selector both apply",
     [ModelView("x", GB, nodes=("a", "b"), selector={"gpu": "big"})],
     nodes(("a", 8, {"gpu": "big"}), ("b", 64), ("c", 64, {"gpu": "big"})), {"x": ("a",)}),
    ("a down node is skipped", [ModelView("x", GB)], nodes(("a", 64, {}, False), ("b", 8)),
     {"x": ("b",)}),
    ("pinned to a down node: unschedulable, naming it",
     [ModelView("x", GB, nodes=("a",))], nodes(("a", 64, {}, False), ("b", 8)),
     {"x": "down: a"}),
    ("fits nowhere", [ModelView("x", 100 * GB)], nodes(("a", 64), ("b", 8)),
     {"x": "the largest, a, has 64.0 GB"}),
    ("no node matches", [ModelView("x", GB, selector={"chip": "m4"})], nodes(("a", 8)),
     {"x": "no node matches its placement (nodeSelector chip=m4)"}),
    ("stays where it is although another node is emptier",
     [ModelView("x", GB)], nodes(("a", 8, {}, True, {"x"}), ("b", 64)), {"x": ("a",)}),
    ("moves when its node is down", [ModelView("x", GB)],
     nodes(("a", 64, {}, False, {"x"}), ("b", 8)), {"x": ("b",)}),
    ("moves when no longer allowed there", [ModelView("x", GB, nodes=("b",))],
     nodes(("a", 64, {}, True, {"x"}), ("b", 8)), {"x": ("b",)}),
    ("two holders (after a split): the first by name keeps it", [ModelView("x", GB)],
     nodes(("b", 8, {}, True, {"x"}), ("a", 8, {}, True, {"x"})), {"x": ("a",)}),
    ("held models count before newcomers are placed",
     [ModelView("new", GB), ModelView("old", 6 * GB)],
     nodes(("a", 8, {}, True, {"old"}), ("b", 4)), {"old": ("a",), "new": ("b",)}),
    ("unknown capacity comes last but still fits",
     [ModelView("x", GB)], nodes(("a", None), ("b", 2)), {"x": ("b",)}),
    ("distributed over named nodes, a share each",
     [ModelView("big", 12 * GB, ranks=("b", "a"))], nodes(("a", 8), ("b", 8)),
     {"big": ("b", "a")}),
    ("distributed by size: the two emptiest",
     [ModelView("big", 12 * GB, size=2)], nodes(("a", 8), ("b", 16), ("c", 10)),
     {"big": ("b", "c")}),
    ("distributed with a rank down", [ModelView("big", 12 * GB, ranks=("a", "b"))],
     nodes(("a", 8), ("b", 8, {}, False)), {"big": "down: b"}),
    ("distributed share too big", [ModelView("big", 40 * GB, size=2)],
     nodes(("a", 8), ("b", 16)), {"big": "on each of 2 nodes"}),
    ("distributed over a node with no manifest",
     [ModelView("big", GB, ranks=("a", "zz"))], nodes(("a", 8)), {"big": "zz"}),
    # Resident models (preload, pinned) hold their memory for as long as they are placed.
    ("residents go only where they fit beside other residents",
     [ModelView("x", 3 * GB, resident=True), ModelView("y", 2 * GB, resident=True)],
     nodes(("a", 4)), {"x": ("a",), "y": "room left beside the other resident models: a 1.0 GB"}),
    ("models loaded on demand take turns on a node too small for all of them",
     [ModelView("x", 3 * GB), ModelView("y", 2 * GB)], nodes(("a", 4)),
     {"x": ("a",), "y": ("a",)}),
    ("a side of a partition runs the residents it can hold, not all of them",
     [ModelView("p", 3 * GB, resident=True), ModelView("q", 3 * GB, resident=True),
      ModelView("r", 3 * GB)],
     nodes(("a", 8, {}, False, {"p"}), ("c", 4, {}, True, {"q"})),
     {"q": ("c",), "p": "needs 3.0 GB held resident", "r": ("c",)}),
    ("residents are placed before models loaded on demand, which cannot crowd them out",
     [ModelView("big", 6 * GB), ModelView("res", 3 * GB, resident=True)],
     nodes(("a", 8, {}, True, {"big"})), {"res": ("a",), "big": ("a",)}),
    ("a resident that stays where it is keeps its room first",
     [ModelView("new", 3 * GB, resident=True), ModelView("old", 3 * GB, resident=True)],
     nodes(("a", 4, {}, True, {"old"})), {"old": ("a",), "new": "room left"}),
]


@pytest.mark.parametrize("what,models,ns,expected", CASES, ids=[c[0] for c in CASES])
def test_placement(what, models, ns, expected):
    got = place(models, ns)
    for name, want in expected.items():
        p = got[name]
        if isinstance(want, tuple):
            assert p.nodes == want, (what, p)
        else:
            assert p.nodes == () and want in p.reason, (what, p)


def test_every_node_computes_the_same_answer():
    """The same inputs in any order give the same placement: no leader is needed."""
    import random

    models = [ModelView(f"m{i}", (i % 5 + 1) * GB) for i in range(12)]
    ns = nodes(("a", 16), ("b", 12), ("c", 12, {"chip": "m2"}), ("d", 4, {}, False))
    first = place(models, ns)
    for seed in range(5):
        rng = random.Random(seed)
        m2, n2 = models[:], ns[:]
        rng.shuffle(m2)
        rng.shuffle(n2)
        assert place(m2, n2) == first
    # and placing again with each node holding what it got changes nothing (stable)
    held = {n.name: frozenset(m for m, p in first.items() if n.name in p.nodes) for n in ns}
    again = place(models, [NodeView(n.name, n.labels, n.capacity, n.healthy, held[n.name])
                           for n in ns])
    assert again == first


def test_one_nodes_absurd_estimate_is_not_believed_and_said_so(caplog):
    """Every node takes the largest estimate any node reports, so that all place alike;
    one node reporting 1 PB for a model made it Unschedulable on every node. A report
    beyond what any other node can hold is a warning with both figures instead."""
    from types import SimpleNamespace

    from mlxfleet.manifest import LoadedManifest, Manifest, NodeManifest
    from mlxfleet.supervisor.fleet import Fleet

    def node(name: str, memory: str) -> NodeManifest:
        return NodeManifest.model_validate({
            "apiVersion": "mlxfleet/v1", "kind": "Node", "metadata": {"name": name},
            "spec": {"url": f"http://{name}:8000", "memory": memory}})

    f = Fleet("a", SimpleNamespace(fleet_key=None, fleet_grace=15))
    f.set_nodes([node("a", "16GB"), node("b", "32GB"), node("c", "8GB")])
    lm = LoadedManifest(Manifest.model_validate({
        "apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": "m"},
        "spec": {"source": "x/y"}}), "m.yaml", 1)
    f.peers["b"].report = {"estimates": {"m": 6 * GB}}
    f.peers["c"].report = {"estimates": {"m": 1 << 50}}  # 1 PB: a bug, or a lie
    assert f.estimate(lm, 2 * GB, 16 * GB) == 6 * GB  # the largest believable one
    assert "node c estimates model m at" in caplog.text and "not believed" in caplog.text
    f.peers["c"].report = {"estimates": {"m": 20 * GB}}  # fits b: believed
    assert f.estimate(lm, 2 * GB, 16 * GB) == 20 * GB
    f.peers["b"].report = {"estimates": {"m": "lots"}}  # not a number: ignored
    assert f.estimate(lm, 2 * GB, 16 * GB) == 20 * GB


def test_a_node_that_cannot_reach_a_models_node_asks_one_that_can():
    """A one-way partition (a cannot see c, b sees both): a finds, from the others'
    reports, a node that reaches the node holding the model, and sends the request
    there; never a node that does not answer, nor one whose holder is a itself."""
    from types import SimpleNamespace

    from mlxfleet.manifest import NodeManifest
    from mlxfleet.supervisor.fleet import Fleet

    def node(name: str) -> NodeManifest:
        return NodeManifest.model_validate({
            "apiVersion": "mlxfleet/v1", "kind": "Node", "metadata": {"name": name},
            "spec": {"url": f"http://{name}:8000"}})

    f = Fleet("a", SimpleNamespace(fleet_key=None, fleet_grace=15))
    f.set_nodes([node("a"), node("b"), node("c"), node("d")])
    for n in "bcd":
        f.peers[n].last_ok = 1e12  # answered (and recently: far in the future)
    f.peers["c"].failures = 3  # a cannot reach c
    f.peers["b"].report = {"placement": {"m": ["c"], "own": ["a"]}, "sees": ["a", "b", "c"]}
    f.peers["d"].report = {"placement": {"m": ["c"]}, "sees": ["a", "d"]}  # d cannot either
    assert f.relay_for("m") == "b"
    assert f.relay_for("own") is None  # b places it on a: nothing to ask
    assert f.relay_for("nowhere") is None
    f.peers["b"].failures = 1  # b stopped answering too: no one to ask
    assert f.relay_for("m") is None
    assert f.answering() == ["a", "d"]
