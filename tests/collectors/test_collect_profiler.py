"""PipelineProfiler: atomic self-describing traces, run.json, and never breaking training."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import multiprocessing
import os
import time

import pytest

torch = pytest.importorskip("torch")

import collectors.profiler as profiler_mod  # noqa: E402
from collectors.manifest import finalize_manifest, ranks_written, trace_path  # noqa: E402
from collectors.profiler import PipelineProfiler  # noqa: E402
from traceana.core.manifest import Manifest  # noqa: E402


def _work(steps: int, prof: PipelineProfiler) -> float:
    """A tiny training loop; returns a value that proves every step ran."""
    w = torch.ones(32, 32, requires_grad=True)
    total = 0.0
    for _ in range(steps):
        loss = (torch.randn(8, 32) @ w).pow(2).mean()
        loss.backward()
        total += 1.0
        prof.step()
    return total


def _read(path):
    with gzip.open(path) as f:
        return json.load(f)


def _profiler(out, **kw):
    kw.setdefault("manifest", Manifest(world_size=1, pp=1, stage_of_rank=(0,), schedule="1f1b"))
    return PipelineProfiler(out, rank=0, stage=0, world_size=1, pp=1, schedule="1f1b", **kw)


def test_writes_one_gzipped_self_describing_trace_and_run_json(tmp_path):
    with _profiler(tmp_path, warmup=1, active=2, bpipe=[(0, 1)]) as prof:
        assert _work(4, prof) == 4
    trace = _read(trace_path(tmp_path, 0))
    assert trace["traceana"]["rank"] == 0 and trace["traceana"]["stage"] == 0 and trace["traceana"]["pp"] == 1
    assert trace["traceana"]["schedule"] == "1f1b" and trace["traceana"]["bpipe"] == [[0, 1]]
    steps = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2  # the active steps only
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # profile_memory on by default
    assert Manifest.read(tmp_path / "run.json").ranks_written == (0,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt.trace.json.gz", "run.json"]  # no leftovers


def test_with_repeat_the_directory_keeps_the_last_cycle(tmp_path):
    with _profiler(tmp_path, warmup=0, active=1, repeat=3) as prof:
        _work(5, prof)
    assert prof.cycle == 3
    trace = _read(trace_path(tmp_path, 0))
    assert trace["traceana"]["cycle"] == 2  # 0-based: the third cycle replaced the first two
    assert [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")] == \
        ["ProfilerStep#2"]


@pytest.mark.slow
def test_an_unwritable_directory_leaves_training_intact_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="traceana.collectors"):
        with _profiler(blocker / "run") as prof:
            assert _work(4, prof) == 4
    assert prof.written is None and prof.warnings
    assert any("could not write" in r.getMessage() or "cannot prepare" in r.getMessage() for r in caplog.records)


def test_a_full_disk_leaves_no_partial_trace_behind(tmp_path, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(profiler_mod.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="traceana.collectors"):
        with _profiler(tmp_path, manifest=None) as prof:
            assert _work(4, prof) == 4
    assert "No space left" in " ".join(prof.warnings)
    assert list(tmp_path.iterdir()) == []  # neither a final nor a temporary file


def test_a_profiler_that_fails_to_start_does_not_stop_training(tmp_path, monkeypatch, caplog):
    def broken(**kwargs):
        raise RuntimeError("kineto unavailable")

    monkeypatch.setattr(profiler_mod, "profile", broken)
    with caplog.at_level(logging.WARNING, logger="traceana.collectors"):
        with _profiler(tmp_path, manifest=None) as prof:
            assert _work(3, prof) == 3
    assert "kineto unavailable" in caplog.text


def test_an_exception_in_training_still_writes_the_trace_marked_interrupted(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with _profiler(tmp_path, warmup=0, active=3) as prof:
            _work(1, prof)
            raise ValueError("boom")
    trace = _read(trace_path(tmp_path, 0))
    assert trace["traceana"]["interrupted"] == "ValueError: boom"


def test_a_stale_trace_from_an_earlier_run_is_removed_at_start(tmp_path):
    stale = trace_path(tmp_path, 0)
    stale.write_bytes(b"old")
    with _profiler(tmp_path, manifest=None, warmup=0, active=1) as prof:
        assert not stale.exists()
        _work(1, prof)
    assert _read(stale)["traceana"]["rank"] == 0


def test_ranks_written_ignores_files_older_than_the_run(tmp_path):
    for rank in (0, 1, 2):
        trace_path(tmp_path, rank).write_bytes(b"x")
    old = time.time() - 3600
    os.utime(trace_path(tmp_path, 1), (old, old))
    (tmp_path / ".rank3.123.gz.partial").write_bytes(b"half")  # a rank killed while writing
    assert ranks_written(tmp_path) == (0, 1, 2)
    assert ranks_written(tmp_path, since=time.time() - 60) == (0, 2)
    finalize_manifest(tmp_path, Manifest(world_size=4), since=time.time() - 60)
    assert Manifest.read(tmp_path / "run.json").ranks_written == (0, 2)


def _rank(rank: int, out: str, crash: bool) -> None:
    prof = PipelineProfiler(out, rank=rank, stage=rank, world_size=2, pp=2, warmup=0, active=3,
                            manifest=Manifest(world_size=2, pp=2, stage_of_rank=(0, 1)) if rank == 0 else None,
                            manifest_timeout_s=3.0)
    with prof:
        for step in range(3):
            torch.ones(64, 64).sum()
            if crash and step == 1:
                os._exit(3)  # killed mid-profile: no exception handling, no trace
            prof.step()


@pytest.mark.multiprocess
def test_a_rank_that_crashes_mid_profile_is_left_out_of_ranks_written(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), r == 1)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 3]
    assert trace_path(tmp_path, 0).is_file() and not trace_path(tmp_path, 1).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert Manifest.read(tmp_path / "run.json").ranks_written == (0,)
