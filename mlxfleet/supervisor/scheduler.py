"""One scheduler per node: every local model's phase, queue, keep-alive and memory.

Typed events in, effects out. ``NodeScheduler.handle(event, now)`` is synchronous and
has no clocks, processes or awaits of its own: the supervisor feeds it events from one
queue (requests arriving and ending, workers ready or exited, timers, manifests) and
carries out the effects it returns (start or stop a worker, grant or refuse a request,
set a timer, record an event or a phase change). So every decision about loading,
waiting, evicting and unloading is made here, in one place, and tested as tables of
events -> effects (tests/test_scheduler.py), the way llama-swap tests its scheduler.

A model's phase is stored on its ``ModelState`` and set only by ``_to``, which
reports each transition once. Nothing else in the code base assigns a phase.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Union

from ..units import fmt_bytes
from ..wire import APIError, error_type_for
from .eviction import Candidate, plan_load
from .lifecycle import ModelPhase, backoff_delay, failures_after_exit


class AdmissionError(APIError):
    """Why a request cannot be served now; ``retry_after`` seconds may change that."""

    def __init__(self, status: int, message: str, code: str,
                 retry_after: Optional[float] = None, param: Optional[str] = None):
        headers = {"Retry-After": str(max(1, round(retry_after)))} \
            if retry_after is not None else None
        super().__init__(status, message, type=error_type_for(status), code=code,
                         param=param, headers=headers)
        self.retry_after = retry_after


# ---- what the scheduler knows of a model and its settings -----------------

@dataclass(frozen=True)
class Facts:
    """What a model's manifest says that scheduling needs."""

    spec_hash: str  # the manifest's worker hash: a new one needs a new worker
    keep_alive: Optional[float] = None  # the manifest's (None: the server's default)
    preload: bool = False
    pinned: bool = False
    priority: int = 0
    max_held: int = 1 << 30  # requests running or waiting at once (maxConcurrency+maxQueue)
    always: bool = False  # a rank of a sharded model: loaded from the start, never expires


@dataclass(frozen=True)
class NodeRules:
    """The node's scheduling settings (ServerSettings' share of them)."""

    budget: int = 1 << 60  # memory budget, bytes
    max_loaded: int = 0  # 0: no limit
    keep_alive: float = 300.0  # the server's default keep-alive
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    stable_period: float = 60.0  # seconds Ready that reset the crash count
    settle: float = 1.0  # a changed spec must stay unchanged this long before a new worker
    busy_wait: float = 120.0  # how long a load waits for busy models to go idle


# ---- events -----------------------------------------------------------------

@dataclass(frozen=True)
class Added:
    """A model's manifest appeared. ``name`` is its key in every event and effect: its
    name, or ``name#n`` when a model of that name was deleted and is still stopping."""

    name: str
    facts: Facts


@dataclass(frozen=True)
class Changed:
    name: str
    facts: Facts
    restart: bool  # the worker hash changed: a new worker, rolled in beside the old


@dataclass(frozen=True)
class Removed:
    name: str


@dataclass(frozen=True)
class Wanted:
    """A request (``lease``) or a load wants the model serving; ``ticket`` is answered
    by a ``Grant`` or a ``Refuse``."""

    name: str
    ticket: int
    lease: bool = True
    keep_alive: Optional[float] = None  # the request's, replacing the manifest's


@dataclass(frozen=True)
class GaveUp:
    """A waiting request stopped waiting (its deadline passed, its client left)."""

    ticket: int


@dataclass(frozen=True)
class Finished:
    """A granted request ended."""

    name: str


@dataclass(frozen=True)
class UnloadAsked:
    name: str
    reason: str
    ticket: Optional[int] = None  # granted once nothing of it runs


@dataclass(frozen=True)
class WorkerReady:
    name: str
    worker: int


@dataclass(frozen=True)
class StartFailed:
    name: str
    worker: int
    why: str


@dataclass(frozen=True)
class WorkerExited:
    """A serving worker exited on its own (a crash), or was killed for not answering."""

    name: str
    worker: int
    why: str


@dataclass(frozen=True)
class WorkerStopped:
    """A worker the scheduler stopped is gone; its memory is free."""

    name: str
    worker: int


@dataclass(frozen=True)
class RetryNow:
    """What made its last start fail may have changed (a node that holds its weights
    came back): try again without waiting out the backoff."""

    name: str
    why: str


@dataclass(frozen=True)
class TimerFired:
    name: str
    kind: str  # "keepalive", "retry", "settle", "memory"
    token: int


Event = Union[Added, Changed, Removed, Wanted, GaveUp, Finished, UnloadAsked, WorkerReady,
              StartFailed, WorkerExited, WorkerStopped, RetryNow, TimerFired]


# ---- effects ----------------------------------------------------------------

@dataclass(frozen=True)
class StartWorker:
    """Start worker ``worker`` for the model's current spec (pull its weights first
    if they are not here); answer ``WorkerReady`` or ``StartFailed``, and
    ``WorkerExited`` if it exits later on its own."""

    name: str
    worker: int


@dataclass(frozen=True)
class StopWorker:
    """Stop it: let its requests finish first (``drain``), or kill it (a start being
    abandoned); answer ``WorkerStopped``."""

    name: str
    worker: int
    drain: bool = True


@dataclass(frozen=True)
class Grant:
    """The request holds worker ``worker`` (None: a load or unload that is done)."""

    ticket: int
    worker: Optional[int]


@dataclass(frozen=True)
class Refuse:
    ticket: int
    error: AdmissionError


@dataclass(frozen=True)
class SetTimer:
    """Send ``TimerFired(name, kind, token)`` at ``at`` (the clock ``handle`` is given).
    A later timer of the same kind replaces it: a stale token is ignored."""

    name: str
    kind: str
    at: float
    token: int


@dataclass(frozen=True)
class Note:
    """An event for ``describe`` and the log."""

    name: str
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class PhaseChanged:
    name: str
    phase: ModelPhase
    reason: str
    message: str


@dataclass(frozen=True)
class Forget:
    """A removed model has nothing left running: drop it."""

    name: str


Effect = Union[StartWorker, StopWorker, Grant, Refuse, SetTimer, Note, PhaseChanged, Forget]


# ---- state ------------------------------------------------------------------

@dataclass
class Worker:
    id: int
    spec_hash: str
    ready_at: Optional[float] = None


@dataclass
class ModelState:
    """One model as the scheduler keeps it. Read by status code; written only here."""

    name: str  # its key: the model's name, or name#n while an older one still stops
    facts: Facts
    label: str = ""  # the model's name, for messages
    phase: ModelPhase = ModelPhase.UNLOADED
    reason: str = ""  # why it is in its phase: a word, then ``message`` in a sentence
    message: str = ""
    wanted: bool = False  # should be in memory: it fit, or was made to fit
    removed: bool = False
    serving: Optional[Worker] = None  # takes the requests
    starting: Optional[Worker] = None  # loading (beside ``serving`` during a rollout)
    stopping: set[int] = field(default_factory=set)  # told to stop, not gone yet
    inflight: int = 0  # granted requests not finished
    tickets: dict[int, bool] = field(default_factory=dict)  # waiting: ticket -> lease?
    unload_tickets: list[int] = field(default_factory=list)
    unloading: Optional[str] = None  # why it was asked to unload, until it has
    keep_alive_override: Optional[float] = None  # the last request's keep_alive
    last_used: Optional[float] = None
    failures: int = 0  # consecutive, for the backoff
    failed_at: Optional[float] = None
    last_error: Optional[str] = None
    settle_until: float = -math.inf
    blocked_by: set[str] = field(default_factory=set)  # evicted models it waits to stop
    waiting_memory: bool = False  # a load waits for busy models to go idle
    timers: dict[str, tuple[int, float]] = field(default_factory=dict)  # kind -> (token, at)
    restarts: int = 0
    loads: int = 0
    unloads: int = 0
    evictions: int = 0

    @property
    def waiters(self) -> int:
        return len(self.tickets)

    @property
    def has_workers(self) -> bool:
        return bool(self.serving or self.starting or self.stopping)

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.wanted and not self.removed


class NodeScheduler:
    """Owns every local model's phase, queue, keep-alive and memory on one node."""

    def __init__(self, rules: NodeRules, footprint: Callable[[str], int]):
        self.rules = rules
        self.footprint = footprint  # bytes a model takes loaded (estimate or measured)
        self.models: dict[str, ModelState] = {}
        self.pending: list[str] = []  # loads waiting for busy models to go idle, in order
        self._ids = itertools.count(1)
        self._tickets: dict[int, str] = {}  # waiting ticket -> model
        self._out: list[Effect] = []
        self._now = 0.0

    # ---- the one entry point --------------------------------------------

    def handle(self, event: Event, now: float) -> list[Effect]:
        """The effects of one event, in order."""
        self._now, self._out = now, []
        getattr(self, "_on_" + type(event).__name__)(event)
        return self._out

    def keep_alive(self, st: ModelState) -> float:
        """How long it stays loaded once idle: a sharded rank forever (every rank must
        run for any to serve), else the last request's, the manifest's, the server's."""
        if st.facts.always:
            return math.inf
        for ka in (st.keep_alive_override, st.facts.keep_alive):
            if ka is not None:
                return ka
        return self.rules.keep_alive

    def retry_after(self, st: ModelState, now: float) -> float:
        """Seconds until another start may be tried after a failure (0: now)."""
        if st.failed_at is None:
            return 0.0
        delay = backoff_delay(st.failures, self.rules.backoff_base, self.rules.backoff_cap)
        return max(0.0, st.failed_at + delay - now)

    def holds_memory(self, st: ModelState) -> bool:
        """Runs, loads, stops, or is about to load: a model backing off after failures
        does not hold memory meanwhile."""
        return st.has_workers or (st.wanted and self.retry_after(st, self._now) == 0)

    # ---- events -----------------------------------------------------------

    def _on_Added(self, ev: Added) -> None:
        st = self.models[ev.name] = ModelState(ev.name, ev.facts,
                                               label=ev.name.partition("#")[0])
        if ev.facts.preload or ev.facts.always:
            self._want(st)
        self._step(st)

    def _on_Changed(self, ev: Changed) -> None:
        st = self.models.get(ev.name)
        if st is None or st.facts == ev.facts:
            return
        was_preload = st.facts.preload
        st.facts = ev.facts
        if ev.restart:
            st.failures, st.failed_at = 0, None
            st.settle_until = self._now + self.rules.settle
            self._note(st, "Normal", "SpecChanged", "spec changed; rolling to a new worker"
                       if self.holds_memory(st) else "spec changed")
            if st.starting is not None:  # a start for the old spec is abandoned
                self._stop(st, st.starting, drain=False)
                st.starting = None
                self._note(st, "Normal", "LoadAbandoned", "superseded while loading")
            if st.settle_until > self._now:
                self._timer(st, "settle", st.settle_until)
        else:
            self._note(st, "Normal", "Updated", "updated without restart (aliases, labels, "
                       "keepAlive, preload, pinned or priority)")
            self._arm_keep_alive(st)
        if ((ev.facts.preload and not was_preload) or ev.facts.always) \
                and not (st.wanted or st.waiting_memory):
            self._want(st)
        self._step(st)

    def _on_Removed(self, ev: Removed) -> None:
        st = self.models.get(ev.name)
        if st is None:
            return
        st.removed, st.wanted = True, False
        self._unpend(st)
        self._refuse_all(st, AdmissionError(404, f"The model '{st.label}' was deleted.",
                                            "model_not_found", param="model"))
        self._step(st)
        self._retry_pending()

    def _on_Wanted(self, ev: Wanted) -> None:
        st = self.models.get(ev.name)
        if st is None or st.removed:
            self._out.append(Refuse(ev.ticket, AdmissionError(
                404, f"The model '{ev.name}' does not exist.", "model_not_found",
                param="model")))
            return
        if ev.keep_alive is not None:
            st.keep_alive_override = ev.keep_alive
            self._arm_keep_alive(st)
        if st.ready:
            if ev.lease and not self._room(st, ev.ticket):
                return
            self._grant(st, ev.ticket, ev.lease)
            return
        if st.phase is ModelPhase.BACKOFF:
            retry = self.retry_after(st, self._now)
            self._out.append(Refuse(ev.ticket, AdmissionError(
                503, f"Model '{st.label}' is not available: {st.last_error}. Restarting in "
                f"about {max(1, round(retry))}s.", "model_unavailable", retry_after=retry)))
            return
        if not self._room(st, ev.ticket):
            return
        st.tickets[ev.ticket] = ev.lease
        self._tickets[ev.ticket] = st.name
        if not st.wanted and not st.waiting_memory:
            self._want(st)
        self._step(st)

    def _on_GaveUp(self, ev: GaveUp) -> None:
        name = self._tickets.pop(ev.ticket, None)
        st = self.models.get(name or "")
        if st is None:
            return
        st.tickets.pop(ev.ticket, None)
        if not st.tickets and st.waiting_memory:  # nobody waits for this load any more
            self._unpend(st)
            self._step(st)

    def _on_Finished(self, ev: Finished) -> None:
        st = self.models.get(ev.name)
        if st is None:
            return
        st.inflight = max(0, st.inflight - 1)
        st.last_used = self._now
        if st.inflight == 0:
            self._arm_keep_alive(st)
            self._step(st)  # (idempotent: a rollout whose timer went astray goes on)
            self._retry_pending()  # a busy model went idle: a waiting load may evict it

    def _on_UnloadAsked(self, ev: UnloadAsked) -> None:
        st = self.models.get(ev.name)
        if st is None:
            if ev.ticket is not None:
                self._out.append(Grant(ev.ticket, None))
            return
        self._unpend(st)
        self._refuse_all(st, AdmissionError(503, f"Model '{st.label}' is being unloaded "
                                            f"({ev.reason}).", "model_unavailable",
                                            retry_after=1))
        if ev.ticket is not None:
            st.unload_tickets.append(ev.ticket)
        self._release(st, ev.reason)
        self._step(st)

    def _on_WorkerReady(self, ev: WorkerReady) -> None:
        st = self.models.get(ev.name)
        if st is None or st.starting is None or st.starting.id != ev.worker:
            return  # abandoned meanwhile: its stop is under way
        w, st.starting = st.starting, None
        w.ready_at = self._now
        old, st.serving = st.serving, w
        st.loads += 1
        st.failed_at = None
        st.last_used = self._now
        self._note(st, "Normal", "Ready", "the worker is serving")
        if old is not None:
            self._stop(st, old, drain=True)
            self._note(st, "Normal", "RolloutComplete", "traffic moved to the new worker")
        self._step(st)
        self._arm_keep_alive(st)  # a load nobody uses still expires

    def _on_StartFailed(self, ev: StartFailed) -> None:
        st = self.models.get(ev.name)
        if st is None or st.starting is None or st.starting.id != ev.worker:
            return
        st.starting = None
        self._stop(st, Worker(ev.worker, ""), drain=False)  # what is left of it
        self._fail(st, ev.why)
        self._note(st, "Warning", "LoadFailed", ev.why)
        err = AdmissionError(503, f"Model '{st.label}' failed to load: {ev.why}",
                             "model_load_failed", retry_after=self.retry_after(st, self._now))
        self._refuse_all(st, err)  # waiters hear why now, not after the retries
        if st.serving is not None:
            self._note(st, "Warning", "NewWorkerFailed",
                       f"{ev.why}; the previous worker keeps serving")
        elif not (st.facts.preload or st.facts.always):
            st.wanted = False  # on-demand: the next request retries, after the backoff
            self._retry_pending()
        self._step(st)

    def _on_WorkerExited(self, ev: WorkerExited) -> None:
        st = self.models.get(ev.name)
        if st is None or st.serving is None or st.serving.id != ev.worker:
            return  # one being stopped: WorkerStopped follows
        w, st.serving = st.serving, None
        st.failures = failures_after_exit(st.failures, self._now - (w.ready_at or self._now),
                                          self.rules.stable_period)
        st.failed_at = self._now
        st.last_error = ev.why
        self._note(st, "Warning", "WorkerCrashed", ev.why)
        self._step(st)

    def _on_WorkerStopped(self, ev: WorkerStopped) -> None:
        st = self.models.get(ev.name)
        if st is None:
            return
        st.stopping.discard(ev.worker)
        if st.has_workers:
            return
        self._step(st)
        for other in list(self.models.values()):  # loads that waited for this eviction
            if st.name in other.blocked_by:
                other.blocked_by.discard(st.name)
                self._step(other)
        self._retry_pending()

    def _on_RetryNow(self, ev: RetryNow) -> None:
        st = self.models.get(ev.name)
        if st is None or st.failed_at is None or st.removed:
            return
        st.failed_at = None
        st.timers.pop("retry", None)
        self._note(st, "Normal", "Retrying", ev.why)
        self._step(st)

    def _on_TimerFired(self, ev: TimerFired) -> None:
        st = self.models.get(ev.name)
        if st is None or st.timers.get(ev.kind, (None,))[0] != ev.token:
            return  # replaced by a later timer
        del st.timers[ev.kind]
        if ev.kind == "keepalive":
            if st.wanted and st.serving and not (st.inflight or st.starting or st.tickets):
                self._release(st, f"idle for {self.keep_alive(st):g}s (keepAlive)")
        elif ev.kind == "memory" and st.waiting_memory:
            self._unpend(st)
            plan = self._plan(st)
            self._refuse_memory(st, plan.message)
        self._step(st)

    # ---- decisions --------------------------------------------------------

    def _step(self, st: ModelState) -> None:
        """Move one model toward what is wanted of it, and store its phase."""
        if st.removed:
            for w in (st.starting, st.serving):
                if w is not None:
                    self._stop(st, w, drain=w is st.serving)
            st.starting = st.serving = None
            if st.has_workers:
                self._to(st, ModelPhase.TERMINATING, "Terminating", "the model is stopping")
            else:
                self._to(st, ModelPhase.STOPPED, "Stopped", "all workers stopped")
                del self.models[st.name]
                self._out.append(Forget(st.name))
            return
        if not st.wanted:
            if st.starting is not None:
                self._stop(st, st.starting, drain=False)
            if st.serving is not None:
                self._stop(st, st.serving, drain=True)
            st.starting = st.serving = None
            if not st.stopping:
                if st.unloading is not None:
                    st.unloads += 1
                    st.unloading = None
                    self._note(st, "Normal", "Unloaded", "worker stopped; memory released")
                for t in st.unload_tickets:
                    self._out.append(Grant(t, None))
                st.unload_tickets.clear()
            if st.stopping and (st.unloading is not None or st.failed_at is None):
                self._to(st, ModelPhase.UNLOADING, "Unloading", "workers are stopping")
            elif st.waiting_memory:
                self._to(st, ModelPhase.LOADING, "WaitingForMemory",
                         "waiting for busy models to go idle")
            elif st.failed_at is not None:  # (what is left of the failed start is reaped)
                self._to(st, ModelPhase.FAILED, "LoadFailed", f"{st.last_error}")
            else:
                self._to(st, ModelPhase.UNLOADED, "Unloaded",
                         "not loaded; loads on the next request")
            return
        current = st.facts.spec_hash
        if st.serving is not None and st.serving.spec_hash == current:
            if st.starting is not None:  # the spec went back to what serves
                self._stop(st, st.starting, drain=False)
                st.starting = None
            self._to(st, ModelPhase.READY, "WorkerReady", "the worker is serving")
            for ticket, lease in list(st.tickets.items()):
                del st.tickets[ticket]
                self._tickets.pop(ticket, None)
                self._grant(st, ticket, lease)
            return
        if st.starting is not None:
            self._loading(st)
            return
        wait = self.retry_after(st, self._now)
        if wait > 0:
            self._timer(st, "retry", self._now + wait)
            if st.serving is None:
                self._to(st, ModelPhase.BACKOFF, "CrashLoopBackOff",
                         f"{st.last_error}; restarting in {wait:.0f}s")
            return
        if st.settle_until > self._now or st.blocked_by or (
                st.stopping and st.serving is None):  # (its old worker still stops)
            if st.settle_until > self._now:  # (again if its timer came a hair early)
                self._timer(st, "settle", st.settle_until)
            self._loading(st)
            return
        if st.failures:
            st.restarts += 1
        st.starting = Worker(next(self._ids), current)
        self._out.append(StartWorker(st.name, st.starting.id))
        self._loading(st)

    def _loading(self, st: ModelState) -> None:
        if st.serving is not None:  # a rollout: the old worker serves meanwhile
            self._to(st, ModelPhase.READY, "WorkerReady",
                     "the worker is serving; a new one is starting beside it")
        elif st.blocked_by:
            self._to(st, ModelPhase.LOADING, "Evicting",
                     f"waiting for {', '.join(sorted(st.blocked_by))} to unload")
        else:
            self._to(st, ModelPhase.LOADING, "Loading", "the worker is loading the model")

    def _want(self, st: ModelState) -> None:
        """It should load: make room (evicting idle models), wait for busy ones to go
        idle, or refuse."""
        wait = self.retry_after(st, self._now)
        if wait > 0 and not (st.facts.preload or st.facts.always):
            self._refuse_all(st, AdmissionError(
                503, f"Model '{st.label}' failed to load: {st.last_error}. Retrying in "
                f"{wait:.0f}s.", "model_load_failed", retry_after=wait))
            return
        plan = self._plan(st)
        if plan.ok:
            for victim in plan.evict:
                v = self.models[victim]
                v.evictions += 1
                self._release(v, f"evicted to make room for '{st.label}' "
                                 f"({fmt_bytes(self.footprint(st.name))})")
                self._step(v)
                if v.has_workers:
                    st.blocked_by.add(victim)
            st.wanted = True
            st.waiting_memory = False
        elif plan.wait:
            if not st.waiting_memory:
                st.waiting_memory = True
                self.pending.append(st.name)
                self._timer(st, "memory", self._now + self.rules.busy_wait)
                self._note(st, "Normal", "WaitingForMemory",
                           f"waiting for a busy model to go idle: {plan.message}")
        else:
            self._refuse_memory(st, plan.message)

    def _plan(self, st: ModelState):
        others = [self._candidate(m) for m in self.models.values() if m is not st]
        return plan_load(self._candidate(st), others, self.rules.budget,
                         self.rules.max_loaded)

    def _candidate(self, st: ModelState) -> Candidate:
        leaving = st.has_workers and not st.wanted  # on its way out: wait for it
        busy = st.inflight > 0 or st.starting is not None or leaving or (
            st.wanted and st.serving is None)
        return Candidate(st.name, self.footprint(st.name), self.holds_memory(st), busy,
                         st.facts.pinned, st.facts.priority, st.last_used or 0.0)

    def _retry_pending(self) -> None:
        """Loads waiting for memory try again (in the order they came)."""
        for name in list(self.pending):
            st = self.models.get(name)
            if st is None or not st.waiting_memory:
                continue
            st.waiting_memory = False
            self.pending.remove(name)
            self._want(st)
            if not st.waiting_memory:
                st.timers.pop("memory", None)
            self._step(st)

    def _unpend(self, st: ModelState) -> None:
        if st.waiting_memory:
            st.waiting_memory = False
            self.pending.remove(st.name)
            st.timers.pop("memory", None)

    def _refuse_memory(self, st: ModelState, message: str) -> None:
        self._note(st, "Warning", "PreloadRefused" if not st.tickets else "LoadRefused",
                   message)
        self._refuse_all(st, AdmissionError(503, f"Cannot load model {message}.",
                                            "insufficient_memory", retry_after=5))

    def _room(self, st: ModelState, ticket: int) -> bool:
        """Whether one more request fits: ``maxConcurrency + maxQueue`` requests may be
        running or waiting for the model (requests; the worker queues sequences)."""
        held = st.waiters + st.inflight
        if held < st.facts.max_held:
            return True
        self._out.append(Refuse(ticket, AdmissionError(
            503, f"Model '{st.label}' has {held} requests running or waiting (maxConcurrency "
            f"+ maxQueue = {st.facts.max_held}); retry shortly.", "queue_full",
            retry_after=2)))
        return False

    def _grant(self, st: ModelState, ticket: int, lease: bool) -> None:
        st.last_used = self._now
        if lease:
            st.inflight += 1
            st.timers.pop("keepalive", None)  # busy: the keep-alive clock stops
            self._out.append(Grant(ticket, st.serving.id))
        else:  # a load: its keep-alive clock starts now, as after a request
            self._arm_keep_alive(st)
            self._out.append(Grant(ticket, None))

    def _release(self, st: ModelState, reason: str) -> None:
        if st.wanted:
            st.wanted = False
            if st.has_workers:
                st.unloading = reason
            self._note(st, "Normal", "Unloading", reason)

    def _fail(self, st: ModelState, why: str) -> None:
        st.failures += 1
        st.failed_at = self._now
        st.last_error = why

    def _refuse_all(self, st: ModelState, err: AdmissionError) -> None:
        for ticket in st.tickets:
            self._tickets.pop(ticket, None)
            self._out.append(Refuse(ticket, err))
        st.tickets.clear()

    def _arm_keep_alive(self, st: ModelState) -> None:
        """The keep-alive clock runs while a loaded model has nothing to do."""
        ka = self.keep_alive(st)
        if not st.wanted or st.inflight or math.isinf(ka):
            st.timers.pop("keepalive", None)
            return
        self._timer(st, "keepalive", (st.last_used or self._now) + max(ka, 0.0))

    def _stop(self, st: ModelState, w: Worker, drain: bool) -> None:
        st.stopping.add(w.id)
        self._out.append(StopWorker(st.name, w.id, drain))

    def _timer(self, st: ModelState, kind: str, at: float) -> None:
        if st.timers.get(kind, (0, None))[1] == at:
            return  # that one is set already
        token = next(self._ids)
        st.timers[kind] = (token, at)
        self._out.append(SetTimer(st.name, kind, at, token))

    def _note(self, st: ModelState, type_: str, reason: str, message: str) -> None:
        self._out.append(Note(st.name, type_, reason, message))

    def _to(self, st: ModelState, phase: ModelPhase, reason: str, message: str) -> None:
        """The one place a phase is set; each change is reported once."""
        if (st.phase, st.reason, st.message) == (phase, reason, message):
            return
        st.phase, st.reason, st.message = phase, reason, message
        self._out.append(PhaseChanged(st.name, phase, reason, message))
