"""The control plane: watch the manifests folder and reconcile it into workers."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from ..files import private_dir
from ..fleet_auth import MAX_HOPS, MOVED_HEADER
from ..manifest import (
    FileResult,
    LoadedManifest,
    ManifestError,
    NodeManifest,
    Rules,
    is_pattern,
    load_paths,
)
from ..names import loggable
from ..settings import ServerSettings
from ..store import Limits, Pulls
from .admission import AdmissionError, ServedModel
from .handle import WorkerHandle
from .membership import FleetMembership
from .reconcile import Action, plan
from .remote import RemoteModel
from .replicas import max_concurrency
from .runtime import ModelRuntime
from .scheduler import (
    Added,
    Changed,
    Effect,
    Event,
    Facts,
    Forget,
    Grant,
    NodeRules,
    NodeScheduler,
    Note,
    PhaseChanged,
    Refuse,
    Removed,
    SetTimer,
    StartWorker,
    StopWorker,
    TimerFired,
)

log = logging.getLogger("mlxfleet.supervisor")


SOCKET_DIR_PREFIX = "mlxfleet-"
OWNER_FILE = "supervisor.pid"
#: The longest socket path every platform takes (macOS: 104 bytes with the NUL; Linux 108).
MAX_SOCKET_PATH = 103


def socket_base() -> Path:
    """Where the private socket folder goes: ``$XDG_RUNTIME_DIR``, or /tmp when that is
    unset or too deep for a socket path under it (a worker could not bind)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    longest = base / f"{SOCKET_DIR_PREFIX}xxxxxxxx" / "99999.sock"
    if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
        log.warning("XDG_RUNTIME_DIR %s is too deep for socket paths (%d bytes at most): "
                    "worker sockets go under /tmp", base, MAX_SOCKET_PATH)
        return Path("/tmp")
    return base


def remove_stale_socket_dirs(base: Path) -> None:
    """Delete socket folders left by supervisors that died without
    cleaning up: ours, marked with an owner pid that no longer runs."""
    for d in base.glob(f"{SOCKET_DIR_PREFIX}*"):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER_FILE).read_text().strip() or 0)
        except (OSError, ValueError):
            continue  # not ours, or not a supervisor's folder: leave it alone
        if pid <= 0 or _pid_alive(pid):
            continue
        log.info("removing %s, left by supervisor %d that is gone", d, pid)
        shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Supervisor(FleetMembership):
    """The node: watches the folder, feeds its scheduler events and carries out the
    effects it decides (through the models' runtimes); the gateway asks it where to
    send requests."""

    def __init__(self, settings: ServerSettings,
                 worker_factory: Optional[Callable[[ModelRuntime], WorkerHandle]] = None):
        self.settings = settings
        self._worker_factory = worker_factory or self._worker_process
        self._seq = 0
        self.manifests_dir = Path(settings.manifests_dir).resolve()
        self.rules = Rules(settings.max_manifest_bytes, tuple(settings.allow_worker_env))
        self.log_dir = Path(settings.state_dir).expanduser().resolve() / "logs"
        self.socket_dir: Optional[Path] = None  # made by start()
        self.models: dict[str, ModelRuntime] = {}  # by name: the ones requests reach
        self._runtimes: dict[str, ModelRuntime] = {}  # by key: these and deleted ones
        self._events: collections.deque[Event] = collections.deque()
        self._dispatching = False
        self._answers: dict[int, asyncio.Future] = {}  # ticket -> the scheduler's answer
        self._tickets = itertools.count(1)
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.aliases: dict[str, str] = {}
        self.patterns: dict[str, str] = {}  # glob aliases -> model name
        self.file_errors: dict[str, list[ManifestError]] = {}
        self._last_good: dict[str, list[LoadedManifest]] = {}
        self._watch_task: Optional[asyncio.Task] = None
        self._stopping: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        budget, self.memory_budget_source = settings.memory_budget_bytes()
        self.scheduler = NodeScheduler(NodeRules(
            budget=budget, max_loaded=settings.max_loaded_models,
            keep_alive=settings.keep_alive_seconds, backoff_base=settings.backoff_base,
            backoff_cap=settings.backoff_cap, stable_period=settings.stable_period,
            settle=settings.spec_settle_ms / 1000, busy_wait=settings.busy_wait_timeout),
            footprint=lambda key: self._runtimes[key].footprint())
        self._own_budget = (budget, self.memory_budget_source)
        # Fleets (--node): the other nodes, placement, and the models they run.
        self.node_name: Optional[str] = settings.node
        self.fleet = None
        if settings.node:
            from .fleet import Fleet

            self.fleet = Fleet(settings.node, settings)
        self.remote: dict[str, Any] = {}  # RemoteModel by name
        self._waiting_roll: dict[str, str] = {}  # replicated model -> spec it waits to roll
        self._wanted: dict[str, LoadedManifest] = {}  # every model of the folder
        self._last_good_nodes: dict[str, list[NodeManifest]] = {}
        self._estimates: dict[str, int] = {}
        self._ranks: dict[str, tuple[int, tuple[str, ...]]] = {}  # sharded models run here
        # downloads running on this machine; in a fleet, nodes that hold a source first
        self.pulls = Pulls(self._peers, settings.peer_copy_rate_mb << 20,
                           Limits.of(settings), settings.pull_concurrency)

    async def start(self) -> None:
        # Sockets live in a private directory with a short path (macOS caps them at 104).
        base = socket_base()
        remove_stale_socket_dirs(base)
        self.socket_dir = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=base))
        os.chmod(self.socket_dir, 0o700)
        (self.socket_dir / OWNER_FILE).write_text(str(os.getpid()))
        private_dir(self.log_dir.parent)  # the state dir: logs, responses, prompt caches
        private_dir(self.log_dir)
        if not self.manifests_dir.exists():
            log.warning("manifests folder %s does not exist; creating it", self.manifests_dir)
            self.manifests_dir.mkdir(parents=True)
        await self.reload()
        self._watch_task = asyncio.create_task(self._watch())
        if self.fleet is not None:
            self._spawn(self._fleet_loop())

    @property
    def memory_budget(self) -> int:
        return self.scheduler.rules.budget

    @memory_budget.setter
    def memory_budget(self, budget: int) -> None:
        self.scheduler.rules = dataclasses.replace(self.scheduler.rules, budget=budget)

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
        for t in list(self._tasks):
            t.cancel()
        for name in list(self.models):
            self._delete(name)
        await asyncio.gather(*self._stopping, return_exceptions=True)
        for h in self._timers.values():
            h.cancel()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self.fleet is not None:
            await self.fleet.close()

    # ---- workers ---------------------------------------------------------

    def new_worker(self, rt: ModelRuntime) -> WorkerHandle:
        """A worker (not started yet) for ``rt``'s current manifest."""
        return self._worker_factory(rt)

    def _worker_process(self, rt: ModelRuntime) -> WorkerHandle:
        from .process import WorkerProcess

        self._seq += 1
        sock = self.socket_dir / f"{self._seq}.sock"  # (a model's name may be 63 bytes)
        s = self.settings
        return WorkerProcess(rt.manifest, sock, self.log_path(rt.name), s.log_max_bytes,
                             s.log_backups, s, rt.worker_config)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    # ---- the scheduler -----------------------------------------------------

    def dispatch(self, event: Event) -> None:
        """Hand the scheduler an event and carry out what it decides. Events that come
        while effects are being carried out queue behind them: one at a time, in order."""
        self._events.append(event)
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._events:
                ev = self._events.popleft()
                try:
                    effects = self.scheduler.handle(ev, time.monotonic())
                except Exception:  # noqa: BLE001 - a bug there must not stall the events after
                    log.exception("the scheduler failed on %s", ev)
                    continue
                if isinstance(ev, Added):
                    self._runtimes[ev.name].state = self.scheduler.models[ev.name]
                for effect in effects:
                    try:
                        self._carry_out(effect)
                    except Exception:  # noqa: BLE001 - the effects after it must happen
                        log.exception("carrying out %s failed", effect)
        finally:
            self._dispatching = False

    def ticket(self) -> tuple[int, asyncio.Future]:
        """A ticket for a request to the scheduler, and the future its answer sets."""
        t = next(self._tickets)
        fut = self._answers[t] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda _: self._answers.pop(t, None))
        return t, fut

    def _carry_out(self, effect: Effect) -> None:
        if isinstance(effect, (Grant, Refuse)):
            fut = self._answers.pop(effect.ticket, None)
            if fut is None or fut.done():
                return
            if isinstance(effect, Refuse):
                fut.set_exception(effect.error)
            elif effect.worker is None:
                fut.set_result(None)
            else:
                rt = next(r for r in self._runtimes.values() if effect.worker in r.workers)
                fut.set_result(rt.grant(effect.worker))
            return
        if isinstance(effect, SetTimer):
            key = (effect.name, effect.kind)
            if key in self._timers:
                self._timers.pop(key).cancel()
            self._timers[key] = asyncio.get_running_loop().call_later(
                max(0.0, effect.at - time.monotonic()), self._fire, effect)
            return
        rt = self._runtimes.get(effect.name)
        if rt is None:
            return
        if isinstance(effect, StartWorker):
            log.info("%s: starting worker %d", rt.name, effect.worker)
            rt.start(effect.worker)
        elif isinstance(effect, StopWorker):
            rt.stop(effect.worker, effect.drain)
        elif isinstance(effect, Note):
            rt.note(effect.type, effect.reason, effect.message)
        elif isinstance(effect, PhaseChanged):
            log.info("%s: %s (%s: %s)", rt.name, effect.phase.value, effect.reason,
                     effect.message)
            rt.phase_changed(effect.phase, effect.reason, effect.message)
        elif isinstance(effect, Forget):
            del self._runtimes[effect.name]
            for kind in ("keepalive", "retry", "settle", "memory"):
                h = self._timers.pop((effect.name, kind), None)
                if h is not None:
                    h.cancel()
            rt.gone.set()

    def _fire(self, timer: SetTimer) -> None:
        if self._timers.get((timer.name, timer.kind)) is not None:
            del self._timers[(timer.name, timer.kind)]
        self.dispatch(TimerFired(timer.name, timer.kind, timer.token))

    def _facts(self, rt: ModelRuntime) -> Facts:
        spec, cfg = rt.manifest.spec, rt.worker_config
        return Facts(rt.manifest.worker_hash(), spec.keep_alive, spec.preload, spec.pinned,
                     spec.priority, cfg.max_concurrency + cfg.max_queue,
                     always=rt.rank is not None)

    # ---- admission -------------------------------------------------------

    def find(self, model: str, forwarded_by: Optional[str] = None, hops: int = 0,
             affinity: Optional[Callable[[], str]] = None) -> ServedModel:
        """The model a request names (``resolve``), or the 404 it gets. ``forwarded_by``:
        the node that sent the request here, ``hops`` nodes having forwarded it so far.
        When placements disagree (a node just came or went, a one-way partition) and this
        node sees another holding the model, the request goes on there, once, never back
        to its sender (no circles); otherwise it is refused with ``model_moved``. A
        replicated model's copy is chosen by the request's ``affinity`` key (a client's
        request; one forwarded here is served by this node's copy)."""
        rt = self.resolve(model)
        if rt is None:
            # glob aliases too: "claude-*" tells a client what it may send
            known = ", ".join(self.all_names() + sorted(self.aliases)
                              + sorted(self.patterns)) or "none"
            raise AdmissionError(404, f"The model {loggable(model)} does not exist. "
                                 f"Available models: {known}.", "model_not_found",
                                 param="model")
        if forwarded_by is not None and rt.node != self.node_name and (
                rt.node is None or rt.node == forwarded_by or hops >= MAX_HOPS):
            where = f"node '{rt.node}'" if rt.node else "no node"
            err = AdmissionError(503, f"Model '{rt.name}' runs on {where}, not on node "
                                 f"'{self.node_name}' that this request was forwarded to; "
                                 "the nodes are updating their placement, retry shortly.",
                                 "model_moved", retry_after=1)
            err.headers[MOVED_HEADER] = "1"  # the sender asks again (api/model_routes.py)
            raise err
        placed = self.fleet.placements.get(rt.name) if self.fleet is not None else None
        if placed is not None and placed.replicas:
            router = self.fleet.router
            if forwarded_by is None and len(placed.nodes) > 1:
                return router.route(rt, placed.nodes, affinity() if affinity else "",
                                    self.models.get(rt.name), max_concurrency(rt.manifest))
            if rt.name in self.models:  # a copy here serves it: its session is live here
                router.served(rt.name, affinity() if affinity else "")
        if forwarded_by is None and isinstance(rt, RemoteModel) and rt.unreachable():
            # this node cannot reach the model's node (or places it nowhere) but another
            # node reaches one holding it: ask, don't refuse (that node forwards it on,
            # the last hop a request may take)
            via = self.fleet.relay_for(rt.name) if self.fleet is not None else None
            if via is not None:
                log.info("%s: node %s cannot be reached from here; through node %s",
                         rt.name, rt.node or "(none)", via)
                return rt.via(via)
        return rt

    # ---- routing ---------------------------------------------------------

    def resolve(self, model: str) -> Optional[ServedModel]:
        """The runtime for a model name or alias, if any (in a fleet, a ``RemoteModel``
        for a model another node runs). ``NAME:latest`` (how Ollama's clients name a
        model) is NAME unless something is called that exactly."""
        name = model if model in self.models or model in self.remote else \
            self.aliases.get(model)
        if name is None:  # glob aliases (claude-*) after every exact name and alias
            from fnmatch import fnmatchcase

            for pattern, target in sorted(self.patterns.items()):
                if fnmatchcase(model, pattern):
                    name = target
                    break
        rt = self.get(name) if name else None
        if rt is None and model.endswith(":latest"):
            return self.resolve(model[:-len(":latest")])
        return rt

    def get(self, name: str) -> Optional[ServedModel]:
        """The local runtime or remote model called exactly ``name``, if any."""
        rt = self.models.get(name)
        if rt is None or (rt.rank and rt.rank[0] > 0):  # a follower rank: route to rank 0
            rt = self.remote.get(name) or rt
        return rt if rt is not None and not rt.removed else None

    def names(self) -> list[str]:
        """The models this node runs."""
        return sorted(n for n, rt in self.models.items() if not rt.removed)

    def all_names(self) -> list[str]:
        """Every model of the fleet (of this node alone when it is not in one)."""
        return sorted(set(self.names()) | set(self.remote))

    def entries(self) -> list[ServedModel]:
        """Every model of the fleet, local runtimes and remote models, by name."""
        return [self.get(n) for n in self.all_names()]

    # ---- reconcile -------------------------------------------------------

    def _desired(self, results: list[FileResult], owners: frozenset[str]
                 ) -> dict[str, LoadedManifest]:
        """Manifests to run: each file's new models, or its last good ones if it broke.
        Files whose models run already keep their names (``owners`` go first)."""
        self.file_errors = {r.file: r.errors for r in results if r.errors}
        present = {r.file for r in results}
        for f in list(self._last_good):
            if f not in present:
                del self._last_good[f]
        desired: dict[str, LoadedManifest] = {}
        claimed: set[str] = set()
        for r in sorted(results, key=lambda r: r.file not in owners):
            models = r.models if not r.errors else self._last_good.get(r.file, [])
            if not r.errors:
                self._last_good[r.file] = r.models
            for lm in models:
                keys = {lm.manifest.name, *lm.manifest.spec.aliases}
                if keys & claimed:
                    continue  # a clash in a last-good file: the earlier file wins
                claimed |= keys
                desired[lm.manifest.name] = lm
        return desired

    async def reload(self) -> None:
        """Parse the manifests folder and act on the difference. A missing folder changes
        nothing (models keep running until it is back)."""
        async with self._lock:
            if not self.manifests_dir.is_dir():
                log.warning("manifests folder %s is missing; models keep running until it "
                            "is back", self.manifests_dir)
                return
            owners = frozenset(rt.file for rt in self.models.values() if not rt.removed)
            results = await asyncio.to_thread(load_paths, [self.manifests_dir], owners,
                                              self.rules)
            for r in results:
                for e in r.errors:
                    log.error("manifest error: %s", e)
            desired = self._desired(results, owners)
            if self.fleet is not None:
                self.fleet.set_nodes(self._nodes(results))
                if not self.fleet.polled:  # hear from the others before placing anything
                    await self.fleet.poll_once(timeout=2.0)
                await self._measure(desired)
            self._wanted = desired
            self._apply()

    def _apply(self) -> None:
        """Act on the wanted models: in a fleet, those placed here run and the others
        are routed to their nodes. Called with ``_lock`` held."""
        desired = self._wanted
        if self.fleet is not None:
            desired = self._place(desired)
            for name, rt in list(self.models.items()):
                if name in desired and rt.rank != self._ranks.get(name):
                    self._delete(name)  # its group changed: a new one starts
        actions = plan({n: lm.manifest.worker_hash() for n, lm in desired.items()},
                       {n: rt.manifest.worker_hash() for n, rt in self.models.items()})
        for name, action in sorted(actions.items()):
            lm = desired.get(name)
            if action is Action.CREATE:
                log.info("%s: creating (%s)", name, lm.manifest.spec.source)
                key = name
                for n in itertools.count(2):  # a deleted one of that name still stops
                    if key not in self._runtimes:
                        break
                    key = f"{name}#{n}"
                self.models[name] = rt = ModelRuntime(lm.manifest, lm.file, key, self,
                                                      self._ranks.get(name))
                self._runtimes[key] = rt
                if rt.rank is not None:
                    log.info("%s: rank %d of %d (%s)", name, rt.rank[0], len(rt.rank[1]),
                             ", ".join(rt.rank[1]))
                self._spawn(self._fetch(rt))
                self.dispatch(Added(key, self._facts(rt)))
            elif action is Action.REPLACE and self._rolls_after_another(name, lm):
                continue  # the next fleet poll asks again
            elif action in (Action.KEEP, Action.REPLACE):
                rt = self.models[name]
                moved = lm.manifest.source_changed(rt.manifest)
                restart = action is Action.REPLACE
                rt.update(lm.manifest, lm.file, restart=restart)
                if moved:
                    self._spawn(self._fetch(rt))
                self.dispatch(Changed(rt.key, self._facts(rt), restart))
            elif action is Action.DELETE:
                self._delete(name)
        wanted = self._wanted
        self.aliases = {a: n for n, lm in wanted.items() for a in lm.manifest.spec.aliases
                        if not is_pattern(a)}
        self.patterns = {a: n for n, lm in wanted.items()
                         for a in lm.manifest.spec.aliases if is_pattern(a)}
        for rt in self.models.values():
            errs = self.file_errors.get(rt.file)
            rt.set_manifest_error("; ".join(map(str, errs)) if errs else None)

    def _rolls_after_another(self, name: str, lm: LoadedManifest) -> bool:
        """A replicated model rolls one copy at a time, in the order of its nodes' names:
        this node's copy waits while a copy on a node before it (one that answers) has not
        yet served the new spec. The others keep serving meanwhile."""
        fleet = self.fleet
        placed = fleet.placements.get(name) if fleet is not None else None
        if placed is None or not placed.replicas:
            return False
        new = lm.manifest.worker_hash()
        for node in placed.nodes:
            if node >= fleet.me:
                break
            peer = fleet.peers.get(node)
            if peer is None or not peer.answers:
                continue  # a node that does not answer holds nobody's rollout up
            st = peer.model(name)
            if st.get("specHash") != new or not st.get("ready") \
                    or st.get("observedGeneration") != st.get("generation"):
                if self._waiting_roll.get(name) != new:
                    self._waiting_roll[name] = new
                    self.models[name].event("Normal", "RolloutWaiting", f"rolls after "
                                            f"the copy on node {node} serves the new spec")
                return True
        self._waiting_roll.pop(name, None)
        return False

    def _delete(self, name: str) -> None:
        rt = self.models.pop(name)
        log.info("%s: deleting", name)
        self.dispatch(Removed(rt.key))
        t = asyncio.ensure_future(rt.wait_gone())
        self._stopping.add(t)
        t.add_done_callback(self._stopping.discard)

    # ---- scheduling ------------------------------------------------------

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _peers(self) -> tuple:
        """The other nodes that answer, to copy weights from before the hub."""
        from ..store import Peer

        f = self.fleet
        if f is None:
            return ()
        return tuple(Peer(n, f.url(n), f.me, f.key, f.tls) for n in sorted(f.peers)
                     if f.healthy(n) and f.url(n))

    async def _fetch(self, rt: ModelRuntime) -> None:
        """A model whose weights are not on this machine is pulled as soon as its manifest
        is there, loaded or not; its workers wait for the pull rather than download."""
        from ..store import PullError, needs_pull
        from .memory import spec_sources

        for source, revision in spec_sources(rt.manifest.spec):  # (a draft model too)
            if not await asyncio.to_thread(needs_pull, source, revision):
                continue
            pull = self.pulls.start(source, revision)
            rt.event("Normal", "Pulling", f"pulling {source} onto this machine")
            try:
                await pull.wait()
            except PullError as e:
                rt.event("Warning", "PullFailed", str(e))
                return
            rt.event("Normal", "Pulled", f"{source} is on disk")

    def memory_status(self) -> dict:
        used = sum(rt.footprint() for rt in self.models.values() if rt.holds_memory)
        loaded = [n for n, rt in self.models.items() if rt.holds_memory]
        return {"budgetBytes": self.memory_budget, "budgetSource": self.memory_budget_source,
                "usedBytes": used,
                "freeBytes": self.memory_budget - used, "loaded": sorted(loaded),
                "maxLoadedModels": self.settings.max_loaded_models or None}

    async def _watch(self) -> None:
        from watchfiles import awatch

        def relevant(_change, path: str) -> bool:
            return Path(path).suffix in (".yaml", ".yml")

        def identity() -> Optional[tuple[int, int]]:
            try:
                st = self.manifests_dir.stat()
            except OSError:
                return None
            return st.st_dev, st.st_ino

        while True:  # the watcher never dies: any failure is logged and watching resumes
            watched = identity()
            if watched is None:
                await asyncio.sleep(1)  # removed: wait for it (models keep running)
                continue
            try:
                # A removed folder stops sending events without ending the watch, so
                # wake once a second and re-arm on the folder that is there now.
                async for changes in awatch(self.manifests_dir, watch_filter=relevant,
                                            debounce=self.settings.reload_debounce_ms,
                                            recursive=False, rust_timeout=1000,
                                            yield_on_timeout=True):
                    if identity() != watched:
                        log.warning("manifests folder %s was removed or replaced; watching "
                                    "it again", self.manifests_dir)
                        break
                    if changes:
                        await self.reload()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - e.g. the folder was removed; keep trying
                log.exception("watching %s failed; retrying", self.manifests_dir)
                await asyncio.sleep(1)
            await self.reload()  # catch up with what changed while not watching
