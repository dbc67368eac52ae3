"""A GPU rank running two operations at once on two streams (issue 32, Build 1: launch → kernel and stream order;
traceana/causal/gpu_edges.py ``lane_order``, the replay's lanes).

Hand-built as Kineto writes it (tests/causal/test_gpu_edges.py's ``Gpu``: annotations, cudaLaunchKernel ↔ kernel by
correlation id, NCCL record_param_comms with its kernel), read, analysed and made a graph by the same code as a real
run's. The expected figures are worked out by hand in the docstrings (µs), from the streams' rules: a kernel waits
for the kernel before it on its stream and, across streams, for what the timeline shows it came after; two
operations that ran at the same time on two streams have no edge between them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from traceana.causal import critical_path, graph, group_replay, replay
from traceana.causal.whatif import _ideals, changed, parse_set
from traceana.measure.analysis_cache import load_and_analyze

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from engine_check import replayed_ns  # noqa: E402
from gen_big_trace import write_run  # noqa: E402
from test_gpu_edges import ZERO, Gpu, _write, replayed_us  # noqa: E402

US = 1_000


def _dualpipe(tmp_path) -> graph.StepGraph:
    """One GPU rank, the CPU ahead of its GPU (every kernel launched by 71, long before it runs). Forwards on stream
    8, backwards on stream 7 (DualPipe's overlapped chunks: micro-batch k+1's forward beside micro-batch k's
    backward), the gradients' all-reduce on stream 20 beside the last backward:

        stream 8:  F0 10-110  F1 110-210  F2 210-310
        stream 7:             B0 110-310 (after F0: an event)   B1 310-510   B2 510-710   O 710-760
        stream 20:                                              C 510-610 (after B1)

    The CPU launches F0's kernel at 1 (the GPU idle before it: host), everything else enqueued; its synchronize
    returns at 761 (1 µs of host after the optimizer). Step: 761. The graph before the lanes (one chain a rank, a
    span inside another's part of it) took F1 and F2, inside B0's span, as part of B0 and left the all-reduce,
    inside B2's, out: forward doubled it read 861, the all-reduce tripled 761 (docs/whatif.md "GPU ranks")."""
    r = Gpu(0, 1)
    r.tb.step(0, 0, 800)
    for at, name, start, dur, stream in [(0, "PP:0F0", 10, 100, 8), (10, "PP:0F1", 110, 100, 8),
                                         (20, "PP:0B0", 110, 200, 7), (30, "PP:0F2", 210, 100, 8),
                                         (40, "PP:0B1", 310, 200, 7), (50, "PP:0B2", 510, 200, 7)]:
        r.tb.annotation(name, at, 8)
        r.kernel(at + 1, start, dur, stream=stream)
    r.allreduce(60, 510, 100)
    r.tb.annotation("Optimizer.step#SGD.step", 70, 8)
    r.kernel(71, 710, 50, stream=7)
    r.sync(80, 761)
    return graph.build(load_and_analyze(_write(tmp_path, [r]), cache=False))


def test_a_forward_beside_a_backward_on_two_streams_runs_at_once_in_the_replay(tmp_path):
    """The step above. Each operation after its stream's previous one and after the latest operation of each other
    stream that ended by its start: B0 after F0 (110), B1 after F2 (310) and B0, the all-reduce after B1 (510),
    the optimizer after B2 and the all-reduce. Replayed: 761, every edge consistent with the timeline (8 of 8).

    Backward doubled: B0 110-510, B1 510-910, the all-reduce 910-1010, B2 910-1310, O 1310-1360: 1361.
    Forward doubled: F0 10-210, F1 210-410, F2 410-610, B0 210-410, B1 after F2 610-810, the all-reduce 810-910,
    B2 810-1010, O 1010-1060: 1061. The all-reduce tripled (300): it ends at 810, after B2 (710): the optimizer
    waits for it, 810-860: 861 (doubled it ends with B2: 761). Every kind at 0: 0."""
    g = _dualpipe(tmp_path)
    ops = g.ops.sort("seq")
    got = {a + (str(m) if m is not None else ""): ((s - g.ranks["start_ns"][0]) / US, w / US, ln)
           for a, m, s, w, ln in ops.select("action", "microbatch", "start_ns", "work_ns", "lane").iter_rows()}
    assert got == {"F0": (10, 100, 8), "F1": (110, 100, 8), "B0": (110, 200, 7), "F2": (210, 100, 8),
                   "B1": (310, 200, 7), "C": (510, 100, 20), "B2": (510, 200, 7), "O": (710, 50, 7)}
    assert g.consistent == (8, 8)
    assert int(g.ops["wait_ns"].sum()) == 0
    assert ops.filter(pl.col("action") == "F", pl.col("microbatch") == 0)["gap_ns"].item() == 10 * US
    assert [n for n in g.notes if "at once in the replay" in n]
    assert replayed_us(g, []) == 761
    assert replayed_us(g, ["backward*2"]) == 1361
    assert replayed_us(g, ["forward*2"]) == 1061
    assert replayed_us(g, ["collective*3"]) == 861
    assert replayed_us(g, ["collective*2"]) == 761
    assert replayed_us(g, list(ZERO)) == 0


def test_the_critical_path_of_two_streams_runs_through_the_stream_that_ended_last(tmp_path):
    """The step above, as measured: back from the step's end, the synchronize's 1 µs of host after the optimizer,
    O 710-760, B2, B1, B0 on stream 7, then F0 (B0 came after it on stream 8), and F0's launch (host 0-10): host 11,
    forward 100, backward 600, optimizer 50 — 761, the step. F1 and F2 ran beside B0, off the path, yet without
    slack: B1 came after F2 (at 310), so F2 must end by 310 and F1 (before it on stream 8) by 210. The all-reduce
    has 100 µs: the optimizer came after it, and it may end as late as B2 does (710)."""
    g = _dualpipe(tmp_path)
    r = replay.replay(g, 0 if 0 in g.steps else g.steps[0])
    assert r.step_ns == 761 * US
    path, slack = critical_path.critical_path(g, r)
    by_kind = {k: round(v / US) for k, v in path.group_by("kind").agg((pl.col("end_ns") - pl.col("start_ns")).sum())
               .iter_rows()}
    assert by_kind == {"host": 11, "forward": 100, "backward": 600, "optimizer": 50}
    assert int((path["end_ns"] - path["start_ns"]).sum()) == 761 * US
    seqs = dict(g.ops.select(pl.concat_str(pl.col("action"), pl.col("microbatch").cast(pl.String).fill_null(""))
                             .alias("name"), "seq").iter_rows())
    s = dict(slack.select("seq", "slack_ns").iter_rows())
    assert s[seqs["C"]] == 100 * US
    assert s[seqs["F1"]] == 0 and s[seqs["F2"]] == 0 and s[seqs["B0"]] == 0


def test_the_synthetic_pipeline_whose_optimizer_runs_beside_its_all_reduce_replays_its_timeline(tmp_path):
    """tests/benchmarks/gen_big_trace.py with ``overlap_optimizer``: pp 2 × dp 2, the optimizer's kernels (compute
    stream) start 188 µs into the 380 µs all-reduce (communication stream). The timeline's step — each rank's last
    event's end less its ProfilerStep's start, the slowest rank's, read from the events here, not from the graph —
    is what the replay gives on the measured durations, step by step, every edge consistent with it (200 of 200)
    and no wait no edge explains. One after another (the graph before the lanes) 20 operations were contradicted
    (the optimizers, started before their all-reduce ended) and each step replayed 192 µs long (4.397 ms for 4.205)."""
    out = tmp_path / "run"
    write_run(out, ranks=2, dp=2, mb=0.3, gz=False, microbatches=4, kernels=2, overlap_optimizer=True)
    a = load_and_analyze(str(out), cache=False)
    g = graph.build(a)
    assert g.consistent == (200, 200) and int(g.ops["wait_ns"].sum()) == 0
    assert g.after is not None
    ev = a.events
    begin = ev.filter(pl.col("kind") == "step").select("rank", "step", pl.col("ts_ns").alias("_s"))
    last = (ev.filter((pl.col("kind") != "step") & pl.col("step").is_not_null()).group_by("rank", "step")
            .agg((pl.col("ts_ns") + pl.col("dur_ns")).max().alias("_e")))
    timeline = dict(begin.join(last, on=["rank", "step"]).group_by("step")
                    .agg((pl.col("_e") - pl.col("_s")).max()).iter_rows())
    assert replay.replay_steps_ns(g) == [timeline[s] for s in g.steps]
    ops, edges = _ideals(g)
    assert replayed_ns(g, ops, edges, changed(ops, [parse_set(s) for s in ZERO])) == [0] * len(g.steps)
    # the lanes on the batched evaluator (engine_check) and per pipeline group are the engine's, to the nanosecond
    sets = [["collective*3"], ["backward*2"], ["optimizer=0"], ["rank=1:host*3", "forward*0.5"]]
    vs = [changed(ops, [parse_set(x) for x in c]) for c in sets]
    for v in vs:
        replayed_ns(g, ops, edges, v)
    assert group_replay.rank_steps_ns(g) == [replay.replay(g, s).ranks.sort("rank")["step_ns"].to_list()
                                             for s in g.steps]
    old, replay.BATCH_FROM_OPS = replay.BATCH_FROM_OPS, 0
    try:
        assert group_replay.replay_variants(g, ops, edges, vs) == replay.replay_variants(g, ops, edges, vs)
    finally:
        replay.BATCH_FROM_OPS = old


def _p2p(r: Gpu, op: str, peer: int, at: float, start: float, dur: float, stream: int) -> None:
    """record_param_comms at ``at`` launching its SendRecv kernel on ``stream`` (sends 20, receives 21)."""
    r.corr += 1
    ext = r.tb._ext + 1
    r.tb.nccl_p2p(op, peer=peer, ts=at, dur=1, kernel_ts=start, kernel_dur=dur, correlation=r.corr, stream=stream)
    r.tb.launch(at + 0.5, 0.4, correlation=r.corr, ext_id=ext)


def test_a_message_from_a_rank_on_two_streams_leaves_with_the_pass_that_made_it(tmp_path):
    """pp 2 on two GPUs, NCCL sends on stream 20, receives on 21, each 10 µs through. Rank 0: F0 (stream 8) 10-110,
    activation 0 sent 110-120; its CPU loads data until 425 and launches F1 (stream 8) at 428: 430-530 (320 µs of
    host work after F0), beside B0 (stream 7, enqueued at 21), which waits for gradient 0 (received 120-430):
    430-630; activation 1 sent after F1, 530-540; B1 after gradient 1, 850-1050; the synchronize until 1051. Rank 1
    (one stream): F0 120-220, B0 220-420, gradient 0 sent 420-430, F1 after activation 1 540-640, B1 640-840,
    gradient 1 840-850. Step: 1051, no wait.

    Activation 1 is F1's (it ended at 530, when the send began), not B0's, which started at the same instant and
    was still running; gradient 0 feeds B0, not F1 (a gradient feeds a backward). Stage 0's backward doubled: B0
    430-830, F1 beside it as before, activation 1 at 540, rank 1's F1 540-640, B1 640-840, gradient 1 at 850, rank
    0's B1 850-1250: 1251. Stage 1's backward doubled: rank 1's B0 220-620, gradient 0 at 630, rank 0's B0 630-830;
    rank 1's F1 620-720 (after its B0), B1 720-1120, gradient 1 at 1130, rank 0's B1 1130-1330: 1331. The graph
    before the lanes took F1 as part of B0 (its span inside B0's): 1451 and 1451; with the lanes but the message's
    ends taken by start, activation 1 left after B0 and gradient 0 fed F1 (B0 a 320 µs wait no edge explains):
    1553.4 and 1353.4."""
    r0, r1 = Gpu(0, 2), Gpu(1, 2)
    for r in (r0, r1):
        r.tb.step(0, 0, 1200)
    r0.tb.annotation("PP:0F0", 0, 8)
    r0.kernel(1, 10, 100, stream=8)
    _p2p(r0, "send", 1, 12, 110, 10, 20)
    _p2p(r0, "recv", 1, 14, 120, 310, 21)
    r0.tb.annotation("PP:0B0", 20, 8)
    r0.kernel(21, 430, 200, stream=7)
    r0.tb.cpu_op("aten::copy_", 35, 390)  # (loading data: host work)
    r0.tb.annotation("PP:0F1", 426, 8)
    r0.kernel(428, 430, 100, stream=8)
    _p2p(r0, "send", 1, 429, 530, 10, 20)
    _p2p(r0, "recv", 1, 431, 540, 310, 21)
    r0.tb.annotation("PP:0B1", 434, 8)
    r0.kernel(435, 850, 200, stream=7)
    r0.sync(440, 1051)
    _p2p(r1, "recv", 0, 0, 5, 115, 21)
    r1.tb.annotation("PP:1F0", 2, 1.5)
    r1.kernel(2.5, 120, 100, stream=7)
    r1.tb.annotation("PP:1B0", 4, 1.5)
    r1.kernel(4.5, 220, 200, stream=7)
    _p2p(r1, "send", 0, 6, 420, 10, 20)
    _p2p(r1, "recv", 0, 8, 120, 420, 21)
    r1.tb.annotation("PP:1F1", 10, 1.5)
    r1.kernel(10.5, 540, 100, stream=7)
    r1.tb.annotation("PP:1B1", 12, 1.5)
    r1.kernel(12.5, 640, 200, stream=7)
    _p2p(r1, "send", 0, 14, 840, 10, 20)
    r1.sync(16, 851)
    g = graph.build(load_and_analyze(_write(tmp_path, [r0, r1]), cache=False))
    assert g.consistent == (8, 8) and int(g.ops["wait_ns"].sum()) == 0 and g.edges.height == 4
    name = pl.concat_str(pl.col("action"), pl.col("microbatch").cast(pl.String))
    seq = {(r, n): s for r, n, s in g.ops.select("rank", name.alias("n"), "seq").iter_rows()}
    got = {(src, dst, s, d) for src, dst, s, d in g.edges.select("src", "dst", "src_seq", "dst_seq").iter_rows()}
    assert got == {(0, 1, seq[(0, "F0")], seq[(1, "F0")]), (1, 0, seq[(1, "B0")], seq[(0, "B0")]),
                   (0, 1, seq[(0, "F1")], seq[(1, "F1")]), (1, 0, seq[(1, "B1")], seq[(0, "B1")])}
    assert replayed_us(g, []) == 1051
    assert replayed_us(g, ["stage=0:backward*2"]) == 1251
    assert replayed_us(g, ["stage=1:backward*2"]) == 1331
    assert replayed_us(g, list(ZERO)) == 0
