"""traceana.ingest.scale: per-rank Parquet partitions written through any executor's map, read back into a Run."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal
from tracebuilder import TraceBuilder

from traceana.core import schema
from traceana.core.errors import BadInputError, RunDirError
from traceana.core.manifest import MANIFEST_NAME, Manifest
from traceana.ingest import scale
from traceana.ingest.run_dir import load_run


def _rank_trace(rank: int, world_size: int) -> TraceBuilder:
    """One stage of a tiny 2-micro-batch GPipe step on CPU/gloo: annotations, ops, P2P and memory."""
    tb = TraceBuilder(rank=rank, world_size=world_size, pid=100 + rank, tid=100 + rank)
    tb.step(1, 0, 400)
    for mb in range(2):
        t = 10 + 40 * (mb + rank)
        if rank > 0:
            tb.recv(peer=rank - 1, tag=0, ts=t, dur=4)
        tb.annotation(f"PP:{rank}F{mb}", t + 5, 20)
        tb.cpu_op("aten::mm", t + 6, 15)
        tb.memory(t + 7, total_allocated=1000 * (mb + 1), delta=1000)
        if rank < world_size - 1:
            tb.send(peer=rank + 1, tag=0, ts=t + 26, dur=4)
    for mb in range(2):
        t = 200 + 60 * (mb + world_size - 1 - rank)
        tb.annotation(f"PP:{rank}B{mb}", t, 30)
        tb.cpu_op("aten::mm", t + 1, 25)
        tb.memory(t + 28, total_allocated=1000 * (1 - mb), delta=-1000)
    return tb


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    for r in range(3):
        _rank_trace(r, 3).write(d / f"rank{r}.pt.trace.json.gz")
    return d


def _without_path(traces: pl.DataFrame) -> pl.DataFrame:
    return traces.drop("path")


def test_writes_one_hive_partition_per_rank_and_table(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parquet"
    summary = scale.ingest_to_parquet(run_dir, out)
    assert [r["rank"] for r in summary] == [0, 1, 2]
    for table in ("events", "memory", "traces"):
        folders = sorted(p.name for p in (out / table).iterdir())
        assert folders == ["rank=0", "rank=1", "rank=2"]
        for f in folders:
            files = list((out / table / f).iterdir())
            assert [p.name for p in files] == [f"rank{f.removeprefix('rank=')}.pt.trace.json.gz.parquet"]
            # The partition folder holds the rank; the file does not repeat it.
            assert "rank" not in pl.read_parquet_schema(files[0])
    assert json.loads((out / scale.INGEST_SUMMARY).read_text()) == summary


def test_loaded_tables_equal_a_direct_load(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parquet"
    scale.ingest_to_parquet(run_dir, out)
    back = scale.load_parquet(out)
    direct = load_run(run_dir, cache=False)
    by_rank = {"by": "rank", "maintain_order": True}
    assert_frame_equal(back.events, direct.events.sort(**by_rank))
    assert_frame_equal(back.memory, direct.memory.sort(**by_rank))
    assert_frame_equal(_without_path(back.traces), _without_path(direct.traces.sort(**by_rank)))
    assert back.ranks == [0, 1, 2]
    assert back.events.height > 0 and back.memory.height == 12


def test_a_dataset_written_before_memory_had_addresses_reads_them_as_null(run_dir: Path, tmp_path: Path) -> None:
    """memory.addr was added after datasets were written: such a dataset still loads, every address null (the
    activation peak then falls back to peak − step start, traceana.measure.memory)."""
    out = tmp_path / "parquet"
    scale.ingest_to_parquet(run_dir, out)
    for f in (out / "memory").rglob("*.parquet"):
        pl.read_parquet(f).drop("addr").write_parquet(f)
    for run in (scale.load_parquet(out), scale.load_parquet(out, ranks=[1])):
        assert run.memory.height > 0 and run.memory["addr"].null_count() == run.memory.height


def test_reading_some_ranks_reads_only_their_partitions(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parquet"
    scale.ingest_to_parquet(run_dir, out)
    some = scale.load_parquet(out, ranks=[2, 0])
    everything = scale.load_parquet(out)
    assert some.ranks == [0, 2]
    assert_frame_equal(some.events, everything.events.filter(pl.col("rank").is_in([0, 2])))
    lazy = scale.scan_tables(out)["events"].filter(pl.col("rank") == 1)
    assert "rank=1" in lazy.explain() or lazy.collect()["rank"].unique().to_list() == [1]
    assert lazy.collect_schema() == pl.Schema(schema.EVENTS)


def _forkserver_pool(max_workers: int) -> ProcessPoolExecutor:
    # Not "fork": a forked child of a process whose polars thread pool has run can deadlock.
    return ProcessPoolExecutor(max_workers=max_workers, mp_context=multiprocessing.get_context("forkserver"))


@pytest.mark.parametrize("executor", [ThreadPoolExecutor, _forkserver_pool])
def test_any_executor_map_gives_the_same_dataset(run_dir: Path, tmp_path: Path, executor) -> None:
    scale.ingest_to_parquet(run_dir, tmp_path / "serial")
    with executor(max_workers=2) as pool:
        scale.ingest_to_parquet(run_dir, tmp_path / "pooled", map=pool.map)
    a, b = scale.load_parquet(tmp_path / "serial"), scale.load_parquet(tmp_path / "pooled")
    assert_frame_equal(a.events, b.events)
    assert_frame_equal(a.memory, b.memory)


def test_reingesting_replaces_partitions_and_leaves_no_temporary_files(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parquet"
    scale.ingest_to_parquet(run_dir, out)
    first = scale.load_parquet(out)
    scale.ingest_to_parquet(run_dir, out)
    assert_frame_equal(scale.load_parquet(out).events, first.events)
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]


def test_ingesting_another_run_into_the_same_folder_leaves_none_of_the_old_one(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parquet"
    scale.ingest_to_parquet(run_dir, out)
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    _rank_trace(0, 1).write(smaller / "only.pt.trace.json.gz")
    scale.ingest_to_parquet(smaller, out)
    assert scale.load_parquet(out).ranks == [0]
    assert sorted(p.name for p in (out / "events").iterdir()) == ["rank=0"]


def test_two_files_of_one_rank_are_reported(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    _rank_trace(0, 2).write(d / "a.pt.trace.json.gz")
    _rank_trace(0, 2).write(d / "b.pt.trace.json.gz")
    with pytest.raises(RunDirError, match="both rank 0"):
        scale.ingest_to_parquet(d, tmp_path / "parquet")


def test_manifest_travels_with_the_dataset(run_dir: Path, tmp_path: Path) -> None:
    manifest = Manifest(world_size=3, pp=3)
    (run_dir / MANIFEST_NAME).write_text(manifest.to_json())
    scale.ingest_to_parquet(run_dir, tmp_path / "parquet")
    back = scale.load_parquet(tmp_path / "parquet")
    assert back.manifest == manifest
    assert back.ranks == [0, 1, 2]  # run.json is not mistaken for a trace


def test_analysis_over_the_partitioned_tables_matches_a_direct_analysis(run_dir: Path, tmp_path: Path) -> None:
    from traceana.measure.analysis import analyze

    scale.ingest_to_parquet(run_dir, tmp_path / "parquet")
    direct = analyze(load_run(run_dir, cache=False))
    from_parquet = analyze(scale.load_parquet(tmp_path / "parquet"))
    order = ["rank", "step", "category"]
    assert_frame_equal(from_parquet.attribution.sort(order), direct.attribution.sort(order))


def test_bad_folders_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="not a directory"):
        scale.ingest_to_parquet(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="no trace files"):
        scale.ingest_to_parquet(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(BadInputError, match="no events/ partitions"):
        scale.load_parquet(tmp_path / "empty")
