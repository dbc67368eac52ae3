"""The known workload (``traceana collect --work sleep``, docs/known-workload.md): its flags, run.json's record, and
its own truth — the durations it was told, the perf_counter spans it records outside the trace (RUN/workload/), and
the analytic step of GPipe, (m − 1)·max F + ΣF + (m − 1)·max B + ΣB (Huang et al. 2019; (m + p − 1)(F + B)
when the stages are equal).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import statistics
import sys
import time

import pytest

from collect_refusal import assert_collect_refused
from collected_runs import RUNS
from schedule_truth import waited_between_holds_ms
from traceana.core.errors import BadInputError
from traceana.core.manifest import Manifest, Workload

# ---- flags and run.json: no processes ------------------------------------------------------------------------------
SLEEP = ["--work", "sleep", "--forward-ms", "20", "--backward-ms", "40"]


@pytest.mark.parametrize("argv, says", [
    (["--forward-ms", "20"], "--forward-ms describes the known workload"),
    (["--work", "compute", "--slow-stage", "1:2"], "add --work sleep"),
    (["--work", "sleep", "--forward-ms", "20"], "--work sleep needs --backward-ms"),
    (["--work", "sleep"], "needs --forward-ms and --backward-ms"),
    (["--work", "sleep", "--forward-ms", "-1", "--backward-ms", "4"], "--forward-ms must be a number of milliseconds"),
    ([*SLEEP, "--weight-ms", "nan"], "--weight-ms must be"),
    ([*SLEEP, "--slow-stage", "1:0"], "the factor must be more than 0"),
    ([*SLEEP, "--slow-stage", "1:-2"], "the factor must be more than 0"),
    ([*SLEEP, "--slow-stage", "2"], "is not INDEX:FACTOR"),
    ([*SLEEP, "--slow-stage", "4:2"], "--slow-stage 4 names no stage: this run has 4 stages"),
    ([*SLEEP, "--slow-rank", "4:2"], "--slow-rank 4 names no rank: this run has 4 ranks"),
    ([*SLEEP, "--slow-rank", "1:2", "--slow-rank", "1:3"], "names 1 twice"),
    # torch.distributed.pipelining's schedules: --pp stages on --pp/2 ranks
    ([*SLEEP, "--schedule", "zbv", "--pp", "4", "--slow-rank", "2:2"], "--slow-rank 2 names no rank: this run has 2"),
    ([*SLEEP, "--schedule", "interleaved-1f1b", "--pp", "4", "--slow-stage", "4:2"], "names no stage"),
])
def test_a_bad_workload_flag_is_one_line_and_exit_2_before_anything_is_written(argv, says, tmp_path, capsys):
    assert_collect_refused(argv, says, tmp_path, capsys)


def test_run_json_records_the_workload_in_typed_fields_and_refuses_a_bad_one():
    w = Workload("sleep", 20, 40, 5, slow_stages=[[1, 2]], slow_ranks=[[3, 0.5]])
    m = Manifest(world_size=4, pp=4, schedule="1f1b", workload=w)
    data = json.loads(m.to_json())
    assert data["workload"] == {"kind": "sleep", "forward_ms": 20.0, "backward_ms": 40.0, "weight_ms": 5.0,
                                "slow_stages": [[1, 2.0]], "slow_ranks": [[3, 0.5]], "slow_layers": [],
                                "spans": "workload", "layer_holds": None}
    assert Manifest.from_dict(data) == m
    # the reference trainer's run says how a pass's hold maps to the stage's blocks (split evenly over them)
    even = Manifest(world_size=4, pp=4, schedule="1f1b", workload=Workload("sleep", 20, 40, layer_holds="even"))
    assert Manifest.from_dict(json.loads(even.to_json())).workload.layer_holds == "even"
    # by hand: stage 1 on rank 3 holds 2 × 0.5 = 1 × the stated times; a full backward is B + W
    assert w.held_ms("F", stage=1, rank=3) == 20 and w.held_ms("B", stage=1, rank=0) == 90
    assert w.held_ms("I", stage=0, rank=3) == 20 and w.held_ms("W", stage=2, rank=2) == 5
    for bad in ({"kind": "nap", "forward_ms": 1, "backward_ms": 1}, {"kind": "sleep", "forward_ms": -1,
                                                                     "backward_ms": 1},
                {"kind": "sleep", "forward_ms": 1, "backward_ms": 1, "slow_stages": [[1, 0]]},
                {"kind": "sleep", "forward_ms": 1, "backward_ms": 1, "slow_stages": [[4, 2]]},
                {"kind": "sleep", "forward_ms": 1, "backward_ms": 1, "slow_ranks": [["a", 2]]},
                {"kind": "sleep", "forward_ms": 1}, "sleep",
                {"kind": "sleep", "forward_ms": 1, "backward_ms": 1, "layer_holds": "per-block"}):
        with pytest.raises(BadInputError):
            Manifest.from_dict({**data, "workload": bad})


# ---- collected runs: the workload's own truth ----------------------------------------------------------------------
def _trace_passes(run, rank: int) -> dict[str, list[float]]:
    """The trace's PP:{s}F{mb} / PP:{s}B{mb} spans of one rank, in ms, in the order they ran (F and B)."""
    with gzip.open(run / f"rank{rank}.pt.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], m.group(1), e["dur"] / 1e3) for e in events if e.get("ph") == "X"
                   and (m := re.fullmatch(r"PP:\d+([FB])\d+", e.get("name", ""))))
    return {a: [d for _, k, d in spans if k == a] for a in "FB"}


def _held(run, manifest: Manifest, rank: int) -> dict:
    from collectors.trainer.workload import read_spans

    return read_spans(run, manifest.workload, rank)


def _calibrated_slack_ms(n: int = 30, ms: float = 1.0) -> float:
    """This machine's wake-up slack now, measured here: the most a hold of ``ms`` overran, less the time the kernel
    kept this thread waiting for a CPU (the held spans account for that delay themselves)."""
    from collectors.trainer.workload import hold_until, run_delay_ns

    worst = 0.0
    for _ in range(n):
        d0, t0 = run_delay_ns(), time.perf_counter()
        hold_until(t0 + ms / 1e3)
        worst = max(worst, (time.perf_counter() - t0) * 1e3 - ms - (run_delay_ns() - d0) / 1e6)
    return worst


@pytest.mark.slow
def test_each_pass_holds_its_stated_time_and_the_trace_shows_it(collected_run):
    run = collected_run("sleep_gpipe_pp2")
    manifest = Manifest.read(run / "run.json")
    w = RUNS["sleep_gpipe_pp2"]["workload"]
    # (the reference trainer's passes split each hold evenly over the stage's blocks, and run.json says so)
    assert manifest.workload == dataclasses.replace(w, layer_holds="even") and manifest.schedule == "gpipe"
    m, steps = RUNS["sleep_gpipe_pp2"]["num_microbatches"], RUNS["sleep_gpipe_pp2"]["steps"]
    slack, gil = 10 * _calibrated_slack_ms(), sys.getswitchinterval() * 1e3
    for rank in range(2):
        stage = rank  # pp=2, dp=1
        held = _held(run, manifest, rank)
        profiled = sorted({s["step"] for s in held["spans"]})[-steps:]
        spans = [s for s in held["spans"] if s["step"] in profiled]
        # the stated times, by hand: stage 1 slowed ×2; one F, one I and one W a micro-batch and step
        stated = {"F": 15.0 * (1 + stage), "I": 25.0 * (1 + stage), "W": 5.0 * (1 + stage)}
        for action, ms in stated.items():
            mine = [s for s in spans if s["action"] == action]
            assert sorted(s["microbatch"] for s in mine) == sorted(list(range(m)) * steps), (rank, action)
            for s in mine:
                assert s["stated_ms"] == ms
                took = (s["end_ns"] - s["start_ns"]) / 1e6
                # never shorter than stated (a deadline); longer only by the time the kernel kept the rank from
                # running (its own run-queue delay), this machine's wake-up slack, measured above, and the time
                # another thread of the rank (gloo's waiters, the profiler) may keep the interpreter before handing
                # it back (Python's switch interval)
                assert ms <= took <= ms + s["run_delay_ns"] / 1e6 + slack + gil, (rank, s, slack)
        # the trace: each forward span holds its F, each backward span its I and W (one full backward); what the
        # trace adds around them (the pass's own bookkeeping) is, where the rank gets to run, smaller than the gap
        # between any two stated durations, so a trace's pass durations tell the stated ones apart
        trace = _trace_passes(run, rank)
        by_mb = {}
        for s in sorted(spans, key=lambda s: s["start_ns"]):
            by_mb.setdefault((s["step"], s["microbatch"], "F" if s["action"] == "F" else "B"), []).append(s)
        # per pass (a backward is two holds, its I and its W): the holds' duration and the time the kernel kept the
        # rank waiting for a CPU inside them (the side spans' schedstat)
        passes = [v for _, v in sorted(by_mb.items(), key=lambda kv: kv[1][0]["start_ns"])]
        side = {a: [sum((s["end_ns"] - s["start_ns"]) / 1e6 for s in v) for v in passes
                    if (v[0]["action"] == "F") == (a == "F")] for a in "FB"}
        # (a hold is a deadline — it sleeps until its start + the stated time —, so a wait for a CPU that ends before
        # the deadline does not lengthen it: what the waiting added to a pass is at most the holds' measured excess
        # over their stated times. Seen at load 11, run 13: rank 0's backwards waited 4–16 ms inside 30 ms holds
        # that still took ~30 ms, and the trace less the whole wait read 22 ms.)
        delay = {a: [min(sum(s["run_delay_ns"] for s in v) / 1e6,
                         sum((s["end_ns"] - s["start_ns"]) / 1e6 - s["stated_ms"] for s in v)) for v in passes
                     if (v[0]["action"] == "F") == (a == "F")] for a in "FB"}
        everything = {15.0, 30.0, 25.0 + 5.0, 50.0 + 10.0}  # every pass's stated time in this run (F0, F1, B0, B1)
        half_gap = min(abs(x - y) for x in everything for y in everything if x != y) / 2
        for action in "FB":
            assert len(trace[action]) == len(side[action]) == m * steps, (rank, action)
            for t, h in zip(trace[action], side[action]):
                assert t >= h - 1e-3, (rank, action, t, h)  # the trace's span contains the hold (µs rounding)
            target = stated["F"] if action == "F" else stated["I"] + stated["W"]
            # the trace's pass less the waiting for a CPU the side spans measured inside its holds: the stated
            # duration, plus the wake-up slack and what the trace adds around the holds (the pass's own bookkeeping,
            # and any wait for a CPU there, which no side span measures). The trace tells the stated durations apart
            # where that addition is below half the smallest gap between two stated durations (7.5 ms); where the
            # rank waited longer there (seen: a 15 ms forward's spans 24 ms at load 12) it cannot, which the side
            # spans record. (Judged per pass: a backward's two holds together, not the median single hold, which
            # for a backward is half the time a 5 ms W: seen at load 21, rank 0's backwards 47.6 ms in the trace
            # with 14 ms of waiting inside their holds, 4 ms per single hold.)
            typical = statistics.median(t - d for t, d in zip(trace[action], delay[action]))
            around = statistics.median(t - h for t, h in zip(trace[action], side[action]))
            nearest = min(everything, key=lambda x: abs(x - typical))
            if around < half_gap:
                assert nearest == target, (rank, action, typical, target, around, delay[action])
            else:
                assert statistics.median(trace[action]) >= target, (rank, action, trace[action], target, around)


@pytest.mark.slow
def test_the_step_is_the_analytic_gpipe_step_plus_the_overhead_a_zero_hold_twin_measures(collected_run):
    # A B A: the configuration holding nothing (its step is what the workload does not hold: P2P, optimizer, host,
    # profiler), the known workload, the zero-hold configuration again (the two differ by the machine's noise)
    zero = collected_run("sleep0_gpipe_pp2")
    run = collected_run("sleep_gpipe_pp2")
    again = collected_run("sleep0_gpipe_pp2_again")
    manifest = Manifest.read(run / "run.json")
    cfg = RUNS["sleep_gpipe_pp2"]
    m, steps = cfg["num_microbatches"], cfg["steps"]
    # by hand (GPipe, Huang et al. 2019): the forwards fill the pipe behind the slowest stage, the backwards drain
    # it: (m − 1)·max F + ΣF + (m − 1)·max B + ΣB, B a full backward (I + W); stage 1 holds twice as long
    f = [15.0, 30.0]
    b = [25.0 + 5.0, 50.0 + 10.0]
    analytic = (m - 1) * max(f) + sum(f) + (m - 1) * max(b) + sum(b)

    def step_spans(path) -> list[float]:
        """Each rank's profiled steps as the trainer's own perf_counter saw them (the side file), in ms."""
        mf = Manifest.read(path / "run.json")
        out = []
        for rank in range(mf.world_size):
            held = _held(path, mf, rank)
            out += [(s["end_ns"] - s["start_ns"]) / 1e6 for s in held["steps"][-steps:]]
        return out

    def overrun(path) -> float:
        """The most the held passes of one profiled step overran their stated time, all ranks' passes together (an
        upper bound of what the step's path holds beyond the analytic step: each pass is on it at most once), from
        the side spans: the wake-up slack and the run-queue delay a loaded machine adds to each hold, which a
        zero-hold twin, holding nothing, does not have."""
        mf = Manifest.read(path / "run.json")
        late: dict[int, float] = {}
        for rank in range(mf.world_size):
            for sp in _held(path, mf, rank)["spans"]:
                late[sp["step"]] = late.get(sp["step"], 0.0) + max(
                    0.0, (sp["end_ns"] - sp["start_ns"]) / 1e6 - sp["stated_ms"])
        return max(v for k, v in late.items() if k >= max(late) - steps + 1)

    measured = step_spans(run)
    waited = waited_between_holds_ms(run)  # the ranks' waiting for a CPU between the holds (measured, side files)
    overhead = [statistics.median(step_spans(zero)), statistics.median(step_spans(again))]
    noise = max(overhead) - min(overhead)
    # never below the analytic step (holds never end early, every dependency is real); above it by no more than
    # the zero-hold twins' step, their difference, what the holds themselves overran and the ranks'
    # waiting for a CPU between them (measured, side spans)
    for step in measured:
        assert analytic - 1e-3 <= step, (step, analytic)
    assert statistics.median(measured) <= analytic + max(overhead) + noise + overrun(run) + waited, (
        measured, analytic, overhead, overrun(run), waited)
    assert manifest.workload.held_ms("B", stage=1, rank=1) == b[1]


@pytest.mark.slow
def test_a_split_backward_schedule_holds_one_f_one_i_and_one_w_per_microbatch(collected_run):
    # torch.distributed.pipelining's ZB-V (2 ranks × 2 stages in a V): its input pass (I) and weight pass (W) each
    # run their own hold once, as the trace's PP:{s}I{mb} / PP:{s}W{mb} spans show — except on stage 0, whose input
    # (token ids) has no gradient: torch's I computes nothing there and its W the whole backward, so the trace's W
    # holds I + W (docs/known-workload.md)
    run = collected_run("pipelining-zbv-sleep")
    manifest = Manifest.read(run / "run.json")
    assert manifest.workload == Workload("sleep", 10.0, 20.0, 10.0) and manifest.schedule == "zbv"
    m = 4
    for rank, stages in enumerate(manifest.stages_of_rank):
        spans = _held(run, manifest, rank)["spans"]
        profiled = max(s["step"] for s in spans)
        with gzip.open(run / f"rank{rank}.pt.trace.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        for stage in stages:
            in_trace = {"F": 10.0, "I": 0.0 if stage == 0 else 20.0, "W": 30.0 if stage == 0 else 10.0}
            for action in "FIW":
                mine = sorted(s["microbatch"] for s in spans if s["step"] == profiled and s["stage"] == stage
                              and s["action"] == action)
                assert mine == list(range(m)), (rank, stage, action, mine)
                name = re.compile(rf"PP:{stage}{action}\d+")
                traced = [e["dur"] / 1e3 for e in events if e.get("ph") == "X" and name.fullmatch(e.get("name", ""))]
                assert len(traced) == m and all(t >= in_trace[action] - 1e-3 for t in traced), \
                    (rank, stage, action, traced)
                if stage == 0 and action == "I":  # the hold is not inside it: shorter than one I
                    assert min(traced) < 20.0, traced
