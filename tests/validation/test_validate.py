"""Validation joins model and measurement: a run made by the simulator validates against itself exactly."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pytest

from traceana.core import schema
from traceana.core.manifest import Manifest, ModelShape
from traceana.core.training_config import FP32_ADAM, TrainingConfig
from traceana.ingest import Run
from traceana.measure.analysis import Analysis
from traceana.measure.p2p import P2P_EXTRA
from traceana.model.memory import activation_peak_estimate
from traceana.model.simulate import StageTimes, simulate
from traceana.validation import cross_run, validate

TINY = ModelShape("gpt", layers=4, hidden=32, heads=4, vocab=64, seq=16, name="tiny")


def fake_analysis(tmp: Path, *, schedule: str, pp: int, m: int, times: StageTimes, recompute: str = "none",
                  steps: int = 2, act_bytes: list[int] | None = None) -> Analysis:
    """An Analysis whose tables are what the simulator says: a run with known truth."""
    manifest = Manifest(world_size=pp, pp=pp, stage_of_rank=tuple(range(pp)), schedule=schedule, microbatch_size=1,
                        num_microbatches=m, model=TINY, dtype="float32", attention="sdpa", recompute=recompute)
    scheds, atts = [], []
    for k in range(steps):
        sim = simulate(schedule, pp=pp, num_microbatches=m, times=times, step=k)
        scheds.append(sim.schedule)
        atts.append(sim.attribution)
    empty_events = schema.empty(schema.EVENTS)
    run = Run(path=tmp, events=empty_events, memory=schema.empty(schema.MEMORY), traces=schema.empty(schema.TRACES),
              manifest=manifest)
    mem = pl.DataFrame(
        {"rank": [r for r in range(pp) for _ in range(steps)], "stage": [r for r in range(pp) for _ in range(steps)],
         "step": [k for _ in range(pp) for k in range(steps)], "baseline_bytes": [0] * (pp * steps),
         "peak_bytes": [b for b in (act_bytes or [0] * pp) for _ in range(steps)],
         "activation_peak_bytes": [b for b in (act_bytes or [0] * pp) for _ in range(steps)]},
        schema=schema.STAGE_MEMORY)
    stages = pl.DataFrame({"rank": list(range(pp)), "stage": list(range(pp))}, schema={"rank": pl.Int32,
                                                                                       "stage": pl.Int32})
    return Analysis(
        run=run, steps=schema.empty(schema.STEPS), p2p=schema.empty({**schema.P2P, **P2P_EXTRA}),
        schedule=pl.concat(scheds), attribution=pl.concat(atts), stage_memory=mem, stages=stages,
        clock_offsets=pl.DataFrame(),
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_simulated_run_validates_against_itself(tmp_path, schedule):
    times = StageTimes(forward_ns=(100e3, 120e3, 90e3), backward_ns=(200e3, 250e3, 180e3),
                       recompute_ns=(0, 0, 0), optimizer_ns=(50e3, 60e3, 40e3), host_ns=(10e3, 5e3, 20e3))
    a = fake_analysis(tmp_path, schedule=schedule, pp=3, m=6, times=times)
    v = validate(a)
    assert v.summary["step_error"] == pytest.approx(0, abs=1e-6)
    assert v.per_stage["step_error"].abs().max() == pytest.approx(0, abs=1e-6)
    assert v.per_stage["blocked_error"].abs().max() == pytest.approx(0, abs=1e-6)
    assert v.summary["steps_used"] == 1  # the first of two steps is dropped as warm-up


def test_cross_run_predicts_dropping_recompute(tmp_path):
    with_rc = StageTimes.uniform(2, forward=100e3, backward=200e3, recompute=100e3)
    without = StageTimes.uniform(2, forward=100e3, backward=200e3)
    base = fake_analysis(tmp_path, schedule="1f1b", pp=2, m=4, times=with_rc, recompute="full")
    target = fake_analysis(tmp_path, schedule="1f1b", pp=2, m=4, times=without)
    out = cross_run(base, target)
    assert out["error"] == pytest.approx(0, abs=1e-6)
    assert out["measured_speedup"] == pytest.approx(out["predicted_speedup"])
    assert out["predicted_speedup"] == pytest.approx(5 * 400 / (5 * 300))


def test_memory_error_against_the_models_own_estimate(tmp_path):
    # what RunConfig.training_config makes of the reference trainer's CPU run: eager PyTorch, no dropout, fp32 Adam
    cfg = TrainingConfig(model=TINY, pp=2, microbatch_size=1, num_microbatches=4, precision=FP32_ADAM, dropout=False,
                         eager=True)
    est = activation_peak_estimate(cfg)
    measured = [int(e * 1.1) for e in est]  # the "run" used 10% more than the model says
    a = fake_analysis(tmp_path, schedule="1f1b", pp=2, m=4, times=StageTimes.uniform(2, forward=1e5, backward=2e5),
                      act_bytes=measured)
    v = validate(a)
    assert v.per_stage["memory_error"].to_list() == pytest.approx([1 / 1.1 - 1] * 2, rel=1e-3)


def test_bpipe_verdict_from_a_measured_run_with_recompute(tmp_path):
    from traceana.validation import bpipe_verdict_from_run

    base = fake_analysis(tmp_path, schedule="1f1b", pp=2, m=4, recompute="full",
                         times=StageTimes.uniform(2, forward=100e3, backward=200e3, recompute=100e3))
    # as configured: BPipe added, recompute kept. pp = 2 holds 2 + 1 micro-batches: the balanced level ⌈3/2⌉ = 2
    # evicts nothing, so nothing changes, and the verdict says so instead of naming a term
    same = bpipe_verdict_from_run(base, bpipe_ns=2e6)
    assert same.baseline == "as-configured" and same.speedup == pytest.approx(1.0)
    assert same.deciding_term == "no change" and "evicts nothing" in same.sentence
    # the BPipe paper's comparison: full recompute against BPipe without it; each of the (4 + 1) 1F1B slots on the
    # critical path loses its 100 µs recompute: 5·400 → 5·300
    v = bpipe_verdict_from_run(base, bpipe_ns=0.0, policy="full-recompute")
    assert v.helps and v.speedup == pytest.approx(5 * 400 / (5 * 300))
    assert v.deciding_term == "recompute" and v.deltas["recompute"] == pytest.approx(-4 * 100e3 / 1e9)
    assert "would help" in v.sentence and "full-recompute" in v.sentence
    deep = fake_analysis(tmp_path, schedule="1f1b", pp=4, m=8, recompute="full",
                         times=StageTimes.uniform(4, forward=100e3, backward=200e3, recompute=100e3))
    fast = bpipe_verdict_from_run(deep, bpipe_ns=0.0, policy="full-recompute")
    slow = bpipe_verdict_from_run(deep, bpipe_ns=2e6, policy="full-recompute")
    assert slow.speedup < fast.speedup and slow.deltas["transfer"] > 0
    # the transfer time at which the verdict flips: between the free one (helps) and 2 ms (does not), and it is the
    # turning point: a little below it BPipe still helps, a little above it no longer
    assert fast.helps and not slow.helps
    flip = fast.flips["bpipe_transfer_ns"]
    assert 0 < flip < 2e6 and "would flip at a BPipe transfer" in fast.sentence
    assert bpipe_verdict_from_run(deep, bpipe_ns=flip / 1.3, policy="full-recompute").helps
    assert not bpipe_verdict_from_run(deep, bpipe_ns=flip * 1.3, policy="full-recompute").helps


def test_bpipe_verdict_has_no_cancelling_terms(tmp_path):
    # The demo's case: pp = 4, m = 8, BPipe added to the run as it is. With free transfers the BPipe schedule runs
    # exactly like the plain one (same order, same durations), so compute, recompute and bubble cannot change; all
    # of the change is the transfers', and it is not printed as "transfer +x, bubble −x".
    from traceana.validation import bpipe_verdict_from_run

    run = fake_analysis(tmp_path, schedule="1f1b", pp=4, m=8,
                        times=StageTimes.uniform(4, forward=100e3, backward=200e3))
    for cost in (0.0, 50e3, 2e6):
        v = bpipe_verdict_from_run(run, bpipe_ns=cost)
        assert v.deltas["bubble"] == pytest.approx(0, abs=1e-9)
        assert v.deltas["compute"] == pytest.approx(0, abs=1e-9)
        assert sum(v.deltas.values()) == pytest.approx(v.with_bpipe.step_s - v.reference.step_s, abs=1e-9)
        assert "bubble" not in v.sentence
        if v.deciding_term != "no change":
            assert v.deciding_term == "bandwidth" and v.speedup < 1
    assert bpipe_verdict_from_run(run, bpipe_ns=0.0).deciding_term == "no change"
    assert bpipe_verdict_from_run(run, bpipe_ns=2e6).deciding_term == "bandwidth"


def test_cross_run_is_a_prediction_with_a_noise_floor(tmp_path):
    times = StageTimes.uniform(2, forward=100e3, backward=200e3)
    a = fake_analysis(tmp_path / "a", schedule="1f1b", pp=2, m=4, times=times)
    b = fake_analysis(tmp_path / "b", schedule="gpipe", pp=2, m=4, times=times)
    slower = fake_analysis(tmp_path / "slower", schedule="1f1b", pp=2, m=4,
                           times=StageTimes.uniform(2, forward=110e3, backward=220e3))
    out = cross_run(a, b, repeat=(a, slower))
    assert out["kind"] == "prediction"
    assert out["noise_floor"] == pytest.approx(0.1 / 1.05)  # the same run 10 % slower: |1.1 − 1| / 1.05
    # the simulator fed with a run's own durations is the model's in-sample prediction ("replay" is the what-if's
    # word only, issue 33): the key says so
    assert validate(a).summary["kind"] == "in_sample_prediction"


def test_cross_run_measured_change_comes_from_runs_not_steps(tmp_path):
    """The measured change's interval comes from the runs of each side (traceana.measure.noise): with one run of the
    target the between-run noise is unknown whatever the baseline's repeats, and with two runs a side, paired by round,
    the interval is Student's t on the per-round log ratios (issue 33: one run's steps said nothing about the next run).
    Uniform stages: GPipe and 1F1B both take (m + p − 1)(f + b), so the model predicts no change."""
    t = lambda k: StageTimes.uniform(2, forward=100e3 * k, backward=200e3 * k)  # noqa: E731
    a = fake_analysis(tmp_path / "a", schedule="1f1b", pp=2, m=4, times=t(1.0), steps=3)
    b = fake_analysis(tmp_path / "b", schedule="gpipe", pp=2, m=4, times=t(1.0), steps=3)
    a2 = fake_analysis(tmp_path / "a2", schedule="1f1b", pp=2, m=4, steps=3, times=t(1.1))
    b2 = fake_analysis(tmp_path / "b2", schedule="gpipe", pp=2, m=4, steps=3, times=t(1.2))
    out = cross_run(a, b, repeat=(a2,))
    assert out["noise_runs"] == [2, 1] and out["within_noise"] is None and out["prediction_within_noise"] is None
    assert "repeat to tell" in out["measured_change_words"] and "cannot judge" in out["prediction_words"]
    # base side √(1 · 1.1), target 1: the one statistic everywhere, and the speed-up is 1/(1 + change)
    assert out["step_change"] == pytest.approx(1 / math.sqrt(1.1) - 1)
    assert out["measured_speedup"] == pytest.approx(1 / (1 + out["step_change"]))
    assert out["measured_step_ms"] / out["baseline_step_ms"] == pytest.approx(1 + out["step_change"])
    # two rounds: log ratios 0 and ln(1.2/1.1); mean m = ln(1.2/1.1)/2, sd = ln(1.2/1.1)/√2, se = sd/√2 = m,
    # t(1) = 12.706: m ± 12.706 m holds 0 — within noise, and the model's 0 lies inside
    both = cross_run(a, b, repeat=(a2, b2))
    m = math.log(1.2 / 1.1) / 2
    assert both["paired"] is True and both["noise_runs"] == [2, 2]
    assert both["step_change_low"] == pytest.approx(math.exp(m - 12.706 * m) - 1, abs=1e-4)
    assert both["within_noise"] is True and both["prediction_within_noise"] is True and both["agree"] is None
    # the same run given again on a side counts once, with a word
    again = cross_run(a, b, repeat=(a,))
    assert again["noise_runs"] == [1, 1] and any("counted once" in n for n in again["counted_once"])


def test_bpipe_verdict_needs_plain_1f1b(tmp_path):
    from traceana.core.errors import AnalysisError
    from traceana.validation import bpipe_verdict_from_run

    g = fake_analysis(tmp_path, schedule="gpipe", pp=2, m=4, times=StageTimes.uniform(2, forward=1e5, backward=2e5))
    with pytest.raises(AnalysisError):
        bpipe_verdict_from_run(g)


@pytest.mark.parametrize("host_cpus, noted", [(2, True), (4, False), (None, False)])
def test_validate_says_when_cpu_ranks_shared_cores(tmp_path, host_cpus, noted):
    """4 CPU ranks on 2 cores cannot all compute at once (hand reasoning: at most 2 run, so a one-device-per-stage
    simulator can be up to 4/2 = 2× short); on 4 cores, or with no host facts, there is nothing to say."""
    import dataclasses

    times = StageTimes(forward_ns=(100e3,) * 4, backward_ns=(200e3,) * 4, recompute_ns=(0,) * 4,
                       optimizer_ns=(50e3,) * 4, host_ns=(10e3,) * 4)
    a = fake_analysis(tmp_path, schedule="1f1b", pp=4, m=4, times=times)
    run = dataclasses.replace(a.run, manifest=dataclasses.replace(
        a.run.manifest, host_cpus=host_cpus, ranks_per_host=None if host_cpus is None else 4))
    notes = [n for n in validate(dataclasses.replace(a, run=run)).notes if "shared" in n]
    assert notes == (["4 CPU ranks shared 2 cores on one host: they could not all compute at once, which the "
                      "simulator (one device per stage) does not model, so its steps can be up to 2.0× too short "
                      "here; an error of that size is the machine, not the model"] if noted else [])


def test_validate_simulates_the_traces_schedule_and_micro_batches_not_a_contradicting_run_json(collected_run, tmp_path):
    """run.json saying gpipe and 2 micro-batches on a 1F1B run of 4: validate simulates what the traces show and
    says so — the same replay as with the true run.json (issue 13: it simulated the wrong schedule silently)."""
    import json
    import shutil

    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.validation import validate

    src = collected_run("1f1b")
    d = tmp_path / "run"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns(".traceana"))
    m = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({**m, "schedule": "gpipe", "num_microbatches": 2}))
    truth = validate(load_and_analyze(src, cache=False))
    v = validate(load_and_analyze(d, cache=False))
    assert (v.summary["schedule"], v.summary["microbatches"]) == ("1f1b", 4)
    assert v.summary["simulated_step_ms"] == truth.summary["simulated_step_ms"]
    assert any("simulated as the traces show it: schedule 1f1b, 4 micro-batches (run.json says gpipe, 2)" in n
               for n in v.notes)


def test_repeated_comparison_headline_agrees_or_says_the_machine_changed(tmp_path):
    from traceana.validation.prediction import repeated_comparison

    times = StageTimes.uniform(2, forward=100e3, backward=200e3)
    def runs(name, t, n=2):
        return [fake_analysis(tmp_path / f"{name}{k}", schedule="1f1b", pp=2, m=4, times=t, steps=3) for k in range(n)]
    base = runs("a", times)
    same = repeated_comparison(base, runs("b", times))
    # identical runs are one run given twice (the same measured steps): counted once, so the noise is unknown and
    # the model is not judged
    assert same["baseline"]["runs"] == 1 and same["agree"] is None and "repeat to tell" in same["headline"]
    assert same["step_change"] == 0 and same["counted_once"]
    # every operation twice as long in the second configuration's runs: a measured +100 % the model (same
    # configuration: no change) cannot predict, and forward+backward per micro-batch 2× says it was the machine
    # (two rounds whose runs differ by 1 %: the ratio 2 in both, beyond the noise)
    def scaled(name, k):
        return [fake_analysis(tmp_path / f"{name}{i}", schedule="1f1b", pp=2, m=4, steps=3,
                              times=StageTimes.uniform(2, forward=100e3 * k * r, backward=200e3 * k * r))
                for i, r in enumerate((1.0, 1.01))]
    slow = repeated_comparison(scaled("p", 1), scaled("c", 2))
    assert slow["within_noise"] is False and slow["agree"] is False and slow["step_change"] == pytest.approx(1.0)
    assert slow["compute_ratio"] == pytest.approx(2.0) and "the machine changed speed" in slow["headline"]
    assert slow["headline"].startswith("step time +100.0% (speed-up 0.500×), beyond the noise: slower")


def test_cross_run_between_plans_is_the_baselines_measured_whatif(tmp_path):
    # two runs that differ only in their micro-batch count: the prediction is the baseline's measured what-if
    # (plan.plan_whatif). By hand, uniform 1F1B takes (m + p − 1)(f + b): 5 × 300 µs at m=4, 9 × 300 µs at m=8
    from traceana.validation.plan import plan_whatif

    times = StageTimes.uniform(2, forward=100e3, backward=200e3)
    a = fake_analysis(tmp_path / "a", schedule="1f1b", pp=2, m=4, times=times, steps=3)
    b = fake_analysis(tmp_path / "b", schedule="1f1b", pp=2, m=8, times=times, steps=3)
    out = cross_run(a, b)
    assert out["kind"] == "prediction" and out["measured_whatif"] is True and "what-if" in out["method"]
    assert out["predicted_step_ms"] == pytest.approx(2.7) and out["measured_step_ms"] == pytest.approx(2.7)
    assert out["predicted_step_ms"] == pytest.approx(plan_whatif(a, microbatches=8)["predicted_step_ms"])
    # the measured change beside it: +80 %, with one run a side the between-run noise unknown (no verdict)
    assert out["step_change"] == pytest.approx(0.8) and out["prediction_within_noise"] is None
    # a change a plan what-if cannot make (recompute): the model with the target's whole configuration
    c = fake_analysis(tmp_path / "c", schedule="1f1b", pp=2, m=4, times=times, recompute="full")
    assert cross_run(a, c)["measured_whatif"] is False


def test_the_demo_results_say_a_change_beyond_the_noise_plainly(tmp_path):
    """The demo's result lines (reports.demo_command.results) from two rounds whose second configuration's passes
    take twice as long in both (hand reasoning: the ratio 2 in each round, no spread between rounds): memory first,
    the bubbles, each side's runs, then the step time said to be beyond the noise, with the model against it."""
    from reports.demo_command import results
    from traceana.validation.prediction import repeated_comparison

    def runs(name, k):
        return [fake_analysis(tmp_path / f"{name}{i}", schedule="1f1b", pp=2, m=4, steps=3, act_bytes=[2**20, 2**19],
                              times=StageTimes.uniform(2, forward=100e3 * k * r, backward=200e3 * k * r))
                for i, r in enumerate((1.0, 1.01))]
    lines = results(repeated_comparison(runs("a", 1), runs("b", 2)), rounds=2)
    assert lines[0] == ("BPipe: largest stage's activation peak 1.00 MiB without, 1.00 MiB with (+0%), the same in "
                        "each of the 2 rounds")
    assert lines[1].startswith("bubble (warm-up + stall + cool-down)")
    assert lines[2].startswith("  baseline  2 runs, step") and lines[3].startswith("  bpipe     2 runs, step")
    assert lines[4].startswith("step time, geometric mean of runs:")
    assert "step time +100.0% (speed-up 0.500×), beyond the noise: slower" in lines[4]
    assert "the machine changed speed" in lines[4]  # the model predicts no change; the work itself took 2×
