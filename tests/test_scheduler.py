"""The node's scheduler as tables: events in, effects out. No process, clock or loop.

Each test feeds ``NodeScheduler.handle`` events at given times and compares the
effects it returns (start or stop a worker, grant or refuse a request, timers,
phases) with what a user would see happen: this is where loading, waiting,
keep-alive, eviction, backoff and rollouts are decided.
"""

from __future__ import annotations

import pytest

from mlxfleet.supervisor.lifecycle import ModelPhase
from mlxfleet.supervisor.scheduler import (
    Added,
    Changed,
    Facts,
    Finished,
    Forget,
    GaveUp,
    Grant,
    NodeRules,
    NodeScheduler,
    Note,
    PhaseChanged,
    Refuse,
    Removed,
    RetryNow,
    SetTimer,
    StartFailed,
    StartWorker,
    StopWorker,
    TimerFired,
    UnloadAsked,
    Wanted,
    WorkerExited,
    WorkerReady,
    WorkerStopped,
)

GB = 1 << 30


class Node:
    """A scheduler and the effects it returned, as the tests read them."""

    def __init__(self, footprints: dict[str, int] | None = None, **rules):
        self.footprints = footprints or {}
        self.s = NodeScheduler(NodeRules(**{"keep_alive": 300.0, "settle": 0.0, **rules}),
                               lambda name: self.footprints.get(name, GB))
        self.now = 0.0

    def on(self, event, at: float | None = None) -> list:
        if at is not None:
            self.now = at
        return self.s.handle(event, self.now)

    def add(self, name: str, **facts) -> list:
        return self.on(Added(name, Facts(f"h-{name}", **facts)))

    def phase(self, name: str) -> ModelPhase:
        return self.s.models[name].phase

    def serve(self, name: str, ticket: int = 1) -> int:
        """Load ``name`` on demand through a request; the worker's id."""
        (start,) = starts(self.on(Wanted(name, ticket)))
        self.on(WorkerReady(name, start.worker))
        return start.worker


def starts(effects: list) -> list[StartWorker]:
    return [e for e in effects if isinstance(e, StartWorker)]


def kinds(effects: list) -> list[str]:
    """The effects that act, in order (notes and phases left out)."""
    return [type(e).__name__ for e in effects if not isinstance(e, (Note, PhaseChanged))]


def timer(effects: list, kind: str) -> SetTimer:
    (t,) = [e for e in effects if isinstance(e, SetTimer) and e.kind == kind]
    return t


def test_a_request_loads_the_model_and_is_granted_once_it_serves():
    n = Node()
    assert kinds(n.add("a")) == [] and n.phase("a") is ModelPhase.UNLOADED
    out = n.on(Wanted("a", 1))
    assert kinds(out) == ["StartWorker"] and n.phase("a") is ModelPhase.LOADING
    assert kinds(n.on(Wanted("a", 2))) == []  # one load, shared by every waiter
    out = n.on(WorkerReady("a", out[0].worker))
    assert [e.ticket for e in out if isinstance(e, Grant)] == [1, 2]
    assert n.phase("a") is ModelPhase.READY and n.s.models["a"].inflight == 2
    assert kinds(n.on(Wanted("a", 3))) == ["Grant"]  # served at once now


def test_keep_alive_runs_only_while_idle_and_unloads_then():
    n = Node(keep_alive=60)
    n.add("a")
    w = n.serve("a")
    assert kinds(n.on(Finished("a"), at=10)) == ["SetTimer"]
    n.on(Wanted("a", 2), at=20)  # busy again: the timer it armed is stale
    out = n.on(Finished("a"), at=30)
    t = timer(out, "keepalive")
    assert t.at == 90
    assert n.on(TimerFired("a", "keepalive", t.token - 1), at=70) == []  # stale
    out = n.on(TimerFired("a", "keepalive", t.token), at=90)
    assert out[-1] == PhaseChanged("a", ModelPhase.UNLOADING, "Unloading",
                                   "workers are stopping")
    assert StopWorker("a", w, drain=True) in out
    out = n.on(WorkerStopped("a", w))
    assert n.phase("a") is ModelPhase.UNLOADED
    assert any(isinstance(e, Note) and e.reason == "Unloaded" for e in out)


def test_a_requests_keep_alive_replaces_the_manifests_and_forever_never_expires():
    n = Node(keep_alive=60)
    n.add("a", keep_alive=600.0)
    n.serve("a")
    assert n.s.keep_alive(n.s.models["a"]) == 600
    n.on(Wanted("a", 2, keep_alive=float("inf")))
    n.on(Finished("a"))
    out = n.on(Finished("a"))
    assert not [e for e in out if isinstance(e, SetTimer)]


def test_a_model_that_does_not_fit_evicts_the_least_recently_used_idle_one():
    n = Node(budget=2 * GB)
    for name in "abc":
        n.add(name)
    wa = n.serve("a", 1)
    n.on(Finished("a"), at=1)
    wb = n.serve("b", 2)
    n.on(Finished("b"), at=2)
    out = n.on(Wanted("c", 3), at=3)
    assert StopWorker("a", wa, drain=True) in out and not starts(out)  # a is older
    assert n.phase("c") is ModelPhase.LOADING
    assert n.s.models["a"].evictions == 1 and n.s.models["b"].serving.id == wb
    out = n.on(WorkerStopped("a", wa))
    assert len(starts(out)) == 1 and starts(out)[0].name == "c"


def test_a_busy_model_is_never_evicted_a_load_waits_for_it_then_gives_up():
    n = Node(budget=GB, busy_wait=30)
    n.add("a")
    n.add("b")
    n.serve("a")  # a request holds it
    out = n.on(Wanted("b", 2), at=1)
    assert kinds(out) == ["SetTimer"] and n.phase("b") is ModelPhase.LOADING
    assert n.s.models["a"].serving is not None
    t = timer(out, "memory")
    assert t.at == 31
    out = n.on(TimerFired("b", "memory", t.token), at=31)
    (refused,) = [e for e in out if isinstance(e, Refuse)]
    assert refused.ticket == 2 and refused.error.code == "insufficient_memory"
    assert "a: busy" in refused.error.message


def test_a_load_waiting_for_a_busy_model_goes_ahead_when_it_goes_idle():
    n = Node(budget=GB)
    n.add("a")
    n.add("b")
    wa = n.serve("a")
    n.on(Wanted("b", 2))
    out = n.on(Finished("a"))
    assert StopWorker("a", wa, drain=True) in out
    assert len(starts(n.on(WorkerStopped("a", wa)))) == 1


def test_pinned_models_stay_and_a_model_bigger_than_the_budget_is_refused_at_once():
    n = Node({"big": 3 * GB}, budget=2 * GB)
    n.add("p", pinned=True, preload=True)
    n.add("big")
    out = n.on(Wanted("big", 1))
    (refused,) = [e for e in out if isinstance(e, Refuse)]
    assert refused.error.status == 503 and "whole memory budget" in refused.error.message


def test_the_queue_bound_counts_requests_running_and_waiting():
    n = Node()
    n.add("a", max_held=2)
    n.on(Wanted("a", 1))
    n.on(Wanted("a", 2))
    (refused,) = n.on(Wanted("a", 3))
    assert refused.error.code == "queue_full" and refused.error.retry_after == 2
    n.on(GaveUp(2))  # one left: room again
    assert kinds(n.on(Wanted("a", 4))) == []


def test_a_failed_on_demand_load_refuses_its_waiters_and_backs_off_the_next_request():
    n = Node(backoff_base=10, backoff_cap=10)
    n.add("a")
    (start,) = starts(n.on(Wanted("a", 1)))
    n.on(Wanted("a", 2))
    out = n.on(StartFailed("a", start.worker, "corrupt weights"), at=5)
    refused = [e for e in out if isinstance(e, Refuse)]
    assert [e.ticket for e in refused] == [1, 2]
    assert refused[0].error.code == "model_load_failed" and refused[0].error.retry_after == 10
    assert StopWorker("a", start.worker, drain=False) in out
    n.on(WorkerStopped("a", start.worker))
    assert n.phase("a") is ModelPhase.FAILED
    (again,) = n.on(Wanted("a", 3), at=8)
    assert again.error.code == "model_load_failed" and again.error.retry_after == 7
    assert len(starts(n.on(Wanted("a", 4), at=15))) == 1  # the backoff has passed


def test_a_crash_backs_off_exponentially_then_restarts():
    n = Node(backoff_base=2, backoff_cap=60, stable_period=60)
    n.add("a", preload=True)
    w = n.s.models["a"].starting.id
    n.on(WorkerReady("a", w), at=0)
    out = n.on(WorkerExited("a", w, "worker exited unexpectedly with code -9"), at=1)
    assert n.phase("a") is ModelPhase.BACKOFF and timer(out, "retry").at == 3
    (refused,) = n.on(Wanted("a", 1), at=2)
    assert refused.error.code == "model_unavailable"
    out = n.on(TimerFired("a", "retry", timer(out, "retry").token), at=3)
    (start,) = starts(out)
    n.on(WorkerReady("a", start.worker), at=4)
    out = n.on(WorkerExited("a", start.worker, "again"), at=5)
    assert timer(out, "retry").at == 9  # 2 failures: 4 s
    assert n.s.models["a"].restarts == 1


def test_a_spec_change_rolls_a_new_worker_in_beside_the_old_one():
    n = Node(settle=1.0)
    n.add("a")
    old = n.serve("a")
    out = n.on(Changed("a", Facts("h-a2"), restart=True), at=10)
    assert kinds(out) == ["SetTimer"]  # settles first: more saves may follow
    out = n.on(TimerFired("a", "settle", timer(out, "settle").token), at=11)
    (start,) = starts(out)
    assert n.phase("a") is ModelPhase.READY  # the old one serves meanwhile
    assert [type(e) for e in n.on(Wanted("a", 2))] == [Grant]
    out = n.on(WorkerReady("a", start.worker))
    assert StopWorker("a", old, drain=True) in out
    assert n.s.models["a"].serving.id == start.worker


def test_a_settle_timer_that_fires_early_is_set_again_not_lost():
    # (an event loop may run a timer a hair before its time: the rollout waited forever)
    n = Node(settle=1.0)
    n.add("a")
    n.serve("a")
    out = n.on(Changed("a", Facts("h-a2"), restart=True), at=10)
    out = n.on(TimerFired("a", "settle", timer(out, "settle").token), at=10.999)
    assert not starts(out) and timer(out, "settle").at == 11
    (start,) = starts(n.on(TimerFired("a", "settle", timer(out, "settle").token), at=11))
    assert start.worker


def test_a_second_save_while_loading_abandons_the_first_start():
    n = Node()
    n.add("a", preload=True)
    first = n.s.models["a"].starting.id
    out = n.on(Changed("a", Facts("h-a2", preload=True), restart=True))
    assert StopWorker("a", first, drain=False) in out and not starts(out)
    assert n.on(WorkerReady("a", first)) == []  # too late: it is being stopped
    (start,) = starts(n.on(WorkerStopped("a", first)))  # its memory is free: the new one
    assert start.worker != first


def test_a_failed_replacement_leaves_the_old_worker_serving():
    n = Node(backoff_base=5)
    n.add("a")
    old = n.serve("a")
    (start,) = starts(n.on(Changed("a", Facts("h-a2"), restart=True)))
    out = n.on(StartFailed("a", start.worker, "bad weights"), at=1)
    assert n.phase("a") is ModelPhase.READY and n.s.models["a"].serving.id == old
    assert any(isinstance(e, Note) and e.reason == "NewWorkerFailed" for e in out)
    assert timer(out, "retry").at == 6


def test_unload_drains_then_answers_and_a_removed_model_is_forgotten():
    n = Node()
    n.add("a")
    w = n.serve("a")
    out = n.on(UnloadAsked("a", "unload requested", ticket=9))
    assert StopWorker("a", w, drain=True) in out and not any(
        isinstance(e, Grant) for e in out)
    out = n.on(WorkerStopped("a", w))
    assert Grant(9, None) in out and n.phase("a") is ModelPhase.UNLOADED
    n.serve("a", 2)
    out = n.on(Removed("a"))
    assert n.phase("a") is ModelPhase.TERMINATING
    w2 = n.s.models["a"].serving
    assert w2 is None
    (stop,) = [e for e in out if isinstance(e, StopWorker)]
    out = n.on(WorkerStopped("a", stop.worker))
    assert Forget("a") in out and "a" not in n.s.models


def test_requests_waiting_for_a_deleted_model_are_told_so():
    n = Node()
    n.add("a")
    n.on(Wanted("a", 1))
    (refused,) = [e for e in n.on(Removed("a")) if isinstance(e, Refuse)]
    assert refused.error.status == 404


def test_a_load_asked_by_the_control_api_is_answered_and_starts_the_keep_alive_clock():
    n = Node(keep_alive=60)
    n.add("a")
    (start,) = starts(n.on(Wanted("a", 1, lease=False), at=0))
    out = n.on(WorkerReady("a", start.worker), at=5)
    assert Grant(1, None) in out and timer(out, "keepalive").at == 65
    assert n.s.models["a"].inflight == 0


@pytest.mark.parametrize("events, phase", [
    ([], ModelPhase.UNLOADED),
    ([Wanted("a", 1)], ModelPhase.LOADING),
    ([Wanted("a", 1), WorkerReady("a", 1)], ModelPhase.READY),
    ([Wanted("a", 1), WorkerReady("a", 1), UnloadAsked("a", "x")], ModelPhase.UNLOADING),
    ([Wanted("a", 1), WorkerReady("a", 1), WorkerExited("a", 1, "x")], ModelPhase.BACKOFF),
    ([Wanted("a", 1), StartFailed("a", 1, "x")], ModelPhase.FAILED),  # reaping it
    ([Wanted("a", 1), StartFailed("a", 1, "x"), WorkerStopped("a", 1)], ModelPhase.FAILED),
    ([Wanted("a", 1), WorkerReady("a", 1), Removed("a")], ModelPhase.TERMINATING),
])
def test_every_phase_is_set_by_the_scheduler(events, phase):
    n = Node()
    n.add("a")
    for ev in events:
        n.on(ev)
    assert n.phase("a") is phase


def test_the_phase_is_stored_and_each_change_reported_once():
    n = Node()
    n.add("a")
    out = n.on(Wanted("a", 1)) + n.on(Wanted("a", 2))
    assert [e.phase for e in out if isinstance(e, PhaseChanged)] == [ModelPhase.LOADING]


def test_a_sharded_rank_loads_at_once_and_never_expires():
    n = Node(keep_alive=1)
    out = n.add("s", always=True)
    assert len(starts(out)) == 1
    assert n.s.keep_alive(n.s.models["s"]) == float("inf")


def test_a_request_during_an_unload_loads_again_once_the_old_worker_is_gone():
    n = Node(keep_alive=60)
    n.add("a")
    w = n.serve("a")
    n.on(UnloadAsked("a", "unload requested"))
    assert kinds(n.on(Wanted("a", 2))) == []  # not two workers' memory at once
    assert n.phase("a") is ModelPhase.LOADING
    (start,) = starts(n.on(WorkerStopped("a", w)))
    assert Grant(2, start.worker) in n.on(WorkerReady("a", start.worker))


def test_no_module_but_the_scheduler_sets_a_phase():
    """The check the design rests on: a model's ``phase`` is assigned in scheduler.py
    alone (``NodeScheduler._to``); the rest of the control plane and the front door
    read it. (A worker's sequences have phases of their own: prefill, decode.)"""
    import ast
    from pathlib import Path

    import mlxfleet

    root = Path(mlxfleet.__file__).parent
    setters = []
    for path in [*root.glob("*.py"), *root.glob("supervisor/*.py"), *root.glob("api/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr == "phase":
                        setters.append(f"{path.relative_to(root)}:{node.lineno}")
    assert setters and all(s.startswith("supervisor/scheduler.py:") for s in setters), setters


def test_a_start_that_failed_pulling_is_retried_at_once_when_a_node_comes_back():
    """After a failed peer copy, the retry waited out the backoff (35 s): when the node
    that holds the weights answers again, the membership loop sends ``RetryNow``."""
    n = Node(backoff_base=30, backoff_cap=60)
    n.add("a", preload=True)
    first = n.s.models["a"].starting.id
    out = n.on(StartFailed("a", first, "cannot reach the hub; node b: refused"), at=1)
    n.on(WorkerStopped("a", first), at=1)
    assert n.phase("a") is ModelPhase.BACKOFF and timer(out, "retry").at == 31
    out = n.on(RetryNow("a", "node 'b' is back"), at=2)
    assert len(starts(out)) == 1 and n.phase("a") is ModelPhase.LOADING
    assert n.on(RetryNow("a", "again"), at=3) == []  # nothing failed: nothing to do
