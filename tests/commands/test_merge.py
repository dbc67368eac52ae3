"""`traceana merge` and `traceana analyze` end to end on a tiny two-rank run written with tests/tracebuilder.py."""

from __future__ import annotations

import gzip
import json

import polars as pl
import pytest
from tracebuilder import write_two_stage_run

from traceana.cli import main
from traceana.core.schema import CATEGORIES


@pytest.fixture
def two_rank_run(tmp_path):
    """Stage 0: F0 then send; stage 1: recv, F0, B0, send grad; stage 0: recv grad, B0 (µs)."""
    return write_two_stage_run(tmp_path)


def test_merge_writes_one_perfetto_trace_with_added_tracks(two_rank_run, tmp_path):
    out = tmp_path / "merged.json.gz"
    assert main(["merge", str(two_rank_run), "-o", str(out), "--no-cache", "--quiet"]) == 0
    trace = json.loads(gzip.decompress(out.read_bytes()))
    ev = trace["traceEvents"]
    x = [e for e in ev if e["ph"] == "X"]
    assert {e["pid"] for e in x} == {0, 1}
    assert all(isinstance(e["tid"], int) and e["dur"] >= 0 for e in x)
    names = {(e["cat"], e["name"]) for e in x}
    assert ("traceana.phase", "forward 0") in names and ("traceana.phase", "backward 0") in names
    assert ("traceana.microbatch", "mb 0") in names
    assert ("traceana.attribution", "bubble_warmup") in names  # rank 1 waits for the first activation
    procs = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"rank 0 (stage 0)", "rank 1 (stage 1)"}
    flows = [e for e in ev if e["ph"] in ("s", "f") and e["cat"] == "traceana.p2p"]
    assert sorted((e["ph"], e["pid"]) for e in flows) == [("f", 0), ("f", 1), ("s", 0), ("s", 1)]
    assert {e["id"] for e in flows} == {1, 2} and all(e["bp"] == "e" for e in flows if e["ph"] == "f")
    # the critical path (stage 0's forward, the activation, stage 1's F and B, the gradient, stage 0's backward):
    # slices in each rank's "critical path" lane, and arrows along it, across the ranks where it goes by message
    path = [e for e in x if e["cat"] == "traceana.critical_path"]
    assert {e["pid"] for e in path} == {0, 1} and {"forward", "backward", "p2p"} <= {e["name"] for e in path}
    arrows = {e["id"]: e["pid"] for e in ev if e["ph"] == "s" and e["cat"] == "traceana.critical_path"}
    heads = {e["id"]: e["pid"] for e in ev if e["ph"] == "f" and e["cat"] == "traceana.critical_path"}
    assert set(arrows) == set(heads) and any(arrows[i] != heads[i] for i in arrows)
    # one clock: rank 0's forward (annotation at 0 µs) starts before rank 1's (26 µs)
    f = {e["pid"]: e["ts"] for e in x if e["cat"] == "traceana.phase" and e["name"] == "forward 0"}
    assert f[1] - f[0] == pytest.approx(26.0)


def test_merge_plain_json(two_rank_run, tmp_path):
    out = tmp_path / "merged.json"
    assert main(["merge", str(two_rank_run), "-o", str(out), "--no-cache", "--quiet"]) == 0
    assert json.loads(out.read_text())["otherData"]["producer"] == "traceana merge"


def test_analyze_json_and_export(two_rank_run, tmp_path, capsys):
    assert main(["analyze", str(two_rank_run), "--json", "--per-step", "--no-cache",
                 "--export", str(tmp_path / "tables")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in out["stages"]] == [0, 1]
    # recv posted at 5 µs (its post call lasts until 10: time in a P2P call), send at 20
    assert out["stages"][1]["bubble_warmup_ms"] == pytest.approx(0.010)
    assert {r["step"] for r in out["per_step"]} == {5}
    attribution = pl.read_parquet(tmp_path / "tables" / "attribution.parquet")
    assert attribution.group_by("rank").agg(pl.col("ns").sum())["ns"].to_list() == [100_000, 100_000]
    assert (tmp_path / "tables" / "schedule.parquet").exists() and (tmp_path / "tables" / "notes.txt").exists()


def test_analyze_csv_export_and_tables(two_rank_run, tmp_path, capsys):
    assert main(["analyze", str(two_rank_run), "--no-cache", "--per-step", "--quiet",
                 "--export", str(tmp_path / "csv"), "--format", "csv"]) == 0
    text = capsys.readouterr().out
    assert "Where each stage's step time goes" in text and "bubble: warm-up" in text
    assert pl.read_csv(tmp_path / "csv" / "attribution.csv")["category"].n_unique() == len(CATEGORIES)


def test_analyze_bad_path_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run directory" in err
