"""`traceana merge` streams its output (issue 13: 2 M tiny events peaked at 4.5 GB, 2.2 KB per event, when the whole
trace's text was built in memory before being written).

What is measured here is the structure that bounds the memory, not a time: the merged trace reaches the file in
pieces of at most one chunk of events' text, however many events the run has, and those pieces make exactly the
trace the one-frame builder describes. (Peak RSS on 2 M events, measured with /usr/bin/time -v in
docs/reliability.md: 4.13 GB before, 1.76 GB after, against 1.62 GB for `analyze` of the same run.)"""

from __future__ import annotations

import gzip
import json

import pytest
from tracebuilder import TraceBuilder

import traceana
from traceana.commands import export
from traceana.core.errors import BadInputError

N_OPS = 6_000  # µs-spaced 1 µs ops inside one step: each is one event line of ~200 bytes
CHUNK = 500


@pytest.fixture
def big_run(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(0, 0, 2 * N_OPS + 10)
    for i in range(N_OPS):
        tb.cpu_op("aten::add", 2 * i + 1, 1)
    tb.write(d / "rank0.pt.trace.json.gz")
    return d


def test_the_merged_trace_is_written_a_chunk_at_a_time(big_run, tmp_path, monkeypatch):
    writes: list[int] = []

    class Recording(export.igzip.IGzipFile):
        def write(self, data):
            writes.append(len(data))
            return super().write(data)

    monkeypatch.setattr(export.igzip, "IGzipFile", Recording)
    analysis = traceana.load_and_analyze(big_run, cache=False)
    out = export.write_merged_trace(analysis, tmp_path / "merged.json.gz", chunk_rows=CHUNK)
    trace = json.loads(gzip.decompress(out.read_bytes()))
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # Every event of the run (the step and its 6000 ops) plus the added lanes, exactly as the one-frame builder says.
    assert sum(e["name"] == "aten::add" for e in x) == N_OPS
    assert len(x) == export.merged_trace_events(analysis).height
    # No piece written holds more than one chunk's lines (each event's JSON line is well under 400 bytes), while
    # the whole text is many times that: the text of the whole trace was never one string.
    assert max(writes) < CHUNK * 400
    assert sum(writes) > 10 * max(writes)


def test_a_failed_merge_leaves_no_partial_file(big_run, tmp_path, monkeypatch):
    out = tmp_path / "merged.json.gz"
    out.write_bytes(b"older")
    analysis = traceana.load_and_analyze(big_run, cache=False)
    calls = {"n": 0}
    original = export.igzip.IGzipFile.write

    def full_disk(self, data):
        calls["n"] += 1
        if calls["n"] == 3:  # after some chunks went out
            raise OSError(28, "No space left on device")
        return original(self, data)

    monkeypatch.setattr(export.igzip.IGzipFile, "write", full_disk)
    with pytest.raises(BadInputError, match="nothing partial was left"):
        export.write_merged_trace(analysis, out, chunk_rows=CHUNK)
    assert out.read_bytes() == b"older"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
