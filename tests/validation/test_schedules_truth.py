"""Every torch.distributed.pipelining schedule of torch 2.13, run for real on CPU/gloo (2–4 processes, tiny GPT,
4 micro-batches, two profiled steps), checked against an independent wall-clock truth: the collector's ``--truth``
spans (``time.perf_counter_ns()`` around every compute call and every P2P call, recorded outside the profiler;
tests/schedule_truth.py reads them without traceana).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import polars as pl
import pytest

from schedule_truth import descheduled_disagreement, shares, unaccounted_ns
from traceana.core.schema import BUBBLE_CATEGORIES, COMPUTE_CATEGORIES
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

MICROBATCHES = 4
PROFILED = [1, 2]  # one warm-up iteration, then the two profiled ones (together: less noise on a loaded machine)
PROFILED_STEP = 1


@pytest.fixture(scope="module")
def collected(collected_run):
    """``collected(schedule) -> (run, analysis, truth folder)``: the session's ``pipelining-<schedule>`` run
    (tests/collected_runs.py: MICROBATCHES micro-batches of 1 sequence, two profiled steps, with the truth)."""
    from collectors.pipelining_example import truth_path

    cache: dict[str, tuple] = {}

    def get(schedule: str):
        if schedule not in cache:
            path = collected_run(f"pipelining-{schedule}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = load_run(path, cache=False)
            assert run.manifest.num_microbatches == MICROBATCHES
            cache[schedule] = (run, analyze(run), truth_path(Path(path)))
        return cache[schedule]

    return get


ALL = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
# Which backward actions each schedule runs (torch 2.13's schedules.py): full B, or its I/W halves, or both
# (ZB-V and DualPipe-V fall back to full B where the schedule has nothing to fill the bubble with).
SPLIT = {"zero-bubble": {"backward_input", "backward_weight"}, "zbv": {"backward_input", "backward_weight"},
         "dualpipev": {"backward", "backward_input", "backward_weight"}}


def share(a, rank: int, categories) -> float:
    x = a.attribution.filter((pl.col("rank") == rank) & pl.col("step").is_in(PROFILED))
    return x.filter(pl.col("category").cast(pl.String).is_in(list(categories)))["ns"].sum() / x["ns"].sum()


BLOCKED = ("p2p", *BUBBLE_CATEGORIES)


def intervals(a, rank: int, categories) -> list[tuple[int, int]]:
    seg = a.segments.filter((pl.col("rank") == rank) & pl.col("category").cast(pl.String).is_in(list(categories)))
    return seg.select("start_ns", "end_ns").rows()


@pytest.mark.parametrize("schedule", ALL)
def test_compute_and_blocked_shares_match_the_wall_clock_truth(collected, schedule):
    run, a, truth_dir = collected(schedule)
    for rank in range(run.manifest.world_size):
        truth = shares(truth_dir, rank, PROFILED)
        compute, blocked = share(a, rank, COMPUTE_CATEGORIES), share(a, rank, BLOCKED)
        # 5 points, and where the two disagree while the rank was descheduled (4 ranks on 2 cores, or a loaded
        # machine: a thread waiting for a CPU records nothing, so the trace cannot tell whose time it was), that too
        # (seen on a loaded CI machine: 0.68 against 0.73 blocked, 16 and 13 ms descheduled inside P2P posts).
        steps = a.steps.filter((pl.col("rank") == rank) & pl.col("step").is_in(PROFILED)).sort("step")
        assert steps["step"].to_list() == PROFILED
        lost = descheduled_disagreement(truth_dir, rank, PROFILED, steps.select("start_ns", "end_ns").rows(),
                                        {"compute": intervals(a, rank, COMPUTE_CATEGORIES),
                                         "blocked": intervals(a, rank, BLOCKED)})
        assert abs(compute - truth["compute"]) <= 0.05 + lost["compute"], (schedule, rank, compute, truth, lost)
        assert abs(blocked - truth["blocked"]) <= 0.05 + lost["blocked"], (schedule, rank, blocked, truth, lost)


@pytest.mark.parametrize("schedule", ALL)
def test_every_virtual_stage_and_microbatch_has_one_forward_and_one_backward(collected, schedule):
    run, a, _ = collected(schedule)
    stages_of_rank = run.manifest.stages_of_rank
    passes = a.schedule.filter(pl.col("phase") != "optimizer")
    assert set(passes["source"]) == {"annotated"}
    # Ranks holding several stages show all of them, in the schedule and in the per-rank table.
    got = passes.group_by("rank").agg(pl.col("stage").unique().sort()).sort("rank")["stage"].to_list()
    assert got == [sorted(s) for s in stages_of_rank]
    listed = dict(a.stages.select("rank", "stages").rows())
    assert all(listed[r] == ",".join(map(str, sorted(s))) for r, s in enumerate(stages_of_rank))
    per = passes.group_by("step", "stage", "microbatch").agg(pl.col("phase").sort())
    assert per.height == len(PROFILED) * run.manifest.pp * MICROBATCHES
    for phases in per["phase"].to_list():
        # a forward, then either one full backward or one input-gradient and one weight-gradient half
        assert phases in (["backward", "forward"], ["backward_input", "backward_weight", "forward"]), phases
    assert set(passes["phase"]) - {"forward"} == SPLIT.get(schedule, {"backward"})


def test_dualpipev_overlapped_spans_count_for_both_phases(collected):
    run, a, _ = collected("dualpipev")
    ev = a.events.filter(pl.col("name").cast(pl.String).str.ends_with(")OVERLAP_F_B") & (pl.col("step") == PROFILED_STEP))
    assert ev.height > 0
    # Each overlapped span gives a forward row and a backward row inside it, back to back.
    for rank, start, dur in ev.select("rank", "ts_ns", "dur_ns").rows():
        inside = a.schedule.filter((pl.col("rank") == rank) & (pl.col("start_ns") >= start)
                                   & (pl.col("end_ns") <= start + dur)).sort("start_ns")
        assert inside["phase"].to_list() == ["forward", "backward"]
        assert inside["start_ns"][0] == start and inside["end_ns"][1] == start + dur
        assert inside["end_ns"][0] == inside["start_ns"][1]
    assert share(a, 0, ("other_compute",)) < 0.05
    assert not any("cannot be told" in n for n in a.notes)


@pytest.mark.parametrize("schedule", ALL)
@pytest.mark.parametrize("with_manifest", [True, False])
def test_with_the_names_stripped_inference_recovers_single_stage_schedules_and_refuses_the_rest(
        collected, schedule, with_manifest):
    from dataclasses import replace

    from traceana.measure.analysis import strip_annotations

    run, a, _ = collected(schedule)
    stripped = analyze(replace(run, events=strip_annotations(run.events), manifest=run.manifest if with_manifest
                               else None))
    passes = stripped.schedule.filter(pl.col("phase") != "optimizer")
    if schedule in ("1f1b", "gpipe"):  # one stage per rank: the same (stage, micro-batch, phase) rows as annotated
        key = ["rank", "stage", "microbatch", "phase"]
        truth = a.schedule.filter(pl.col("phase") != "optimizer").select(key).sort(key)
        assert set(passes["source"]) == {"inferred"} and passes.select(key).sort(key).equals(truth)
    elif with_manifest and schedule in ("interleaved-1f1b", "looped-bfs"):
        # run.json names a multi-stage schedule that keeps each backward whole: the passes come from autograd's ops
        # and run.json's plan numbers them (issue 36): the same (rank, stage, micro-batch, phase) rows as torch's own
        # annotations, and every rank's forward and backward shares the annotated ones' to within 0.07
        key = ["rank", "stage", "microbatch", "phase"]
        assert set(passes["source"]) == {"autograd"}
        truth = a.schedule.filter(pl.col("phase").is_in(["forward", "backward"])
                                  & pl.col("step").is_in(passes["step"].unique().implode()))
        assert passes.select(key).sort(key).equals(truth.select(key).sort(key))
        for rank in range(run.manifest.world_size):
            for phase in ("forward", "backward"):
                assert share(stripped, rank, (phase,)) == pytest.approx(share(a, rank, (phase,)), abs=0.07), \
                    (schedule, rank, phase)
    else:  # several stages per rank (run.json, or the trace's own metadata, says so): refused, and said why
        assert passes.height == 0
        assert share(stripped, 0, ("forward", "backward", "backward_input", "backward_weight")) == 0
        assert any("several virtual stages per rank" in n and "no forward/backward is claimed" in n
                   for n in stripped.notes)


@pytest.mark.parametrize("schedule", ALL)
def test_each_rank_runs_the_order_of_the_pipeline_rules(collected, schedule):
    # What torch actually ran (the annotated passes of a profiled step, by start time) is the rules' device order.
    from traceana.core.pipeline_rules import device_order

    run, a, _ = collected(schedule)
    cfg = a.config.training_config()
    op = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
    for rank in range(run.manifest.world_size):
        ran = (a.schedule.filter((pl.col("rank") == rank) & (pl.col("step") == PROFILED_STEP)
                                 & pl.col("phase").is_in(list(op)))
               .sort("start_ns").select("phase", "stage", "microbatch").rows())
        assert [(op[p], s, mb) for p, s, mb in ran] == [tuple(o) for o in device_order(
            schedule, pp=cfg.pp, num_microbatches=MICROBATCHES, device=rank, virtual_stages=cfg.virtual_stages)]


@pytest.mark.parametrize("schedule", ["zero-bubble", "zbv", "dualpipev"])
def test_validate_replays_the_split_backward_schedules(collected, schedule):
    # The replay (simulator fed with the run's own F, B, I and W durations) runs the same passes as the run did, fed
    # every message's own transfer. How close its step lands is not judged here: on real compute, 2-4 ranks on 2
    # loaded cores wait for a CPU in ways no simulator input holds (errors of 0.36-0.50 at load 2-8); that is
    # judged on the known workload below, against the time the run itself measured it could not know.
    from traceana.validation import validate

    run, a, _ = collected(schedule)
    v = validate(a)
    # the simulator fed with the last step's own durations: the model's in-sample prediction ("replay" is the
    # what-if's word only, issue 33)
    assert v.summary["kind"] == "in_sample_prediction" and v.summary["last_step_predicted_ms"] > 0, v.summary
    # every message of the replayed step is fed its own measured transfer, keyed by the pass that sent it; as many
    # as the step's P2P pairs, and as the rules count (2m per stage boundary crossing devices)
    from traceana.core.pipeline_rules import pipeline_messages
    from traceana.validation.measurement import measure
    from traceana.validation.replay import replay_inputs

    cfg = a.config.training_config()
    _, costs = replay_inputs(a, cfg, measure(a, cfg))
    step = max(a.summary.steps)
    sent = a.p2p.filter((pl.col("step") == step) & (pl.col("channel") == "p2p")).height
    assert len(costs.per_message_ns) == sent == pipeline_messages(
        schedule, pp=cfg.pp, num_microbatches=MICROBATCHES, virtual_stages=cfg.virtual_stages)
    key = ["stage", "microbatch", "phase"]
    sim = v.simulation.schedule.filter(pl.col("phase") != "optimizer").select(key).unique().sort(key)
    ran = a.schedule.filter((pl.col("step") == PROFILED_STEP) & (pl.col("phase") != "optimizer")).select(key)
    assert sim.equals(ran.unique().sort(key).cast(sim.schema))


def test_validate_replays_a_split_backward_schedule_of_the_known_workload_within_what_the_run_could_not_know(
        collected_run):
    # ZB-V on the known workload (2 ranks × 2 stages, F 10, I 20, W 10 ms held, tests/collected_runs.py), with the
    # wall-clock truth beside it. The replay is fed the step's own pass durations and transfers, so by construction
    # what it can miss is only what no input holds: on each rank the time inside neither a compute nor a P2P call
    # (the Python between them, or the rank waiting for a CPU there), the run delay inside its P2P waits and that
    # of its other threads (gloo's socket threads move the bytes), all measured by the run itself (perf_counter and
    # schedstat, outside the trace). Every such instant on the step's path is some rank's, so their sum over ranks
    # bounds the replay's error either way; on a quiet machine it is ~14 ms of a ~365 ms step (the replay was 4.5 ms
    # off), and a loaded machine widens it by exactly what it took (8 busy loops: 69-158 ms, errors 14-49 ms).
    from collectors.pipelining_example import truth_path
    from traceana.validation import validate

    path = collected_run("pipelining-zbv-sleep")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = analyze(load_run(path, cache=False))
    v = validate(a)
    assert a.run.manifest.workload is not None and v.summary["schedule"] == "zbv"
    step_ms = v.summary["last_step_predicted_ms"] / (1 + v.summary["last_step_error"])  # the measured last step
    truth = truth_path(Path(path))
    unknown_ms = sum(unaccounted_ns(truth, rank, -1) for rank in range(a.run.manifest.world_size)) / 1e6
    # the step holds at least each device's stated passes: 2 stages × 4 micro-batches × (F + I + W)
    assert step_ms >= 2 * MICROBATCHES * (10 + 20 + 10) - 1e-3, v.summary
    assert abs(v.summary["last_step_predicted_ms"] - step_ms) <= unknown_ms, (v.summary, unknown_ms)
