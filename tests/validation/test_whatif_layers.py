"""Layers moved between stages from the measured per-layer work (``whatif --layers-per-stage``): the reference
trainer's layer spans (``PP:{stage}F{mb}/L{layer}``, collectors.annotations) read into per-layer work
(traceana.validation.measurement.layer_work), and the plan what-if that moves blocks with their measured time
(traceana.validation.plan). Expected values come from the trace's own events read apart (json) and from the known
workload's stated times worked out by hand."""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict

import pytest

from collected_runs import RUNS
from traceana.core.pipeline_rules import stage_layer_ranges


def _raw_layer_spans(run_dir, step: int) -> dict[tuple, tuple[float, int]]:
    """(rank, stage, action, micro-batch, layer) → (summed µs, spans) of the layer spans inside ProfilerStep#step,
    read from each rank's trace file with json and a regular expression (not traceana's reader)."""
    out: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for f in sorted(run_dir.glob("rank*.pt.trace.json.gz")):
        rank = int(re.match(r"rank(\d+)", f.name).group(1))
        events = [e for e in json.load(gzip.open(f))["traceEvents"] if e.get("ph") == "X"]
        (win,) = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == f"ProfilerStep#{step}"]
        for e in events:
            m = re.fullmatch(r"PP:(\d+)([A-Z_]+)(\d+)/L(\d+)", e["name"])
            if m and win[0] <= e["ts"] <= win[1]:
                key = (rank, int(m[1]), m[2], int(m[3]), int(m[4]))
                out[key][0] += e["dur"]
                out[key][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_moved_layers_keep_their_work_and_the_rest_stays_by_hand():
    """Two stages of 2 blocks, one micro-batch. Stage 0's forward 10 ms, its blocks 0 and 1 2 and 3 ms (5 ms of
    non-layer work: the embedding); stage 1's 30 ms, blocks 2 and 3 12 and 13 ms (5 ms: head and loss). Split 3,1:
    stage 0 holds blocks 0–2, 5 + 2 + 3 + 12 = 22 ms; stage 1 block 3, 5 + 13 = 18 ms. Split 1,3: 5 + 2 = 7 and
    5 + 3 + 12 + 13 = 33 ms. A pass whose blocks' spans exceed it keeps no negative rest (0)."""
    from traceana.validation.plan import _moved_layers

    per_op = {("F", 0, 0): 10.0, ("F", 1, 0): 30.0}
    layers = {("F", 0, 0): 2.0, ("F", 1, 0): 3.0, ("F", 2, 0): 12.0, ("F", 3, 0): 13.0}
    assert _moved_layers(per_op, layers, (2, 2), (3, 1)) == {("F", 0, 0): 22.0, ("F", 1, 0): 18.0}
    assert _moved_layers(per_op, layers, (2, 2), (1, 3)) == {("F", 0, 0): 7.0, ("F", 1, 0): 33.0}
    assert _moved_layers(per_op, layers, (2, 2), (2, 2)) == per_op
    assert _moved_layers({("F", 0, 0): 4.0, ("F", 1, 0): 30.0}, layers, (2, 2), (3, 1))[("F", 0, 0)] == 17.0


def test_layer_spans_of_a_real_compute_run(collected_run):
    """gpipe_llama_recompute: tiny-llama's 8 blocks on pp 2 (blocks 0–3, 4–7: stage_layer_ranges), 2 micro-batches,
    selective recompute. Every block of every stage has one forward, one backward and one recompute span per
    micro-batch in the measured step, and layer_work's work per (rank, stage, layer, action, micro-batch) is the
    span's duration as the trace file gives it (read with json: within 1 µs of Kineto's rounding). A block's
    forward spans together are less than their pass's."""
    import traceana
    from traceana.validation.measurement import layer_work

    run = collected_run("gpipe_llama_recompute")
    a = traceana.load_and_analyze(run, cache=False)
    work, notes = layer_work(a)
    assert notes == []
    (step,) = a.summary.steps
    ranges = stage_layer_ranges(8, 2)
    want = {(s, act, mb, k) for s in (0, 1) for act in ("F", "B", "RECOMPUTE") for mb in (0, 1) for k in ranges[s]}
    got = {(r["stage"], r["action"], r["microbatch"], r["layer"]): r for r in work.iter_rows(named=True)}
    assert set(got) == want and set(work["step"]) == {step} and set(work["spans"]) == {1}
    assert all(r["rank"] == r["stage"] for r in got.values())
    raw = _raw_layer_spans(run, step)
    assert {k[1:] for k in raw} == want
    for (rank, s, act, mb, k), (us, n) in raw.items():
        assert n == 1 and got[(s, act, mb, k)]["work_ns"] == pytest.approx(us * 1e3, abs=1e3)
    import polars as pl

    fwd = a.schedule.filter((pl.col("phase") == "forward") & (pl.col("step") == step))
    for r in fwd.iter_rows(named=True):
        inside = sum(got[(r["stage"], "F", r["microbatch"], k)]["work_ns"] for k in ranges[r["stage"]])
        assert 0 < inside < r["end_ns"] - r["start_ns"]


def test_layer_spans_are_spans_not_work(collected_run, tmp_path):
    """The same run with its layer spans taken out of every trace (json, by name) analyses alike: the same
    attribution, schedule and step (a layer span is a span inside its pass, not work of its own)."""
    import shutil

    from polars.testing import assert_frame_equal

    import traceana

    run = collected_run("gpipe_llama_recompute")
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns(".traceana"))
    for f in bare.glob("rank*.pt.trace.json.gz"):
        doc = json.load(gzip.open(f))
        kept = [e for e in doc["traceEvents"] if not re.fullmatch(r"PP:\d+[A-Z_]+\d+/L\d+", e.get("name", ""))]
        assert len(kept) < len(doc["traceEvents"])
        doc["traceEvents"] = kept
        with gzip.open(f, "wt") as out:
            json.dump(doc, out)
    a, b = (traceana.load_and_analyze(d, cache=False) for d in (run, bare))
    assert a.summary.step_ms == b.summary.step_ms
    for table in ("attribution", "schedule"):
        assert_frame_equal(getattr(a, table).sort(getattr(a, table).columns),
                           getattr(b, table).sort(getattr(b, table).columns))


def test_moving_a_layer_changes_the_step_by_hand(collected_run):
    """The known workload, GPipe pp 2, m 4, F 10 ms, B 20 ms, stage 1 slowed ×3; each pass's hold split evenly over
    its stage's 4 blocks (run.json's workload.layer_holds "even"): blocks 0–3 hold F 2.5 / B 5 ms, blocks 4–7
    7.5 / 15 ms. The layer spans of each held pass sum to its hold as the workload's own perf_counter span records
    it (less the pass's work before its first block: at most 1 ms plus the pass's run-queue delay).

    ``--layers-per-stage 6,2`` moves blocks 4 and 5 to stage 0 with their time: stage 0 F = 4 × 2.5 + 2 × 7.5 = 25,
    B = 50; stage 1 F 15, B 30. By hand, two-stage GPipe (messages and per-pass overhead aside, alike on both
    paths: 10 passes each): the forwards take f0 + f1 + (m − 1) max f, the backwards b0 + b1 + (m − 1) max b. As
    run: 40 + 90 + 80 + 180 = 390 ms; the plan: 40 + 75 + 80 + 150 = 345 ms: 45 ms shorter. The step ends on stage
    0 both times, after its optimizer, whose work the plan scales by its layer count (6 / 4: the optimizer is not
    timed a block): the plan adds half of stage 0's measured optimizer span. Scaling every pass by its stage's
    layer count (the fallback) would give stage 0 F 15, B 30, stage 1 F 15, B 30: 30 + 45 + 60 + 90 = 225 ms,
    165 ms shorter.

    Noise beside it: 5 ms (wake-ups, the engine's host gaps placed on other passes) plus twice the run-queue delay
    the workload recorded inside the held passes, per step (a hold overshoots by about its delay, and a moved block
    carries its overshoot; both the run's path and the plan's hold some: quiet, a few ms; under 8 CPU-bound loops
    up to ~150 ms a step was seen). Whatever the noise, the answer is nearer the hand value than the fallback's."""
    import polars as pl

    import traceana
    from collectors.trainer.workload import read_spans
    from traceana.validation.measurement import layer_work
    from traceana.validation.plan import plan_whatif

    run = collected_run("sleep_gpipe_pp2_layers")
    assert json.loads((run / "run.json").read_text())["workload"]["layer_holds"] == "even"
    a = traceana.load_and_analyze(run, cache=False)
    work, _ = layer_work(a)
    steps = set(a.summary.steps)
    workload = RUNS["sleep_gpipe_pp2_layers"]["workload"]
    held = [s for r in (0, 1) for s in read_spans(run, workload, r)["spans"] if s["step"] in steps]
    assert {s["action"] for s in held} == {"F", "I"} and len(held) == 2 * 2 * 4 * len(steps)  # (W holds 0: none)
    sums = {tuple(k): v for *k, v in work.group_by("step", "stage", "action", "microbatch")
            .agg(pl.col("work_ns").sum()).iter_rows()}
    blocks = dict(work.group_by("stage").agg(pl.col("layer").n_unique()).iter_rows())
    assert blocks == {0: 4, 1: 4}
    for s in held:
        inside = sums[(s["step"], s["stage"], {"F": "F", "I": "B"}[s["action"]], s["microbatch"])]
        before = (s["end_ns"] - s["start_ns"]) - inside
        assert -0.1e6 <= before <= 1e6 + s["run_delay_ns"], s

    delay = sum(s["run_delay_ns"] for s in held) / len(steps) / 1e6
    tol = 5.0 + 2 * delay
    opt0 = (a.schedule.filter((pl.col("phase") == "optimizer") & (pl.col("stage") == 0)
                              & pl.col("step").is_in(list(steps)))
            .select(((pl.col("end_ns") - pl.col("start_ns")).mean() / 1e6)).item())
    plan = plan_whatif(a, layers_per_stage=(6, 2))
    change = plan["predicted_step_ms"] - plan["simulated_as_run_ms"]
    assert plan["layers_source"] == "measured per-layer work"
    assert any("measured per-layer work" in n and "4,4 → 6,2" in n for n in plan["notes"])
    expected, fallback = -45 + 0.5 * opt0, -165 + 0.5 * opt0
    assert change == pytest.approx(expected, abs=tol), (change, expected, tol)
    assert abs(change - expected) < abs(change - fallback), (change, expected, fallback)
    same = plan_whatif(a, layers_per_stage=(4, 4))
    assert same["layers_source"] is None and same["predicted_step_ms"] == pytest.approx(same["simulated_as_run_ms"])
