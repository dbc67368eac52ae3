"""Schedule reconstruction and bubble patterns on synthetic pipelines built by a tiny exact simulation.

``pipeline_trace`` plays GPipe or 1F1B on p stages with gloo-style P2P: blocking receives (complete ``lat`` after
both sides are there) and asynchronous sends (posted in 1 µs, complete ``lat`` after the receiver posted; blocking
sends would deadlock 1F1B, which is why real pipelines batch them), and writes what a CPU trace would hold: the
P2P ops and spans, one compute op per F/B (autograd's op name for B) and, optionally, our PP: annotations.
Because every time is known, the recovered schedule and the bubbles can be checked exactly.
"""

from __future__ import annotations

import polars as pl
import pytest
from attribution_builder import US, EventsBuilder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from traceana.core.manifest import Manifest
from traceana.measure.analysis import analyze, strip_annotations

BWD = "autograd::engine::evaluate_function: MmBackward0"


def program(schedule: str, p: int, m: int, s: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(p - s - 1, m)  # 1F1B (Narayanan et al. 2021, Fig. 4): warm-up forwards, steady 1F1B, cool-down
    prog = [("F", k) for k in range(warm)]
    for k in range(m - warm):
        prog += [("F", warm + k), ("B", k)]
    prog += [("B", k) for k in range(m - warm, m)]
    return prog


def pipeline_trace(schedule: str, *, p: int = 4, m: int = 8, tf: int = 10, tb: int = 20, lat: int = 2,
                   annotate: bool = True, rank_of_stage: list[int] | None = None, bpipe: bool = False,
                   step: int = 1) -> EventsBuilder:
    rank = rank_of_stage or list(range(p))
    b = EventsBuilder()
    progs = [program(schedule, p, m, s) for s in range(p)]
    pos, free, phase = [0] * p, [0] * p, ["recv"] * p
    send_start_ns: dict[tuple, int] = {}  # (kind, k, src stage) -> when the sender's send began
    recv_post_ns: dict[tuple, int] = {}  # (kind, k, dst stage) -> when the receiver posted
    pending: list[tuple] = []
    done = 0
    while done < p:
        progressed = False
        for s in range(p):
            if pos[s] == len(progs[s]):
                continue
            act, k = progs[s][pos[s]]
            src = s - 1 if act == "F" else s + 1  # where this action's input comes from
            dst = s + 1 if act == "F" else s - 1  # where its output goes
            kind = "act" if act == "F" else "grad"
            if phase[s] == "recv":
                if 0 <= src < p:
                    recv_post_ns.setdefault((kind, k, s), free[s])
                    if (kind, k, src) not in send_start_ns:
                        continue
                    end = max(free[s], send_start_ns[(kind, k, src)]) + lat
                    b.recv(rank[s], rank[src], free[s], end)
                    free[s] = end
                dur = tf if act == "F" else tb
                if annotate:
                    b.ann(rank[s], f"PP:{s}{act}{k}", free[s], free[s] + dur)
                b.op(rank[s], "aten::mm" if act == "F" else BWD, free[s], free[s] + dur)
                free[s] += dur
                if 0 <= dst < p:
                    send_start_ns[(kind, k, s)] = free[s]
                phase[s] = "send"
                progressed = True
            if phase[s] == "send":
                if 0 <= dst < p:  # isend: post and go on; the send completes once the receiver posted
                    pending.append((s, dst, free[s], (kind, k, dst)))
                    free[s] += 1
                if bpipe and act == "F" and s < p // 2:
                    partner = p - 1 - s  # BPipe pairs stage s with p−1−s (Kim et al. 2023)
                    b.ann(rank[s], f"PP:{s}EVICT{k}", free[s], free[s] + 3)
                    b.send(rank[s], rank[partner], free[s] + 1, free[s] + 3, tag=7)
                    b.recv(rank[partner], rank[s], free[s] + 1, free[s] + 3, tag=7)
                    free[s] += 3
                phase[s] = "recv"
                pos[s] += 1
                done += pos[s] == len(progs[s])
                progressed = True
        assert progressed, "synthetic pipeline deadlocked"
    for s, dst, start, key in pending:
        b.send(rank[s], rank[dst], start, max(start, recv_post_ns[key]) + lat)
    end = max(free) + 5
    for s in range(p):
        b.step(rank[s], step, 0, end)
    return b


def by_stage(a, category: str) -> list[int]:
    return (a.attribution.filter(pl.col("category") == category).sort("stage")["ns"] // US).to_list()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_annotated_schedule_is_recovered_in_full(schedule):
    a = analyze(pipeline_trace(schedule).run())
    assert a.schedule.height == 4 * 8 * 2
    assert set(a.schedule["source"]) == {"annotated"}
    got = a.schedule.group_by("stage", "phase").agg(pl.col("microbatch").sort()).sort("stage", "phase")
    assert all(mbs == list(range(8)) for mbs in got["microbatch"].to_list())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_inferred_schedule_equals_the_annotated_truth(schedule):
    b = pipeline_trace(schedule)
    truth = analyze(b.run())
    inferred = analyze(b.run(events=strip_annotations(b.events())))
    assert set(inferred.schedule["source"]) == {"inferred"}
    cols = ["rank", "step", "stage", "microbatch", "phase", "start_ns", "end_ns"]
    assert_frame_equal(inferred.schedule.select(cols), truth.schedule.select(cols))
    assert_frame_equal(inferred.attribution, truth.attribution)


def test_stage_order_is_inferred_from_the_p2p_chain_whatever_the_rank_numbering():
    perm = [2, 0, 3, 1]  # stage s runs on rank perm[s]
    b = pipeline_trace("1f1b", annotate=False, rank_of_stage=perm)
    a = analyze(b.run())
    got = dict(a.stages.select("rank", "stage").rows())
    assert got == {perm[s]: s for s in range(4)}
    assert set(a.stages["stage_source"]) == {"inferred from P2P chain"}
    assert a.schedule.height == 64


def test_1f1b_bubbles_last_stage_waits_longest_first_stage_idles_longest_at_the_end():
    a = analyze(pipeline_trace("1f1b").run())
    warm, cool = by_stage(a, "bubble_warmup"), by_stage(a, "bubble_cooldown")
    assert warm == sorted(warm) and warm[-1] == max(warm) and warm[0] == 0
    assert cool == sorted(cool, reverse=True) and cool[0] == max(cool) and cool[-1] == 0
    # Compute is exactly what was scheduled: m·tf forward and m·tb backward on every stage.
    assert by_stage(a, "forward") == [80] * 4 and by_stage(a, "backward") == [160] * 4
    # The last stage posted its first recv at 0 and the data left stage 2 after three forwards and two hops;
    # the last hop itself (2 µs) is transfer, and so is the 1 µs inside the post call: neither is waiting.
    assert warm[-1] == 3 * 10 + 2 * 2 - 1


def test_gpipe_fill_grows_down_the_pipeline_and_drain_up_it():
    a = analyze(pipeline_trace("gpipe").run())
    warm, cool = by_stage(a, "bubble_warmup"), by_stage(a, "bubble_cooldown")
    # s·tf + (s−1)·lat − 1: waiting for the first activation, less the 1 µs spent inside the post call
    assert warm == [0, 9, 21, 33]
    assert cool == sorted(cool, reverse=True) and cool[0] > cool[-1] > 0


def test_bpipe_evictions_are_bpipe_time_and_leave_the_chain_and_schedule_alone():
    plain = analyze(pipeline_trace("1f1b", annotate=False).run())
    b = pipeline_trace("1f1b", bpipe=True)
    a = analyze(b.run())
    assert by_stage(a, "bpipe")[:2] == [8 * 3, 8 * 3]  # each of 8 evictions blocks its evictor for 3 µs
    assert set(a.p2p.filter(pl.col("tag") == 7)["channel"]) == {"bpipe"}
    assert set(a.p2p.filter(pl.col("tag") != 7)["channel"]) == {"p2p"}
    assert not any("no counterpart" in n for n in a.notes)
    inferred = analyze(b.run(events=strip_annotations(b.events())))
    assert inferred.stages.select("rank", "stage").rows() == plain.stages.select("rank", "stage").rows()
    cols = ["rank", "stage", "microbatch", "phase"]
    assert_frame_equal(inferred.schedule.select(cols), a.schedule.select(cols))


def test_mfu_uses_the_manifest_model_and_peak():
    from traceana.core.manifest import ModelShape

    model = ModelShape(family="gpt", layers=4, hidden=64, heads=4, vocab=256, seq=32)
    m = Manifest(world_size=4, pp=4, schedule="1f1b", microbatch_size=2, num_microbatches=8, model=model,
                 peak_flops=1e12)
    a = analyze(pipeline_trace("1f1b").run(m))
    mfu = a.stages.sort("stage")["mfu"].to_list()
    assert all(0 < x < 1 for x in mfu) and mfu[-1] > mfu[0]
    assert a.stages["hfu"].to_list() == a.stages["mfu"].to_list()  # no recompute: hardware = model FLOPs


def test_skewed_clocks_are_corrected_from_p2p_pairs():
    """Rank 3's clock runs 500 µs ahead: its sends seem to start after rank 2 already received them. The correction
    must make every pair possible again, take rank 3 back by about the skew, and leave the schedule intact."""
    b = pipeline_trace("1f1b")
    truth = analyze(b.run())
    skewed = b.events().with_columns(
        pl.when(pl.col("rank") == 3).then(pl.col("ts_ns") + 500 * US).otherwise(pl.col("ts_ns")).alias("ts_ns"))
    a = analyze(b.run(events=skewed))
    o = dict(a.clock_offsets.select("rank", "offset_ns").rows())
    assert set(a.clock_offsets["source"]) == {"p2p constraints"}
    assert o[0] == 0 and -500 * US <= o[3] <= -(500 - 2) * US  # exact up to the 2 µs link latency
    assert (a.p2p["transfer_ns"] >= 0).all() and (a.p2p["recv_end_ns"] >= a.p2p["send_start_ns"]).all()
    cols = ["rank", "stage", "microbatch", "phase"]
    assert_frame_equal(a.schedule.select(cols), truth.schedule.select(cols))
    assert any("clocks differ" in n for n in a.notes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(2, 5), m=st.integers(1, 6),
       tf=st.integers(1, 30), tb=st.integers(1, 60), lat=st.integers(1, 10))
def test_inference_equals_annotations_for_any_gpipe_or_1f1b_pipeline(schedule, p, m, tf, tb, lat):
    b = pipeline_trace(schedule, p=p, m=m, tf=tf, tb=tb, lat=lat)
    truth = analyze(b.run())
    inferred = analyze(b.run(events=strip_annotations(b.events())))
    cols = ["rank", "step", "stage", "microbatch", "phase", "start_ns", "end_ns"]
    assert truth.schedule.height == p * m * 2
    assert_frame_equal(inferred.schedule.select(cols), truth.schedule.select(cols))
    assert_frame_equal(inferred.attribution, truth.attribution)
    sums = truth.attribution.group_by("rank", "step").agg(pl.col("ns").sum())
    assert (truth.steps.join(sums, on=["rank", "step"]).select(pl.col("ns") == pl.col("dur_ns"))).to_series().all()


def test_a_run_without_messages_pairs_into_the_tables_one_message_gives_emptied():
    # p2p.pair plans but does not run its queries when there is no message: the empty tables must be exactly
    # the ones its queries give (one unmatched send, run through them, then emptied).
    from traceana.measure.p2p import MESSAGE, pair
    from traceana.core.schema import conform

    one = conform(pl.DataFrame({"rank": [0], "dir": ["send"], "channel": ["p2p"], "peer": [1], "tag": [0],
                                "nbytes": [4], "step": [0], "post_ns": [10], "end_ns": [20], "on_gpu": [False],
                                "launch_ns": [10]}), MESSAGE)
    ran = pair(one)
    assert ran[1].height == 1 and ran[3]  # the send is unmatched, and said so
    empty = pair(one.clear())
    for got, want in zip(empty[:3], ran[:3]):
        assert got.schema == want.schema and got.height == 0
    assert empty[3] == []
