"""The measured graph's replay holds no frozen time (issue 32, Builds 1, 2 and 5): hand-built steps whose
counterfactual is worked out by hand, and properties on every run in tests/data and every schedule collect makes —
with every kind of work at 0 the replay is at most 2 % of the measured step; the replay does not read the ProfilerStep
end; the critical path sums to the step; messages whose traces name no peer pair as the peers' own traces say;
messages that do not pair and orders no schedule can run are said."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import critical_path, graph, replay
from traceana.causal.whatif import _ideals, changed, parse_set
from traceana.measure.analysis_cache import load_and_analyze

from engine_check import replayed_ns

DATA = Path(__file__).parents[1] / "data"
MS = 1_000_000
ZERO = [parse_set(s) for s in ("forward=0", "backward=0", "optimizer=0", "collective=0", "p2p=0", "host=0")]
TESTS_DATA = ["megatron_pipe/1f1b/run", "megatron_pipe/interleaved/run", "deepspeed_pipe/1f1b/run",
              "pipelining_memory/gpipe_m2", "pipelining_memory/interleaved_m1"]
# every schedule traceana collect makes (tests/collected_runs.py): the reference trainer's and pipelining's
COLLECTED = ["1f1b", "gpipe", "1f1b_bpipe", "1f1b_pp2dp2", "pipelining-interleaved-1f1b", "pipelining-looped-bfs",
             "pipelining-zero-bubble", "pipelining-zbv", "pipelining-dualpipev"]


def hand(ops: list[tuple], edges: list[tuple] = (), *, starts: dict[int, float] | None = None) -> graph.StepGraph:
    """ops: (rank, seq, action, work ms, host gap ms, wait ms); edges: (src, src_seq, dst, dst_seq, anchor_seq or
    None, send lag ms, post lag ms, transfer ms). One step (0), every rank its own stage, starting at 0 unless given;
    no tails."""
    o = pl.DataFrame(
        [(r, 0, q, a, graph.KIND_OF_ACTION[a], r, None, 0, 0, round(w * MS), round(g * MS), None, None, "hand",
          False, round(wt * MS)) for r, q, a, w, g, wt in ops],
        schema={**graph.OPS, **graph.WAIT}, orient="row")
    e = pl.DataFrame([(0, "p2p", s, sq, d, dq, a, round(sl * MS), round(p * MS), round(t * MS))
                      for s, sq, d, dq, a, sl, p, t in edges], schema=graph.EDGES, orient="row")
    starts = starts or {}
    rk = pl.DataFrame([(r, 0, round(starts.get(r, 0) * MS), 0, 0, r, 0) for r in sorted({op[0] for op in ops})],
                      schema=graph.RANK_STEPS, orient="row")
    return graph.StepGraph(ops=o, edges=e, ranks=rk, steps=(0,))


def with_ideals(g: graph.StepGraph) -> tuple[pl.DataFrame, pl.DataFrame]:
    ops = g.ops.with_columns(pl.col("work_ns").alias("ideal_work"), pl.col("gap_ns").alias("ideal_gap"),
                             pl.col("work_ns").alias("peer_work"), pl.col("gap_ns").alias("peer_gap"),
                             pl.col("work_ns").alias("stage_work"), pl.lit(0).alias("replica"),
                             pl.col("phase").alias("kind"))
    return ops, g.edges.with_columns(pl.col("transfer_ns").alias("ideal_transfer"))


def replayed_ms(g: graph.StepGraph, changes: list[str]) -> list[float]:
    """The step replayed with ``changes``, on the engine and on the batched evaluator (which must agree)."""
    ops, edges = with_ideals(g)
    engine = replayed_ns(g, ops, edges, changed(ops, [parse_set(c) for c in changes]))
    return [x / MS for x in engine]


def test_a_wait_no_edge_explains_shrinks_with_the_step():
    # rank 0: A (10 ms); rank 1: 10 ms of waiting on nothing the graph knows, then C (10 ms): the step is 20 ms.
    # Forwards at half their time: the step's work halves (10 of 20 ms), so does the wait: C at 5, ends 10. Frozen,
    # the wait would have kept the step at 15 ms. Everything at 0: nothing is left.
    g = hand([(0, 0, "F", 10, 0, 0), (1, 0, "F", 10, 0, 10)])
    assert replayed_ms(g, []) == [20]
    assert replayed_ms(g, ["forward*0.5"]) == [10]
    assert replayed_ms(g, [c.text for c in ZERO]) == [0]


def test_a_senders_lag_is_its_host_work():
    # rank 0: A (10 ms), 2 ms of host work, B (10 ms); A's activation is sent 2 ms after A ends (the same host time)
    # and takes 5 ms: C on rank 1 at 17, ends 27. Host time gone: the send follows A at once, C 15-25. Host time
    # doubled: the send 4 ms after A, C 19-29 (B 14-24).
    g = hand([(0, 0, "F", 10, 0, 0), (0, 1, "F", 10, 2, 0), (1, 0, "F", 10, 0, 0)], [(0, 0, 1, 0, None, 2, 0, 5)])
    assert replayed_ms(g, []) == [27]
    assert replayed_ms(g, ["host=0"]) == [25]
    assert replayed_ms(g, ["host*2"]) == [29]


def test_a_ranks_host_ratio_is_over_the_run_not_one_step():
    # the senders-lag step twice: rank 0's 2 ms send lag in both, its host gap before B 2 ms in step 0 and 0.1 ms in
    # step 1 (2.1 ms of host work over the run); both steps 27 ms (C ends at 10 + 2 + 5 + 10). The variant gives that
    # gap 1 ms in both steps (what the ideal does: the rank's typical gap): its host work over the run 2 ms, so its
    # lags scale by 2 / 2.1, C ends at 25 + 2 × 2 / 2.1 = 26.904762 ms in both steps. Per step, step 1's ratio would
    # be 1 / 0.1 = 10: a 20 ms lag, a 45 ms step.
    one = hand([(0, 0, "F", 10, 0, 0), (0, 1, "F", 10, 2, 0), (1, 0, "F", 10, 0, 0)], [(0, 0, 1, 0, None, 2, 0, 5)])
    o = pl.concat([one.ops, one.ops.with_columns(step=pl.lit(1, dtype=one.ops["step"].dtype),
                                                 gap_ns=pl.when((pl.col("rank") == 0) & (pl.col("seq") == 1))
                                                 .then(round(0.1 * MS)).otherwise(pl.col("gap_ns")))])
    e = pl.concat([one.edges, one.edges.with_columns(step=pl.lit(1, dtype=one.edges["step"].dtype))])
    rk = pl.concat([one.ranks, one.ranks.with_columns(step=pl.lit(1, dtype=one.ranks["step"].dtype))])
    g = graph.StepGraph(ops=o, edges=e, ranks=rk, steps=(0, 1))
    assert replay.replay_steps_ns(g) == [27 * MS, 27 * MS]
    gap = pl.when((pl.col("rank") == 0) & (pl.col("seq") == 1)).then(MS).otherwise(pl.col("gap_ns"))
    want = round(25 * MS + 2 * MS * 2 / 2.1)
    assert replay.replay_steps_ns(g, ops=o.with_columns(gap_ns=gap)) == [want, want]
    old, replay.BATCH_FROM_OPS = replay.BATCH_FROM_OPS, 0
    try:
        assert replay.replay_variants(g, o, e, [(pl.col("work_ns"), gap, pl.col("transfer_ns"))]) == [[want, want]]
    finally:
        replay.BATCH_FROM_OPS = old


def test_a_late_start_shrinks_with_the_step():
    # rank 1 starts its step 4 ms after rank 0 (the previous step ended late there); A (10 ms) on rank 0 feeds C
    # (10 ms) on rank 1 at once: C 10-20, rank 1's step 16 ms. Forwards at half: the step's work halves, so does the
    # late start (2 ms): A 0-5, C 5-10, rank 1's step 8 ms.
    g = hand([(0, 0, "F", 10, 0, 0), (1, 0, "F", 10, 0, 0)], [(0, 0, 1, 0, None, 0, 0, 0)], starts={1: 4})
    assert replayed_ms(g, []) == [16]
    assert replayed_ms(g, ["forward*0.5"]) == [8]


def test_a_blocking_send_holds_its_sender_until_the_message_is_through():
    # rank 0: A (10 ms) sends to rank 1, whose receive is posted after its X (20 ms, a backward); the message takes
    # 1 ms once both are posted: it is through at 21, C 21-31. The send blocked (gloo's send waits for its
    # receiver), so rank 0's B waits for it too: 21-31 (without that edge 10-20). X at half: through at 11, B and
    # C 11-21.
    g = hand([(0, 0, "F", 10, 0, 0), (0, 1, "F", 10, 0, 0), (1, 0, "B", 20, 0, 0), (1, 1, "F", 10, 0, 0)],
             [(0, 0, 1, 1, 0, 0, 0, 1)])
    g = graph.StepGraph(ops=g.ops, edges=g.edges, ranks=g.ranks, steps=g.steps,
                        blocking=pl.DataFrame([(0, 0, 0, 1)], schema=graph.BLOCKING, orient="row"))
    r = replay.replay(g, 0)
    got = {(a, b): (s / MS, e / MS) for a, b, s, e in r.ops.select("rank", "seq", "start_ns", "end_ns").iter_rows()}
    assert got[(0, 1)] == (21, 31) and got[(1, 1)] == (21, 31)
    assert replayed_ms(g, []) == [31]
    assert replayed_ms(g, ["backward*0.5"]) == [21]
    path, _ = critical_path.critical_path(g, r)
    assert int((path["end_ns"] - path["start_ns"]).sum()) == r.step_ns


def test_a_send_posted_after_a_blocking_receive_waits_on_that_receives_message():
    """DeepSpeed's 1F1B, by hand (pp 2; stage 1's forwards slowed to 30 ms). Rank 0: F0 0-10, F1 10-20, then its
    blocking receive of gradient 0 (posted at 20), then the send of activation 1, then B0 (10 ms). Rank 1: F0 10-40
    (activation 0 at once), B0 40-50, gradient 0 takes 1 ms: rank 0's receive returns at 51; 1 ms of host work later
    (52) it posts activation 1 (1 ms: arrives 53): rank 1's F1 53-83; rank 0's B0 after that host work, 52-62. Step:
    83 ms. The send's measured lag after F1 is 32 ms, 31 of them the receive's wait (from its post at 20 to gradient
    0's arrival at 51): that part waits on gradient 0's message, the 1 ms after it is host work.
    Stage 1's forwards at 10 ms: F0 10-20, B0 20-30, gradient 0 at 31, activation 1 posted 32 (max(F1's end 20 + the
    1 ms of host work, 31 + 1)), arrives 33, F1 33-43; B0 on rank 0 32-42: 43 ms. Were the 32 ms the sender's host
    work (frozen), activation 1 would leave at 52 and the step be 63 ms. With every kind at 0 nothing is left."""
    g = hand([(0, 0, "F", 10, 0, 0), (0, 1, "F", 10, 0, 0), (0, 2, "B", 10, 1, 0),
              (1, 0, "F", 30, 0, 0), (1, 1, "B", 10, 0, 0), (1, 2, "F", 30, 0, 0)],
             [(0, 0, 1, 0, None, 0, 0, 0),   # activation 0
              (1, 1, 0, 2, 1, 0, 0, 1),      # gradient 0: the receive posted after F1 (anchor seq 1)
              (0, 1, 1, 2, 1, 32, 0, 1)])    # activation 1: 32 ms after F1, posted by rank 1 after its B0
    # in the replay's order (dst, dst_seq, …): gradient 0 is edge 0, activation 0 edge 1, activation 1 edge 2
    after = pl.DataFrame([(0, 2, "send", 0, 1 * MS, 31 * MS)], schema=graph.AFTER_RECEIVE, orient="row")
    g = graph.StepGraph(ops=g.ops, edges=g.edges, ranks=g.ranks, steps=g.steps, after_receive=after)
    assert replayed_ms(g, []) == [83]
    assert replayed_ms(g, ["stage=1:forward=10"]) == [43]
    assert replayed_ms(g, [c.text for c in ZERO]) == [0]
    r = replay.replay(g, 0)
    got = {(a, b): (s / MS, e / MS) for a, b, s, e in r.ops.select("rank", "seq", "start_ns", "end_ns").iter_rows()}
    assert got[(1, 2)] == (53, 83) and got[(0, 2)] == (52, 62)
    path, slack = critical_path.critical_path(g, r)
    assert int((path["end_ns"] - path["start_ns"]).sum()) == r.step_ns
    assert slack["slack_ns"].min() >= 0


def _zeroed_share(a) -> float:
    g = graph.build(a)
    ops, edges = _ideals(g)
    zeroed = replay.replay_variants(g, ops, edges, [changed(ops, ZERO)])[0]
    measured = (g.ranks.group_by("step").agg((pl.col("end_ns") - pl.col("start_ns")).max()).sort("step")
                ["end_ns"].to_list())
    return max(z / m for z, m in zip(zeroed, measured))


@pytest.mark.parametrize("run", TESTS_DATA)
def test_every_kind_at_zero_leaves_no_frozen_time_in_the_runs_of_tests_data(run):
    assert _zeroed_share(load_and_analyze(str(DATA / run), cache=False)) <= 0.02


@pytest.mark.parametrize("name", COLLECTED)
def test_every_kind_at_zero_leaves_no_frozen_time_in_every_schedule_collect_makes(collected_run, name):
    assert _zeroed_share(load_and_analyze(str(collected_run(name)), cache=False)) <= 0.02


def _copy(src: Path, dst: Path, edit) -> Path:
    """A copy of the run directory with ``edit(rank_file_name, events)`` applied to each trace's events."""
    shutil.copytree(src, dst)
    for trace in sorted(dst.glob("rank*.pt.trace.json.gz")):
        with gzip.open(trace, "rt") as f:
            doc = json.load(f)
        doc["traceEvents"] = edit(trace.name, doc["traceEvents"])
        with gzip.open(trace, "wt") as f:
            json.dump(doc, f)
    return dst


def _replayed(run: Path) -> list[int]:
    return replay.replay_steps_ns(graph.build(load_and_analyze(str(run), cache=False)))


@pytest.mark.filterwarnings("ignore:.*ProfilerStep spans overlap")
def test_the_replay_does_not_read_the_profilerstep_end(tmp_path):
    # every ProfilerStep span 50 ms longer: the measured step follows, the replay (the graph's work) does not
    def later(_name, events):
        return [{**e, "dur": e["dur"] + 50_000} if str(e.get("name", "")).startswith("ProfilerStep#") else e
                for e in events]

    src = DATA / "pipelining_memory/gpipe_m2"
    moved = _copy(src, tmp_path / "late", later)
    assert _replayed(moved) == _replayed(src)


@pytest.mark.parametrize("run", TESTS_DATA)
def test_the_critical_path_spans_the_step_printed_beside_it(run):
    g = graph.build(load_and_analyze(str(DATA / run), cache=False))
    for step in g.steps:
        r = replay.replay(g, step)
        path, _ = critical_path.critical_path(g, r)
        assert int((path["end_ns"] - path["start_ns"]).sum()) == r.step_ns


def _without_shapes(_name, events):
    """record_shapes off: no Concrete Inputs (the P2P calls' peers), no input dims."""
    drop = {"Input Dims", "Input type", "Concrete Inputs", "Input Strides"}
    return [{**e, "args": {k: v for k, v in e["args"].items() if k not in drop}} if isinstance(e.get("args"), dict)
            else e for e in events]


@pytest.mark.parametrize("run", ["pipelining_memory/gpipe_m2", "pipelining_memory/interleaved_m1"])
def test_messages_without_peers_pair_as_the_peers_traces_say(tmp_path, run):
    # the same run with its peers removed: every message is given its peer from the schedule, and the pairs are the
    # ones the traces' own peers make
    src = DATA / run
    a = load_and_analyze(str(src), cache=False)
    b = load_and_analyze(str(_copy(src, tmp_path / "no_shapes", _without_shapes)), cache=False)
    assert b.p2p.height == 0  # (what the analysis itself pairs without peers)
    ga, gb = graph.build(a), graph.build(b)
    cols = ["step", "src", "src_seq", "dst", "dst_seq"]
    assert gb.edges.height == ga.edges.height > 0
    assert gb.edges.select(cols).sort(cols).equals(ga.edges.select(cols).sort(cols))
    assert any("name no peer" in n for n in gb.notes) and not any("no counterpart" in n for n in gb.notes)
    assert replay.replay_steps_ns(gb) == replay.replay_steps_ns(ga)


def test_messages_without_a_counterpart_are_said(tmp_path):
    # rank 1's receives removed (its gloo:recv spans and c10d recv ops): the sends to it pair with nothing
    def no_recvs(name, events):
        if not name.startswith("rank1."):
            return events
        return [e for e in events if not ("recv" in str(e.get("name", "")).lower() and e.get("ph") == "X")]

    g = graph.build(load_and_analyze(str(_copy(DATA / "pipelining_memory/gpipe_m2", tmp_path / "r", no_recvs)),
                                     cache=False))
    assert any("have no counterpart" in n for n in g.notes), g.notes


def test_an_order_no_schedule_can_run_is_said(tmp_path):
    # rank 0's forward of micro-batch 0 moved after its backward: a dependency cycle, said, and not consistent
    def swap(name, events):
        if not name.startswith("rank0."):
            return events
        f = sorted((e for e in events if e.get("name") == "PP:0F0"), key=lambda e: e["ts"])
        b = sorted((e for e in events if e.get("name") == "PP:0B0"), key=lambda e: e["ts"])
        for fe, be in zip(f, b):
            fe["ts"] = be["ts"] + be["dur"] + 1
        return events

    g = graph.build(load_and_analyze(str(_copy(DATA / "pipelining_memory/gpipe_m2", tmp_path / "s", swap)),
                                     cache=False))
    assert any(n.startswith("dependency cycle") for n in g.notes), g.notes
    n, m = g.consistent
    assert n < m


def test_the_batched_replay_is_the_engines_on_a_graph_of_ten_thousand_operations():
    # pp 8 × dp 20, 1F1B, m 32 (tests/benchmarks/bench_whatif_scale.py's synthetic step): 10,560 operations. The
    # batched evaluator checks itself against the engine on the measured durations (its run-time invariant) and
    # gives the engine's step on changed ones: a slowed stage, everything at half, a rank's host time doubled.
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_whatif_scale import synthetic, with_windows

    g = with_windows(synthetic(8, 20, 32))
    assert g.ops.height >= 10_000
    ops = g.ops.with_columns(pl.col("phase").alias("kind"))
    variants = [
        (pl.when(pl.col("stage") == 3).then(pl.col("work_ns") * 2).otherwise("work_ns"), pl.col("gap_ns"),
         pl.col("transfer_ns")),
        ((pl.col("work_ns") // 2), (pl.col("gap_ns") // 2), (pl.col("transfer_ns") // 2)),
        (pl.col("work_ns"), pl.when(pl.col("rank") == 5).then(pl.col("gap_ns") * 2).otherwise("gap_ns"),
         pl.col("transfer_ns")),
    ]
    batched = replay.replay_variants(g, ops, g.edges, variants)
    engine = [replay.replay_steps_ns(g, ops=ops.with_columns(w.alias("work_ns"), gp.alias("gap_ns")),
                                    edges=g.edges.with_columns(t.alias("transfer_ns"))) for w, gp, t in variants]
    assert batched == engine
    assert batched[0][0] > replay.replay_steps_ns(g)[0] > batched[1][0]


def test_a_single_pipeline_without_peers_gets_no_invented_replicas(tmp_path):
    # gpipe_m2 is one pipeline of 3 ranks; without shapes its messages name no peer: the summary's replica table must
    # not show each rank as a replica of its own (it showed 3), nor the graph
    a = load_and_analyze(str(_copy(DATA / "pipelining_memory/gpipe_m2", tmp_path / "r", _without_shapes)), cache=False)
    s = a.summary
    assert s.per_stage["replicas"].to_list() == [1, 1, 1], s.per_stage
    assert s.replicas is None or s.replicas["replica"].null_count() == s.replicas.height, s.replicas
    assert graph.build(a).ranks["replica"].n_unique() == 1
