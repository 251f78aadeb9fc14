"""Which node runs each model of a fleet. Pure and deterministic; no I/O.

Every node computes placement itself from the same inputs (the manifests, which
nodes are healthy, their capacity, and which node holds each model now), so all
of them reach the same answer without a leader or a consensus store. The rules:

1. A model may run on the nodes its ``placement`` allows (``nodes`` and
   ``nodeSelector``; neither: any node), among those that are healthy and whose
   capacity is at least the model's memory estimate.
2. A model stays where it is (a healthy, allowed node that holds it) when it
   still fits: models do not move back and forth when a node comes and goes.
3. Otherwise it goes to the allowed node with the most free memory (capacity minus
   the estimates already placed there), ties broken by name. Biggest models are
   placed first.
4. A model no allowed node can take is unschedulable, with the reason.
5. A resident model (preloaded, pinned or sharded: it holds its memory for as long as it is
   placed) goes only where it fits beside the residents placed there already, so a
   side of a partition, or a fleet short of memory, runs the residents it can hold
   and calls the rest unschedulable (they would evict each other in turn). Models
   loaded on demand need only fit the node: they take turns, evicting idle ones.

A distributed model (``spec.distributed``) is placed on several nodes at once
(rank 0 first), each holding an equal share of its estimate. A replicated model
(``spec.replicas``) is placed on up to that many distinct nodes, each holding a whole
copy, by the same rules (those that hold a copy keep it; the others go where there is
the most free memory); fewer fitting nodes than replicas leave it degraded, with the
reason, still serving from the copies it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..units import fmt_bytes


@dataclass(frozen=True)
class NodeView:
    """A node as placement sees it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    capacity: Optional[int] = None  # bytes mlxfleet may use there; None: not known yet
    healthy: bool = True
    holds: frozenset[str] = frozenset()  # models it runs (or is assigned) now


@dataclass(frozen=True)
class ModelView:
    """A model as placement sees it."""

    name: str
    estimate: int = 0  # bytes
    nodes: tuple[str, ...] = ()  # allowed nodes; empty: any
    selector: Mapping[str, str] = field(default_factory=dict)
    ranks: tuple[str, ...] = ()  # distributed over exactly these nodes
    size: int = 1  # distributed over this many nodes, chosen here
    resident: bool = False  # preloaded, pinned or sharded: loaded while it is placed
    replicas: int = 1  # whole copies on distinct nodes, each serving alone
    replicated: bool = False  # it has spec.replicas (a number > 1, or {min, max})


@dataclass(frozen=True)
class Placement:
    """Where a model runs: ``nodes[0]`` serves it; more than one node for sharded models.
    No nodes: unschedulable, and ``reason`` says why."""

    nodes: tuple[str, ...] = ()
    reason: str = ""  # with nodes: why there are fewer replicas than asked (degraded)
    replicas: bool = False  # the nodes hold whole copies, each serving alone (not ranks)

    @property
    def node(self) -> Optional[str]:
        return self.nodes[0] if self.nodes else None


def place(models: Sequence[ModelView], nodes: Sequence[NodeView]) -> dict[str, Placement]:
    """The node(s) of every model, or why it has none."""
    by_name = {n.name: n for n in nodes}
    free = {n.name: n.capacity for n in nodes}  # minus every estimate placed: to spread
    room = dict(free)  # minus the residents' estimates: what a resident may still take
    out: dict[str, Placement] = {}
    todo: list[tuple[ModelView, list[NodeView]]] = []
    for m in models:
        allowed = [n for n in sorted(nodes, key=lambda n: n.name) if _allowed(m, n)]
        if not allowed or any(r not in by_name for r in m.ranks):
            out[m.name] = Placement(reason=_no_match(m, by_name))
            continue
        share = _share(m)
        healthy = [n for n in allowed if n.healthy]
        fits = [n for n in healthy if n.capacity is None or share <= n.capacity]
        need = len(m.ranks) or m.size
        if len(fits) < need:
            out[m.name] = Placement(reason=_why_not(m, allowed, healthy, share, need))
        else:
            todo.append((m, fits))

    def put(m: ModelView, names, fits: Sequence[NodeView] = ()) -> None:
        names = tuple(names)
        if m.replicated or m.replicas > 1:
            short = "" if len(names) >= m.replicas else (
                f"{len(names)} of {m.replicas} replicas: {_why_few(m, fits, names)}")
            out[m.name] = Placement(names, short, replicas=True)
        else:
            out[m.name] = Placement(names)
        _take(free, names, _share(m))
        if m.resident:
            _take(room, names, _share(m))

    def roomy(m: ModelView, fits: list[NodeView]) -> list[NodeView]:
        if not m.resident:
            return fits
        return [n for n in fits if room[n.name] is None or _share(m) <= room[n.name]]

    # Named ranks first (nowhere else to go), then models that stay where they are, so
    # newcomers cannot push them away; residents before models loaded on demand.
    rest = []
    for m, fits in sorted(todo, key=lambda t: (not t[0].ranks, not t[0].resident)):
        if m.ranks:
            if len(roomy(m, fits)) < len(m.ranks):
                out[m.name] = Placement(reason=_no_room(m, fits, room))
            else:
                put(m, m.ranks)
            continue
        holders = [n.name for n in roomy(m, fits) if m.name in n.holds]
        if len(holders) >= _want(m):
            put(m, holders[:_want(m)], fits)
        else:
            rest.append((m, fits))
    for m, fits in sorted(rest, key=lambda t: (not t[0].resident, -t[0].estimate, t[0].name)):
        can = roomy(m, fits)
        if len(can) < m.size or not can:
            out[m.name] = Placement(reason=_no_room(m, fits, room))
            continue
        # copies held already first (they stay), then the most free memory
        best = sorted(can, key=lambda n: (m.name not in n.holds, _free_key(free[n.name]),
                                          n.name))[:_want(m)]
        # ranks in name order, as a group that stays put lists them (holders, above)
        put(m, sorted(n.name for n in best), fits)
    return out


def _want(m: ModelView) -> int:
    """How many nodes the model takes: its ranks, or its replicas."""
    return max(m.size, m.replicas)


def _why_few(m: ModelView, fits: Sequence[NodeView], placed: Sequence[str]) -> str:
    if len(fits) < m.replicas:
        return (f"only {len(fits)} healthy allowed node{'s' if len(fits) != 1 else ''} can "
                f"hold it ({', '.join(n.name for n in fits) or 'none'})")
    return "no room beside the resident models on " + ", ".join(
        n.name for n in fits if n.name not in placed)


def _no_room(m: ModelView, fits: list[NodeView], room: dict[str, Optional[int]]) -> str:
    left = ", ".join(f"{n.name} {fmt_bytes(max(room[n.name] or 0, 0))}" for n in fits)
    return (f"needs {fmt_bytes(_share(m))} held resident (preload, pinned or sharded) on "
            f"{len(m.ranks) or m.size} node(s); room left beside the other resident models: "
            f"{left}")


def _allowed(m: ModelView, n: NodeView) -> bool:
    if m.ranks:
        return n.name in m.ranks
    if m.nodes and n.name not in m.nodes:
        return False
    return all(n.labels.get(k) == v for k, v in m.selector.items())


def shard_share(total: int, shards: int) -> int:
    """What each of a sharded model's ``shards`` nodes holds of ``total`` bytes (rounded
    up): placement and each rank's memory account both divide here."""
    return -(-total // max(shards, 1))


def _share(m: ModelView) -> int:
    return shard_share(m.estimate, len(m.ranks) or m.size)


def _take(free: dict[str, Optional[int]], names, share: int) -> None:
    for name in names:
        if free[name] is not None:
            free[name] -= share


def _free_key(free: Optional[int]) -> float:
    """Most free memory first; a node whose capacity is not known yet comes last."""
    return float("inf") if free is None else -free


def _no_match(m: ModelView, nodes: Mapping[str, NodeView]) -> str:
    if m.ranks:
        missing = [r for r in m.ranks if r not in nodes]
        return f"no Node manifest for {', '.join(missing)} (spec.distributed.nodes)"
    asked = []
    if m.nodes:
        asked.append(f"nodes {', '.join(m.nodes)}")
    if m.selector:
        asked.append("nodeSelector " + ", ".join(f"{k}={v}" for k, v in m.selector.items()))
    return f"no node matches its placement ({'; '.join(asked)})"


def _why_not(m: ModelView, allowed: list[NodeView], healthy: list[NodeView], share: int,
             need: int) -> str:
    down = [n.name for n in allowed if not n.healthy]
    if len(healthy) < need:
        return (f"needs {need} healthy node{'s' if need > 1 else ''} of "
                f"{', '.join(n.name for n in allowed)}; down: {', '.join(down)}")
    biggest = max(healthy, key=lambda n: (n.capacity or 0, n.name))
    what = f"needs {fmt_bytes(share)}" + (f" on each of {need} nodes" if need > 1 else "")
    return (f"{what}, more than any allowed node can hold (the largest, {biggest.name}, has "
            f"{fmt_bytes(biggest.capacity)})" + (f"; down: {', '.join(down)}" if down else ""))
