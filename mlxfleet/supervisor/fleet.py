"""This node's view of the fleet: the Node manifests, the other nodes' reports, health.

Each node polls every other node's ``/mlxfleet/v1/node`` (every
``fleet_poll_interval`` seconds, signed with the fleet key: ``fleet_auth``) and keeps
its last answer, taken only when the other node signed it with the same key.
From those answers and the manifests it builds the inputs of ``placement.place``;
every node does the same, so every node computes the same placement. A node is
healthy while it answered within ``fleet_grace`` seconds (a node that never
answered counts as healthy for the first ``fleet_grace`` seconds after this one
starts, so that nodes starting together place models alike without waiting; a node
added later counts once it answers).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import httpx

from ..fleet_auth import AUTH_HEADER, FORWARDED_HEADER, answer_ok, sign
from ..fleet_tls import FleetTLS, node_dns
from ..manifest import LoadedManifest, NodeManifest
from ..units import fmt_bytes, iso
from .placement import ModelView, NodeView, Placement, place
from .replicas import ReplicaRouter
from .scaling import DEFAULT_TARGET, ScaleState, decide


class NodeState(str, Enum):
    """A node of the fleet as this one sees it (``mlxfleet get nodes``)."""

    READY = "Ready"  # answering
    NOT_READY = "NotReady"  # failing, within the grace period: its models stay placed
    LOST = "Lost"  # down past the grace period: its models moved
    UNKNOWN = "Unknown"  # not answered yet
    REJECTS_US = "RejectsOurKey"  # answers, but refuses this node's fleet key
    REJECTED = "Rejected"  # this node: every other node refuses its key (takes no model)

log = logging.getLogger("mlxfleet.fleet")

NODE_PATH = "/mlxfleet/v1/node"


@dataclass
class Peer:
    """What this node knows of another node."""

    manifest: NodeManifest
    report: Optional[dict] = None  # its last answer
    last_ok: Optional[float] = None  # monotonic
    error: Optional[str] = None
    failures: int = 0
    rejects: bool = False  # it answered 401: it does not share this node's fleet key

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def answers(self) -> bool:
        """It answered its last poll, with this fleet's key and certificate."""
        return self.failures == 0 and self.last_ok is not None and not self.rejects

    def model(self, name: str) -> dict:
        """Its last reported status of its model ``name`` (empty: none reported)."""
        for st in (self.report or {}).get("models") or []:
            if isinstance(st, dict) and st.get("name") == name:
                return st
        return {}


class Fleet:
    """The fleet as seen from node ``me``: membership, health and placement inputs."""

    def __init__(self, me: str, settings: Any):
        self.me = me
        self.settings = settings
        self.key: Optional[str] = settings.fleet_key
        self.grace = settings.fleet_grace
        self.nodes: dict[str, NodeManifest] = {}
        self.peers: dict[str, Peer] = {}
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.held: frozenset[str] = frozenset()  # models placed here by the last placement
        self.placements: dict[str, Placement] = {}
        self.scaled: dict[str, int] = {}  # replicas chosen by load, for {min, max} models
        self.wanted: dict[str, int] = {}  # replicas asked of the last placement
        self.router = ReplicaRouter(self)  # which copy of a replicated model serves
        self._scale_state: dict[str, ScaleState] = {}
        self.scalings: dict[str, dict] = {}  # model -> its last scaling: when, why
        self._estimates: dict[tuple[str, Optional[str]], int] = {}
        self._doubted: dict[tuple[str, str], int] = {}  # (node, model) -> a report not believed
        self._client: Optional[httpx.AsyncClient] = None
        self._retired: list[httpx.AsyncClient] = []  # closed with this one
        # this machine's certificate and the fleet CA, when it joined a fleet with TLS
        folder = getattr(settings, "fleet_folder", None)
        self.tls: Optional[FleetTLS] = FleetTLS.load(folder, me) if folder else None
        self.polled = False  # the other nodes were asked once (before the first placement)

    # ---- membership --------------------------------------------------------

    def set_nodes(self, nodes: list[NodeManifest]) -> None:
        moved = any(n.name in self.nodes and n.spec.url != self.nodes[n.name].spec.url
                    for n in nodes)
        if moved and self._client is not None:
            # a kept connection was checked (TLS) as the node its url named then: a node
            # given another's old url must not inherit it
            self._retired.append(self._client)
            self._client = None
        self.nodes = {n.name: n for n in nodes}
        for name in list(self.peers):
            if name not in self.nodes or name == self.me:
                del self.peers[name]
        for n in nodes:
            if n.name == self.me:
                continue
            if n.name in self.peers:
                self.peers[n.name].manifest = n
            else:
                self.peers[n.name] = Peer(n)

    @property
    def manifest(self) -> Optional[NodeManifest]:
        return self.nodes.get(self.me)

    def url(self, node: str) -> Optional[str]:
        n = self.nodes.get(node)
        return n.spec.url if n else None

    def healthy(self, node: str) -> bool:
        if node == self.me:
            return True
        p = self.peers.get(node)
        if p is None:
            return False
        # Never answered: healthy only within the grace period after this node started
        # (nodes starting together place alike), never for a node added later.
        since = p.last_ok if p.last_ok is not None else self.started
        return time.monotonic() - since < self.grace

    @property
    def rejected(self) -> bool:
        """Every other node refuses this node's fleet key (a mistyped key): this node is
        not part of the fleet, and takes none of its models."""
        return bool(self.peers) and all(p.rejects for p in self.peers.values())

    def node_status(self, node: str) -> NodeState:
        if node == self.me:
            return NodeState.REJECTED if self.rejected else NodeState.READY
        p = self.peers.get(node)
        if p is None:
            return NodeState.UNKNOWN
        if p.rejects:
            return NodeState.REJECTS_US
        if p.failures == 0 and p.last_ok is not None:
            return NodeState.READY
        if not self.healthy(node):
            return NodeState.LOST
        return NodeState.NOT_READY if p.last_ok is not None else NodeState.UNKNOWN

    def answering(self) -> list[str]:
        """The nodes this one reaches now (itself included): part of its report, so that
        a node that cannot reach a model's node finds one that can (``relay_for``)."""
        return sorted([self.me] + [n for n, p in self.peers.items() if p.answers])

    def relay_for(self, model: str) -> Optional[str]:
        """A node that answers this one and, by its last report, reaches a node it places
        ``model`` on (not this one): where a request goes when this node cannot reach
        the model's node itself (a one-way partition: a cannot see c, b sees both; or
        views that disagree). None when there is no such node."""
        for name, p in sorted(self.peers.items()):
            if not p.answers or not p.report:
                continue
            placed = (p.report.get("placement") or {}).get(model) or []
            holder = placed[0] if placed and isinstance(placed, list) else None
            if holder and holder != self.me and holder in (p.report.get("sees") or ()):
                return name
        return None

    # ---- placement ---------------------------------------------------------

    def estimate(self, lm: LoadedManifest, local_bytes: Optional[int],
                 own_capacity: Optional[int] = None) -> int:
        """A model's memory estimate: the largest any node reports, so every node uses
        the same number once the reports have gone round; but a node's report is
        believed only up to the largest capacity of the *other* nodes (a model larger
        than that runs nowhere but on the reporter, whose word it would then be alone):
        one node reporting 1 PB made every model Unschedulable on every node. Such a
        report is a warning with both figures, once."""
        name = lm.manifest.name
        best = local_bytes or 0
        caps = {p.name: capacity(p.manifest, p.report or {}) or 0 for p in self.peers.values()}
        caps[self.me] = own_capacity or 0
        for p in self.peers.values():
            try:
                reported = int((p.report or {}).get("estimates", {}).get(name) or 0)
            except (TypeError, ValueError, AttributeError):
                reported = 0
            ceiling = max((c for n, c in caps.items() if n != p.name), default=0)
            if ceiling and reported > max(ceiling, best):
                if self._doubted.get((p.name, name)) != reported:
                    self._doubted[(p.name, name)] = reported
                    log.warning("node %s estimates model %s at %s, more than any other node "
                                "of the fleet can hold (%s): not believed; using %s",
                                p.name, name, fmt_bytes(reported), fmt_bytes(ceiling),
                                fmt_bytes(best))
                continue
            best = max(best, max(reported, 0))
        return best

    def place(self, desired: Mapping[str, LoadedManifest], estimates: Mapping[str, int],
              own_capacity: int) -> dict[str, Placement]:
        """Placement of every desired model, remembered as what this node holds."""
        views = []
        for name, lm in desired.items():
            spec = lm.manifest.spec
            d = spec.distributed
            views.append(ModelView(name, estimates.get(name, 0), tuple(spec.placement.nodes),
                                   dict(spec.placement.node_selector),
                                   tuple(d.nodes) if d else (),
                                   (d.size or 1) if d and not d.nodes else 1,
                                   resident=bool(spec.preload or spec.pinned or d),
                                   replicas=self.replicas(name, spec.replica_range),
                                   replicated=spec.replica_range != (1, 1)))
        self.wanted = {v.name: v.replicas for v in views}
        self.placements = place(views, self.node_views(own_capacity))
        self.held = frozenset(n for n, p in self.placements.items() if self.me in p.nodes)
        return self.placements

    def replica_view(self, model: str, own: Optional[dict]) -> Optional[dict]:
        """A replicated model's copies as this node sees them (None: not replicated):
        each copy's node, phase and load (this node's from ``own``, its status; the
        others' from their reports), how many are asked for, and why fewer run."""
        p = self.placements.get(model)
        if p is None or not p.replicas:
            return None
        items = []
        for node in p.nodes:
            if node == self.me:
                st = own or {}
            else:
                peer = self.peers.get(node)
                st = peer.model(model) if peer is not None else {}
                if peer is None or peer.failures or peer.last_ok is None:
                    st = {**st, "phase": "Unknown", "ready": False}
            items.append({"node": node, "phase": st.get("phase", "Unknown"),
                          "ready": bool(st.get("ready")),
                          "inflight": int(st.get("inflight") or 0),
                          "waiting": int(st.get("waiting") or 0),
                          "ttftP50": float(st.get("ttftP50") or 0.0),
                          "routedFromHere": self.router.routed.get((model, node), 0)})
        return {"desired": self.wanted.get(model, len(p.nodes)), "items": items,
                "ready": sum(i["ready"] for i in items), "reason": p.reason or None,
                "lastScaling": self.scalings.get(model)}

    def scale(self, desired: Mapping[str, LoadedManifest], own: Mapping[str, dict],
              keep_alive: float) -> list[tuple[str, str]]:
        """Scale the models with ``replicas: {min, max}`` (``scaling``): this node decides
        when it is the first by name of those it reaches, else it takes the counts from
        that node's report. Returns (model, why) for each change it made."""
        decider = self.answering()[0]
        if decider != self.me:
            got = (self.peers[decider].report or {}).get("scaled") or {}
            self.scaled = {k: v for k, v in got.items() if isinstance(k, str)
                           and isinstance(v, int) and 1 <= v <= 64}
            return []
        changes = []
        now = time.monotonic()
        for name, lm in desired.items():
            spec = lm.manifest.spec
            if isinstance(spec.replicas, int):
                continue
            view = self.replica_view(name, own.get(name))
            if view is None:
                continue
            cur = self.replicas(name, spec.replica_range)
            target = spec.replicas.target_wait or DEFAULT_TARGET
            waits = [i["ttftP50"] for i in view["items"]]
            busy = any(i["inflight"] or i["waiting"] for i in view["items"])
            ka = spec.keep_alive if spec.keep_alive is not None else keep_alive
            new, why = decide(cur, spec.replica_range, waits, busy, target, ka,
                              self._scale_state.setdefault(name, ScaleState()), now)
            self.scaled[name] = new
            if why:
                self.scalings[name] = {"at": iso(time.time()), "message": why}
                changes.append((name, why))
        return changes

    def replicas(self, model: str, bounds: tuple[int, int]) -> int:
        """How many copies of ``model`` to place: its number, or within {min, max} what
        scaling decided (``scaled``; at least one: ``min: 0`` loads on demand)."""
        low, high = bounds
        return max(1, min(high, self.scaled.get(model, low)))

    def node_views(self, own_capacity: int) -> list[NodeView]:
        from ..accelerator import this_node

        out = []
        for name, n in sorted(self.nodes.items()):
            if name == self.me:  # (a node the fleet rejects offers no room)
                out.append(NodeView(name, _labels(n, this_node().kind),
                                    0 if self.rejected else own_capacity, True, self.held))
                continue
            rep = self.peers[name].report or {}
            out.append(NodeView(name, _labels(n, (rep.get("accelerator") or {}).get("kind")),
                                capacity(n, rep), self.healthy(name),
                                frozenset(rep.get("holds") or ())))
        return out

    # ---- polling -----------------------------------------------------------

    def headers(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        """What a request to another node carries: this node's name, signed with the
        fleet key (``target``: the path and query as sent)."""
        if self.key:
            return sign(self.key, self.me, method, target, body)
        return {FORWARDED_HEADER: self.me}  # no key: loopback fleets only (the guard)

    def sign(self, req: httpx.Request, node: str) -> httpx.Request:
        """``req`` to ``node`` (built, with its body) signed as this node's; over TLS, the
        server must show the certificate of ``node`` (not just any node's)."""
        req.headers.update(self.headers(req.method, req.url.raw_path.decode("ascii"),
                                        req.content))
        if self.tls is not None and req.url.scheme == "https":
            req.extensions["sni_hostname"] = node_dns(node)
        return req

    def answer_ok(self, req: httpx.Request, status: int, body: bytes,
                  headers: Mapping[str, str]) -> bool:
        """Whether another node signed its answer to ``req`` (always, with no key)."""
        return not self.key or answer_ok(self.key, req.headers, status, body,
                                         headers.get(AUTH_HEADER))

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self.transport = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_keepalive_connections=32),
                verify=self.tls.client_context() if self.tls is not None else True)
            self._client = httpx.AsyncClient(transport=self.transport,
                                             timeout=httpx.Timeout(None, connect=5.0))
        return self._client

    async def poll_once(self, timeout: float) -> None:
        await asyncio.gather(*(self._poll(p, timeout) for p in list(self.peers.values())))
        self.polled = True

    async def _poll(self, p: Peer, timeout: float) -> None:
        try:
            req = self.sign(self.client.build_request(
                "GET", p.manifest.spec.url + NODE_PATH, timeout=timeout), p.name)
            r = await self.client.send(req)
            if r.status_code == 401 and "invalid_fleet_key" in r.text:
                self._rejected_by(p, "fleet key", "it refuses this node's fleet key (401 "
                                  "invalid_fleet_key)")
                return
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
            if not self.answer_ok(req, r.status_code, r.content, r.headers):
                raise ValueError(f"{p.manifest.spec.url} did not sign its answer with the "
                                 "fleet key: not a node of this fleet")
            rep = r.json()
            if rep.get("name") != p.name:
                raise ValueError(f"{p.manifest.spec.url} answers as node "
                                 f"{rep.get('name')!r}, not {p.name!r}")
        except (httpx.HTTPError, ValueError) as e:
            why = tls_refusal(e)
            if why:  # it answers, but one of the two certificates is not of this fleet
                self._rejected_by(p, "certificate", why)
                return
            if p.failures == 0:
                log.warning("node %s (%s) does not answer: %s", p.name, p.manifest.spec.url,
                            e or type(e).__name__)
            p.failures += 1
            p.error = str(e) or type(e).__name__
            return
        if p.failures or p.last_ok is None or p.rejects:
            log.info("node %s (%s) answers", p.name, p.manifest.spec.url)
        p.report, p.last_ok, p.failures, p.error = rep, time.monotonic(), 0, None
        p.rejects = False

    def _rejected_by(self, p: Peer, what: str, why: str) -> None:
        """``p`` answered, but refuses this node's ``what`` (its fleet key, its
        certificate) or shows a certificate that is not of this fleet: they are not of
        one fleet, and a node that every other refuses takes none of its models."""
        was = self.rejected
        if not p.rejects:
            hint = "check MLXFLEET_FLEET_KEY on both" if what == "fleet key" else \
                "both must have joined the same fleet (mlxfleet fleet show, fleet join)"
            log.error("node %s (%s): %s; %s", p.name, p.manifest.spec.url, why, hint)
        p.rejects, p.failures = True, p.failures + 1
        p.error = why
        if self.rejected and not was:
            log.error("every other node of the fleet refuses this node's %s: this node "
                      "takes none of the fleet's models until it is one of theirs (%s)", what,
                      "check MLXFLEET_FLEET_KEY" if what == "fleet key" else
                      "mlxfleet fleet join, with a token of the fleet's first node")

    async def close(self) -> None:
        for c in (*self._retired, self._client):
            if c is not None:
                await c.aclose()


def _labels(node: NodeManifest, accelerator: Optional[str]) -> dict[str, str]:
    """A node's labels, with ``accelerator`` (metal, cuda, cpu: what its report says) for
    nodeSelector unless its manifest sets one."""
    labels = dict(node.metadata.labels)
    if isinstance(accelerator, str) and accelerator:
        labels.setdefault("accelerator", accelerator)
    return labels


def with_replicas(st: dict[str, Any], view: Optional[dict]) -> dict[str, Any]:
    """A model's status with its copies (``Fleet.replica_view``), and a ``Degraded``
    condition when fewer run than asked for."""
    if view is None:
        return st
    st["replicas"] = view
    if view["reason"]:
        st["conditions"] = [*st.get("conditions", []), {
            "type": "Replicated", "status": "False", "reason": "Degraded",
            "message": view["reason"]}]
    return st


def tls_refusal(e: BaseException) -> Optional[str]:
    """Why a node's TLS handshake failed when it is a matter of trust (the other's
    certificate is not of this fleet's CA or names another node; it refuses this one's),
    not of reaching it; None otherwise."""
    import ssl

    seen: set[int] = set()
    err: Optional[BaseException] = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ssl.SSLCertVerificationError):
            return ("its TLS certificate is not of this fleet's CA, or names another node "
                    f"({err.verify_message})")
        if isinstance(err, ssl.SSLError) and "ALERT" in str(err.reason or ""):
            return f"it refuses this node's TLS certificate ({err.reason})"
        err = err.__cause__ or err.__context__
    return None


def capacity(node: NodeManifest, report: dict) -> Optional[int]:
    """What ``node`` may use: its manifest's ``spec.memory`` (a share resolved against the
    machine's memory it reports), else the budget it reports (None before it answers)."""
    mem = report.get("memory") or {}
    if node.spec.memory:
        return node.spec.memory_bytes(int(mem.get("totalBytes") or 0) or (1 << 40))
    return mem.get("capacityBytes")


@functools.cache
def chip() -> str:
    """The processor's name (Apple M2 Max, an x86 model name), for ``get nodes``."""
    import subprocess
    import sys

    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=2).stdout.strip()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.machine()
