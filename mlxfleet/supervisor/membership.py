"""A supervisor as a node of a fleet (a part of Supervisor, mixed in): the Node
manifests, this node's estimates, placement, the fleet loop and the reports.

Every method here runs only with ``--node`` (``self.fleet`` set); the rest of the
supervisor sees the result as ``self.remote`` (models other nodes run) and
``self._ranks`` (sharded models with a rank here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..manifest import FileResult, LoadedManifest, NodeManifest
from .scheduler import RetryNow

log = logging.getLogger("mlxfleet.supervisor")


class FleetMembership:
    """Mixed into Supervisor, whose fields it reads."""

    def _nodes(self, results: list[FileResult]) -> list[NodeManifest]:
        """The Node manifests of the folder; a broken file keeps its last good nodes (a
        typo must not make its nodes vanish and their models move)."""
        present = {r.file for r in results}
        for f in list(self._last_good_nodes):
            if f not in present:
                del self._last_good_nodes[f]
        for r in results:
            if not r.errors:
                self._last_good_nodes[r.file] = r.nodes
        seen: dict[str, NodeManifest] = {}
        for f in sorted(self._last_good_nodes):
            for n in self._last_good_nodes[f]:
                seen.setdefault(n.name, n)
        return list(seen.values())

    async def _measure(self, desired: dict[str, LoadedManifest]) -> None:
        """This node's memory estimate of every model (weights it can see on disk, KV
        budget, worker overhead), reported to the other nodes."""
        from .memory import spec_weight_bytes
        from .worker_config import worker_config

        def measure() -> dict[str, int]:
            out = {}
            for name, lm in desired.items():
                spec = lm.manifest.spec
                w = spec_weight_bytes(spec) or 0
                out[name] = (w + worker_config(lm.manifest, self.settings).cache_bytes
                             + (self.settings.worker_overhead_mb << 20))
            return out

        self._estimates = await asyncio.to_thread(measure)

    def _place(self, desired: dict[str, LoadedManifest]) -> dict[str, LoadedManifest]:
        """Place every model; build a ``RemoteModel`` for those another node (or none)
        runs; return the ones to run here."""
        from .remote import RemoteModel

        fleet = self.fleet
        me = fleet.manifest
        cap = me.spec.memory_bytes(_physical_memory()) if me is not None else None
        self.memory_budget, self.memory_budget_source = (
            (min(cap, self._own_budget[0]), f"node {me.name}: spec.memory {me.spec.memory}")
            if cap is not None else self._own_budget)
        if me is None:
            log.warning("no Node manifest named %s in %s: this node runs no model and only "
                        "routes", fleet.me, self.manifests_dir)
        estimates = {n: fleet.estimate(lm, self._estimates.get(n), self.memory_budget)
                     for n, lm in desired.items()}
        placements = fleet.place(desired, estimates, self.memory_budget) if me is not None \
            else {}
        local: dict[str, LoadedManifest] = {}
        remote: dict[str, Any] = {}
        self._ranks = {}
        for name, lm in desired.items():
            p = placements.get(name)
            if p is not None and fleet.me in p.nodes:
                local[name] = lm
                if p.replicas:
                    continue  # a whole copy, serving here (requests are routed: find)
                if len(p.nodes) > 1:  # sharded: every rank's node runs a worker
                    port = lm.manifest.spec.distributed.port
                    hosts = tuple(f"{fleet.nodes[n].spec.host}:{port + i}"
                                  for i, n in enumerate(p.nodes))
                    self._ranks[name] = (p.nodes.index(fleet.me), hosts)
                if p.node == fleet.me:
                    continue  # rank 0 (or the only node): requests are served here
            if p is None:
                from .placement import Placement

                p = Placement(reason=f"node {fleet.me} has no Node manifest")
            old = self.remote.get(name)
            if old is not None and (old.placement, old.manifest) == (p, lm.manifest):
                remote[name] = old
            else:
                if p.node is None:
                    log.warning("%s: unschedulable: %s", name, p.reason)
                elif name in self.models or old is None or old.node != p.node:
                    log.info("%s: runs on node %s", name, p.node)
                remote[name] = RemoteModel(lm.manifest, lm.file, p, fleet)
        self.remote = remote
        return local

    async def _fleet_loop(self) -> None:
        """Poll the other nodes; place again whenever what they say changes it."""
        fleet = self.fleet
        while True:
            await asyncio.sleep(self.settings.fleet_poll_interval)
            try:
                up = {n for n in fleet.peers if fleet.healthy(n)}
                await fleet.poll_once(timeout=max(1.0, self.settings.fleet_poll_interval))
                back = sorted(n for n in fleet.peers if fleet.healthy(n) and n not in up)
                if back:  # a pull that failed may succeed from it: retry without backoff
                    for rt in list(self.models.values()):
                        if rt.pull_failed:
                            self.dispatch(RetryNow(rt.key, f"node '{back[0]}' is back; "
                                                   "pulling the weights again"))
                await self._scale()
                async with self._lock:
                    before = dict(fleet.placements)
                    self._apply()
                    if fleet.placements != before:
                        log.info("placement changed: %s", ", ".join(
                            f"{n} -> {p.node or 'none'}" for n, p in
                            sorted(fleet.placements.items()) if before.get(n) != p))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bad report must not stop the fleet loop
                log.exception("fleet update failed")

    async def _scale(self) -> None:
        """Models with ``replicas: {min, max}``: their copies' waits, then the count."""
        fleet = self.fleet
        own = {}
        for name, rt in list(self.models.items()):
            if isinstance(rt.manifest.spec.replicas, int):
                continue
            st = await rt.worker_status() if rt.ready else None
            rt.ttft = float((st or {}).get("ttft_p50_s") or 0.0)
            own[name] = rt.status()
        for name, why in fleet.scale(self._wanted, own, self.settings.keep_alive_seconds):
            rt = self.models.get(name)
            if rt is not None:
                rt.event("Normal", "Scaled", why)
            else:
                log.info("%s: %s", name, why)

    def node_report(self) -> dict[str, Any]:
        """What this node tells the others (``GET /mlxfleet/v1/node``)."""
        import platform

        from .. import __version__
        from ..accelerator import this_node
        from ..units import iso
        from .fleet import chip

        fleet = self.fleet
        mem = self.memory_status()
        me = fleet.manifest if fleet else None
        return {
            "name": self.node_name, "url": me.spec.url if me else None,
            "labels": dict(me.metadata.labels) if me else {}, "version": __version__,
            "startedAt": iso(fleet.started_wall) if fleet else None,
            "chip": chip(), "system": f"{platform.system()} {platform.machine()}",
            "accelerator": this_node().as_dict(),
            "memory": {"capacityBytes": self.memory_budget, "usedBytes": mem["usedBytes"],
                       "freeBytes": mem["freeBytes"], "totalBytes": _physical_memory()},
            "holds": sorted(fleet.held) if fleet else self.names(),
            "models": [self.models[n].status() for n in self.names()],
            "estimates": self._estimates,
            "placement": {n: list(p.nodes) for n, p in sorted(fleet.placements.items())}
            if fleet else {},
            "sees": fleet.answering() if fleet else [],
            "scaled": dict(fleet.scaled) if fleet else {},
            "sessions": fleet.router.sessions() if fleet else {},
            "health": "ok",
        }

    def nodes_status(self) -> list[dict[str, Any]]:
        """Every node as this one sees it (``get nodes``)."""
        from .fleet import NodeState, capacity

        fleet = self.fleet
        if fleet is None:
            return []
        out = []
        for name, n in sorted(fleet.nodes.items()):
            if name == fleet.me:
                rep, seen, err = self.node_report(), 0.0, None
            else:
                p = fleet.peers[name]
                rep, err = p.report or {}, p.error
                seen = None if p.last_ok is None else time.monotonic() - p.last_ok
            status = fleet.node_status(name)
            # a lost node's last figures are not its memory now: shown as unknown
            mem = {} if status in (NodeState.LOST, NodeState.REJECTS_US) else \
                rep.get("memory") or {}
            out.append({
                "name": name, "url": n.spec.url, "labels": dict(n.metadata.labels),
                "status": status.value, "self": name == fleet.me,
                "models": sorted(m for m, p in fleet.placements.items() if name in p.nodes),
                "memory": {"usedBytes": mem.get("usedBytes"), "capacityBytes": capacity(n, rep),
                           "totalBytes": mem.get("totalBytes")},
                "chip": rep.get("chip"), "system": rep.get("system"),
                "accelerator": rep.get("accelerator"),
                "version": rep.get("version"), "startedAt": rep.get("startedAt"),
                "lastSeenSecondsAgo": None if seen is None else round(seen, 1),
                "error": err,
            })
        return out


def _physical_memory() -> int:
    import psutil

    return psutil.virtual_memory().total

