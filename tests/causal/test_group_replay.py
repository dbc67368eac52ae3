"""The replay one pipeline group a task (traceana.causal.group_replay, issue 32 Build 6): the same figures as the
one-process engine (replay.replay: causal.scheduler.run_schedule) to the nanosecond — on every run in tests/data
with data-parallel replicas, on generated GPU-style jobs of many replicas (tests/benchmarks/gen_big_trace.py), on the
what-if's variants — and on a hand-built pp 2 × dp 3 step whose replay, and whose counterfactual with its slowed
replica at the others' speed, are worked out by hand. Where the run does not split, one line says why."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from traceana.causal import graph, group_replay, replay
from traceana.causal.whatif import _ideals, all_ideal_except, changed, parse_set, whatif
from traceana.measure.analysis_cache import load_and_analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "whatif_foreign"
MS = 1_000_000
# every run in tests/data with more than one data-parallel replica (the rest are single pipelines)
DP_RUNS = sorted(p.name for p in DATA.iterdir() if "-dp2-" in p.name)
SETS = [["forward=0"], ["rank=1:ideal"], ["stage=1:forward*0.5"], ["host*3"], ["p2p=0", "collective*0.3"],
        ["replica=1:peers"], ["forward*0.7", "backward*1.3"]]


def engine_rank_steps(g: graph.StepGraph) -> list[list[int]]:
    return [replay.replay(g, s).ranks.sort("rank")["step_ns"].to_list() for s in g.steps]


def variants(ops: pl.DataFrame) -> list:
    return [changed(ops, [parse_set(x) for x in c]) for c in SETS] + [all_ideal_except(None, None, None),
                                                                      all_ideal_except("stage", 0, None, peers=True)]


def test_tests_data_has_runs_with_replicas():
    assert len(DP_RUNS) == 16, DP_RUNS


@pytest.mark.parametrize("name", DP_RUNS)
def test_per_group_is_the_engine_on_every_run_of_tests_data_with_replicas(name):
    g = graph.build(load_and_analyze(str(DATA / name / "run"), cache=False))
    groups = group_replay.pipeline_groups(g)
    assert len(groups) == 2
    # the data-parallel all-reduces join the replicas: the split has starts to solve for
    assert all(group_replay.boundary_collectives(g, groups)[s] for s in g.steps)
    assert group_replay.rank_steps_ns(g) == engine_rank_steps(g)
    if "steps6" in name and "sleep-1" in name:  # (the variants on two of them: each is the engine's, exactly)
        ops, edges = _ideals(g)
        vs = variants(ops)
        assert group_replay.replay_variants(g, ops, edges, vs) == replay.replay_variants(g, ops, edges, vs)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> graph.StepGraph:
    # 4 stages × 12 replicas, 16 micro-batches, two measured steps: 48 ranks, ~3,500 operations (the batched
    # evaluator's range: above replay.BATCH_FROM_OPS)
    out = tmp_path_factory.mktemp("gen") / "run"
    write_run(out, ranks=4, dp=12, mb=0.4, gz=False, microbatches=16, kernels=1)
    g = graph.build(load_and_analyze(str(out), cache=False))
    assert g.ops.height >= replay.BATCH_FROM_OPS and len(g.steps) >= 2
    return g


def test_per_group_is_the_engine_on_a_generated_job_of_many_replicas(generated):
    g = generated
    assert len(group_replay.pipeline_groups(g)) == 12
    assert group_replay.rank_steps_ns(g) == engine_rank_steps(g)
    assert group_replay.replay_steps_ns(g) == replay.replay_steps_ns(g)
    ops, edges = _ideals(g)
    vs = variants(ops)
    assert group_replay.replay_variants(g, ops, edges, vs, chunk=4) == replay.replay_variants(g, ops, edges, vs)


def test_many_variants_go_in_rounds_with_the_same_figures(generated, monkeypatch):
    g = generated
    ops, edges = _ideals(g)
    vs = variants(ops)
    want = group_replay.replay_variants(g, ops, edges, vs)
    # (48 ranks × 2 columns — the all-reduce of every rank is each step's one boundary collective — × 3 variants a
    # round: 9 variants and the 2 probes in 4 rounds of the 12 groups' tasks)
    assert {s: len(x) for s, x in group_replay.boundary_collectives(g, group_replay.pipeline_groups(g)).items()} == {
        s: 1 for s in g.steps}
    monkeypatch.setattr(group_replay, "GROUP_CELLS", 48 * 2 * 3)
    calls = []
    real = group_replay.group_task
    monkeypatch.setattr(group_replay, "group_task", lambda t: calls.append(1) or real(t))
    assert group_replay.replay_variants(g, ops, edges, vs) == want
    assert len(vs) == 9 and len(calls) == 4 * 12


def hand_pp2_dp3(slow: float = 2.0) -> graph.StepGraph:
    """pp 2 × dp 3, one micro-batch: replica k is rank k (stage 0) and rank 3 + k (stage 1). Each rank: F (10 ms;
    stage 1's after stage 0's activation), B (20 ms; stage 0's after stage 1's gradient), its stage's data-parallel
    all-reduce (5 ms; ``ar0`` of ranks 0–2, ``ar1`` of 3–5), an all-reduce of all six (1 ms, ``norm``: the gradient
    norm) and the optimizer (stage 0: 2 ms, stage 1: 4 ms). Replica 1's F and B take ``slow`` times as long."""
    def w(r, ms):
        return round(ms * (slow if r in (1, 4) else 1.0) * MS)
    ops = []
    for r in range(6):
        st, ar = (0, "ar0") if r < 3 else (1, "ar1")
        ops += [(r, 0, "F", w(r, 10), None, None), (r, 1, "B", w(r, 20), None, None),
                (r, 2, "C", 5 * MS, ar, 3), (r, 3, "C", 1 * MS, "norm", 6), (r, 4, "O", (2 if st == 0 else 4) * MS,
                                                                              None, None)]
    o = pl.DataFrame([(r, 0, q, a, graph.KIND_OF_ACTION[a], 0 if r < 3 else 1, 0 if a in "FB" else None, 0, 0, wk, 0,
                       grp, n, "hand", False, 0) for r, q, a, wk, grp, n in ops],
                     schema={**graph.OPS, **graph.WAIT}, orient="row")
    e = pl.DataFrame([(0, "p2p", k, 0, 3 + k, 0, None, 0, 0, 0) for k in range(3)]
                     + [(0, "p2p", 3 + k, 1, k, 1, None, 0, 0, 0) for k in range(3)], schema=graph.EDGES, orient="row")
    rk = pl.DataFrame([(r, 0, 0, 0, 0, 0 if r < 3 else 1, r % 3) for r in range(6)], schema=graph.RANK_STEPS,
                      orient="row")
    return graph.StepGraph(ops=o, edges=e, ranks=rk, steps=(0,))


def test_a_hand_built_pp2_dp3_step_with_one_slowed_replica():
    """By hand, replica 1 at twice the work (F 20, B 40 ms), the others at F 10, B 20:
    replicas 0 and 2: stage 0 F 0–10; stage 1 F 10–20, B 20–40, ready for ar1 at 40; stage 0 B 40–60, ready for ar0
    at 60. Replica 1: rank 1 F 0–20; rank 4 F 20–40, B 40–80 (ar1 at 80); rank 1 B 80–120 (ar0 at 120).
    ar1 starts with its last member, 80: 80–85 on ranks 3–5; ar0 at 120: 120–125 on 0–2. norm joins all six: stage 1
    ready at 85, stage 0 at 125: 125–126 (a collective after the others: a chain of boundary starts). Optimizer:
    stage 0 126–128, stage 1 126–130. Every rank starts at 0: ranks 0–2 128 ms, ranks 3–5 130 ms, the step 130.

    Replica 1 at the others' speed (its F and B halved): every replica as replicas 0 and 2 above: ar1 40–45, ar0
    60–65, norm 65–66, optimizer to 68 (stage 0) and 70 (stage 1): the step 70 ms; a gain of 60 ms, the slowed
    replica's whole excess (its 30 ms longer passes on each of its two stages, in series)."""
    g = hand_pp2_dp3()
    groups = group_replay.pipeline_groups(g)
    assert groups == [(0, 3), (1, 4), (2, 5)]
    assert group_replay.boundary_collectives(g, groups) == {0: {"ar0": 0, "ar1": 1, "norm": 2}}
    assert group_replay.rank_steps_ns(g) == [[128 * MS] * 3 + [130 * MS] * 3]
    assert group_replay.rank_steps_ns(g) == engine_rank_steps(g)  # (and the engine agrees with the hand)
    fixed = pl.when(pl.col("rank").is_in([1, 4]) & pl.col("action").is_in(["F", "B"])).then(
        pl.col("work_ns") // 2).otherwise(pl.col("work_ns"))
    v = [(fixed, pl.col("gap_ns"), pl.col("transfer_ns"))]
    assert group_replay.rank_steps_variants(g, g.ops, g.edges, v)[0] == [[68 * MS] * 3 + [70 * MS] * 3]
    assert group_replay.replay_variants(g, g.ops, g.edges, v) == [[70 * MS]]
    assert replay.replay_variants(g, g.ops, g.edges, v) == [[70 * MS]]
    # the what-if on it, per group and in one process: the same tables (per_group's one note aside)
    hand = SimpleNamespace(run=SimpleNamespace(path="hand"))
    one, per = whatif(hand, graph=g), whatif(hand, graph=g, per_group=map)
    assert per.groups.equals(one.groups) and per.summary == one.summary
    assert [n for n in per.notes if n not in one.notes] == ["the variants replayed one pipeline group a task: 3 "
                                                             "groups of 2 ranks"]


def test_the_groups_tasks_run_on_a_dask_cluster():
    distributed = pytest.importorskip("distributed")
    from traceana.measure.partitioned import dask_map

    g = hand_pp2_dp3()
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        assert group_replay.rank_steps_ns(g, map=dask_map(client)) == [[128 * MS] * 3 + [130 * MS] * 3]


def test_a_run_that_does_not_split_is_said_in_one_line():
    g = hand_pp2_dp3()
    unknown = g.ranks.with_columns(pl.lit(None, pl.Int32).alias("replica"))
    with pytest.raises(group_replay.GroupSplitError, match="replicas are not known"):
        group_replay.pipeline_groups(graph.StepGraph(ops=g.ops, edges=g.edges, ranks=unknown, steps=g.steps))
    across = pl.concat([g.edges, pl.DataFrame([(0, "p2p", 0, 4, 4, 4, None, 0, 0, 0)], schema=graph.EDGES,
                                              orient="row")])
    with pytest.raises(group_replay.GroupSplitError, match="1 P2P messages go between pipeline replicas") as e:
        group_replay.pipeline_groups(graph.StepGraph(ops=g.ops, edges=across, ranks=g.ranks, steps=g.steps))
    assert "\n" not in e.value.line()
    # one replica (pp 2): one group, the whole job
    pp = hand_pp2_dp3().ranks.with_columns(pl.lit(0, pl.Int32).alias("replica"))
    assert group_replay.pipeline_groups(graph.StepGraph(ops=g.ops, edges=g.edges, ranks=pp, steps=g.steps)) == [
        tuple(range(6))]


def test_whatif_per_group_through_the_command(capsys):
    from traceana.cli import main

    run = str(DATA / "megatron-dp2-steps6-defaults-sleep-1" / "run")
    out = []
    for extra in ([], ["--per-group"]):
        assert main(["whatif", run, "--no-cache", "--json", *extra]) == 0
        out.append(json.loads(capsys.readouterr().out))
    one, per = out
    note = [n for n in per["notes"] if n not in one["notes"]]
    assert note == ["the variants replayed one pipeline group a task: 2 groups of 2 ranks"]
    per["notes"] = one["notes"]
    assert per == one
    assert main(["whatif", run, "--no-cache", "--dask", "tcp://127.0.0.1:1"]) == 2  # (--dask needs --per-group)
    err = capsys.readouterr().err.strip()
    assert "needs --per-group" in err and "\n" not in err
