"""The measured step as a dependency graph (traceana.causal.graph), its replay on the simulator's engine, and the
what-if (traceana.causal.whatif): hand-built graphs whose replay is worked out by hand, the real runs in tests/data (the
replay against the ProfilerStep spans each rank recorded; no straggler named), and the command's errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from stripped_runs import as_defaults
from traceana.causal import critical_path, graph, replay
from traceana.causal.diagnosis import diagnose
from traceana.causal.whatif import SetError, apply, materialize, parse_set, whatif
from traceana.measure.analysis_cache import load_and_analyze

DATA = Path(__file__).parents[1] / "data"
MS = 1_000_000


def hand_graph(ops: list[tuple], edges: list[tuple] = (), *, tails: dict[int, float] | None = None,
               starts: dict[int, float] | None = None) -> graph.StepGraph:
    """ops: (rank, seq, action, work ms, gap ms, group or None, members); edges: (src, src_seq, dst, dst_seq,
    anchor_seq or None, send lag ms, post lag ms, transfer ms). One step (0); every rank starts at 0 unless given."""
    o = pl.DataFrame(
        [(r, 0, q, a, graph.KIND_OF_ACTION[a], 0 if r == 0 else 1, None, 0, 0, round(w * MS), round(g * MS), grp,
          n, "hand", False) for r, q, a, w, g, grp, n in ops],
        schema=graph.OPS, orient="row")
    e = pl.DataFrame([(0, "p2p", s, sq, d, dq, a, round(sl * MS), round(pl_ * MS), round(t * MS))
                      for s, sq, d, dq, a, sl, pl_, t in edges], schema=graph.EDGES, orient="row")
    ranks = sorted({r for r, *_ in ops})
    starts = starts or {}
    tails = tails or {}
    rk = pl.DataFrame([(r, 0, round(starts.get(r, 0) * MS), 0, round(tails.get(r, 0) * MS), r, 0) for r in ranks],
                      schema=graph.RANK_STEPS, orient="row")
    return graph.StepGraph(ops=o, edges=e, ranks=rk, steps=(0,))


def two_ranks() -> graph.StepGraph:
    # rank 0: A (10 ms), B (10 ms), then 3 ms to its step's end; rank 1: C (10 ms, 1 ms of host before it), D (20 ms).
    # A's activation reaches C, B's reaches D; D's receive is posted right after C ends (its anchor).
    return hand_graph([(0, 0, "F", 10, 0, None, None), (0, 1, "F", 10, 0, None, None),
                       (1, 0, "F", 10, 1, None, None), (1, 1, "B", 20, 0, None, None)],
                      [(0, 0, 1, 0, None, 0, 0, 5), (0, 1, 1, 1, 0, 0, 0, 5)], tails={0: 3})


def ends(r: replay.Replay) -> dict[tuple[int, int], tuple[float, float]]:
    return {(a, b): (s / MS, e / MS) for a, b, s, e in r.ops.select("rank", "seq", "start_ns", "end_ns").iter_rows()}


def test_replay_of_a_hand_built_step():
    # By hand: A 0-10, B 10-20 (rank 0 ends at 20 + 3); C's input arrives at 10 + 5 and its host time follows: 16-26;
    # D's receive is posted when C ends, so B's gradient is in flight from 26: arrives 31, D 31-51.
    r = replay.replay(two_ranks(), 0)
    assert ends(r) == {(0, 0): (0, 10), (0, 1): (10, 20), (1, 0): (16, 26), (1, 1): (31, 51)}
    assert dict(r.ranks.select("rank", "step_ns").iter_rows()) == {0: 23 * MS, 1: 51 * MS}
    assert r.step_ns == 51 * MS
    bound = dict(((a, b), c) for a, b, c in r.ops.select("rank", "seq", "bound").iter_rows())
    assert bound == {(0, 0): "device", (0, 1): "device", (1, 0): "input", (1, 1): "input"}


def test_critical_path_and_slack_of_a_hand_built_step():
    # By hand (see above): the step (51 ms) is set by A 0-10, its activation in flight 10-15, C's host time 15-16,
    # C 16-26, B's gradient in flight from when D's receive was posted 26-31, D 31-51. B (ends 20) could end as late
    # as 26 (D's receive is posted then): slack 6; everything on the path has none.
    g = two_ranks()
    r = replay.replay(g, 0)
    path, slack = critical_path.critical_path(g, r)
    got = [(rk, sq, kind, s / MS, e / MS) for rk, sq, kind, s, e in
           path.select("rank", "seq", "kind", "start_ns", "end_ns").iter_rows()]
    assert got == [(0, 0, "forward", 0, 10), (1, None, "p2p", 10, 15), (1, None, "host", 15, 16),
                   (1, 0, "forward", 16, 26), (1, None, "p2p", 26, 31), (1, 1, "backward", 31, 51)]
    assert path["ms"].sum() == 51
    assert dict(((a, b), c / MS) for a, b, c in slack.iter_rows()) == {(0, 0): 0, (0, 1): 6, (1, 0): 0, (1, 1): 0}


def test_changes_on_a_hand_built_step():
    g = two_ranks()
    ops = g.ops.with_columns(pl.col("work_ns").alias("ideal_work"), pl.col("gap_ns").alias("ideal_gap"),
                             pl.col("work_ns").alias("peer_work"), pl.col("gap_ns").alias("peer_gap"),
                             pl.col("work_ns").alias("stage_work"), pl.lit(0).alias("replica"),
                             pl.col("phase").alias("kind"))
    edges = g.edges.with_columns(pl.col("transfer_ns").alias("ideal_transfer"))
    # no transfer time: C at 10 + 1 = 11-21, D when C ends: 21-41
    o, e = apply(ops, edges, [parse_set("p2p=0")])
    assert replay.replay(g, 0, ops=o, edges=e).step_ns == 41 * MS
    # rank 1's backward at half its time: D 31-41
    o, e = apply(ops, edges, [parse_set("rank=1:backward*0.5")])
    assert replay.replay(g, 0, ops=o, edges=e).step_ns == 41 * MS
    # every forward of stage 0 (rank 0) takes 2 ms: A 0-2, B 2-4; C at 7 + 1 = 8-18; D at max(4, 18) + 5 = 23-43
    o, e = apply(ops, edges, [parse_set("stage=0:forward=2")])
    assert replay.replay(g, 0, ops=o, edges=e).step_ns == 43 * MS
    # host gaps gone: C 15-25, D 30-50
    o, e = apply(ops, edges, [parse_set("host=0")])
    assert replay.replay(g, 0, ops=o, edges=e).step_ns == 50 * MS


def test_a_collective_starts_when_its_last_member_joins():
    # rank 0 joins after 10 ms, rank 1 after 30 ms; each takes 2 ms once both are in: both end at 32
    g = hand_graph([(0, 0, "F", 10, 0, None, None), (0, 1, "C", 2, 0, "g", 2),
                    (1, 0, "F", 30, 0, None, None), (1, 1, "C", 2, 0, "g", 2)])
    r = replay.replay(g, 0)
    assert ends(r)[(0, 1)] == (30, 32) and ends(r)[(1, 1)] == (30, 32)
    assert dict(r.ops.select("rank", "seq", "bound").rows(named=False)[i][::2] for i in (1, 3)) == {0: "group",
                                                                                                      1: "device"}


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "megatron_pipe/interleaved/run",
                                 "deepspeed_pipe/1f1b/run", "pipelining_memory/gpipe_m2",
                                 "pipelining_memory/interleaved_m1"])
def test_replay_matches_every_rank_of_the_runs_in_tests_data(run):
    # the truth: each rank's ProfilerStep span (analysis.steps), which the replay does not read
    a = load_and_analyze(str(DATA / run), cache=False)
    g = graph.build(a)
    for step in g.steps:
        r = replay.replay(g, step)
        measured = dict(a.steps.filter(pl.col("step") == step).select("rank", "dur_ns").iter_rows())
        for rank, got in r.ranks.select("rank", "step_ns").iter_rows():
            assert abs(got - measured[rank]) <= 0.02 * measured[rank], (run, step, rank, got, measured[rank])
    assert not g.ops["contradicted"].any(), g.ops.filter(pl.col("contradicted"))


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "megatron_pipe/interleaved/run",
                                 "deepspeed_pipe/1f1b/run", "pipelining_memory/gpipe_m2"])
def test_the_critical_path_is_a_chain_to_the_step_end_with_no_slack(run):
    # what a critical path is, checked on real steps: one piece after another without a hole, ending where the slowest
    # rank's step ends (its ProfilerStep span); every operation on it has no slack, and none anywhere has less
    a = load_and_analyze(str(DATA / run), cache=False)
    g = graph.build(a)
    for step in g.steps:
        r = replay.replay(g, step)
        path, slack = critical_path.critical_path(g, r)
        starts, ends = path["start_ns"].to_list(), path["end_ns"].to_list()
        assert all(abs(s - e) <= 1 for s, e in zip(starts[1:], ends[:-1])), path
        slowest = a.steps.filter(pl.col("step") == step).sort("dur_ns", descending=True).row(0, named=True)
        assert abs(ends[-1] - slowest["end_ns"]) <= 0.02 * slowest["dur_ns"]
        on_path = path.filter(pl.col("seq").is_not_null()).select("rank", "seq").join(slack, on=["rank", "seq"])
        assert on_path["slack_ns"].max() <= 1_000, on_path.filter(pl.col("slack_ns") > 1_000)
        assert slack["slack_ns"].min() >= 0


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "deepspeed_pipe/1f1b/run"])
def test_other_frameworks_runs_name_no_straggler(run):
    s = diagnose(load_and_analyze(str(DATA / run), cache=False))
    assert s.stragglers.height == 0, s.per_stage
    assert s.bottleneck is None or s.bottleneck["group"] == "stage", s.diagnosis


def test_unknown_stages_invent_no_replicas_and_no_straggler():
    # megatron 1F1B as a trace without its stages (record_shapes off, no metadata): the two ranks are not replicas
    # of one stage '–', and neither is the other's peer
    a = load_and_analyze(str(DATA / "megatron_pipe/1f1b/run"), cache=False)
    blind = dataclasses.replace(a, schedule=a.schedule.with_columns(pl.lit(None, pl.Int32).alias("stage")),
                                stages=a.stages.with_columns(pl.lit(None, pl.Int32).alias("stage")))
    s = diagnose(blind)
    # (stages now told from megatron's pipeline group or the P2P call order: one pipeline, one replica a stage)
    assert s.per_stage["replicas"].fill_null(1).to_list() == [1] * s.per_stage.height, s.per_stage
    assert s.stragglers.height == 0 and s.bottleneck is None, s.diagnosis
    w = whatif(blind)
    assert set(w.groups["group"]) == {"kind", "rank"}, w.groups


def test_parse_set():
    c = parse_set("stage=1:forward*0.5")
    assert (c.who, c.who_id, c.kind, c.how, c.value) == ("stage", 1, "forward", "scale", 0.5)
    c = parse_set("p2p=0")
    assert (c.who, c.kind, c.how, c.value) == (None, "p2p", "set", 0.0)
    c = parse_set("rank=3:ideal")
    assert (c.who, c.who_id, c.kind, c.how) == ("rank", 3, None, "ideal")
    for bad in ("stage=1:fwd*0.5", "rank=3", "forward*x", "stage=a:ideal", "p2p=-1", ""):
        with pytest.raises(SetError):
            parse_set(bad)


def test_whatif_command_json_and_errors(tmp_path):
    run = str(DATA / "deepspeed_pipe/1f1b/run")
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "traceana", "whatif", run, "--no-cache"]
    doc = json.loads(subprocess.run([*cmd, "--json", "--set", "p2p=0"], capture_output=True, text=True, check=True,
                                    env=env).stdout)
    for key in ("measured_step_ms", "replayed_step_ms", "replay_error", "ideal_step_ms", "slowdown", "by_stage",
                "by_rank", "by_replica", "by_kind", "diagnosis", "changed_step_ms"):
        assert key in doc
    assert doc["replay_error"] < 0.02 and doc["changed_step_ms"] <= doc["replayed_step_ms"]
    bad = subprocess.run([*cmd, "--set", "stage=1:fwd*2"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "--set 'stage=1:fwd*2' cannot be read" in bad.stderr
    # a run whose ranks have no schedule: said, not guessed
    none = subprocess.run([sys.executable, "-m", "traceana", "whatif", str(DATA / "third_party/hta/cpu_only"),
                           "--no-cache"], capture_output=True, text=True, env=env)
    assert none.returncode == 2 and "no schedule" in none.stderr and "Traceback" not in none.stderr


def engine_and_batch_agree(monkeypatch, analysis, graph_=None, changes=()):
    """Every variant the what-if replays (every group made ideal and kept as measured, the changes), evaluated by
    replay.replay_variants, against the engine itself (replay.replay_steps_ns: causal.scheduler.run_schedule) on the
    variant's frames: to the nanosecond."""
    import traceana.causal.whatif as wi

    seen = []

    def recording(g, ops, edges, variants, **kw):
        got = replay.replay_variants(g, ops, edges, variants, chunk=3)  # (several chunks)
        seen.append((g, ops, edges, variants, got))
        return got

    monkeypatch.setattr(wi, "replay_variants", recording)
    monkeypatch.setattr(replay, "BATCH_FROM_OPS", 0)  # these graphs are small: batch them anyway
    w = whatif(analysis, [parse_set(c) for c in changes], graph=graph_)
    n = 0
    for g, ops, edges, variants, got in seen:
        assert all(replay._levels(g, step) is not None for step in g.steps)  # (batched, not the engine's fallback)
        for v, batch in zip(variants, got):
            o, e = materialize(ops, edges, v)
            assert batch == replay.replay_steps_ns(g, ops=o, edges=e)
            n += 1
    return w, n


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "megatron_pipe/interleaved/run",
                                 "deepspeed_pipe/1f1b/run", "pipelining_memory/gpipe_m2",
                                 "pipelining_memory/interleaved_m1"])
def test_batched_replays_are_the_engines_on_every_variant_of_the_runs(monkeypatch, run):
    a = load_and_analyze(str(DATA / run), cache=False)
    _, n = engine_and_batch_agree(monkeypatch, a, changes=("stage=0:forward*1.7", "p2p*3", "host=0.5"))
    assert n >= 10


def test_batched_replays_are_the_engines_on_hand_built_steps(monkeypatch):
    hand = SimpleNamespace(run=SimpleNamespace(path="hand"))
    collective = hand_graph([(0, 0, "F", 10, 0, None, None), (0, 1, "C", 2, 1, "g", 2), (0, 2, "O", 3, 0, None, None),
                             (1, 0, "F", 30, 0, None, None), (1, 1, "C", 2, 0, "g", 2)], starts={1: 4})
    for g, changes in ((two_ranks(), ("p2p=0",)), (two_ranks(), ("rank=1:backward*0.5", "stage=0:forward=2")),
                       (two_ranks(), ("host=0",)), (collective, ("rank=0:collective*4",))):
        w, n = engine_and_batch_agree(monkeypatch, hand, g, changes)
        assert n >= 5
    # by hand (test_changes_on_a_hand_built_step): no transfer time: 41 ms
    assert engine_and_batch_agree(monkeypatch, hand, two_ranks(), ("p2p=0",))[0].summary["changed_step_ms"] == 41


def test_a_small_runs_whatif_replays_on_the_engine_without_numpy():
    """A tiny run's what-if (every analyze runs it) replays each variant on the engine: importing numpy for the batched
    evaluation would cost more than the replays (docs/performance.md "Fixed cost")."""
    code = ("import sys, warnings; warnings.simplefilter('ignore'); import traceana; "
            f"a = traceana.load_and_analyze({str(DATA / 'megatron_pipe/1f1b/run')!r}, cache=False); traceana.diagnose(a); "
            "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "megatron_pipe/interleaved/run", "deepspeed_pipe/1f1b/run"])
def test_other_frameworks_runs_profiled_with_the_defaults_name_no_straggler_and_invent_no_replicas(tmp_path, run):
    # (issue 25: such a megatron job was shown as "4 data-parallel replicas of stage –" with "straggler: replica 0")
    a = load_and_analyze(str(as_defaults(DATA / run, tmp_path / "run")), cache=False)
    s = diagnose(a)
    assert s.stragglers.height == 0, s.diagnosis
    # (stages now told from megatron's pipeline group or the P2P call order: one pipeline, one replica a stage)
    assert s.per_stage["replicas"].fill_null(1).to_list() == [1] * s.per_stage.height, s.per_stage
    # (issues 32 and 36: the passes told from autograd's ops, the peerless messages paired from the schedule's
    # adjacent stages: the what-if answers, and says how its edges were made)
    assert any("name no peer" in n and "paired in order" in n for n in whatif(a).notes), whatif(a).notes
    full = diagnose(load_and_analyze(str(DATA / run), cache=False))  # the same run with its Python frames and shapes
    if full.bottleneck is not None:  # what the full trace names, the defaults name too (megatron 1F1B: stage 1)
        assert s.bottleneck is not None and (s.bottleneck["group"], s.bottleneck["id"]) == (
            full.bottleneck["group"], full.bottleneck["id"]), (s.diagnosis, full.diagnosis)
    else:  # where the full trace names nothing, the defaults may name a stage, never a rank: without Python frames
        # the first stage's forward also holds the data loading before it (issue 36's truth table: +0.06 of the
        # step on DeepSpeed), an imbalance the full trace counts as host time
        assert s.bottleneck is None or s.bottleneck["group"] == "stage", (s.diagnosis, full.diagnosis)
