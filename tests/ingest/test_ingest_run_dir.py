"""Run directories: all ranks in one table, determinism (parallel = serial, cached = uncached), the Parquet cache,
and the per-rank summary."""

from __future__ import annotations

import json
import os
import shutil
import stat

import polars as pl
import pytest
from polars.testing import assert_frame_equal
from test_ingest import gloo_pair
from tracebuilder import TraceBuilder

from traceana.core import schema
from traceana.ingest import Run
from traceana.ingest import run_dir as run_dir_mod
from traceana.ingest.cache import CACHE_DIR, TraceCache
from traceana.ingest.run_dir import load_run
from traceana.measure.classify import rank_summary

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def pipeline_rank(rank: int, world: int, steps: int = 2) -> TraceBuilder:
    """A CPU pipeline rank: steps, forward/backward ops, gloo send/recv to neighbours, memory instants."""
    tb = TraceBuilder(rank=rank, world_size=world, pid=100 + rank, tid=100 + rank,
                      meta={"rank": rank, "stage": rank, "pp": world, "world_size": world})
    t = 0.0
    for s in range(steps):
        tb.step(s, t, t + 100.0)
        tb.cpu_op("aten::mm", t + 1.0, 10.0)
        tb.cpu_op("aten::mm", t + 1.0, 10.0)  # identical twin: order must still be deterministic
        if rank + 1 < world:
            gloo_pair(tb, "send", peer=rank + 1, tag=0, ts=t + 12.0, dur=5.0)
        if rank > 0:
            gloo_pair(tb, "recv_", peer=rank - 1, tag=0, ts=t + 20.0, dur=8.0)
        tb.memory(t + 2.0, 1000 * (s + 1), 1000)
        t += 100.0
    return tb


@pytest.fixture
def run4(tmp_path):
    d = tmp_path / "run4"
    d.mkdir()
    for r in range(4):
        pipeline_rank(r, 4).write(d / f"rank{r}.pt.trace.json.gz")
    (d / "run.json").write_text(json.dumps({"world_size": 4, "pp": 4, "schedule": "1f1b",
                                            "stage_of_rank": [0, 1, 2, 3]}))
    return d


def test_run_directory_loads_every_rank_in_rank_order(run4):
    run = load_run(run4)
    assert isinstance(run, Run) and run.ranks == [0, 1, 2, 3] and run.world_size == 4
    assert run.manifest is not None and run.manifest.schedule == "1f1b"
    assert run.events["rank"].to_list() == sorted(run.events["rank"].to_list())
    schema.check(run.events, schema.EVENTS, "events")
    schema.check(run.traces, schema.TRACES, "traces")
    assert run.traces["stage"].to_list() == [0, 1, 2, 3]
    assert run.traces["rank_source"].to_list() == ["distributedInfo"] * 4
    assert run.memory.group_by("rank").len().sort("rank")["len"].to_list() == [2, 2, 2, 2]
    sends = run.events.filter(pl.col("name") == "gloo:send").group_by("rank").agg(pl.col("peer").unique())
    assert {r: p for r, p in sends.iter_rows()} == {0: [1], 1: [2], 2: [3]}
    assert not run.warnings


def test_single_file_path_loads_that_rank(run4):
    run = load_run(run4 / "rank2.pt.trace.json.gz", cache=False)
    assert run.ranks == [2] and run.manifest is None


def test_parallel_ingest_equals_serial(run4, decoder):
    """Threads with the native scanner; worker processes where it is not built ("general")."""
    serial = load_run(run4, workers=1, cache=False)
    parallel = load_run(run4, workers=2, cache=False)
    assert_frame_equal(serial.events, parallel.events)
    assert_frame_equal(serial.memory, parallel.memory)
    assert_frame_equal(serial.traces, parallel.traces)


def test_serial_ingest_finishing_one_rank_while_scanning_the_next_equals_one_at_a_time(run4, monkeypatch):
    """workers=1 finishes a rank in a second thread while it scans the next (with the native scanner): the same
    tables as reading the ranks strictly one after the other."""
    overlapped = load_run(run4, workers=1, cache=False)
    monkeypatch.setattr(run_dir_mod, "_parse_pipelined",
                        lambda files, bar: [run_dir_mod._parse_serial(f, None) for f in files])
    one_at_a_time = load_run(run4, workers=1, cache=False)
    assert_frame_equal(overlapped.events, one_at_a_time.events)
    assert_frame_equal(overlapped.memory, one_at_a_time.memory)
    assert_frame_equal(overlapped.traces, one_at_a_time.traces)
    assert overlapped.warnings == one_at_a_time.warnings


def test_cached_ingest_equals_uncached_and_skips_parsing(run4, monkeypatch):
    fresh = load_run(run4, cache=False)
    assert not (run4 / CACHE_DIR).exists()  # cache=False writes nothing
    first = load_run(run4)
    entries = sorted(p.name for p in (run4 / CACHE_DIR / "ingest").iterdir())
    assert len(entries) == 12 and all(".pt.trace.json.gz." in e for e in entries)

    def boom(*a, **k):
        raise AssertionError("a cached trace was parsed again")

    monkeypatch.setattr(run_dir_mod, "read_trace", boom)
    cached = load_run(run4)
    for a, b in ((fresh, first), (fresh, cached)):
        assert_frame_equal(a.events, b.events)
        assert_frame_equal(a.memory, b.memory)
        assert_frame_equal(a.traces, b.traces)


def test_changed_trace_invalidates_its_cache_entry(run4):
    load_run(run4)
    pipeline_rank(1, 4, steps=3).write(run4 / "rank1.pt.trace.json.gz")
    os.utime(run4 / "rank1.pt.trace.json.gz", ns=(1, 1))  # a different mtime even on coarse clocks
    run = load_run(run4)
    steps = run.events.filter(pl.col("name").cast(pl.String).str.starts_with("ProfilerStep#")).group_by("rank").len().sort("rank")
    assert steps["len"].to_list() == [2, 3, 2, 2]
    assert len(list((run4 / CACHE_DIR / "ingest").glob("rank1.*"))) == 3  # the stale entry was replaced


def test_new_tool_version_invalidates_the_cache(run4, monkeypatch):
    from traceana import version

    load_run(run4)
    before = set((run4 / CACHE_DIR / "ingest").iterdir())
    monkeypatch.setattr(version, "__version__", "99.0")
    load_run(run4)
    after = set((run4 / CACHE_DIR / "ingest").iterdir())
    assert before.isdisjoint(after) and len(after) == 12


def test_read_only_run_directory_is_never_written(run4):
    run4.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    try:
        run = load_run(run4)
        assert run.ranks == [0, 1, 2, 3] and not run.warnings
        assert not (run4 / CACHE_DIR).exists()
    finally:
        run4.chmod(0o755)


def test_cache_write_failure_is_a_warning(run4):
    (run4 / CACHE_DIR).mkdir()
    (run4 / CACHE_DIR / "ingest").write_text("a file where the cache directory should be")
    with pytest.warns(UserWarning, match="could not write the ingest cache"):
        run = load_run(run4)
    assert run.ranks == [0, 1, 2, 3] and len(run.warnings) == 1


def test_damaged_cache_entry_is_a_miss(run4):
    load_run(run4)
    for p in (run4 / CACHE_DIR / "ingest").glob("*.events.parquet"):
        p.write_bytes(b"garbage")
    fresh = load_run(run4, cache=False)
    assert_frame_equal(load_run(run4).events, fresh.events)


def test_cache_keeps_truncation_warnings(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    data = pipeline_rank(0, 1).to_bytes()
    (d / "rank0.json").write_bytes(data[: len(data) // 2])
    first = load_run(d)
    second = load_run(d)
    assert first.warnings == second.warnings and "truncated" in first.warnings[0]
    assert second.traces["truncated"].to_list() == [True]


def test_third_party_directory_is_read_without_caching(third_party, tmp_path):
    d = third_party / "hta/trace_filter"
    run = load_run(d)
    assert run.ranks == [0, 1] and run.world_size == 128
    assert not (d / CACHE_DIR).exists()
    assert any("126 of 128 ranks have no trace" in w for w in run.warnings)
    # A writable copy is cached, and loads the same.
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    copy.chmod(0o755)
    assert TraceCache(copy).enabled
    assert_frame_equal(load_run(copy).events, run.events)
    assert_frame_equal(load_run(copy).events, run.events)


def test_rank_summary(run4):
    summary = rank_summary(load_run(run4))
    expected = pl.DataFrame({
        "rank": [0, 1, 2, 3], "devices": ["cpu"] * 4, "steps": [2] * 4, "first_step": [0] * 4,
        "last_step": [1] * 4, "mean_step_ms": [0.1] * 4, "p2p_ops": [2, 4, 4, 2], "collectives": [0] * 4,
        "kernels": [0] * 4,
    }, schema_overrides={"rank": pl.Int32, "first_step": pl.Int32, "last_step": pl.Int32})
    assert_frame_equal(summary.select(expected.columns), expected)
    assert summary["n_events"].to_list() == [10, 14, 14, 10]


def test_summarize_third_party(third_party):
    s = rank_summary(load_run(third_party / "hta/nccl_parser_config")).row(0, named=True)
    assert (s["rank"], s["world_size"], s["devices"], s["steps"], s["first_step"], s["last_step"]) == \
        (0, 2, "0", 3, 4, 6)
    assert (s["kernels"], s["nccl_kernels"], s["collectives"], s["p2p_ops"]) == (2700, 21, 21, 0)


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_bar_does_not_change_results(run4, workers):
    plain = load_run(run4, cache=False)
    shown = load_run(run4, cache=False, progress=True, workers=workers)
    assert_frame_equal(plain.events, shown.events)


def test_default_workers_stay_serial_for_small_runs(run4, monkeypatch):
    def no_pool(*a, **k):
        raise AssertionError("a process pool was started for a few kB of traces")

    monkeypatch.setattr(run_dir_mod.cf, "ProcessPoolExecutor", no_pool)
    assert load_run(run4, cache=False).ranks == [0, 1, 2, 3]


def test_many_small_ranks_are_cached_in_batches(tmp_path, monkeypatch):
    """A run of many small ranks writes their events into one batch file (issue 29 item 9: a Parquet write each
    cost ~2.5 ms); read back, each rank is what a fresh read gives, a changed rank misses alone, and a batch none of
    whose ranks is current any more is removed."""
    from traceana.ingest import cache as cache_mod

    monkeypatch.setattr(cache_mod, "BATCH_MIN", 2)  # (4 ranks stand for thousands)
    run4 = tmp_path / "small"
    run4.mkdir()
    for r in range(4):  # as tests/benchmarks/bench_many_ranks.py: no allocator samples
        tb = TraceBuilder(rank=r, world_size=4, pid=r, tid=r)
        tb.step(1, 0, 100)
        for i in range(3):
            tb.cpu_op("aten::mm", 2 + 20 * i, 15 + r)
        tb.write(run4 / f"rank{r}.pt.trace.json")
    parsed = []
    real = run_dir_mod._parse_all
    monkeypatch.setattr(run_dir_mod, "_parse_all", lambda files, **kw: parsed.append(len(files)) or real(files, **kw))
    first = load_run(run4)
    ingest = run4 / CACHE_DIR / "ingest"
    names = sorted(p.name for p in ingest.iterdir())
    assert len(names) == 2 and names[0].startswith("batch-") and names[0].endswith(".events.parquet")
    assert names[1].endswith(".rows.json")
    fresh = load_run(run4, cache=False)
    again = load_run(run4)
    assert parsed == [4, 4, 0]  # the third read: every rank from the batch
    assert_frame_equal(again.events, fresh.events) and assert_frame_equal(first.events, fresh.events)
    assert again.traces.drop("path").equals(fresh.traces.drop("path"))
    # A damaged batch: every rank misses (read once), is written again, and the newer batch is what is read next.
    (ingest / names[0]).write_bytes(b"garbage")
    assert_frame_equal(load_run(run4).events, fresh.events)
    os.utime(ingest / names[1], (1, 1))  # (the damaged batch's rows older, as they are; it stays: its ranks current)
    assert_frame_equal(load_run(run4).events, fresh.events)
    assert parsed[-2:] == [4, 0]
    names = sorted(p.name for p in ingest.iterdir() if p.name not in names)
    # One rank rewritten (same bytes, a new file): it alone is read again, into its own batch-less entry.
    f = sorted(run4.glob("*.json*"))[1]
    data = f.read_bytes()
    f.unlink()
    f.write_bytes(data)
    assert_frame_equal(load_run(run4).events, fresh.events)
    assert parsed[-1] == 1 and len(list(ingest.iterdir())) == 6  # 2 batches (3 current ranks) + 1 rank's 2 files
    # Every rank rewritten: the old batch holds no current rank and is swept at the next write.
    for f in sorted(run4.glob("*.json*")):
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    assert_frame_equal(load_run(run4).events, fresh.events)
    assert parsed[-1] == 4 and names[0] not in {p.name for p in ingest.iterdir()}
