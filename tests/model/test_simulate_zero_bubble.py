"""The simulator and the rules on the schedules that split the backward (zero-bubble ZB-1P, ZB-V, DualPipe-V) and
on looped BFS. Expected values come from hand-traced timelines and from Qi et al. 2023 (arXiv 2401.10241):
with T_F = T_I = T_W (the paper's assumption) 1F1B's bubble is (p−1)(T_F + T_B) with T_B = T_I + T_W, ZB-H1's
(p−1)(T_F + T_I − T_W) — a third of it; ZB-H1 and ZB-V hold 1F1B's peak activations (p micro-batches) on every
device; ZB-V sends twice 1F1B's pipeline messages."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceana.core import schema
from traceana.core.pipeline_rules import (
         BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, device_order, microbatches_in_flight, pipeline_messages,
         stages_of_device, warmup_forwards,
     )
from traceana.core.training_config import TrainingConfig
from traceana.model.memory import estimate_stage_memory
from traceana.model.presets import model_preset
from traceana.model.simulate import Costs, StageTimes, simulate

T = 100  # one F, one I, one W (ns); a whole backward B = I + W = 2T


def test_zero_bubble_p2_m2_hand_traced():
    # Orders: device 0 F0 F1 I0 W0 I1 W1; device 1 F0 I0 F1 I1 W0 W1 (torch's ZB-1P with one chunk).
    # Device 0: F0 0–1, F1 1–2, waits, I0 3–4 (device 1's I0 ends at 3), W0 4–5, I1 5–6, W1 6–7.
    # Device 1: F0 1–2, I0 2–3, F1 3–4, I1 4–5, W0 5–6, W1 6–7. Step 7 units; 1F1B needs (m+p−1)(F+B) = 9.
    assert [f"{o.action}{o.microbatch}" for o in device_order("zero-bubble", pp=2, num_microbatches=2, device=1)] \
        == ["F0", "I0", "F1", "I1", "W0", "W1"]
    sim = simulate("zero-bubble", pp=2, num_microbatches=2, times=StageTimes.uniform(2, forward=T, backward=2 * T))
    assert sim.step_ns == 7 * T
    rows = sim.schedule.filter(pl.col("rank") == 0, pl.col("microbatch") == 0, pl.col("phase") == "backward_input")
    assert rows.select("start_ns", "end_ns").row(0) == (3 * T, 4 * T)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_bubble_is_a_third_of_1f1b(p, m):
    times = StageTimes.uniform(p, forward=T, backward=2 * T)
    zb = simulate("zero-bubble", pp=p, num_microbatches=m, times=times)
    one = simulate("1f1b", pp=p, num_microbatches=m, times=times)
    compute = m * 3 * T
    assert one.step_ns - compute == (p - 1) * (T + 2 * T)  # 1F1B: (p−1)(T_F + T_B)
    assert zb.step_ns - compute == (p - 1) * (T + T - T)  # ZB-H1: (p−1)(T_F + T_I − T_W)
    # every device holds p micro-batches at most: 1F1B's first stage's peak, on all of them
    assert zb.peak_in_flight == (p,) * p
    assert [microbatches_in_flight("zero-bubble", pp=p, stage=d, num_microbatches=m) for d in range(p)] == [p] * p


def test_zbv_p2_m4_hand_traced():
    # V placement: device 0 holds stages 0 and 3, device 1 stages 1 and 2; each op T. Traced by hand from the
    # orders (torch's ZB-V): device 1's last W ends at 25 T; every device computes 2 chunks × 4 × 3 = 24 T.
    assert stages_of_device("zbv", pp=2, device=0, virtual_stages=2) == (0, 3)
    sim = simulate("zbv", pp=2, num_microbatches=4, virtual_stages=2,
                   times=StageTimes.uniform(4, forward=T, backward=2 * T))
    assert sim.step_ns == 25 * T
    # the hand trace: device 1 waits from 17 T for stage 3's I2 (its I2 of stage 2 runs 17–18 T)
    i22 = sim.schedule.filter(pl.col("stage") == 2, pl.col("microbatch") == 2, pl.col("phase") == "backward_input")
    assert i22.select("start_ns", "end_ns").row(0) == (17 * T, 18 * T)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zbv_bubble_does_not_grow_with_m_and_memory_is_1f1b_s(p):
    # Qi et al. §6: ZB-V's bubble rate falls to zero as m grows (its idle time is the fill, independent of m) at
    # 1F1B's peak activation memory: p micro-batches' worth of the device's layers, on every device.
    times = StageTimes.uniform(2 * p, forward=T, backward=2 * T)
    idle = [simulate("zbv", pp=p, num_microbatches=m, virtual_stages=2, times=times).step_ns - 2 * m * 3 * T
            for m in (2 * p, 4 * p)]
    assert idle[0] == idle[1]
    assert [microbatches_in_flight("zbv", pp=p, stage=d, num_microbatches=4 * p, virtual_stages=2)
            for d in range(p)] == [p] * p


def test_zbv_sends_twice_the_messages_of_1f1b():
    # 1F1B: m activations and m gradients over each of the p−1 boundaries; V: 2p−1 boundaries, one of them local.
    for p, m in [(2, 4), (4, 8)]:
        assert pipeline_messages("1f1b", pp=p, num_microbatches=m) == 2 * m * (p - 1)
        assert pipeline_messages("zbv", pp=p, num_microbatches=m, virtual_stages=2) == 2 * 2 * m * (p - 1)
        assert pipeline_messages("dualpipev", pp=p, num_microbatches=m, virtual_stages=2) == 4 * m * (p - 1)


def test_looped_bfs_holds_every_microbatch_like_gpipe():
    # Breadth-first: every forward of every chunk before the first backward.
    assert warmup_forwards("looped-bfs", pp=2, num_microbatches=4, device=0, virtual_stages=2) == 8
    assert microbatches_in_flight("looped-bfs", pp=2, stage=0, num_microbatches=4, virtual_stages=2) == 4


def test_a_weight_pass_holds_the_microbatch_until_it_runs():
    # I does not free a micro-batch's activations, W does: F0 F1 I0 W0 … on device 0 of ZB-1P p=2 peaks at 2.
    order = device_order("zero-bubble", pp=2, num_microbatches=4, device=0)
    live, trace = 0, []
    for op in order:
        live += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(op.action, 0)
        trace.append(live)
    assert max(trace) == 2 == microbatches_in_flight("zero-bubble", pp=2, stage=0, num_microbatches=4)
    assert sum(op.action == BACKWARD_INPUT for op in order) == 4


def test_memory_model_on_v_places_the_logits_on_device_0():
    # On a V placement device 0 holds the first and the last stage: the output layer's parameters are there.
    model = model_preset("gpt3-13b")
    v = estimate_stage_memory(TrainingConfig(model=model, pp=4, num_microbatches=8, schedule="zbv", virtual_stages=2))
    plain = estimate_stage_memory(TrainingConfig(model=model, pp=4, num_microbatches=8, schedule="1f1b"))
    assert v[0].params == plain[3].params + plain[0].params - plain[1].params
    assert [s.in_flight for s in v] == [4.0] * 4


durations = st.lists(st.integers(min_value=1, max_value=1000), min_size=8, max_size=8)


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(["zero-bubble", "zbv", "dualpipev", "looped-bfs"]),
       p=st.integers(min_value=1, max_value=4), extra=st.integers(min_value=0, max_value=4),
       fwd=durations, bwd=durations, wgt=st.lists(st.integers(0, 4), min_size=8, max_size=8),
       p2p=st.integers(min_value=0, max_value=300), send=st.integers(min_value=0, max_value=50),
       window=st.sampled_from(["rolling", "synchronous"]))
def test_split_backward_schedules_tile_the_step(schedule, p, extra, fwd, bwd, wgt, p2p, send, window):
    v = 1 if schedule == "zero-bubble" and extra % 2 else 2
    m = 2 * p + extra if schedule == "dualpipev" else p * (1 + extra % 3)
    n = p * v
    times = StageTimes(tuple(fwd[:n]), tuple(bwd[:n]), (), tuple(fwd[:p]), (),
                       weight_ns=tuple(b * w // 4 for b, w in zip(bwd[:n], wgt[:n])))
    sim = simulate(schedule, pp=p, num_microbatches=m, times=times, virtual_stages=v,
                   costs=Costs(p2p_ns=p2p, send_ns=send), window=window)
    schema.check(sim.attribution, schema.ATTRIBUTION, "test")
    per_rank = sim.attribution.group_by("rank").agg(pl.col("ns").sum())
    assert (per_rank["ns"] == sim.step_ns).all()
    # every (stage, micro-batch) ran one forward and one backward, whole or split in I and W
    runs = sim.schedule.filter(pl.col("phase") != "optimizer").group_by("stage", "microbatch").agg(pl.col("phase"))
    assert runs.height == n * m
    for phases in runs["phase"].to_list():
        assert sorted(phases) in (["backward", "forward"], ["backward_input", "backward_weight", "forward"])
    busy = sim.schedule.sort("rank", "start_ns", "end_ns")  # a zero-length W sorts before what follows it
    overlaps = busy.with_columns(prev=pl.col("end_ns").shift().over("rank")).filter(pl.col("start_ns") < pl.col("prev"))
    assert overlaps.height == 0


def test_weight_gradient_flops_follow_qi_table_1():
    # Qi et al. 2023, Table 1, per GPT layer: F = sbh(24h + 4s), B (the input gradient, our I) = sbh(24h + 8s),
    # W = sbh·24h; b = 1 here. The last stage adds the logit projection's weight gradient, 2·s·h·V.
    from traceana.core.manifest import ModelShape
    from traceana.core import flops

    s, h, V = 64, 32, 100
    model = ModelShape("gpt", layers=3, hidden=h, heads=4, seq=s, vocab=V)
    w = flops.stage_weight_gradient_flops(model, layers=3, microbatch_size=1)
    assert w == 3 * s * h * 24 * h
    total = flops.stage_flops(model, layers=3, microbatch_size=1)
    assert total - 3 * s * h * (24 * h + 4 * s) - w == 3 * s * h * (24 * h + 8 * s)  # what is left is I
    assert flops.stage_weight_gradient_flops(model, layers=0, microbatch_size=1, last=True) == 2 * s * h * V
