"""Plan what-ifs (traceana.validation.plan.plan_whatif) that move layers between stages (--layers-per-stage), and the one
path from per-operation durations to the schedule engine (model.simulate.engine_inputs) that the plans' measured work
and estimate's modelled work both take. Expected values are worked out by hand in each docstring."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from traceana.core.errors import AnalysisError
from traceana.model.simulate import StageTimes, engine_inputs

US = 1_000.0
GPIPE_M2 = Path(__file__).parents[1] / "data" / "pipelining_memory" / "gpipe_m2"


def test_engine_inputs_by_hand():
    """Two stages on two devices. Measured: stage 0's forwards 100 and 300 µs (mean 200: both kept, they differ from
    it), its backwards 400 and 400 µs (equal: 400 exactly, none kept); stage 1 F 50 µs for every micro-batch
    (modelled, micro-batch None) and B 100; one activation message of 7 µs and one of 9 µs, a gradient of 9 µs
    (median, the upper of three: 9; only the 7 µs one differs from it and is kept). The same work on one device's
    two chunks (interleaved: stages 0 and 1 both on device 0 would be a placement of 2 stages for a plan of 4) is
    summed per device: device 0 holds stage 0 (F 200, B 400), device 1 stage 1 (F 50, B 100), and nothing single is
    kept."""
    work = {("F", 0, 0): 100 * US, ("F", 0, 1): 300 * US, ("B", 0, 0): 400 * US, ("B", 0, 1): 400 * US,
            ("F", 1, None): 50 * US, ("B", 1, None): 100 * US}
    msgs = {("F", 0, 0): 7 * US, ("F", 0, 1): 9 * US, ("B", 1, 0): 9 * US}
    t, c = engine_inputs(work, device_of_work=(0, 1), stages=2, messages=msgs, optimizer_ns=(5 * US, 6 * US))
    assert t.forward_ns == (200 * US, 50 * US) and t.backward_ns == (400 * US, 100 * US)
    assert t.per_op_ns == {("F", 0, 0): 100 * US, ("F", 0, 1): 300 * US}
    assert t.weight_ns == () and t.recompute_ns == () and t.optimizer_ns == (5 * US, 6 * US)
    assert c.p2p_ns == 9 * US and c.per_message_ns == {("F", 0, 0): 7 * US}
    # a split backward: B = I + W, W its weight part
    t, _ = engine_inputs({("F", 0, None): 1.0, ("I", 0, None): 2.0, ("W", 0, None): 3.0}, device_of_work=(0,),
                         stages=1)
    assert t.backward_ns == (5.0,) and t.weight_ns == (3.0,)
    # another placement: per device, the simulator splits it over the chunks
    t, c = engine_inputs(work, device_of_work=(0, 1), stages=4, messages=msgs)
    assert t.forward_ns == (200 * US, 50 * US) and t.per_op_ns is None and c.per_message_ns is None


def test_estimate_feeds_the_same_path():
    """estimate's modelled step (model.bpipe.estimate_step) goes through engine_inputs: its StageTimes are the
    modelled work per device (F = 1/3 of the stage's FLOPs at the rate, B = 2/3, every micro-batch alike: no single
    operation kept), and its step is the engine's on them. By hand, GPipe of p = 4 stages and m = 8 micro-batches
    with free messages, stages 0-2 at F = f, B = 2f and the last (which holds the head) at f3, 2 f3 > f: the
    forwards take ΣF + (m − 1) max F = 3f + 8 f3, the backwards ΣB + (m − 1) max B = 6f + 16 f3: 9f + 24 f3."""
    from traceana.core.manifest import ModelShape
    from traceana.core import flops
    from traceana.model.bpipe import EfficiencyCurve, Network, estimate_step, stage_times
    from traceana.core.training_config import TrainingConfig

    shape = ModelShape("gpt", layers=8, hidden=64, heads=4, vocab=64, seq=16, name="t")
    cfg = TrainingConfig(model=shape, pp=4, num_microbatches=8, schedule="gpipe")
    rate = 0.5e12 / 1e9  # FLOP per ns
    t, _ = stage_times(cfg, peak_flops=1e12, efficiency=0.5)
    f = flops.stage_flops(shape, layers=2, microbatch_size=1, last=False) / 3 / rate
    f3 = flops.stage_flops(shape, layers=2, microbatch_size=1, last=True) / 3 / rate
    assert t.forward_ns == pytest.approx((f, f, f, f3)) and t.backward_ns == pytest.approx((2 * f, 2 * f, 2 * f,
                                                                                            2 * f3))
    assert t.per_op_ns is None and f3 > f
    est = estimate_step(cfg, device=None, curve=EfficiencyCurve(points=((1, 0.5),)),
                        network=Network(p2p_bytes_per_s=float("inf")), peak_flops=1e12)
    assert est.step_s * 1e9 == pytest.approx(9 * f + 24 * f3, abs=1)  # the step is whole nanoseconds


def test_layers_moved_between_stages_by_hand(tmp_path):
    """GPipe, pp 2, m 4, the 4-layer model split 2 / 2 (run.json gives no split: the rules' even one). Stage 0's
    forwards take 100 µs, backwards 200; stage 1's 300 and 600 (a run made by the simulator: its timeline is known).
    By hand, GPipe with the slower stage last takes F0 + m F1 + B0 + m B1 = 100 + 1,200 + 200 + 2,400 = 3,900 µs.

    --layers-per-stage 3,1 scales each stage's work by its layer count: stage 0 × 3/2 (F 150, B 300), stage 1 × 1/2
    (F 150, B 300): a uniform GPipe, (m + p − 1)(F + B) = 5 × 450 = 2,250 µs, 3,900 / 2,250 = 1.733× the speed; each
    stage busy 4 × 450 = 1,800 of 2,250 µs: bubble share 20 %. 1,3: stage 0 F 50, B 100, stage 1 F 450, B 900:
    50 + 1,800 + 100 + 3,600 = 5,550 µs. Memory: the same 4 micro-batches in flight on each stage (GPipe), each
    micro-batch's activations by the model's ratio of 3 blocks (+ the embedding) to 2 on stage 0: more, but less
    than 3/2; 1 block (+ the head) to 2 on stage 1: less, but more than 1/2. A split with a stage of no layers or
    counts that do not sum to the model's 4 are refused, as collect refuses a model it cannot split."""
    from test_validate import fake_analysis

    from traceana.validation.plan import plan_whatif

    times = StageTimes(forward_ns=(100 * US, 300 * US), backward_ns=(200 * US, 600 * US))
    act = [4_000_000, 4_000_000]
    a = fake_analysis(tmp_path, schedule="gpipe", pp=2, m=4, times=times, act_bytes=act)
    same = plan_whatif(a, layers_per_stage=(2, 2))
    assert same["simulated_as_run_ms"] == pytest.approx(3.9) and same["predicted_step_ms"] == pytest.approx(3.9)
    assert same["plan"]["layers_per_stage"] == [2, 2] and not any("layers moved" in n for n in same["notes"])
    moved = plan_whatif(a, layers_per_stage=(3, 1))
    assert moved["predicted_step_ms"] == pytest.approx(2.25) and moved["speedup"] == pytest.approx(3.9 / 2.25)
    assert moved["plan"]["layers_per_stage"] == [3, 1] and moved["as_run"]["layers_per_stage"] == [2, 2]
    assert moved["bubble_fraction"] == pytest.approx({0: 0.2, 1: 0.2})
    assert any("layers moved" in n and "2,2 → 3,1" in n and "assumption" in n for n in moved["notes"])
    # a run without layer spans (PP:0F0/L1): the scaling, and the output says so and why
    assert moved["layers_source"] == "scaled by layer count" and same["layers_source"] is None
    assert any("assumption" in n and "per-layer work is not measured" in n for n in moved["notes"])
    was, now = same["memory_bytes"], moved["memory_bytes"]
    assert was[0] < now[0] < 1.5 * was[0] and 0.5 * was[1] < now[1] < was[1]
    assert plan_whatif(a, layers_per_stage=(1, 3))["predicted_step_ms"] == pytest.approx(5.55)
    with pytest.raises(AnalysisError, match="stage 1 would hold 0 layers"):
        plan_whatif(a, layers_per_stage=(4, 0))
    with pytest.raises(AnalysisError, match="must be 2 counts \(one a device\) summing to the model.s 4 layers"):
        plan_whatif(a, layers_per_stage=(2, 1))
    # with another schedule: 1F1B of the moved layers, uniform 150 / 300: 5 × 450 µs as well
    assert plan_whatif(a, schedule="1f1b", layers_per_stage=(3, 1))["predicted_step_ms"] == pytest.approx(2.25)


def test_layers_moved_on_a_real_run():
    """tests/data/pipelining_memory/gpipe_m2: torch.distributed.pipelining's GPipe, pp 3, m 2, tiny-gpt's 8 layers
    split 3 / 3 / 2 (the rules' even split); the what-if names stage 0 (embedding + 3 blocks) as what holds the step
    back. The run's own split is no change (the plan is the run on the engine). 2,3,3 takes a block off stage 0 and
    puts one on stage 2: shorter than the run on the engine, and no shorter than any stage's own work under the
    plan (stage 0's measured passes × 2/3, stage 2's × 3/2, from the annotated spans themselves, which bound the
    step from below since a stage runs its passes one at a time). Memory: stage 0 holds less, stage 2 more, stage 1
    as much. Refusals through the command: one line, exit 2."""
    import polars as pl

    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.validation.plan import plan_whatif

    a = load_and_analyze(str(GPIPE_M2), progress=False, cache=False)
    same = plan_whatif(a, layers_per_stage=(3, 3, 2))
    assert same["predicted_step_ms"] == pytest.approx(same["simulated_as_run_ms"])
    p = plan_whatif(a, layers_per_stage=(2, 3, 3))
    assert p["predicted_step_ms"] < p["simulated_as_run_ms"] and p["speedup"] > 1
    lo, hi = p["interval_ms"]
    assert lo <= p["predicted_step_ms"] <= hi
    spans = (a.schedule.filter(pl.col("phase").is_in(["forward", "backward"]))
             .group_by("step", "stage").agg((pl.col("end_ns") - pl.col("start_ns")).sum().alias("ns")))
    scale = {0: 2 / 3, 1: 1.0, 2: 3 / 2}
    busiest = max(ns * scale[st] for _, st, ns in spans.iter_rows()) / 1e6
    assert p["predicted_step_ms"] >= busiest
    assert set(p["bubble_fraction"]) == {0, 1, 2} and all(0 <= x < 1 for x in p["bubble_fraction"].values())
    was, now = same["memory_bytes"], p["memory_bytes"]
    assert now[0] < was[0] and now[2] > was[2] and now[1] == pytest.approx(was[1])
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "traceana", "whatif", str(GPIPE_M2), "--no-cache", "--layers-per-stage"]
    for bad, why in (("8,0,0", "stage 1 would hold 0 layers"), ("4,4", "must be 3 counts"),
                     ("2,x,3", "not a comma-separated list")):
        r = subprocess.run([*cmd, bad], capture_output=True, text=True, env=env)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
