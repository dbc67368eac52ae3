"""The paper's estimation method: compute efficiency measured from traced runs (Huang et al. 2024) and the curve
built from two of them."""

from __future__ import annotations

import pytest
from test_attribution import two_stage_cpu

from traceana.core.errors import AnalysisError
from traceana.core.manifest import Manifest, ModelShape
from traceana.measure.analysis import analyze
from traceana.model.bpipe import EfficiencyCurve
from traceana.validation import measured_efficiency

SHAPE = ModelShape(family="gpt", layers=2, hidden=64, heads=4, vocab=256, seq=64)


def _run(**kw):
    m = Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), model=SHAPE, microbatch_size=1, num_microbatches=1,
                 attention="naive", **kw)
    return analyze(two_stage_cpu().run(m))


def test_efficiency_is_model_flops_over_compute_time_times_peak():
    # By hand (Narayanan et al. 2021 §5.1): one GPT layer's forward is 24·b·s·h² + 4·b·s²·h = 6,291,456 + 1,048,576
    # FLOPs (b=1, s=64, h=64), training 3× that: 22,020,096 per stage; the last stage adds the logits, 3·2·b·s·h·V =
    # 6,291,456. Compute time (two_stage_cpu): the annotated F and B windows, in which nothing waits (the
    # blocked-or-computing rule, docs/schedules.md): rank 0 forward 20 + backward 20 µs, rank 1 14 + 20 µs = 74 µs.
    flops = 2 * 22_020_096 + 6_291_456
    b, attention, e = measured_efficiency(_run(), peak_flops=1e12)
    assert (b, attention) == (1, "naive")
    assert e == pytest.approx(flops / (74e-6 * 1e12), rel=1e-9)


def test_efficiency_needs_a_peak():
    with pytest.raises(AnalysisError, match="peak FLOP/s"):
        measured_efficiency(_run())
    assert measured_efficiency(_run(peak_flops=2e12))[2] == pytest.approx(measured_efficiency(_run(), peak_flops=2e12)[2])


def test_a_curve_from_two_runs_interpolates_between_them_and_splits_by_attention():
    curve = EfficiencyCurve.measured([(1, "naive", 0.2), (4, "naive", 0.4)], source="runs")
    assert curve.at(2, seq=64) == pytest.approx(0.3)  # linear in log2(b): halfway from 1 to 4
    both = EfficiencyCurve.measured([(1, "naive", 0.2), (1, "sdpa", 0.5)], source="runs")
    assert both.at(1, seq=64, attention="naive") == 0.2 and both.at(1, seq=64, attention="sdpa") == 0.5
