"""Attribution on tiny synthetic traces whose answer is known exactly (times in µs; tables in ns).

Each test builds one behaviour with tests/attribution_builder.py and compares the non-zero categories of every
(rank, step) with an expected table worked out by hand in the comments.
"""

from __future__ import annotations

import polars as pl
import pytest
from attribution_builder import US, EventsBuilder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from traceana.core.manifest import Manifest
from traceana.measure import timeline
from traceana.measure.analysis import analyze, strip_annotations

BWD = "autograd::engine::evaluate_function: MmBackward0"


def cats(analysis, rank: int | None = None) -> pl.DataFrame:
    a = analysis.attribution.filter(pl.col("ns") > 0)
    if rank is not None:
        a = a.filter(pl.col("rank") == rank)
    return a.select("rank", "step", pl.col("category").cast(pl.String), "ns").sort("rank", "step", "category")


def expected(rows: list[tuple[int, int, str, float]]) -> pl.DataFrame:
    return pl.DataFrame(
        [(r, s, c, int(us * US)) for r, s, c, us in rows],
        schema={"rank": pl.Int32, "step": pl.Int32, "category": pl.String, "ns": pl.Int64}, orient="row",
    ).sort("rank", "step", "category")


def two_stage_cpu(annotated: bool = True) -> EventsBuilder:
    """Stage 0 runs F0, sends the activation, waits for the gradient, runs B0; stage 1 the mirror image."""
    b = EventsBuilder()
    b.step(0, 1, 0, 100)
    if annotated:
        b.ann(0, "PP:0F0", 0, 20)
        b.ann(0, "PP:0B0", 70, 90)
        b.ann(1, "PP:1F0", 26, 40)
        b.ann(1, "PP:1B0", 40, 60)
    b.op(0, "aten::mm", 2, 18)
    b.send(0, 1, 20, 25)
    b.recv(0, 1, 30, 70)  # rank 1 sends the gradient at 60: waiting 30→60, moving 60→70
    b.op(0, BWD, 72, 88)
    b.step(1, 1, 0, 100)
    b.recv(1, 0, 5, 26)  # rank 0 sends at 20: waiting 5→20, moving 20→26
    b.op(1, "aten::mm", 27, 39)
    b.op(1, BWD, 41, 59)
    b.send(1, 0, 60, 65)
    return b


CPU_TWO_STAGE = [
    # rank 0: the F window 0–20 is forward (work 2–18; 0–2 and 18–20 are the action's own overhead: no wait explains
    # them); activation out 20–25 (rank 1 had posted: all transfer); posting the gradient's receive 30–31 is time in
    # a P2P call; its wait 31–60 comes after the last forward: cooldown; transfer 60–70; the B window 70–90 is
    # backward; host is what lies in no action and no wait: 25–30 and 90–100.
    (0, 1, "forward", 20), (0, 1, "backward", 20), (0, 1, "p2p", 5 + 1 + 10), (0, 1, "bubble_cooldown", 29),
    (0, 1, "host", 5 + 10),
    # rank 1: posting 5–6, then waits 6–20 before its first forward: warmup; transfer 20–26 and 60–65; the F window
    # 26–40 and the B window 40–60; host 0–5 and 65–100.
    (1, 1, "forward", 14), (1, 1, "backward", 20), (1, 1, "p2p", 1 + 6 + 5), (1, 1, "bubble_warmup", 14),
    (1, 1, "host", 5 + 35),
]

# Without annotations there are no action windows: inferred windows run from the first to the last op of each
# micro-batch's work, so the overhead at the old windows' edges (0–2 and 18–20, 70–72 and 88–90 on rank 0; 26–27,
# 39–41 and 59–60 on rank 1) is host.
CPU_TWO_STAGE_INFERRED = [
    (0, 1, "forward", 16), (0, 1, "backward", 16), (0, 1, "p2p", 5 + 1 + 10), (0, 1, "bubble_cooldown", 29),
    (0, 1, "host", 5 + 10 + 2 + 2 + 2 + 2),
    (1, 1, "forward", 12), (1, 1, "backward", 18), (1, 1, "p2p", 1 + 6 + 5), (1, 1, "bubble_warmup", 14),
    (1, 1, "host", 5 + 35 + 1 + 2 + 1),
]


def test_cpu_two_stage_annotated():
    a = analyze(two_stage_cpu().run())
    assert_frame_equal(cats(a), expected(CPU_TWO_STAGE))


def test_p2p_pairs_split_wait_and_transfer():
    a = analyze(two_stage_cpu().run())
    got = a.p2p.select("src", "dst", "seq", "channel", "send_start_ns", "recv_post_ns", "data_ready_ns", "recv_end_ns",
                       "wait_ns", "transfer_ns")
    want = pl.DataFrame(
        [(0, 1, 0, "p2p", 20, 5, 20, 26, 15, 6), (1, 0, 0, "p2p", 60, 30, 60, 70, 30, 10)],
        schema=got.columns, orient="row",
    ).with_columns(pl.col(c) * US for c in got.columns[4:]).cast(got.schema)
    assert_frame_equal(got, want)


def test_inferred_schedule_matches_annotations_and_gives_the_same_attribution():
    annotated = analyze(two_stage_cpu().run())
    inferred = analyze(two_stage_cpu(annotated=False).run())
    assert set(inferred.schedule["source"]) == {"inferred"}
    key = ["rank", "step", "stage", "microbatch", "phase"]
    assert_frame_equal(inferred.schedule.select(key), annotated.schedule.select(key))
    assert_frame_equal(cats(inferred), expected(CPU_TWO_STAGE_INFERRED))
    assert inferred.stages["stage_source"].to_list() == ["inferred from P2P chain"] * 2


def test_strip_annotations_removes_only_pipeline_names():
    ev = two_stage_cpu().events()
    stripped = strip_annotations(ev)
    assert ev.height - stripped.height == 4
    assert not stripped["name"].cast(pl.String).str.starts_with("PP:").any()


def two_stage_gpu(*, cpu_ops: bool = False) -> EventsBuilder:
    b = EventsBuilder()
    b.step(0, 1, 0, 100)
    b.ann(0, "PP:0F0", 0, 10)
    b.kernel(0, "sgemm", 5, 25, launch=2)
    b.nccl(0, "send", 1, launch=12, start=25, end=35)
    b.nccl(0, "recv", 1, launch=45, start=40, end=70)
    b.ann(0, "PP:0B0", 50, 60)
    b.kernel(0, "sgemm_bwd", 70, 90, launch=52)
    b.step(1, 1, 0, 100)
    b.nccl(1, "recv", 0, launch=1, start=10, end=36)
    b.ann(1, "PP:1F0", 30, 40)
    b.kernel(1, "sgemm", 36, 50, launch=31)
    b.ann(1, "PP:1B0", 40, 55)
    b.kernel(1, "sgemm_bwd", 50, 60, launch=41)
    b.nccl(1, "send", 0, launch=56, start=60, end=68)
    if cpu_ops:  # the cpu ops around the launches; autograd runs backward on its own thread
        b.op(0, "aten::mm", 1.5, 3)
        b.op(0, BWD, 51.5, 53, tid="autograd")
        b.op(1, "aten::mm", 30.5, 32)
        b.op(1, BWD, 40.5, 42, tid="autograd")
    return b


def test_gpu_kernels_are_the_busy_timeline_and_nccl_kernels_are_p2p():
    a = analyze(two_stage_gpu().run())
    assert_frame_equal(cats(a), expected([
        # rank 0: kernels 5–25 (launched in F0) and 70–90 (in B0); send kernel 25–35 all transfer (rank 1's recv
        # kernel was already up); recv kernel 40–70 waits until rank 1's send kernel starts at 60, after the last
        # forward kernel: cooldown 20, then transfer 10.
        (0, 1, "forward", 20), (0, 1, "backward", 20), (0, 1, "p2p", 10 + 10), (0, 1, "bubble_cooldown", 20),
        (0, 1, "host", 5 + 5 + 10),
        # rank 1: recv kernel 10–36 waits until 25 (before its first forward kernel at 36: warmup), moves 25–36.
        (1, 1, "forward", 14), (1, 1, "backward", 10), (1, 1, "p2p", 11 + 8), (1, 1, "bubble_warmup", 15),
        (1, 1, "host", 10 + 32),
    ]))
    assert a.p2p.select("src", "dst", "wait_ns", "transfer_ns").rows() == [(0, 1, 15 * US, 11 * US),
                                                                             (1, 0, 20 * US, 10 * US)]
    # The schedule shows when the GPU ran each phase, not when the CPU launched it.
    assert a.schedule.select("rank", "phase", "start_ns", "end_ns").rows() == [
        (0, "forward", 5 * US, 25 * US), (0, "backward", 70 * US, 90 * US),
        (1, "forward", 36 * US, 50 * US), (1, "backward", 50 * US, 60 * US)]


def test_gpu_schedule_inferred_from_launch_order_matches_annotations():
    b = two_stage_gpu(cpu_ops=True)
    truth = analyze(b.run())
    inferred = analyze(b.run(events=strip_annotations(b.events())))
    assert set(inferred.schedule["source"]) == {"inferred"}
    cols = ["rank", "stage", "microbatch", "phase", "start_ns", "end_ns"]  # GPU extents of the launched kernels
    assert_frame_equal(inferred.schedule.select(cols), truth.schedule.select(cols))
    assert_frame_equal(cats(inferred), cats(truth))


def test_collectives_and_the_optimizer_on_a_single_cpu_rank():
    b = EventsBuilder()
    b.step(0, 3, 0, 100)
    b.op(0, "aten::mm", 0, 30)
    b.op(0, "c10d::allreduce_", 30, 35)
    b.ann(0, "gloo:all_reduce", 32, 60, tid="runloop")  # gloo runs collectives on its own thread
    b.op(0, "aten::mm", 60, 70)
    b.ann(0, "Optimizer.step#SGD.step", 70, 90)
    b.op(0, "aten::add_", 72, 88)
    a = analyze(b.run())
    assert_frame_equal(cats(a), expected([
        # the optimizer step's whole window is the optimizer's (its own overhead, no wait in it); host only after it
        (0, 3, "other_compute", 40), (0, 3, "collective", 30), (0, 3, "optimizer", 20), (0, 3, "host", 10),
    ]))
    assert any("stage of rank 0 could not be determined (no run.json," in n for n in a.notes)
    # a run.json without stages (a data-parallel job under attach) is named as such, not as missing
    with_manifest = analyze(b.run(Manifest(world_size=1)))
    assert any("could not be determined (run.json gives no stage_of_rank," in n for n in with_manifest.notes)


def test_recompute_inside_backward_is_its_own_category():
    b = EventsBuilder()
    b.step(0, 1, 0, 50)
    b.ann(0, "PP:0B0", 0, 50)
    b.op(0, BWD, 0, 20)
    b.ann(0, "PP:0RECOMPUTE0", 20, 40)
    b.op(0, "aten::mm", 22, 38)
    b.op(0, BWD, 40, 50)
    a = analyze(b.run())
    # the RECOMPUTE window 20–40 is recompute (work 22–38 and its own overhead), the rest of B's window backward
    assert_frame_equal(cats(a), expected([(0, 1, "backward", 30), (0, 1, "recompute", 20)]))


def test_bpipe_transfers_count_as_bpipe_not_p2p():
    b = EventsBuilder()
    b.step(0, 1, 0, 100)
    b.ann(0, "PP:0F0", 0, 10)
    b.op(0, "aten::mm", 0, 10)
    b.ann(0, "PP:0EVICT0", 10, 20)
    b.op(0, "aten::copy_", 10, 11)
    b.send(0, 1, 11, 19)
    b.step(1, 1, 0, 100)
    b.ann(1, "PP:3ACCEPT0", 5, 25)
    b.recv(1, 0, 6, 20)
    a = analyze(b.run())
    assert_frame_equal(cats(a), expected([
        (0, 1, "forward", 10), (0, 1, "bpipe", 10), (0, 1, "host", 80), (1, 1, "bpipe", 20), (1, 1, "host", 80),
    ]))
    assert a.p2p["channel"].to_list() == ["bpipe"]


def test_bpipe_group_traffic_is_bpipe_even_without_annotations():
    b = EventsBuilder()
    b.step(0, 1, 0, 100)
    b.send(0, 1, 10, 30)
    b.rows[-2]["pg"] = "traceana_bpipe"
    b.step(1, 1, 0, 100)
    b.recv(1, 0, 10, 30)
    b.rows[-2]["pg"] = "traceana_bpipe"
    a = analyze(b.run())
    assert a.p2p["channel"].to_list() == ["bpipe"]
    assert cats(a).filter(pl.col("category") == "bpipe")["ns"].to_list() == [20 * US, 20 * US]


def test_unmatched_recv_counts_as_waiting_and_is_reported():
    b = EventsBuilder()  # rank 0's trace is missing
    b.step(1, 1, 0, 100)
    b.recv(1, 0, 10, 50)
    b.ann(1, "PP:1F0", 50, 60)
    b.op(1, "aten::mm", 50, 60)
    a = analyze(b.run())
    # 10–11 inside the receive's post call, then waiting 11–50
    assert_frame_equal(cats(a), expected([(1, 1, "forward", 10), (1, 1, "p2p", 1), (1, 1, "bubble_warmup", 39),
                                          (1, 1, "host", 50)]))
    assert any("no counterpart" in n and "rank 1←0: 1" in n for n in a.notes)
    assert a.p2p.height == 0


def test_no_steps_means_one_whole_trace_step_and_a_note():
    b = EventsBuilder()
    b.op(0, "aten::mm", 10, 30)
    b.op(0, "aten::mm", 40, 50)
    a = analyze(b.run())
    assert a.steps.rows() == [(0, timeline.WHOLE_TRACE_STEP, 10 * US, 50 * US, 40 * US)]
    assert_frame_equal(cats(a), expected([(0, -1, "other_compute", 30), (0, -1, "host", 10)]))
    assert any("no ProfilerStep" in n for n in a.notes)


def test_steps_on_some_ranks_only_are_reported():
    b = two_stage_cpu()
    b.rows = [r for r in b.rows if not (r["rank"] == 1 and r["name"].startswith("ProfilerStep"))]
    a = analyze(b.run())
    assert sorted(a.steps.select("rank", "step").rows()) == [(0, 1), (1, -1)]
    assert any("ranks 1 have no ProfilerStep" in n for n in a.notes)


def test_memory_per_stage_baseline_peak_and_balance():
    b = two_stage_cpu()
    b.memory(0, -10, 1000, 1000)
    b.memory(0, 10, 1500, 500)
    b.memory(0, 50, 3000, 1500)
    b.memory(0, 90, 1200, -1800)
    b.memory(1, 20, 600, 100)  # no sample before the step: baseline = 600 − 100
    a = analyze(b.run(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1))))
    assert a.stage_memory.select("rank", "stage", "baseline_bytes", "peak_bytes", "activation_peak_bytes").rows() == [
        (0, 0, 1000, 3000, 2000), (1, 1, 500, 600, 100)]
    assert a.summary.memory_balance == pytest.approx(5.0)
    assert a.stages["peak_memory_bytes"].to_list() == [3000, 600]


def test_clock_offsets_from_pairs_that_would_receive_before_sending():
    pairs = pl.DataFrame({"src": [0, 1], "dst": [1, 2], "send_start_ns": [1000, 5000], "recv_end_ns": [500, 5200]})
    got, notes = timeline.clock_offsets(pairs, [0, 1, 2], same_host=None)
    # rank 1's clock reads at least 500 ns early relative to rank 0; every pair must be possible afterwards.
    o = dict(got.select("rank", "offset_ns").rows())
    assert o[0] == 0 and o[1] == 500
    for src, dst, send, recv in pairs.rows():
        assert send + o[src] <= recv + o[dst]
    assert got["source"].unique().to_list() == ["p2p constraints"] and notes


def test_clock_offsets_are_zero_on_one_host():
    pairs = pl.DataFrame({"src": [0], "dst": [1], "send_start_ns": [1000], "recv_end_ns": [500]})
    got, _ = timeline.clock_offsets(pairs, [0, 1], same_host=True)
    assert got["offset_ns"].to_list() == [0, 0] and got["source"][0] == "same host"


def test_mfu_from_the_manifest():
    from traceana.core.manifest import ModelShape

    model = ModelShape(family="gpt", layers=2, hidden=64, heads=4, vocab=128, seq=16)
    m = Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), microbatch_size=2, num_microbatches=1, model=model,
                 peak_flops=1e12)
    a = analyze(two_stage_cpu().run(m))
    mfu = a.stages["mfu"].to_list()
    assert all(x is not None and 0 < x < 1 for x in mfu)
    assert mfu[1] > mfu[0]  # the last stage also runs the logit layer, in the same step time


# --- property: categories of every (rank, step) are non-negative and sum to the step --------------------------
@st.composite
def random_trace(draw):
    b = EventsBuilder()
    n_ranks = draw(st.integers(1, 3))
    for r in range(n_ranks):
        steps = draw(st.integers(0, 2))
        for s in range(steps):
            b.step(r, s, s * 100, s * 100 + draw(st.integers(1, 100)))
        for _ in range(draw(st.integers(0, 6))):
            t0 = draw(st.integers(-20, 220))
            t1 = t0 + draw(st.integers(0, 40))
            kind = draw(st.sampled_from(["op", "bwd", "F", "B", "R", "EVICT", "send", "recv", "coll", "opt", "ker"]))
            peer = draw(st.integers(0, 2))
            if kind == "op":
                b.op(r, "aten::mm", t0, t1)
            elif kind == "bwd":
                b.op(r, BWD, t0, t1)
            elif kind in ("F", "B", "R", "EVICT"):
                action = {"R": "RECOMPUTE"}.get(kind, kind)
                b.ann(r, f"PP:{r}{action}{draw(st.integers(0, 2))}", t0, t1)
            elif kind == "send":
                b.send(r, peer, t0, t1)
            elif kind == "recv":
                b.recv(r, peer, t0, t1)
            elif kind == "coll":
                b.op(r, "c10d::allreduce_", t0, t1)
            elif kind == "opt":
                b.ann(r, "Optimizer.step#SGD.step", t0, t1)
            else:
                b.kernel(r, "sgemm", t0, t1, launch=t0 - 1)
    if not b.rows:
        b.op(0, "aten::mm", 0, 1)
    return b


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_trace())
def test_categories_are_non_negative_and_sum_to_the_step(b):
    a = analyze(b.run())
    assert (a.attribution["ns"] >= 0).all()
    sums = a.attribution.group_by("rank", "step").agg(pl.col("ns").sum())
    check = a.steps.join(sums, on=["rank", "step"], how="left")
    assert (check["ns"] == check["dur_ns"]).all(), check
    seg = a.segments
    assert (seg["end_ns"] > seg["start_ns"]).all()
