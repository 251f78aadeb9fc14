"""Models that another node of the fleet runs: the worker interface over HTTP.

A ``RemoteModel`` stands where a ``ModelRuntime`` would for a model placed on
another node. Its ``RemoteWorker`` is a ``WorkerHandle`` whose ``forward`` sends
the request to that node's gateway, which admits it, loads the model on demand
and streams the answer back; the gateway here relays it like any worker's. The
other node owns the model's lifecycle (keep-alive, memory, restarts); this one
only routes, and shows the status that node reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Optional

import httpx

from ..fleet_auth import CLIENT_AUTH
from ..manifest import Manifest
from ..units import iso
from ..wire import APIError
from .admission import AdmissionError, ServedModel
from .fleet import Fleet, with_replicas
from .handle import InflightCounter, WorkerFailed, WorkerUnreachable
from .lifecycle import ModelPhase
from .placement import Placement

#: Polls a node may miss before requests stop waiting on it (``RemoteWorker.silent``).
SILENT_POLLS = 2
#: How often a request waiting on another node checks that it still answers (seconds).
WATCH_INTERVAL = 0.25


class RemoteWorker(InflightCounter):
    """Another node's gateway, as a worker of one model (a ``WorkerHandle``)."""

    def __init__(self, fleet: Fleet, node: str, spec_hash: str):
        super().__init__()
        self.fleet, self.node, self.spec_hash = fleet, node, spec_hash
        self.ready_at: Optional[float] = time.monotonic()
        self.started_at: Optional[float] = self.ready_at
        self.stopping = False

    pid = None
    returncode = None

    @property
    def alive(self) -> bool:
        return self.fleet.healthy(self.node)

    async def spawn(self) -> None:  # the other node starts it
        return None

    async def wait_ready(self, timeout: float) -> tuple[bool, str]:
        return self.alive, "" if self.alive else f"node {self.node} is down"

    async def wait_exit(self) -> Optional[int]:
        return None

    def silent(self) -> Optional[str]:
        """Why the node counts as silent, or None: it missed its last ``SILENT_POLLS``
        polls. A stopped process or a cut link may still accept connections (the
        kernel does), so a request would wait for its whole timeout (300 s); its polls
        tell within seconds."""
        p = self.fleet.peers.get(self.node)
        if p is None or p.failures < SILENT_POLLS:
            return None
        return (f"node '{self.node}' stopped answering: its last {p.failures} polls "
                f"failed ({p.error}); its models move to other nodes once it has been "
                f"silent for {self.fleet.grace:g}s, where their placement allows")

    async def watched(self, aw: Any) -> Any:
        """``aw``, given up on with a 503 ``node_unreachable`` as soon as the node goes
        silent (``silent``)."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL)
                if done:
                    return task.result()
                why = self.silent()
                if why:
                    raise WorkerFailed(why, retry_after=self.fleet.grace,
                                       code="node_unreachable")
        finally:
            if not task.done():
                task.cancel()

    async def forward(self, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> Any:
        url = self.fleet.url(self.node)
        client = self.fleet.client
        req = self.fleet.sign(client.build_request(method, url + path, content=body,
                                                   headers=headers), self.node)
        try:  # straight to the pooled transport, as WorkerProcess.forward does
            resp = await self.watched(self.fleet.transport.handle_async_request(req))
        except httpx.ConnectError as e:
            raise WorkerUnreachable(f"Node '{self.node}' ({url}) is unreachable: {e}. Its "
                                    "models move to other nodes once it has been down for "
                                    f"{self.fleet.grace:g}s, where their placement allows.",
                                    retry_after=self.fleet.grace, code="node_unreachable"
                                    ) from None
        except httpx.TransportError as e:
            raise WorkerFailed(f"node '{self.node}' ({url}): {type(e).__name__}"
                               + (f": {e}" if str(e) else "")) from None
        resp.request = req
        return _Watched(resp, self)

    async def get_json(self, path: str, timeout: float) -> Optional[dict]:
        return None

    def memory_bytes(self) -> Optional[int]:
        return None

    async def stop(self, drain_timeout: float, stop_timeout: float) -> Optional[int]:
        return None

    def kill(self) -> None:
        return None

    async def close(self) -> None:
        return None


class _Watched:
    """A node's answer whose body is given up on when the node goes silent (the
    subset of ``httpx.Response`` the gateway reads)."""

    def __init__(self, resp: httpx.Response, worker: RemoteWorker):
        self._resp, self._worker = resp, worker
        self.status_code, self.headers = resp.status_code, resp.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        chunks = self._resp.aiter_raw()
        while True:
            try:
                chunk = await self._worker.watched(chunks.__anext__())
            except StopAsyncIteration:
                return
            except WorkerFailed as e:
                raise httpx.ReadError(str(e)) from None
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([c async for c in self.aiter_raw()])

    async def aclose(self) -> None:
        await self._resp.aclose()


class RemoteModel(ServedModel):
    """A model of the fleet served by another node, or by none (unschedulable)."""

    removed = False
    waiters = 0

    def __init__(self, manifest: Manifest, file: str, placement: Placement, fleet: Fleet):
        self.manifest, self.file, self.placement, self.fleet = manifest, file, placement, fleet
        self.created = time.time()
        self.worker = RemoteWorker(fleet, placement.node, manifest.worker_hash()) \
            if placement.node else None

    @property
    def node(self) -> Optional[str]:
        return self.placement.node

    def reported(self) -> dict:
        """The serving node's last status of this model (empty before it reports)."""
        p = self.fleet.peers.get(self.node or "")
        return p.model(self.name) if p is not None else {}

    @property
    def phase(self) -> ModelPhase:
        if self.node is None:
            return ModelPhase.UNSCHEDULABLE
        if not self.fleet.healthy(self.node) or self.fleet.peers[self.node].failures:
            return ModelPhase.UNKNOWN
        try:
            return ModelPhase(self.reported().get("phase"))
        except ValueError:
            return ModelPhase.UNKNOWN

    @property
    def ready(self) -> bool:
        return bool(self.reported().get("ready")) and self.phase is ModelPhase.READY

    @property
    def inflight(self) -> int:
        return int(self.reported().get("inflight") or 0)

    @property
    def paths(self) -> Optional[dict]:
        return self.reported().get("paths") if self.ready else None

    @property
    def weight_bytes(self) -> Optional[int]:
        return (self.reported().get("memory") or {}).get("weightBytes")

    @property
    def keep_alive(self) -> float:
        ka = self.reported().get("keepAlive")
        return float("inf") if ka == "forever" else float(ka or 0)

    def unreachable(self) -> bool:
        """No node serves it, or its node went silent for this one."""
        return self.node is None or bool(self.worker is not None and self.worker.silent())

    def via(self, node: str) -> RemoteModel:
        """This model, reached through ``node`` (which reaches its node) for one request."""
        return RemoteModel.copy_on(self, node, self.fleet)

    @classmethod
    def copy_on(cls, model: ServedModel, node: str, fleet: Fleet) -> RemoteModel:
        """``model`` (local or not) as served by ``node``: a copy of a replicated model
        there, or the way to it."""
        return cls(model.manifest, model.file, Placement((node,)), fleet)

    def check(self) -> None:
        """Raise the 503 a request for this model gets when no node can serve it, or
        when its node went silent (at once, rather than waiting on it)."""
        if self.node is None:
            raise AdmissionError(503, f"Model '{self.name}' cannot run on any node: "
                                 f"{self.placement.reason}.", "model_unschedulable",
                                 retry_after=max(5, self.fleet.grace))
        why = self.worker.silent() if self.worker is not None else None
        if why:
            raise AdmissionError(503, f"Model '{self.name}' is unavailable: {why}.",
                                 "node_unreachable", retry_after=self.fleet.grace)

    async def hold(self, deadline: float, keep_alive: Optional[float] = None
                   ) -> RemoteWorker:
        """The node that runs it, which loads it when the request gets there (the
        forwarded body carries ``keep_alive``)."""
        self.check()
        self.worker.acquire()
        return self.worker

    def let_go(self, w: RemoteWorker) -> None:
        w.release()

    async def worker_status(self) -> Optional[dict]:
        return None  # its node reports it

    async def load(self, deadline: float, keep_alive: Optional[float] = None) -> dict:
        params = {} if keep_alive is None else {
            "keepAlive": "-1" if math.isinf(keep_alive) else f"{keep_alive:g}s"}
        r = await self._ask("POST", "load", params, max(1.0, deadline - time.monotonic()))
        return json.loads(await r.aread())

    async def unload(self, reason: str = "unload requested") -> dict:
        r = await self._ask("POST", "unload", {}, self.fleet.settings.startup_timeout)
        return json.loads(await r.aread())

    async def logs(self, tail: int, follow: bool) -> AsyncIterator[str]:
        r = await self._ask("GET", "logs", {"tail": str(tail), "follow": str(follow).lower()},
                            None if follow else 30.0)

        async def relay():
            try:
                async for chunk in r.aiter_text():
                    yield chunk
            except httpx.HTTPError:
                pass  # the node went away mid-answer: end it here
            finally:
                await r.aclose()

        return relay()

    async def _ask(self, method: str, what: str, params: dict,
                   timeout: Optional[float]) -> httpx.Response:
        """The node's control API for this model, as if the client had asked it: the
        streamed answer, or its error as an ``APIError``."""
        self.check()
        fleet = self.fleet
        auth = CLIENT_AUTH.get()  # a change needs the admin key there too
        req = fleet.sign(fleet.client.build_request(
            method, f"{fleet.url(self.node)}/mlxfleet/v1/models/{self.name}/{what}",
            params=params, timeout=httpx.Timeout(timeout, connect=5),
            headers={"Authorization": auth} if auth else {}), self.node)
        try:
            r = await fleet.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise APIError(503, f"Node '{self.node}' does not answer: "
                           f"{e or type(e).__name__}", code="node_unreachable") from None
        if r.status_code < 400:
            return r
        try:
            body = await r.aread()
        finally:
            await r.aclose()
        raise APIError.answered(r.status_code, body, f"node '{self.node}'", r.headers)

    def status(self) -> dict[str, Any]:
        """The serving node's status of the model (the same fields as a local one's),
        with this node's view of where it runs."""
        spec = self.manifest.spec
        st = {"generation": 1, "observedGeneration": None, "restarts": 0, "pid": None,
              "memoryBytes": None, "lastError": None, "inflight": 0, "waiting": 0,
              "keepAlive": 0, "lastUsed": None, "expiresAt": None, "loaded": False,
              "pinned": spec.pinned, "priority": spec.priority, "preload": spec.preload,
              "memory": {"estimatedBytes": None, "measuredBytes": None, "weightBytes": None,
                         "cacheBytes": None, "footprintBytes": None},
              "createdAt": iso(self.created), "ageSeconds": round(time.time() - self.created, 1),
              "conditions": [], "events": [], "logFile": "-", **self.reported()}
        st.update({"name": self.name, "source": spec.source, "aliases": list(spec.aliases),
                   "labels": dict(self.manifest.metadata.labels), "file": self.file,
                   "phase": self.phase.value, "ready": self.ready, "node": self.node,
                   "nodes": list(self.placement.nodes)})
        if self.node is None:
            st.update({"lastError": self.placement.reason, "conditions": [{
                "type": "Scheduled", "status": "False", "reason": "Unschedulable",
                "message": self.placement.reason}]})
        return with_replicas(st, self.fleet.replica_view(self.name, None))

