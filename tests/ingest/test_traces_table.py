"""The run's traces table (run_dir._traces_table) holds each rank's own pg_config text, as reading that rank's file
alone gives it (kineto.read_trace), though ranks sharing one pg_config share its text (converted once, gathered),
and each rank's process groups are read from it (traceana.ingest.process_groups): GPU-style ranks made by
tests/benchmarks/gen_big_trace.py, whose files each list the job's default group, beside a real megatron-core run
whose ranks list groups of their own, and a hand-made table."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import polars as pl

from traceana.ingest import kineto
from traceana.ingest.process_groups import process_groups
from traceana.ingest.run_dir import _traces_table, find_traces, load_run

ROOT = Path(__file__).resolve().parents[2]


def _gen(out: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tests" / "benchmarks" / "gen_big_trace.py"), str(out),
                    "--ranks", "2", "--dp", "3", "--mb", "0.1", "--microbatches", "2", "--kernels", "1"],
                   check=True, capture_output=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return out


def _groups(frame: pl.DataFrame) -> list[tuple]:
    return list(zip(frame["rank"].to_list(), frame["desc"].to_list(), frame["ranks"].to_list()))


def test_each_rank_keeps_its_own_process_groups(tmp_path):
    run_dir = _gen(tmp_path / "gen")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traces = load_run(run_dir, cache=False).traces
        alone = {f.name: kineto.read_trace(f)[2] for f in find_traces(run_dir)}
    assert traces.height == 6 == len(alone)
    assert "process_groups" not in traces.columns  # (derived from pg_config: not 6 copies of a 6-rank list)
    for row in traces.iter_rows(named=True):
        own = alone[Path(row["path"]).name]
        assert row["pg_config"] == own["pg_config"]
        assert [g["ranks"] for g in json.loads(row["pg_config"])] == [list(range(6))]
    # by hand: the generator's default group lists the job's 6 ranks, in every rank's file
    assert _groups(process_groups(traces)) == [(r, "default_pg", list(range(6))) for r in traces["rank"].to_list()]


def test_a_megatron_runs_groups_are_each_files_own():
    # megatron-core's ranks each list their own groups (pipeline, data-parallel, ...): read here from the files'
    # JSON by hand, in each file's order
    run_dir = ROOT / "tests/data/whatif_foreign/megatron-dp2-defaults-none-0/run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traces = load_run(run_dir, cache=False).traces
    expected = []
    for path in traces["path"].to_list():
        top = json.loads(gzip.open(run_dir / Path(path).name).read())
        info = top["distributedInfo"]
        expected += [(info["rank"], g.get("pg_desc"), [int(r) for r in g["ranks"]]) for g in info["pg_config"]]
    got = _groups(process_groups(traces))
    assert got == expected and len({d for _, d, _ in got}) > 2
    pipeline = process_groups(traces, pl.col("desc") == "PIPELINE_MODEL_PARALLEL_GROUP")
    assert _groups(pipeline) == [e for e in expected if e[1] == "PIPELINE_MODEL_PARALLEL_GROUP"]


def test_shared_and_distinct_groups_in_one_table():
    a = {"rank": 0, "pg_config": json.dumps([{"ranks": [0, 1], "pg_desc": "d"}, {"ranks": ["1"], "pg_desc": 5}])}
    b = {"rank": 1, "pg_config": a["pg_config"]}  # shared: the same object
    c = {"rank": 2, "pg_config": json.dumps([{"ranks": [2], "pg_desc": "e"}, {"ranks": ["x"]}, "junk"])}
    d = {"rank": 3}  # none
    e = {"rank": 4, "pg_config": "[]"}
    t = _traces_table([a, b, c, d, e])
    assert t["rank"].to_list() == [0, 1, 2, 3, 4]
    assert t["pg_config"].to_list() == [a["pg_config"], a["pg_config"], c["pg_config"], None, "[]"]
    # by hand: each rank's groups in its config's order; a desc that is not text is none; ranks that are not
    # ints, and entries that are not groups, are left out
    assert _groups(process_groups(t)) == [(0, "d", [0, 1]), (0, None, [1]), (1, "d", [0, 1]), (1, None, [1]),
                                          (2, "e", [2])]
    assert _groups(process_groups(t, pl.col("ranks").list.contains(1))) == [
        (0, "d", [0, 1]), (0, None, [1]), (1, "d", [0, 1]), (1, None, [1])]
    assert _groups(process_groups(t, pl.col("desc") == "nothing")) == []
    assert process_groups(t).schema == pl.Schema({"rank": pl.Int32, "desc": pl.String, "ranks": pl.List(pl.Int32)})


def test_the_readers_of_the_groups_see_each_ranks_own():
    # p2p.bpipe_groups: each rank's BPipe group (collectors.bpipe names it), in group-rank order, only where the rank
    # is a member; schedule.pipeline_group_stages: megatron-core's pipeline group gives rank -> (its index, size)
    from traceana.measure.p2p import bpipe_groups
    from traceana.measure.schedule import pipeline_group_stages

    def config(bpipe):
        return json.dumps([{"ranks": [0, 1, 2, 3], "pg_desc": "default_pg"},
                           {"ranks": bpipe, "pg_desc": "traceana_bpipe_0"},
                           {"ranks": [3, 1], "pg_desc": "PIPELINE_MODEL_PARALLEL_GROUP"}])
    t = _traces_table([{"rank": 0, "pg_config": config([0, 2])}, {"rank": 1, "pg_config": config([1, 3])},
                       {"rank": 2, "pg_config": config([0, 2])}, {"rank": 3, "pg_config": config([1, 3])},
                       {"rank": 4}])
    got = bpipe_groups(t)
    assert list(zip(got["rank"].to_list(), got["group_ranks"].to_list())) == [
        (0, [0, 2]), (1, [1, 3]), (2, [0, 2]), (3, [1, 3])]
    assert got.schema == pl.Schema({"rank": pl.Int32, "group_ranks": pl.List(pl.Int32)})
    assert pipeline_group_stages(t) == {3: (0, 2), 1: (1, 2)}
