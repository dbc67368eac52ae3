"""The pipeline rules (traceana/core/pipeline_rules.py): orders, in-flight counts, the layer split, BPipe's plan and the
bubble windows, on cases small enough to check by hand, and with hypothesis."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceana.core.errors import ConfigError
from traceana.core.pipeline_rules import (
         BACKWARD, FORWARD, Op, bpipe_held, bpipe_holding, bpipe_inflight, bpipe_pair_of, bpipe_plan, bubble_windows,
         device_order, microbatches_in_flight, peak_in_flight, stage_layer_ranges, stage_layers, warmup_forwards,
     )


def _names(order):
    return [f"{op.action}{op.microbatch}" for op in order]


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert _names(device_order("gpipe", pp=4, num_microbatches=3, device=1)) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_1f1b_warms_up_with_p_minus_s_minus_1_forwards_then_alternates():
    assert _names(device_order("1f1b", pp=3, num_microbatches=4, device=0)) == \
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert _names(device_order("1f1b", pp=3, num_microbatches=4, device=2)) == \
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [warmup_forwards("1f1b", pp=4, num_microbatches=8, device=d) for d in range(4)] == [3, 2, 1, 0]


def test_interleaved_1f1b_goes_through_chunks_in_rounds_of_p():
    # p = 2, v = 2, m = 2: device 0 owns virtual stages 0 and 2; warm-up (p−d−1)·2 + (v−1)·p = 4 forwards.
    order = device_order("interleaved-1f1b", pp=2, num_microbatches=2, device=0, virtual_stages=2)
    assert order == [Op("F", 0, 0), Op("F", 0, 1), Op("F", 2, 0), Op("F", 2, 1),
                     Op("B", 2, 0), Op("B", 2, 1), Op("B", 0, 0), Op("B", 0, 1)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 2), (4, 4), (4, 8), (5, 7)])
def test_every_stage_runs_each_microbatch_forward_before_backward(schedule, stages, microbatches):
    for s in range(stages):
        ops = device_order(schedule, pp=stages, num_microbatches=microbatches, device=s)
        assert sorted(op.microbatch for op in ops if op.action == FORWARD) == list(range(microbatches))
        assert [op.microbatch for op in ops if op.action == BACKWARD] == list(range(microbatches))
        for mb in range(microbatches):
            assert ops.index(Op(FORWARD, s, mb)) < ops.index(Op(BACKWARD, s, mb))


def test_in_flight_1f1b_stage_s_holds_p_minus_s_gpipe_holds_all():
    assert [microbatches_in_flight("1f1b", pp=4, stage=s, num_microbatches=8) for s in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("1f1b", pp=4, stage=s, num_microbatches=2) for s in range(4)] == [2, 2, 2, 1]
    assert [microbatches_in_flight("gpipe", pp=4, stage=s, num_microbatches=8) for s in range(4)] == [8] * 4
    # Korthikanti et al. 2022: interleaved stage 0 holds p·(1 + (p−1)/(p·v)) = 4·(1 + 3/8) = 5.5 micro-batches
    assert microbatches_in_flight("interleaved-1f1b", pp=4, stage=0, num_microbatches=16, virtual_stages=2) == 5.5
    assert peak_in_flight(device_order("1f1b", pp=4, num_microbatches=8, device=0)) == 4


def test_layer_split_is_contiguous_and_gives_the_remainder_to_early_stages():
    assert stage_layers(10, 4) == (3, 3, 2, 2)
    assert stage_layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ConfigError):
        stage_layers(3, 4)


def test_pairs_are_s_and_p_minus_1_minus_s_and_the_middle_stage_has_none():
    assert [bpipe_pair_of(s, 5) for s in range(5)] == [(0, 4), (1, 3), None, (1, 3), (0, 4)]


def test_bpipe_plan_for_4_stages_evicts_one_microbatch_at_a_time_from_stage_0():
    plan = bpipe_plan("1f1b", pp=4, num_microbatches=8, evictor=0)
    assert plan.keep == 3  # ⌈(4 + 1)/2⌉
    # F0 F1 F2 | F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 | B5 B6 B7: make room for F3, F5, F7 by evicting 2, 4, 6
    assert plan.evict_before == {3: (2,), 7: (4,), 11: (6,)}
    assert plan.load_before == {8: 2, 12: 4, 14: 6}
    # Stage 3 runs F0 B0 F1 B1 …: it takes 2 at the start (stage 0 evicts it before any backward), 4 after its own
    # B1 (stage 0's last backward before evicting 4 is B1) and 6 after its B3; it returns each after its own
    # backward of it (B2, B4, B6 at positions 5, 9, 13).
    assert plan.accept_after == {-1: (2,), 3: (4,), 7: (6,)}
    assert plan.return_after == {5: (2,), 9: (4,), 13: (6,)}
    assert bpipe_plan("1f1b", pp=4, num_microbatches=8, evictor=1).evicted == 0  # 3 + 2 in flight: balanced


def test_bpipe_acceptor_stays_at_the_balanced_level():
    # By hand from the plan above: stage 3 holds its own 1 plus at most 2 foreign (4 arrives after B1, 2 leaves
    # after B2): 3, the pair's balanced level; stage 0 keeps 3 of its 4.
    held = bpipe_held(bpipe_plan("1f1b", pp=4, num_microbatches=8, evictor=0), schedule="1f1b", pp=4,
                      num_microbatches=8)
    assert held == {0: (3, 0), 3: (1, 2)}
    assert bpipe_holding("1f1b", pp=4, num_microbatches=8) == [(3, 0), (3, 0), (2, 0), (1, 2)]


@pytest.mark.parametrize("p, m", [(2, 8), (3, 5), (3, 9)])
def test_bpipe_balances_nothing_where_the_acceptor_would_take_the_next_before_returning_the_last(p, m):
    # p = 2: stage 0 holds 2, stage 1 holds 1, ⌈3/2⌉ = 2: nothing to move. p = 3: keeping 2 on stage 0 would have
    # stage 2 hold its own 1 plus 2 foreign (the next is sent before the last comes back) = 3, no better.
    assert bpipe_inflight("1f1b", pp=p, num_microbatches=m, evictor=0) == \
        microbatches_in_flight("1f1b", pp=p, stage=0, num_microbatches=m)
    assert bpipe_plan("1f1b", pp=p, num_microbatches=m, evictor=0).evicted == 0


def test_bpipe_plans_1f1b_only():
    with pytest.raises(ConfigError, match="1f1b"):
        bpipe_plan("interleaved-1f1b", pp=4, num_microbatches=8, evictor=0)
    # GPipe: every stage holds all m at its peak, so an acceptor has no room to lend (keeping 2 of 8 on stage 0
    # would put 8 + 6 on stage 3): refused, with that reason, wherever BPipe is asked for
    with pytest.raises(ConfigError, match="GPipe holds all its micro-batches on every stage"):
        bpipe_plan("gpipe", pp=4, num_microbatches=8, evictor=0, keep=2)


def _replay(order, plan):
    """Replay a plan: what is on device before each operation, and is everything back for its backward?"""
    resident, evicted, worst = set(), set(), 0
    for i, op in enumerate(order):
        for victim in plan.evict_before.get(i, ()):
            assert victim in resident
            resident.discard(victim)
            evicted.add(victim)
        if i in plan.load_before:
            assert plan.load_before[i] == op.microbatch and op.microbatch in evicted
            evicted.discard(op.microbatch)
            resident.add(op.microbatch)
        if op.action == FORWARD:
            resident.add(op.microbatch)
        worst = max(worst, len(resident))
        if op.action == BACKWARD:
            assert op.microbatch in resident, f"{op} without its activations"
            resident.discard(op.microbatch)
    assert not resident and not evicted
    return worst


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(2, 8), extra=st.integers(0, 8), keep=st.integers(1, 9), data=st.data())
def test_a_plan_never_exceeds_keep_and_brings_everything_back(stages, extra, keep, data):
    m = stages + extra
    stage = data.draw(st.integers(0, stages // 2 - 1))
    order = device_order("1f1b", pp=stages, num_microbatches=m, device=stage)
    plan = bpipe_plan("1f1b", pp=stages, num_microbatches=m, evictor=stage, keep=keep)
    # keep 1 cannot hold a forward plus the load its next backward needs; 2 always can
    assert _replay(order, plan) <= max(keep, 2)
    assert len(plan.order) == len(set(plan.order))
    assert set(plan.order) == set(plan.load_before.values())
    assert sorted(v for vs in plan.accept_after.values() for v in vs) == sorted(plan.order)
    if keep >= peak_in_flight(order):
        assert plan.order == ()


@settings(max_examples=100, deadline=None)
@given(stages=st.integers(2, 8), extra=st.integers(0, 12), data=st.data())
def test_the_default_keep_never_makes_the_pairs_larger_peak_worse(stages, extra, data):
    m = stages + extra
    e = data.draw(st.integers(0, stages // 2 - 1))
    plan = bpipe_plan("1f1b", pp=stages, num_microbatches=m, evictor=e)
    held = bpipe_held(plan, schedule="1f1b", pp=stages, num_microbatches=m)
    before = microbatches_in_flight("1f1b", pp=stages, stage=e, num_microbatches=m)
    assert max(sum(h) for h in held.values()) <= before
    if plan.evicted:
        assert max(sum(h) for h in held.values()) < before


def test_bubble_windows_split_a_step_at_the_first_and_last_forward_work():
    steps = pl.DataFrame({"rank": [0, 1], "step": [0, 0], "start": [0, 0], "end": [100, 100]})
    fwd = pl.DataFrame({"rank": [0, 0], "step": [0, 0], "start": [10, 40], "end": [20, 60]})
    w = bubble_windows(steps, fwd)
    assert w.rows() == [
        (0, 0, "bubble_warmup", 0, 10), (0, 0, "bubble_stall", 10, 60), (0, 0, "bubble_cooldown", 60, 100),
        (1, 0, "bubble_stall", 0, 100),  # no forward work on rank 1: all of it is a stall
    ]
