"""The run's traces table (run_dir._traces_table) holds each rank's own pg_config text and process groups, as
reading that rank's file alone gives them (kineto.read_trace), though ranks sharing one pg_config share its text
and groups (converted once, gathered): GPU-style ranks made by tests/benchmarks/gen_big_trace.py, whose files each
list the job's default group, beside a real run whose ranks list groups of their own."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import polars as pl

from traceana.ingest import kineto
from traceana.ingest.run_dir import _traces_table, find_traces, load_run

ROOT = Path(__file__).resolve().parents[2]


def _gen(out: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tests" / "benchmarks" / "gen_big_trace.py"), str(out),
                    "--ranks", "2", "--dp", "3", "--mb", "0.1", "--microbatches", "2", "--kernels", "1"],
                   check=True, capture_output=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return out


def test_each_rank_keeps_its_own_process_groups(tmp_path):
    run_dir = _gen(tmp_path / "gen")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traces = load_run(run_dir, cache=False).traces
        alone = {f.name: kineto.read_trace(f)[2] for f in find_traces(run_dir)}
    assert traces.height == 6 == len(alone)
    for row in traces.iter_rows(named=True):
        own = alone[Path(row["path"]).name]
        assert row["pg_config"] == own["pg_config"]
        assert row["process_groups"] == own["process_groups"]
        # by hand: the generator's default group lists the job's 6 ranks
        assert [(g["desc"], g["ranks"]) for g in row["process_groups"]] == [("default_pg", list(range(6)))]
        assert [g["ranks"] for g in json.loads(row["pg_config"])] == [list(range(6))]


def test_shared_and_distinct_groups_in_one_table():
    a = {"rank": 0, "pg_config": json.dumps([{"ranks": [0, 1]}]), "process_groups": [{"desc": "d", "ranks": [0, 1]}]}
    b = {"rank": 1, "pg_config": a["pg_config"], "process_groups": a["process_groups"]}  # shared: the same objects
    c = {"rank": 2, "pg_config": json.dumps([{"ranks": [2]}]), "process_groups": [{"desc": "e", "ranks": [2]}]}
    d = {"rank": 3}  # none
    t = _traces_table([a, b, c, d])
    assert t["rank"].to_list() == [0, 1, 2, 3]
    assert t["pg_config"].to_list() == [a["pg_config"], a["pg_config"], c["pg_config"], None]
    assert t["process_groups"].to_list() == [a["process_groups"], a["process_groups"], c["process_groups"], None]
    assert t.schema["process_groups"] == pl.List(pl.Struct({"desc": pl.String, "ranks": pl.List(pl.Int32)}))
