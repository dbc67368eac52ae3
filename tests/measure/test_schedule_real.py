"""Real runs: the reference trainer (GPipe, 1F1B, 1F1B + BPipe, 4 stages) and torch.distributed.pipelining's own
schedules. Collected once per session (tests/collected_runs.py, collectors.pipelining_example); skipped without
torch. Inference is checked against the annotated truth by analysing the same run with its annotations stripped.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import polars as pl
import pytest

from traceana.core import names
from traceana.core.schema import CATEGORIES, COMPUTE_CATEGORIES
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze, strip_annotations

pytestmark = pytest.mark.slow


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_run(path, cache=False)


@pytest.fixture(scope="module")
def analysed(collected_run):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            run = load(collected_run(name))
            cache[name] = (run, analyze(run), analyze(replace(run, events=strip_annotations(run.events))))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def pipelining_run(collected_run):
    """The session's ``pipelining-<schedule>`` run (tests/collected_runs.py: 4 micro-batches of 1 sequence)."""
    cache: dict[str, tuple] = {}

    def get(schedule: str):
        if schedule not in cache:
            run = load(collected_run(f"pipelining-{schedule}"))
            cache[schedule] = (run, analyze(run), analyze(replace(run, events=strip_annotations(run.events))))
        return cache[schedule]

    return get


def fb(schedule: pl.DataFrame) -> pl.DataFrame:
    return schedule.filter(pl.col("phase").is_in(["forward", "backward"]))


def per_stage(a, category: str) -> list[int]:
    return a.attribution.filter(pl.col("category") == category).group_by("stage").agg(pl.col("ns").sum()) \
        .sort("stage")["ns"].to_list()


def assert_schedule_complete(run, a):
    m = run.manifest
    stages = m.pp
    got = fb(a.schedule).group_by("step", "stage", "phase").agg(pl.col("microbatch").sort())
    assert got.height == a.steps["step"].n_unique() * stages * 2
    assert all(mbs == list(range(m.num_microbatches)) for mbs in got["microbatch"].to_list())


WORK = (*COMPUTE_CATEGORIES, "host")


STEP = pl.col("name").cast(pl.String).str.starts_with("ProfilerStep#")


def activity_points(events: pl.DataFrame, thread: pl.DataFrame) -> pl.DataFrame:
    """``rank, t``: every start and end of an event on the training ``thread`` (rank, tid), the step spans left
    out: the instants at which the thread was seen running."""
    ev = events.join(thread, on=["rank", "tid"]).filter(~STEP)
    return pl.concat([ev.select("rank", t="ts_ns"), ev.select("rank", t=pl.col("ts_ns") + pl.col("dur_ns"))])


def annotation_edges(a, inferred) -> pl.DataFrame:
    """``rank, start, end`` (disjoint): where taking the annotations away can move time between working and waiting.

    An annotation's start and end are instants the thread was seen running. Without them, the last activity before
    a wait returns can be earlier, and a wait annotation no longer holds the time after its op returned. Either way,
    what can change lies between an annotation's edge and the last instant before it at which a kept event shows
    the thread running (docs/schedules.md: an action owns the idle edges of its span). A WAIT_F/WAIT_B span also
    says the thread waited all along, where inference goes by the last activity it sees (an asynchronous BPipe
    send completing in the middle of it, say), so all of that span is in too. Found from the events alone.
    """
    key = ["rank", "tid", "ts_ns", "dur_ns", "name"]
    thread = a.events.filter(STEP).select("rank", "tid").unique()  # the one holding ProfilerStep spans
    assert thread.height > 0, "no ProfilerStep spans"
    removed = a.events.join(inferred.events.select(key), on=key, how="anti")
    kept = activity_points(inferred.events, thread).unique().sort("rank", "t").with_columns(kept=pl.col("t"))
    edges = (activity_points(removed, thread).sort("rank", "t")
             .join_asof(kept, on="t", by="rank", strategy="backward", check_sortedness=False).drop_nulls()
             .select("rank", start="kept", end="t"))
    waits = removed.filter(pl.col("pp_action").is_in([names.WAIT_F, names.WAIT_B])).select(
        "rank", start="ts_ns", end=pl.col("ts_ns") + pl.col("dur_ns"))
    return union(pl.concat([edges, waits]))


def union(spans: pl.DataFrame) -> pl.DataFrame:
    """``rank, start, end`` made disjoint per rank: a span starts a new piece where it begins after every earlier one
    of its rank has ended."""
    spans = spans.sort("rank", "start")
    piece = (pl.col("start") > pl.col("end").cum_max().shift(1).over("rank")).fill_null(True).cum_sum()
    return spans.group_by("rank", piece.alias("piece")).agg(pl.col("start").min(), pl.col("end").max()).drop("piece")


def idle_ns(a, *cats) -> int:
    """How much of the time ``a`` counts as ``cats`` no op of the rank's training thread runs in: the idle inside an
    annotated action's span (its Python, or the rank descheduled), which the action owns (docs/schedules.md)."""
    seg = a.segments.filter(pl.col("category").cast(pl.String).is_in(list(cats))).select(
        "rank", start="start_ns", end="end_ns")
    thread = a.events.filter(STEP).select("rank", "tid").unique()
    ops = a.events.join(thread, on=["rank", "tid"]).filter(pl.col("kind") == "compute").select(
        "rank", start="ts_ns", end=pl.col("ts_ns") + pl.col("dur_ns"))
    return int((seg["end"] - seg["start"]).sum()) - covered_ns(seg, union(ops))


def work_wait_disagreement(a, inferred) -> pl.DataFrame:
    """``rank, start, end``: the instants one analysis counts as working (compute or host) and the other as waiting
    (P2P, BPipe, a bubble)."""
    def side(x):
        return x.segments.select("rank", "start_ns", "end_ns", work=pl.col("category").cast(pl.String).is_in(WORK))

    both = side(a).join(side(inferred), on="rank", suffix="_inf").select(
        "rank", "work", "work_inf", start=pl.max_horizontal("start_ns", "start_ns_inf"),
        end=pl.min_horizontal("end_ns", "end_ns_inf"))
    return both.filter(pl.col("end") > pl.col("start"), pl.col("work") != pl.col("work_inf")).select(
        "rank", "start", "end")


def covered_ns(spans: pl.DataFrame, by: pl.DataFrame) -> int:
    """How much of ``spans`` (disjoint per rank) lies inside ``by`` (disjoint per rank)."""
    x = spans.join(by, on="rank", suffix="_by").select(
        (pl.min_horizontal("end", "end_by") - pl.max_horizontal("start", "start_by")).clip(lower_bound=0))
    return int(x.to_series().sum())


def forward_extent_shift(a, inferred) -> pl.DataFrame:
    """``rank, start, end`` (disjoint): where the two analyses put a (rank, step)'s forwards' extent differently —
    between the annotated first forward's start and the inferred one's, and between the last forward's ends. The
    bubble rule splits idle time there (warm-up before the first forward, cool-down after the last one, stall
    between), so that is where the bubbles' split can move."""
    def extent(x):
        f = x.schedule.filter(pl.col("phase") == "forward", pl.col("step").is_not_null())
        return f.group_by("rank", "step").agg(first=pl.col("start_ns").min(), last=pl.col("end_ns").max())

    both = extent(a).join(extent(inferred), on=["rank", "step"], suffix="_inf")
    return union(pl.concat([
        both.select("rank", start=pl.min_horizontal("first", "first_inf"), end=pl.max_horizontal("first", "first_inf")),
        both.select("rank", start=pl.min_horizontal("last", "last_inf"), end=pl.max_horizontal("last", "last_inf")),
    ]).filter(pl.col("end") > pl.col("start")))


def assert_inference_matches(a, inferred):
    key = ["rank", "step", "stage", "microbatch", "phase"]
    assert set(inferred.schedule.filter(pl.col("phase") != "optimizer")["source"]) == {"inferred"}
    assert sorted(fb(inferred.schedule).select(key).rows()) == sorted(fb(a.schedule).select(key).rows())

    def total(x, *cats):
        return sum(sum(per_stage(x, c)) for c in cats)

    # Backward work is told apart exactly (autograd names it), but an annotated action also owns the idle time
    # inside its span, where no op runs (its Python, or the process descheduled on a loaded machine:
    # docs/schedules.md), which inference cannot see and leaves to host: inferred phases are at most the annotated
    # ones, and all of them together leave out at most that idle time (seen: an annotated forward 77 ms, inferred
    # 38 ms, with four busy loops besides the 4 ranks). Forward work is everything else between the transfers, so
    # inference also counts what runs just outside an annotated F span (the loss), taken from other_compute, and
    # the forward ops (the loss) at the start of the last stage's B span, taken from backward.
    for cats in (("backward",), ("forward", "other_compute")):
        truth, guess = total(a, *cats), total(inferred, *cats)
        assert guess <= 1.05 * truth, (cats, truth, guess)
    truth, guess = total(a, *COMPUTE_CATEGORIES), total(inferred, *COMPUTE_CATEGORIES)
    idle = idle_ns(a, *COMPUTE_CATEGORIES)
    assert truth - idle - 0.05 * truth <= guess, ("compute", truth, guess, idle)
    # Working against waiting (compute + host against P2P, BPipe and bubbles): the two analyses agree at every
    # instant except next to an annotation's edge, the only activity inference loses. How much sits there depends on
    # how long the 2-core machine descheduled a rank at that moment (seen: 2-19 ms in 12 runs of a 4-rank step, up to
    # 5% of compute + host), so it is located rather than bounded, and the bubbles below allow it on top.
    moved = work_wait_disagreement(a, inferred)
    moved_ns = int((moved["end"] - moved["start"]).sum())
    outside = moved_ns - covered_ns(moved, annotation_edges(a, inferred))
    assert outside <= 1e-4 * total(a, *CATEGORIES), ("working vs waiting away from annotation edges", outside)
    # Idle time does not depend on how compute is split, so the bubbles together agree closely. Where one bubble
    # ends and the next begins does: cool-down starts when the last forward ends, and inferred forwards also take
    # in the loss computed just after torch.distributed.pipelining's F span (~10% of a tiny run's cool-down).
    bubbles = ("bubble_warmup", "bubble_cooldown", "bubble_stall")
    truth, guess = total(a, *bubbles), total(inferred, *bubbles)
    assert abs(guess - truth) <= 0.05 * max(truth, 1) + moved_ns, ("bubbles", truth, guess, moved_ns)
    # Each bubble apart: where a forward's extent begins or ends differs between the two, idle time there changes
    # bubble (seen in CI: stage 0 descheduled 26 ms between its last forward's last op and the detach before its
    # send, which inference counts as forward work, so that idle was stall instead of cool-down; and the reference
    # trainer's batch, made just before stage 0's first forward span, is forward work to inference). What can move
    # is the idle of the training thread there (no compute op running), measured from the events.
    shift = forward_extent_shift(a, inferred)
    thread = a.events.filter(STEP).select("rank", "tid").unique()
    ops = union(a.events.join(thread, on=["rank", "tid"]).filter(~STEP, pl.col("kind") == "compute").select(
        "rank", start="ts_ns", end=pl.col("ts_ns") + pl.col("dur_ns")))
    idle_in_shift = int((shift["end"] - shift["start"]).sum()) - covered_ns(shift, ops)
    for cat in bubbles:
        truth, guess = total(a, cat), total(inferred, cat)
        assert abs(guess - truth) <= 0.2 * max(truth, 1) + moved_ns + idle_in_shift, (cat, truth, guess, moved_ns,
                                                                                      idle_in_shift)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "1f1b_bpipe"])
def test_reference_trainer_schedule_fully_recovered_and_inferred(analysed, name):
    run, a, inferred = analysed(name)
    assert set(fb(a.schedule)["source"]) == {"annotated"}
    assert_schedule_complete(run, a)
    assert_inference_matches(a, inferred)
    sums = a.attribution.group_by("rank", "step").agg(pl.col("ns").sum())
    assert (a.steps.join(sums, on=["rank", "step"]).select(pl.col("ns") == pl.col("dur_ns"))).to_series().all()


def test_1f1b_bubbles_last_stage_waits_longest_first_stage_idles_longest_at_the_end(analysed):
    # The known workload (collect --work sleep): every pass holds its stated time, so the ordering below is the
    # schedule's and not which rank a loaded machine happened to run (with real compute 4 ranks on 2 cores reordered
    # the stages' cool-downs: 71, 87, 49, 0 ms)
    _, a, _ = analysed("sleep_1f1b")
    w = a.run.manifest.workload
    warm, cool = per_stage(a, "bubble_warmup"), per_stage(a, "bubble_cooldown")
    # Each rank's step starts when *it* called prof.step(), and those starts differ between ranks, so the warm-up
    # bubbles are compared through the dependency they measure: every later stage starts its first forward later,
    # by at least one held forward (F) of the stage before it, and only stage 0 starts without waiting.
    first_f = fb(a.schedule).filter(pl.col("phase") == "forward").group_by("stage").agg(pl.col("start_ns").min()) \
        .sort("stage")["start_ns"].to_list()
    assert all(later - earlier >= w.forward_ms * 1e6 for earlier, later in zip(first_f, first_f[1:])), first_f
    assert warm[0] == 0 and all(wm > 0 for wm in warm[1:])
    # By hand (1F1B, equal stages): after its last forward, stage s still runs its remaining backwards, each waiting
    # for the gradient of stage s + 1, so it idles longer the earlier it is in the pipe; the last stage's cool-down
    # is only the step's tail (its last backward follows its last forward at once).
    assert cool.index(max(cool)) == 0, cool
    assert cool[-1] < cool[0] / 2, cool


def test_bpipe_transfers_are_bpipe_time_not_p2p(analysed):
    run, a, _ = analysed("1f1b_bpipe")
    partners = {tuple(sorted(p)) for p in run.manifest.bpipe}
    pairs = a.p2p.with_columns(pl.min_horizontal("src", "dst").alias("a"), pl.max_horizontal("src", "dst").alias("b"))
    bp = pairs.filter(pl.col("channel") == "bpipe")
    assert bp.height > 0 and {tuple(r) for r in bp.select("a", "b").unique().rows()} <= partners
    neighbours = pairs.filter((pl.col("b") - pl.col("a")) == 1)
    assert set(neighbours["channel"]) == {"p2p"}
    assert not any("no counterpart" in n for n in a.notes)
    assert sum(per_stage(a, "bpipe")) > 0
    stage_of = dict(a.stages.select("rank", "stage").rows())
    evictors = {stage_of[r] for r in bp["src"].unique().to_list()}
    bpipe = per_stage(a, "bpipe")
    assert all(bpipe[s] > 0 for s in evictors)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_torch_pipelining_schedules_inferred_like_their_annotations(pipelining_run, schedule):
    run, a, inferred = pipelining_run(schedule)
    assert_schedule_complete(run, a)
    assert_inference_matches(a, inferred)


def test_torch_pipelining_interleaved_annotated_and_not_guessed(pipelining_run):
    run, a, inferred = pipelining_run("interleaved-1f1b")
    got = fb(a.schedule).group_by("rank").agg(pl.col("stage").unique().sort())
    assert sorted(got.rows()) == [(0, [0, 2]), (1, [1, 3])]  # two virtual stages per rank, from PP: names
    # 4 virtual stages × 4 micro-batches × F/B, in each profiled step
    assert fb(a.schedule).height == 4 * 4 * 2 * a.schedule["step"].n_unique()
    # Without the names, run.json's interleaved 1F1B keeps each backward whole: the passes come from autograd's ops
    # and run.json's plan numbers them (issue 36): the annotated (stage, micro-batch, phase) of every pass
    key = ["rank", "step", "stage", "microbatch", "phase"]
    told = fb(inferred.schedule)
    assert set(told["source"]) == {"autograd"}
    assert told.select(key).sort(key).equals(fb(a.schedule).select(key).sort(key))
    assert any("several stages a rank" in n for n in inferred.notes)
