"""The engine's admission policy (gathering bursts, the KV budget), without MLX."""

from __future__ import annotations

import pytest

from mlxfleet.worker.policy import KV_BLOCK, AdmissionPolicy

P = AdmissionPolicy(budget=1000, kv_per_token=1, prefill_batch=4, batch_wait=0.02,
                    batch_gap=0.005, admit_wait=0.05)


def test_need_rounds_up_to_kv_blocks():
    assert P.need(10, 20) == KV_BLOCK
    assert P.need(200, 57) == 2 * KV_BLOCK
    assert AdmissionPolicy(1, 0, 1).need(10_000, 10_000) == 0  # unknown shape: cache only


def test_gathering_stops_at_a_full_batch_or_when_the_wait_is_spent():
    assert P.gather_timeout(pending=1, now=0.0, deadline=0.02) == 0.005
    assert P.gather_timeout(pending=1, now=0.018, deadline=0.02) == pytest.approx(0.002)
    assert P.gather_timeout(pending=4, now=0.0, deadline=0.02) is None
    assert P.gather_timeout(pending=1, now=0.021, deadline=0.02) is None
    assert P.gather_on_quiet(announced=2) and not P.gather_on_quiet(announced=0)


def test_a_lone_request_starts_at_once_and_a_burst_gathers():
    assert not P.gathers(announced=0, since_previous=10.0)  # one person typing
    assert P.gathers(announced=1, since_previous=10.0)  # another one is being parsed
    assert P.gathers(announced=0, since_previous=0.002)  # arrivals close together


def test_stragglers_gather_only_while_decoding_and_briefly():
    assert P.hold(running=3, pending=1, oldest_age=0.01)
    assert not P.hold(running=0, pending=1, oldest_age=0.01)  # idle: start now
    assert not P.hold(running=3, pending=4, oldest_age=0.01)  # a full prefill batch
    assert not P.hold(running=3, pending=1, oldest_age=0.06)  # waited long enough


def test_admission_keeps_within_the_kv_budget():
    assert P.admit(running=0, reserved=0, needs=[300, 300, 300, 300]) == 3
    assert P.admit(running=2, reserved=900, needs=[200]) == 0  # waits for room
    assert P.admit(running=2, reserved=500, needs=[500, 1]) == 1  # head first, in order


def test_an_oversized_request_still_starts_when_nothing_runs():
    assert P.admit(running=0, reserved=0, needs=[5000, 10]) == 1
    assert P.admit(running=1, reserved=0, needs=[5000]) == 0


def test_a_burst_of_short_prompts_is_prefilled_by_tokens_not_eight_at_a_time():
    q = AdmissionPolicy(budget=1000, kv_per_token=1, prefill_batch=8, prefill_step=512)
    # 8 x 512 tokens per pass: fourteen 274-token prompts, not eight
    assert q.prefill_group([], [274] * 100) == 14
    assert q.prefill_group([], [64] * 100) == 64
    # long prompts count one chunk each: never fewer than prefill_batch
    assert q.prefill_group([], [5000] * 100) == 8
    assert q.prefill_group([], [274] * 3) == 8  # (mlx-lm takes what waits)
    # prompts mid-prefill count their next chunk, and stay in the pass
    assert q.prefill_group([512] * 6, [274] * 100) == 9
    assert P.prefill_group([], [10] * 100) == 4  # no chunk size known: as configured


def test_first_tokens_come_first_unless_the_groups_behind_pay_more():
    assert AdmissionPolicy.first_tokens_first(5, 0.1, float("inf"))  # unmeasured
    assert AdmissionPolicy.first_tokens_first(3, 0.2, 4.0)  # a 50M model, 32 streams
    assert not AdmissionPolicy.first_tokens_first(17, 0.05, 0.1)  # 256 tiny streams
