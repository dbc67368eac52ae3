"""Megatron-core (1F1B, interleaved) and DeepSpeed's PipelineEngine as torch.profiler's defaults record them (no
``with_stack``: no Python frames; no ``record_shapes``: P2P calls without their peer; no run.json, no traceana
metadata): the passes come from autograd's ops and the communication calls' order (issue 36).

The truth is the runs' own perf_counter timers (tests/data/README.md, ``truth.rank{R}.json``), recorded outside the
trace: the framework's forward_step / backward_step (Megatron) and ForwardPass / BackwardPass instructions
(DeepSpeed) per step, and the step. Counts are the schedule's, by hand: 4 micro-batches, 2 stages (interleaved:
2 model chunks a rank, so 8 forwards and 8 backwards a rank and step)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest

import traceana
from stripped_runs import SHAPE_KEYS, as_defaults
from traceana.core.schema import COMPUTE_CATEGORIES
from traceana.measure.analysis import analyze

DATA = Path(__file__).parents[1] / "data"
# Every share within 0.05 of the step (the issue's target). The P2P helpers' own Python (Megatron's send_forward…,
# DeepSpeed's SendActivation…: truth "p2p" − "p2p_torch") has no event of its own without Python frames: the idle
# time touching a P2P call is taken for it (attribution._helpers_python; without that, blocked read 0.08–0.10 low).
# DeepSpeed's last stage: its RecvActivation's own ops after the receive (the buffer's clone, requires_grad) and its
# LoadMicroBatch (the labels) run between the receive and the ForwardPass with no call between them, so they read
# as forward (measured: 0.061 of the step over the timer's ForwardPass).
TOL, BLOCKED_TOL, DS_LAST_FORWARD_TOL = 0.05, 0.05, 0.07
BLOCKED = ("p2p", "bubble_warmup", "bubble_stall", "bubble_cooldown")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name in ("megatron_pipe/1f1b", "megatron_pipe/interleaved", "deepspeed_pipe/1f1b"):
        run = as_defaults(DATA / name / "run", tmp_path_factory.mktemp(name.replace("/", "_")) / "run")
        truth = {r: json.loads((DATA / name / f"truth.rank{r}.json").read_text()) for r in (0, 1)}
        out[name] = (analyze(traceana.load_run(run, cache=False)), truth)
    return out


def _shares(a, rank: int, step: int) -> dict[str, float]:
    att = a.attribution.filter((pl.col("rank") == rank) & (pl.col("step") == step))
    total = att["ns"].sum()
    got = {c: att.filter(pl.col("category") == c)["ns"].sum() / total for c in att["category"].cast(str).unique()}
    got["blocked"] = sum(got.get(c, 0) for c in BLOCKED)
    return got


def _want(name: str, t: dict) -> dict[str, float]:
    if name.startswith("deepspeed"):
        ins, step = t["instructions_ns"], t["train_batch_ns"]
        p2p = sum(ins.get(i, 0) for i in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"))
        return {"forward": ins["ForwardPass"] / step, "backward": ins["BackwardPass"] / step, "blocked": p2p / step}
    c, step = t["calls_ns"], t["step_ns"]
    return {"forward": c["forward_step"] / step, "backward": c["backward_step"] / step,
            "optimizer": c["optimizer"] / step, "blocked": c["p2p"] / step}


@pytest.mark.parametrize("name", ["megatron_pipe/1f1b", "megatron_pipe/interleaved", "deepspeed_pipe/1f1b"])
def test_shares_from_the_defaults_against_the_frameworks_timers(runs, name):
    a, truth = runs[name]
    steps = sorted(a.steps["step"].unique().to_list())
    assert steps
    for step in steps:
        for rank in (0, 1):
            got, want = _shares(a, rank, step), _want(name, truth[rank]["steps"][str(step)])
            for k, v in want.items():
                tol = (BLOCKED_TOL if k == "blocked" else
                       DS_LAST_FORWARD_TOL if (name.startswith("deepspeed") and rank == 1 and k == "forward") else TOL)
                assert got.get(k, 0) == pytest.approx(v, abs=tol), \
                    (name, rank, step, k, got.get(k, 0), v)


@pytest.mark.parametrize("name", ["megatron_pipe/1f1b", "deepspeed_pipe/1f1b"])
def test_one_stage_a_rank_gets_its_stages_and_micro_batches(runs, name):
    a, _ = runs[name]
    # Megatron names its pipeline group in distributedInfo; DeepSpeed's groups are "undefined", and the rank whose
    # steps open with a send is stage 0.
    assert dict(a.stages.select("rank", "stage").rows()) == {0: 0, 1: 1}
    how = "megatron-core's pipeline process group" if name.startswith("megatron") else "P2P call order"
    assert all(how in s for s in a.stages["stage_source"].to_list()), a.stages
    fb = a.schedule.filter(pl.col("phase").is_in(["forward", "backward"]))
    assert set(fb["source"]) == {"autograd"}
    for (rank, step, phase), rows in fb.group_by("rank", "step", "phase"):
        assert rows["microbatch"].sort().to_list() == [0, 1, 2, 3], (rank, step, phase)
        assert rows["stage"].unique().to_list() == [rank]
    # 1F1B over 2 stages, 4 micro-batches: the first stage's order (Narayanan et al. 2021, Fig. 4).
    last = max(fb["step"].to_list())
    r0 = fb.filter((pl.col("rank") == 0) & (pl.col("step") == last)).sort("start_ns")
    assert [f"{p[0].upper()}{m}" for p, m in r0.select("phase", "microbatch").rows()] == \
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert not any("could not be determined" in n for n in a.notes), a.notes


def test_interleaved_passes_are_counted_not_numbered(runs):
    a, _ = runs["megatron_pipe/interleaved"]
    fb = a.schedule.filter(pl.col("phase").is_in(["forward", "backward"]))
    counts = fb.group_by("rank", "step", "phase").len()["len"].unique().to_list()
    assert counts == [8], counts  # 4 micro-batches × 2 model chunks
    assert fb["microbatch"].is_null().all()
    assert any("more P2P calls per step than it runs passes" in n for n in a.notes), a.notes
    assert any("stages_of_rank" in n for n in a.notes)


# The two readings of one trace differ where the rank was descheduled (4 ranks on 2 cores, and whatever else the
# machine runs): a thread waiting for a CPU records nothing, so a gap inside a pass reads as that pass in the
# annotated reading (its span covers it) and, in the defaults' reading, as a wait when a P2P call returns after it
# (seen at load 11: 7.3 ms inside a forward read as bubble_stall; reported on a quiet machine: bubble_warmup 0.238
# against 0.088). That is noise, and the test measures it beside each comparison: the collector's wall-clock truth
# carries the run-queue delay (schedstat) inside every compute and P2P span (schedule_truth.descheduled_disagreement:
# where a reading disagrees with the truth while the thread was descheduled, up to that delay; _misplaced_delay: the
# delay charged to a span that lies just outside it; _swapped_while_descheduled: a pass's edge moved by an op the
# rank was descheduled in, which the truth, holding compute and not which pass, cannot place). And the defaults'
# windows run from a pass's first op to the next communication call, so they take in compute the annotated spans leave
# outside every pass (the last stage's loss, up to 0.05 of its step here, when a rank was descheduled inside the
# loss's op): the annotated reading's other_compute, measured in the same run. What is left is the Python at a
# pass's edges: at most 0.007 of a step over 212 rank-steps (53 collections of 1F1B and GPipe, at load 3-5 and
# 11-15, readings differing by up to 0.104).
PIPELINING_PHASE_FLOOR = 0.03


def _intervals(a, rank: int, categories) -> list[tuple[int, int]]:
    seg = a.segments.filter((pl.col("rank") == rank) & pl.col("category").cast(pl.String).is_in(list(categories)))
    return seg.select("start_ns", "end_ns").rows()


def _descheduled(a, truth_dir: Path, rank: int, step: int) -> float:
    """The share of ``step`` where ``a``'s compute disagrees with the truth while the rank was descheduled."""
    from schedule_truth import descheduled_disagreement

    bounds = a.steps.filter((pl.col("rank") == rank) & (pl.col("step") == step)).select("start_ns", "end_ns").rows()
    return descheduled_disagreement(truth_dir, rank, [step], bounds,
                                    {"compute": _intervals(a, rank, COMPUTE_CATEGORIES)})["compute"]


def _misplaced_delay(truth_dir: Path, rank: int, step: int) -> float:
    """The share of ``step`` of run delay the truth charged to a span that cannot have happened inside it: the
    collector reads schedstat just after a span's closing perf_counter (and just before its opening one), and that
    read is where a thread is preempted, so a wait right after a span (or right before it) is charged to the span
    (seen at load 3: a 3.2 ms forward holding 10.3 ms of delay, and 8.6 ms after it with no event in the trace nor
    span in the truth, which the last stage's defaults' forward window, running on to the loss, covers). What a
    top-level span holds beyond its length lies just outside it: counted as descheduled there."""
    doc = json.loads((truth_dir / f"rank{rank}.json").read_text())
    lo, hi, *_ = doc["steps"][step]
    excess, reach = 0, lo
    for _, s, e, d in sorted((sp for sp in doc["spans"] if sp[1] < hi and sp[2] > lo), key=lambda x: (x[1], -x[2])):
        if s >= reach:  # a top-level span (not inside an earlier one)
            excess += max(0, d - (e - s))
            reach = e
        else:
            reach = max(reach, e)
    return excess / (hi - lo)


def _swapped_while_descheduled(one, other, truth_dir: Path, rank: int, step: int) -> float:
    """The share of ``step`` that one reading gives a forward and the other a backward (or the reverse) inside a
    compute span of the truth, up to the run delay measured in that span: a pass's edge is where its ops begin, and
    an op the rank was descheduled in lasts that much longer (seen at load 5: the last stage's first backward op
    3.2 ms long, read as forward by the defaults, whose backward begins at autograd's first backward op). The truth
    holds compute, not which pass, so this is not in ``_descheduled``."""
    from schedule_truth import _length, _overlap, _union

    doc = json.loads((truth_dir / f"rank{rank}.json").read_text())
    lo, hi, *_ = doc["steps"][step]
    ((start, end),) = one.steps.filter((pl.col("rank") == rank) & (pl.col("step") == step)).select(
        "start_ns", "end_ns").rows()
    offset = ((start - lo) + (end - hi)) // 2  # the trace's clock less the truth's, from the step's bounds

    def of(a, phase):
        return _union([(x - offset, y - offset) for x, y in _intervals(a, rank, [phase])], lo, hi)

    def both(x, y):  # the intersection of two disjoint sorted interval lists
        out = []
        for s, e in x:
            out.extend((max(s, s2), min(e, e2)) for s2, e2 in y if s2 < e and e2 > s)
        return _union(out, lo, hi)

    swapped = _union(both(of(one, "forward"), of(other, "backward")) + both(of(one, "backward"), of(other, "forward")),
                     lo, hi)
    explained = 0
    for kind, s, e, d in doc["spans"]:
        if kind == "compute" and s < hi and e > lo and d > 0:
            explained += min(d, _overlap(swapped, [(max(s, lo), min(e, hi))]))
    return min(explained, _length(swapped)) / (hi - lo)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipelining_profiled_with_the_defaults_gets_its_annotated_schedule(collected_run, tmp_path, schedule):
    """torch.distributed.pipelining's own Schedule1F1B / ScheduleGPipe on 4 ranks (tests/collected_runs.py), the
    truth its own record_function spans of each action (F, B): with those spans, the Python frames, the input
    shapes (so the P2P peers), the metadata and run.json removed, the stages (from P2P order and timing: one
    pipeline, every rank traced), micro-batches and phases are the annotated ones (logic: exact), and each rank's
    forward and backward shares those of the annotated analysis within PIPELINING_PHASE_FLOOR plus what this run
    measures beside them: the time the two readings disagree with the wall-clock truth while the rank was
    descheduled, and the annotated reading's compute outside every pass (the loss); blocked at least the annotated
    reading's."""
    from collectors.pipelining_example import truth_path
    from stripped_runs import strip_trace

    src = collected_run(f"pipelining-{schedule}")
    dst = tmp_path / "run"
    dst.mkdir()
    for trace in sorted(Path(src).glob("rank*.pt.trace.json*")):
        opener = gzip.open if trace.suffix == ".gz" else open
        with opener(trace, "rt") as f:
            doc = strip_trace(json.load(f))
        doc["traceEvents"] = [
            {**e, "args": {k: v for k, v in e["args"].items() if k not in SHAPE_KEYS}}
            if isinstance(e.get("args"), dict) else e
            for e in doc["traceEvents"] if e.get("cat") != "python_function"]
        with opener(dst / trace.name, "wt") as f:
            json.dump(doc, f)
    annotated = analyze(traceana.load_run(src, cache=False))
    inferred = analyze(traceana.load_run(dst, cache=False))
    assert dict(inferred.stages.select("rank", "stage").rows()) == dict(annotated.stages.select("rank", "stage").rows())
    key = ["rank", "step", "stage", "microbatch", "phase"]
    fb = lambda a: a.schedule.filter(pl.col("phase").is_in(["forward", "backward"])).select(key).sort(key)  # noqa: E731
    assert fb(inferred).equals(fb(annotated))
    assert set(inferred.schedule.filter(pl.col("phase") != "optimizer")["source"]) == {"autograd"}
    truth_dir = truth_path(Path(src))
    for step in annotated.summary.steps:
        for rank in range(4):
            got, want = _shares(inferred, rank, step), _shares(annotated, rank, step)
            # A gap one reading gives a pass and the other not is, at each instant, a disagreement of one of them
            # with the truth's compute; while descheduled, it is counted (up to the run delay measured there). A pass
            # read as another (forward for backward) is compute in both and truth alike: never excused by it.
            noise = (_descheduled(inferred, truth_dir, rank, step) + _descheduled(annotated, truth_dir, rank, step)
                     + _misplaced_delay(truth_dir, rank, step)
                     + _swapped_while_descheduled(inferred, annotated, truth_dir, rank, step))
            outside_passes = want.get("other_compute", 0)
            for k in ("forward", "backward"):
                assert got.get(k, 0) == pytest.approx(want.get(k, 0),
                                                      abs=PIPELINING_PHASE_FLOOR + noise + outside_passes), \
                    (schedule, rank, step, k, noise, got, want)
            # blocked: at least the annotated reading's (the defaults' reading gives the P2P calls the idle time
            # touching them: torch's _batch_p2p / _wait_batch_p2p Python, which the annotated reading leaves to
            # host or to the action whose span holds it; descheduling only adds to it, the defaults' reading having
            # fewer marks of activity; measured: 0.001-0.22 more over the rank-steps above)
            assert got["blocked"] >= want["blocked"] - 0.02, (schedule, rank, step, got, want)
    # (Not checked here against the collector's wall-clock truth: tests/validation/test_schedules_truth.py holds that
    # check for the annotated reading.)


def test_interleaved_passes_are_numbered_by_run_jsons_plan(tmp_path):
    """Megatron's interleaved run profiled with the defaults, with the run.json of its real configuration (2 ranks,
    stages [[0, 2], [1, 3]], 4 micro-batches): each forward's stage and micro-batch are the ones the with_stack trace
    of the same run shows, read here from its raw Python frames (``nn.Module: Stage_{c}`` is model chunk c; the
    k-th call of a chunk in a step is its micro-batch k), and every stage runs 4 backwards a step."""
    src = DATA / "megatron_pipe" / "interleaved" / "run"
    run = as_defaults(src, tmp_path / "run")
    (run / "run.json").write_text(json.dumps({"world_size": 2, "pp": 4, "stages_of_rank": [[0, 2], [1, 3]],
                                              "schedule": "interleaved-1f1b", "num_microbatches": 4}))
    a = analyze(traceana.load_run(run, cache=False))
    fb = a.schedule.filter(pl.col("phase").is_in(["forward", "backward"]))
    assert fb["microbatch"].null_count() == 0 and set(fb["source"]) == {"autograd"}
    for rank in (0, 1):
        with gzip.open(src / f"rank{rank}.pt.trace.json.gz", "rt") as f:
            ev = json.load(f)["traceEvents"]
        steps = sorted((e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
        chunks = sorted((e for e in ev if e.get("name") in ("nn.Module: Stage_0", "nn.Module: Stage_1")),
                        key=lambda e: e["ts"])
        for s in steps:
            step = int(s["name"].split("#")[1])
            seen: dict[int, int] = {}
            want = []
            for e in chunks:
                if s["ts"] <= e["ts"] < s["ts"] + s["dur"]:
                    c = int(e["name"][-1])
                    want.append((2 * c + rank, seen.get(c, 0)))
                    seen[c] = seen.get(c, 0) + 1
            got = fb.filter((pl.col("rank") == rank) & (pl.col("step") == step) & (pl.col("phase") == "forward")) \
                .sort("start_ns").select("stage", "microbatch").rows()
            assert got == want, (rank, step)
            back = fb.filter((pl.col("rank") == rank) & (pl.col("step") == step) & (pl.col("phase") == "backward"))
            assert sorted(back.group_by("stage").len().rows()) == [(rank, 4), (rank + 2, 4)]
