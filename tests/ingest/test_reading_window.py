"""The reading window (traceana/ingest/reading.py ``Reader``): what it hands the scanner is the file's bytes, in
order, whichever way it gunzips (inline, or ahead in a thread of its own into a second window), wherever the
scanner cuts, and however long the piece it keeps; a bad stream fails the same way; windows kept for the next
file are freed when load_run ends."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest
from polars.testing import assert_frame_equal
from tracebuilder import TraceBuilder

from traceana.core.errors import TraceFormatError
from traceana.ingest import kineto, reading
from traceana.ingest.run_dir import load_run


def _gz(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data, compresslevel=1))
    return path


def _delivered(path: Path, keeps, *, ahead: bool) -> bytes:
    """Every byte the Reader hands over, read as a scanner reads: each window consumed up to a cut that keeps the
    next value of ``keeps`` bytes (or all of the window, when it holds no more) for the next window."""
    r = reading.Reader(path, threads_from=0 if ahead else 1 << 62)
    assert (r.spare is not None) == ahead
    out = bytearray()
    try:
        r.extend(0)
        while True:
            if r.final:
                out += r.buf
                return bytes(out)
            keep = min(next(keeps), len(r.buf))
            out += r.buf[: len(r.buf) - keep]
            r.extend(len(r.buf) - keep)
    finally:
        r.close()


@pytest.mark.parametrize("ahead", [True, False])
def test_the_window_hands_over_the_files_bytes_in_order(tmp_path, monkeypatch, ahead):
    monkeypatch.setattr(reading, "READ_PIECE", 4096)
    monkeypatch.setattr(reading, "MIN_PIECE", 512)
    monkeypatch.setattr(reading, "HEAD", 512)
    rng = random.Random(7)
    data = bytes(rng.randrange(256) for _ in range(200_000))  # incompressible: many windows of gzip
    f = _gz(tmp_path / "t.json.gz", data)
    # Kept pieces shorter than the window's head, as long as it, longer (the window made for it), and whole windows.
    keeps = iter(rng.choice([0, 1, 100, 511, 512, 513, 3000, 5000, 9000]) for _ in range(10**6))
    assert _delivered(f, keeps, ahead=ahead) == data
    assert _delivered(f, iter([0] * 10**6), ahead=ahead) == data


def test_a_trace_gunzipped_ahead_reads_the_same(tmp_path, monkeypatch):
    # Many small windows, a head shorter than most events: every swap, and the window made for a longer kept piece.
    tb = TraceBuilder(rank=0)
    for i in range(3000):
        tb.cpu_op(f"aten::op_{i % 97}" + "x" * (i % 300), 10.0 + i, 0.5, args={"External id": i})
        tb.memory(i + 0.25, i, 1)
    f = tb.write(tmp_path / "t.pt.trace.json.gz")
    inline = kineto.read_trace(f)
    monkeypatch.setattr(reading, "THREADED_GUNZIP_BYTES", 0)
    monkeypatch.setattr(reading, "READ_PIECE", 5000)
    monkeypatch.setattr(reading, "HEAD", 256)
    monkeypatch.setattr(reading, "NATIVE_CHUNK", 7000)
    ahead = kineto.read_trace(f)
    assert_frame_equal(inline[0], ahead[0])
    assert_frame_equal(inline[1], ahead[1])
    assert ahead[0].height == 3000 and ahead[1].height == 3000
    with monkeypatch.context() as m:
        m.setattr(kineto, "_scan", None)
        general = kineto.read_trace(f)
    assert_frame_equal(general[0], ahead[0])


def test_a_cut_gzip_gunzipped_ahead_is_handed_back_and_recovered(tmp_path, monkeypatch):
    tb = TraceBuilder(rank=0)
    for i in range(20_000):
        tb.cpu_op(f"aten::op_{i % 997}_{i * 7919 % 100_003}", 10.0 + i, 0.5)
    whole = tb.write(tmp_path / "whole.pt.trace.json.gz").read_bytes()
    cut = tmp_path / "cut.pt.trace.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    monkeypatch.setattr(reading, "THREADED_GUNZIP_BYTES", 0)
    monkeypatch.setattr(reading, "READ_PIECE", 1 << 16)
    with pytest.raises(reading.HANDED_BACK):  # the fill thread's error, raised where the window is extended
        reading.scan(cut)
    events, _, row = kineto.read_trace(cut)
    assert row["truncated"] and 0 < events.height < 20_000


def test_a_value_over_the_rule_gunzipped_ahead_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "THREADED_GUNZIP_BYTES", 0)
    monkeypatch.setattr(reading, "READ_PIECE", 1 << 16)
    monkeypatch.setattr(reading.limits, "MAX_VALUE_BYTES", 1 << 20)
    f = _gz(tmp_path / "t.json.gz", b'{"traceEvents": [{"ph": "X", "name": "' + b"a" * (3 << 20) + b'", "ts": 1, "dur": 1}]}')
    with pytest.raises(TraceFormatError, match="exceeds 1 MiB"):
        reading.scan(f)


def test_windows_are_kept_for_the_next_rank_and_freed_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "THREADED_GUNZIP_BYTES", 0)
    monkeypatch.setattr(reading, "READ_PIECE", 1 << 16)  # every rank's windows of one size (a rank's larger)
    made = []
    new_window = reading._new_window
    monkeypatch.setattr(reading, "_new_window", lambda size: made.append(size) or new_window(size))
    for rank in range(4):
        tb = TraceBuilder(rank=rank, world_size=4)
        for i in range(2000):
            tb.cpu_op(f"op{i % 7}", 10.0 + i, 0.5)
        tb.write(tmp_path / f"rank{rank}.pt.trace.json.gz")
    run = load_run(tmp_path, workers=1, cache=False)
    assert run.events.height == 4 * 2000
    # Two windows (the one scanned, the one filled) for the first rank; the later ranks reuse them.
    assert len(made) == 2, made
    assert not reading._POOL and not reading._POOL_USERS
