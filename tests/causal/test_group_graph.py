"""The measured step's graph built one pipeline group a task (traceana.causal.group_graph, issue 32 Build 6): the
graph assembled from the groups' parts, each built in a task that held only its group's events, is the graph
``graph.build`` makes of the whole run in one process — frame for frame, note for note, and so its replay — on every
run in tests/data with data-parallel replicas (the one-process build is the independent path: one process, every
rank's events at once, no Parquet round trip). On a generated pp 2 × dp 2 job the facts only the whole job holds are
checked by hand: the step's gradient all-reduce has its 4 members, two in each group, and its work is what a
member took after the last of them joined."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import graph, group_graph, replay
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze
from traceana.measure.analysis_cache import load_and_analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "whatif_foreign"
DP_RUNS = sorted(p.name for p in DATA.iterdir() if "-dp2-" in p.name)


def _sorted(frame: pl.DataFrame | None) -> pl.DataFrame | None:
    return None if frame is None else frame.sort(frame.columns, nulls_last=True)


def assert_same_graph(got: graph.StepGraph, want: graph.StepGraph) -> None:
    assert got.steps == want.steps
    assert _sorted(got.ops).equals(_sorted(want.ops))
    assert got.edges.equals(want.edges)  # (both in the replay's order: the edge numbers below refer to it)
    assert got.ranks.equals(want.ranks)
    for name in ("blocking", "after_receive", "lag_wait", "after"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None or w.height == 0:
            assert g is None or g.height == 0, name
        else:
            assert _sorted(g).equals(_sorted(w)), name
    # (one difference by design: in one process a data-parallel run's peers without record_shapes are taken by place,
    # the i-th rank of a stage to the i-th of the next; in its pipeline group each stage is one rank, so none is)
    by_place = re.compile(r"; \d+ of them between stages held by several ranks, .*? \(rank = stage · dp \+ replica\)")
    assert (got.notes, got.unpaired, got.data_parallel) == (tuple(by_place.sub("", n) for n in want.notes),
                                                            want.unpaired, want.data_parallel)


@pytest.mark.parametrize("name", DP_RUNS)
def test_groups_parts_assemble_the_one_process_graph_on_every_run_of_tests_data_with_replicas(name, tmp_path):
    run = DATA / name / "run"
    want = graph.build(load_and_analyze(str(run), cache=False))
    analysis, got = group_graph.analyze_with_graph(run, tmp_path / "parts")
    if name.startswith("deepspeed"):  # no peer named, no pipeline group named: each rank a group, refused
        assert isinstance(got, graph.GraphError) and "are not its pipelines" in got.what, got
        return
    assert isinstance(got, graph.StepGraph), got
    assert analysis.events is None  # (the parent never held an event)
    assert_same_graph(got, want)
    assert [replay.replay(got, s).step_ns for s in got.steps] == [replay.replay(want, s).step_ns for s in want.steps]


@pytest.fixture(scope="module")
def run_2x2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pp2dp2") / "run"
    write_run(out, ranks=2, dp=2, mb=0.05, microbatches=2, kernels=2)
    return out


def test_a_collective_spanning_groups_gets_its_members_and_its_work_from_both(run_2x2, tmp_path):
    analysis, got = group_graph.analyze_with_graph(run_2x2, tmp_path / "parts")
    assert isinstance(got, graph.StepGraph), got
    assert_same_graph(got, graph.build(analyze(load_run(run_2x2, cache=False))))
    coll = got.ops.filter(pl.col("group").is_not_null())
    assert coll.height
    # the generator's gradient all-reduce runs on the default process group (every rank; gen_big_trace.py) and
    # global rank = stage * dp + replica: the pipelines are {0, 2} and {1, 3}, so each all-reduce has 4 members,
    # two in each group — though each group's task saw only its own two
    members = coll.group_by("group").agg(pl.col("rank").sort(), pl.col("members").unique())
    assert members.height == len(got.steps)  # (one a step)
    for ranks, m in members.select("rank", "members").rows():
        assert (ranks, m) == ([0, 1, 2, 3], [4])
    # each member works for what it took after the later member joined (its span's end less the last start)
    last = coll.group_by("group").agg(pl.col("start_ns").max().alias("_last"))
    hand = coll.join(last, on="group").select(((pl.col("end_ns") - pl.col("_last")).clip(lower_bound=0)
                                               == pl.col("work_ns")).all()).item()
    assert hand
    assert got.ranks.select("rank", "replica").unique().sort("rank").rows() == [(0, 0), (1, 1), (2, 0), (3, 1)]


def test_a_refused_part_is_the_graphs_one_line_error(tmp_path):
    refused = group_graph.PartRefused("ranks 1 has no schedule", "profile with the PP: annotations")
    with pytest.raises(graph.GraphError, match="no schedule"):
        group_graph.assemble_parts([refused], [1], path=tmp_path)


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c:
        yield c.scheduler_address


def _copy(name: str, tmp_path: Path) -> str:  # (the cluster's partitions go under the run: a copy, not tests/data)
    import shutil

    return str(shutil.copytree(DATA / name / "run", tmp_path / "run"))


def test_whatif_per_group_on_a_cluster_is_the_one_process_whatif(cluster, tmp_path, capsys):
    import json

    from traceana.cli import main

    run = _copy("megatron-dp2-steps6-defaults-sleep-1", tmp_path)
    out = []
    for extra in ([], ["--per-group", "--dask", cluster]):
        assert main(["whatif", run, "--no-cache", "--json", *extra]) == 0
        out.append(json.loads(capsys.readouterr().out))
    one, per = out
    assert "the variants replayed one pipeline group a task: 2 groups of 2 ranks" in per["notes"]
    # everything but the notes (the variants' one; the peers by place, as above) and the run's path
    for d in (one, per):
        d.pop("notes")
        d.pop("run")
    assert per == one


def test_analyze_on_a_cluster_diagnoses_as_in_one_process(cluster, tmp_path):
    from traceana.commands.analyze_run import load_and_analyze as command_analysis

    run = _copy("megatron-dp2-steps6-defaults-sleep-1", tmp_path)
    one = command_analysis(run, peak_flops=None, workers=None, cache=False, progress=False).summary
    per = command_analysis(run, peak_flops=None, workers=None, cache=False, progress=False, dask=cluster).summary
    assert per.diagnosed and per.diagnosis is not None and not per.diagnosis.startswith("no what-if")
    assert (per.diagnosis, per.bottleneck) == (one.diagnosis, one.bottleneck)
    assert per.per_stage.select("stage", "straggler", "straggler_rank").equals(
        one.per_stage.select("stage", "straggler", "straggler_rank"))


def test_analyze_on_a_cluster_says_why_it_has_no_diagnosis(cluster, tmp_path):
    from traceana.commands.analyze_run import load_and_analyze as command_analysis

    run = _copy("deepspeed-dp2-defaults-none-0", tmp_path)
    per = command_analysis(run, peak_flops=None, workers=None, cache=False, progress=False, dask=cluster).summary
    assert per.diagnosis.startswith("no what-if: ") and "are not its pipelines" in per.diagnosis
