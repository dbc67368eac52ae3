"""Schedules and BPipe's eviction plan: pure functions, checked exhaustively on small cases and with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.bpipe import balanced_keep, eviction_plan, pair_of, plan_for
from collectors.trainer.schedules import B, F, Action, actions_for, gpipe, one_f_one_b, peak_in_flight


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert gpipe(1, 4, 3) == [Action(F, 0), Action(F, 1), Action(F, 2), Action(B, 0), Action(B, 1), Action(B, 2)]


def test_1f1b_warms_up_with_p_minus_s_minus_1_forwards_then_alternates():
    assert [f"{a.kind}{a.microbatch}" for a in one_f_one_b(0, 3, 4)] == \
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [f"{a.kind}{a.microbatch}" for a in one_f_one_b(2, 3, 4)] == \
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 2), (4, 4), (4, 8), (5, 7)])
def test_every_stage_runs_each_microbatch_forward_before_backward(schedule, stages, microbatches):
    for s in range(stages):
        acts = actions_for(schedule, s, stages, microbatches)
        assert sorted(a.microbatch for a in acts if a.kind == F) == list(range(microbatches))
        assert [a.microbatch for a in acts if a.kind == B] == list(range(microbatches))  # backwards in order
        for mb in range(microbatches):
            assert acts.index(Action(F, mb)) < acts.index(Action(B, mb))


def test_1f1b_stage_s_holds_p_minus_s_microbatches_gpipe_holds_all():
    assert [peak_in_flight(one_f_one_b(s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]
    assert [peak_in_flight(gpipe(s, 4, 8)) for s in range(4)] == [8, 8, 8, 8]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_balanced_level_of_a_1f1b_pair_is_ceil_of_p_plus_1_over_2(p):
    for s in range(p // 2):
        assert balanced_keep("1f1b", s, p - 1 - s, p, 2 * p) == math.ceil((p + 1) / 2)


def test_pairs_are_s_and_p_minus_1_minus_s_and_the_middle_stage_has_none():
    assert [pair_of(s, 5) for s in range(5)] == [(0, 4), (1, 3), None, (1, 3), (0, 4)]


def test_plan_for_4_stages_evicts_one_microbatch_at_a_time_from_stage_0():
    plan = plan_for("1f1b", 0, 3, 4, 8)
    assert plan.keep == 3
    # F0 F1 F2 | F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 | B5 B6 B7: make room for F3, F5, F7 by evicting 2, 4, 6
    assert plan.evict_before == {3: [2], 7: [4], 11: [6]}
    assert plan.load_before == {8: 2, 12: 4, 14: 6}
    assert plan_for("1f1b", 1, 2, 4, 8).order == ()  # 3 + 2 in flight: already balanced


def _simulate(actions, plan):
    """Replay a plan: what is on device before each action, and is everything back for its backward?"""
    resident, evicted, worst = set(), set(), 0
    for i, a in enumerate(actions):
        for victim in plan.evict_before.get(i, []):
            assert victim in resident
            resident.discard(victim)
            evicted.add(victim)
        if i in plan.load_before:
            assert plan.load_before[i] == a.microbatch and a.microbatch in evicted
            evicted.discard(a.microbatch)
            resident.add(a.microbatch)
        if a.kind == F:
            resident.add(a.microbatch)
        worst = max(worst, len(resident))
        if a.kind == B:
            assert a.microbatch in resident, f"{a} without its activations"
            resident.discard(a.microbatch)
    assert not resident and not evicted
    return worst


@settings(max_examples=200, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), stages=st.integers(2, 8), extra=st.integers(0, 8),
       keep=st.integers(1, 9), data=st.data())
def test_a_plan_never_exceeds_keep_and_brings_everything_back(schedule, stages, extra, keep, data):
    microbatches = stages + extra
    stage = data.draw(st.integers(0, stages // 2 - 1))
    actions = actions_for(schedule, stage, stages, microbatches)
    plan = eviction_plan(actions, keep)
    # keep 1 cannot hold a forward plus the load its next backward needs; 2 always can
    assert _simulate(actions, plan) <= max(keep, 2)
    assert len(plan.order) == len(set(plan.order))
    assert set(plan.order) == set(plan.load_before.values())
    if keep >= peak_in_flight(actions):
        assert plan.order == ()
