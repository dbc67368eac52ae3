"""The analysis cache (traceana/measure/analysis_cache.py): a hit equals a miss, changed inputs miss, damaged entries
miss, read-only run directories and --no-cache work."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest
from polars.testing import assert_frame_equal
from tracebuilder import write_two_stage_run

from traceana.cli import main
from traceana.core.manifest import Manifest
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze
from traceana.measure.analysis_cache import CachedAnalysis, load_and_analyze


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return write_two_stage_run(d)


def _entries(d):
    root = d / ".traceana" / "analysis"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def assert_same(a, b):
    ta, tb = a.tables(), b.tables()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert_frame_equal(ta[name], tb[name], check_row_order=True), name
    assert_frame_equal(a.rank_summary, b.rank_summary)
    assert_frame_equal(a.run.traces, b.run.traces)
    assert_frame_equal(a.run.memory, b.run.memory)
    assert a.notes == b.notes and a.run.warnings == b.run.warnings
    assert a.summary.as_dict() == b.summary.as_dict()
    assert_frame_equal(a.summary.per_stage, b.summary.per_stage, check_row_order=True)  # the hit's, kept as Parquet
    assert (a.summary.replicas is None) == (b.summary.replicas is None)
    if a.summary.replicas is not None:
        assert_frame_equal(a.summary.replicas, b.summary.replicas, check_row_order=True)
    assert a.run.path == b.run.path and a.run.manifest == b.run.manifest


def test_hit_equals_miss_and_equals_plain_analyze(run_dir):
    miss = load_and_analyze(run_dir)
    assert not isinstance(miss, CachedAnalysis)
    assert len(_entries(run_dir)) == 1
    hit = load_and_analyze(run_dir)
    assert isinstance(hit, CachedAnalysis)
    assert "summary" in hit.__dict__  # read from the entry, not recomputed
    assert_same(miss, hit)
    plain = analyze(load_run(run_dir, cache=False))
    assert plain.summary.as_dict() == hit.summary.as_dict()
    for name, table in plain.tables().items():
        assert_frame_equal(table, hit.tables()[name])
    # the big tables come back on demand, equal to a fresh computation
    assert_frame_equal(hit.run.events, plain.run.events)
    assert_frame_equal(hit.events, plain.events)


def test_a_changed_trace_or_run_json_misses(run_dir):
    first = load_and_analyze(run_dir)
    write_two_stage_run(run_dir, f0_dur=18)  # rank 0's forward is shorter: a different attribution
    st = (run_dir / "rank0.pt.trace.json.gz").stat()
    os.utime(run_dir / "rank0.pt.trace.json.gz", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = load_and_analyze(run_dir)
    assert not isinstance(second, CachedAnalysis)
    for name, table in analyze(load_run(run_dir, cache=False)).tables().items():
        assert_frame_equal(table, second.tables()[name])
    with pytest.raises(AssertionError):
        assert_frame_equal(first.attribution, second.attribution)
    assert len(_entries(run_dir)) == 1  # the stale entry was replaced

    (run_dir / "run.json").write_text(Manifest(world_size=2, pp=2, schedule="1f1b").to_json())
    third = load_and_analyze(run_dir)
    assert not isinstance(third, CachedAnalysis) and third.run.manifest is not None
    hit = load_and_analyze(run_dir)
    assert isinstance(hit, CachedAnalysis) and hit.run.manifest == third.run.manifest
    assert_same(third, hit)


def test_peak_flops_is_part_of_the_key(run_dir):
    load_and_analyze(run_dir)
    assert not isinstance(load_and_analyze(run_dir, peak_flops=1e12), CachedAnalysis)
    assert isinstance(load_and_analyze(run_dir, peak_flops=1e12), CachedAnalysis)


def test_damaged_entry_is_a_miss(run_dir):
    miss = load_and_analyze(run_dir)
    entry = run_dir / ".traceana" / "analysis" / _entries(run_dir)[0]
    (entry / "attribution.parquet").write_bytes(b"not parquet")
    again = load_and_analyze(run_dir)
    assert not isinstance(again, CachedAnalysis)
    assert_same(miss, again)
    assert_same(miss, load_and_analyze(run_dir))  # the miss rewrote the entry: a hit again
    assert isinstance(load_and_analyze(run_dir), CachedAnalysis)
    (entry / "meta.json").unlink()  # an entry without meta.json (a crash mid-write) is a miss
    assert not isinstance(load_and_analyze(run_dir), CachedAnalysis)
    assert isinstance(load_and_analyze(run_dir), CachedAnalysis)


def test_read_only_run_dir_works_without_writing(run_dir):
    mode = run_dir.stat().st_mode
    os.chmod(run_dir, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning either: a read-only run is normal (a shared folder)
            a = load_and_analyze(run_dir)
            b = load_and_analyze(run_dir)
        assert not (run_dir / ".traceana").exists()
        assert not isinstance(b, CachedAnalysis)
        assert_same(a, b)
    finally:
        os.chmod(run_dir, mode)


def test_unwritable_cache_folder_is_a_warning(run_dir):
    (run_dir / ".traceana").mkdir()
    (run_dir / ".traceana" / "analysis").write_text("a file where the folder should be")
    with pytest.warns(UserWarning, match="could not write the analysis cache"):
        a = load_and_analyze(run_dir)
    assert a.attribution.height


def test_no_cache_flag_writes_nothing(run_dir, capsys):
    assert main(["analyze", str(run_dir), "--no-cache", "--json"]) == 0
    assert not (run_dir / ".traceana").exists()
    no_cache = json.loads(capsys.readouterr().out)
    assert main(["analyze", str(run_dir), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert _entries(run_dir)
    assert main(["analyze", str(run_dir), "--json"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert no_cache == first == cached
    assert main(["analyze", str(run_dir)]) == 0  # tables (rank summary from the cache)
    assert "rank" in capsys.readouterr().out


def test_merge_from_a_cached_analysis(run_dir, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["merge", str(run_dir), "-o", str(a), "--quiet"]) == 0
    assert main(["merge", str(run_dir), "-o", str(b), "--quiet"]) == 0  # from the cache
    assert json.loads(a.read_text()) == json.loads(b.read_text())


def test_single_trace_file_has_its_own_entry(run_dir):
    f = run_dir / "rank1.pt.trace.json.gz"
    a = load_and_analyze(f)
    b = load_and_analyze(f)
    assert isinstance(b, CachedAnalysis) and b.run.path == f
    assert_same(a, b)
    load_and_analyze(run_dir)
    assert len(_entries(run_dir)) == 2
