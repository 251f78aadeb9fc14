"""Which copy of a replicated model (``spec.replicas``) serves a request.

A naive balancer sends each turn of an agent's session to a copy that has never seen
its prefix, and every turn pays its whole prefill again. So requests are routed by
**cache affinity with bounded load**:

- The request's affinity key (``api/affinity.py``: the client's session hint, else a
  hash of the prompt's opening) ranks the copies by rendezvous hashing (highest random
  weight): every node of the fleet ranks them alike without asking anyone, and a copy
  that goes away moves only the sessions it had (each to its own next choice, the same
  on every node).
- Bounded load (consistent hashing with bounded loads, Mirrokni, Thorup and
  Zadimoghaddam, 2018) over live sessions (keys seen in the last ``SESSION_TTL``): a new
  session goes to the first copy in its order that holds at most ``BOUND`` times the
  average with it, so one Mac never takes much more than its share of conversations.
  A copy's count is the most of what it reports (the sessions it served) and what this
  node sent it.
- A session stays on its copy while that copy is up: its prefix is cached there.
- A request whose copy is saturated (its batch full: ``maxConcurrency`` requests in
  flight) while another copy has room goes there, that once (a cache miss beats a wait
  behind a full batch); the session stays where it was.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .fleet import Fleet
    from .remote import RemoteModel

BOUND = 1.25
SESSION_TTL = 600.0  # seconds a session counts as live after its last request
_SESSIONS = 20_000  # sessions remembered, all models together


@dataclass(frozen=True)
class Replica:
    """One copy as routing sees it."""

    node: str
    load: int  # live sessions there
    up: bool = True


def ranking(key: str, nodes: Sequence[str]) -> list[str]:
    """The copies' nodes in the order ``key`` prefers them (rendezvous hashing)."""
    def weight(node: str) -> bytes:
        return hashlib.sha256(f"{key}\0{node}".encode()).digest()

    return sorted(nodes, key=weight, reverse=True)


def pick(key: str, replicas: Sequence[Replica], bound: float = BOUND) -> Optional[str]:
    """The copy a new session with affinity ``key`` goes to (None: none is up)."""
    up = {r.node: r for r in replicas if r.up}
    if not up:
        return None
    cap = math.ceil(bound * (sum(r.load for r in up.values()) + 1) / len(up))
    for node in ranking(key, list(up)):
        if up[node].load + 1 <= cap:
            return node
    return min(up.values(), key=lambda r: (r.load, r.node)).node


class _Live:
    """(model, session) keys seen lately, each with a value and when it was last seen
    (LRU, TTL), and how many each (model, value) has: counted as they come and go, as
    routing asks on every request."""

    def __init__(self) -> None:
        self.items: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()
        self.counts: Counter[tuple[str, Any]] = Counter()

    def put(self, key: tuple[str, str], value: Any, now: float) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.counts[(key[0], old[0])] -= 1
        self.items[key] = (value, now)
        self.counts[(key[0], value)] += 1
        self.expire(now, _SESSIONS)

    def expire(self, now: float, most: int = _SESSIONS) -> None:
        while self.items and (len(self.items) > most
                              or now - next(iter(self.items.values()))[1] > SESSION_TTL):
            (model, _), (value, _) = self.items.popitem(last=False)
            self.counts[(model, value)] -= 1

    def get(self, key: tuple[str, str], now: float) -> Any:
        got = self.items.get(key)
        return got[0] if got is not None and now - got[1] <= SESSION_TTL else None

    def count(self, model: str, value: Any, now: float) -> int:
        self.expire(now)
        return self.counts[(model, value)]


def max_concurrency(manifest: Any) -> int:
    """Requests a copy's batch runs at once (the manifest's, else the default)."""
    from ..worker_settings import default

    return manifest.spec.batching.max_concurrency or default("max_concurrency")


class ReplicaRouter:
    """This node's routing of requests for replicated models, and the sessions its own
    copies serve (what it reports)."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._assigned = _Live()  # (model, key) -> node: the sessions this node routed
        self._served = _Live()  # (model, key) -> True: sessions this node's copies served
        self._remote: dict[tuple[str, str], RemoteModel] = {}
        self.routed: dict[tuple[str, str], int] = {}  # (model, node) -> requests sent

    def served(self, model: str, key: str) -> None:
        """This node's copy of ``model`` serves a request of session ``key``."""
        self._served.put((model, key), True, time.monotonic())

    def sessions(self) -> dict[str, int]:
        """Live sessions per model on this node's copies (its report carries it)."""
        self._served.expire(time.monotonic())
        return {model: n for (model, _), n in self._served.counts.items() if n > 0}

    def route(self, model: Any, nodes: Sequence[str], key: str, local: Any,
              max_concurrency: int) -> Any:
        """The served model that takes this request: ``local`` (this node's copy) or the
        copy on another node, reached through it (``RemoteModel``)."""
        name, now = model.name, time.monotonic()
        replicas = {n: self._replica(name, n, local, now) for n in nodes}
        node = self._assigned.get((name, key), now)
        if node not in replicas or not replicas[node].up:  # new, or its copy went away
            node = pick(key, list(replicas.values()))
            if node is None:
                return local if local is not None else model
        self._assigned.put((name, key), node, now)
        busy = {n: self._inflight(name, n, local) for n in replicas}
        if busy[node] >= max_concurrency:  # its batch is full: elsewhere, this once
            room = [n for n, r in replicas.items() if r.up and busy[n] < max_concurrency]
            if room:
                node = min(room, key=lambda n: (busy[n], n))
        self.routed[(name, node)] = self.routed.get((name, node), 0) + 1
        if node == self.fleet.me and local is not None:
            self.served(name, key)
            return local
        return self._remote_copy(model, node)

    def _replica(self, name: str, node: str, local: Any, now: float) -> Replica:
        mine = self._assigned.count(name, node, now)
        if node == self.fleet.me:
            here = self._served.count(name, True, now)
            return Replica(node, max(here, mine), local is not None)
        p = self.fleet.peers.get(node)
        # up: it answers, and says itself that it holds a copy (a copy just placed there
        # by this node's view is not sent requests until that node's view agrees)
        rep = (p.report or {}) if p is not None else {}
        up = p is not None and p.answers and name in (rep.get("holds") or ())
        try:
            reported = int((rep.get("sessions") or {}).get(name) or 0)
        except (TypeError, ValueError, AttributeError):
            reported = 0
        return Replica(node, max(reported, mine), up)

    def _inflight(self, name: str, node: str, local: Any) -> int:
        if node == self.fleet.me:
            return (local.inflight + local.waiters) if local is not None else 0
        p = self.fleet.peers.get(node)
        st = p.model(name) if p is not None else {}
        reported = int(st.get("inflight") or 0) + int(st.get("waiting") or 0)
        mine = self._remote.get((name, node))
        sent = mine.worker.inflight if mine is not None and mine.worker is not None else 0
        return max(reported, sent)

    def _remote_copy(self, model: Any, node: str) -> RemoteModel:
        from .remote import RemoteModel

        have = self._remote.get((model.name, node))
        if have is None or have.manifest is not model.manifest:
            have = self._remote[(model.name, node)] = RemoteModel.copy_on(model, node,
                                                                          self.fleet)
        return have
