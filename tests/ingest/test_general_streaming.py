"""The general decoder streams (issue 13: it read the whole decompressed stream into memory): a JSON over
``WHOLE_JSON_BYTES`` goes through a window of a few chunks, cut between events. Here the window is made tiny
(``WHOLE_JSON_BYTES`` 0, 300-byte chunks) so that small hand-written traces exercise every cut, and each must give
exactly what decoding the whole JSON at once gives."""

from __future__ import annotations

import gzip
import json

import pytest
from polars.testing import assert_frame_equal

from traceana.core.errors import TraceFormatError
from traceana.ingest import kineto


def _ev(i: int, name: str = "aten::add") -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 2 * i + 1, "dur": 1}


def _decode_both(path, monkeypatch):
    monkeypatch.setattr(kineto, "_scan", None)
    whole = kineto.read_trace(path)
    monkeypatch.setattr(kineto, "WHOLE_JSON_BYTES", 0)
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 300)
    streamed = kineto.read_trace(path)
    return whole, streamed


def _same(whole, streamed):
    assert_frame_equal(whole[0], streamed[0])
    assert_frame_equal(whole[1], streamed[1])
    for k in ("rank", "world_size", "truncated", "n_events", "devices", "base_time_ns"):
        assert whole[2][k] == streamed[2][k], k


def test_cuts_inside_strings_and_keys_after_the_array(tmp_path, monkeypatch):
    # Names holding the very separator the cutter looks for ("},{"), and top-level keys after traceEvents whose
    # values are lists of objects (more separators, past the array's end).
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0,
               "dur": 500}]
    events += [_ev(i, "a}, {b" * (i % 7) + "x") for i in range(200)]
    doc = {"schemaVersion": 1, "traceEvents": events, "deviceProperties": [{"id": 0}, {"id": 1}],
           "distributedInfo": {"rank": 3, "world_size": 4}, "baseTimeNanoseconds": 1000}
    f = tmp_path / "rank3.json"
    f.write_text(json.dumps(doc))
    whole, streamed = _decode_both(f, monkeypatch)
    assert streamed[0].height == 201 and streamed[2]["rank"] == 3 and streamed[2]["world_size"] == 4
    _same(whole, streamed)


def test_a_cut_off_gzip_keeps_its_complete_events(tmp_path, monkeypatch):
    doc = {"traceEvents": [_ev(i) for i in range(300)]}
    data = gzip.compress(json.dumps(doc, indent=1).encode())
    f = tmp_path / "rank0.json.gz"
    f.write_bytes(data[: len(data) * 2 // 3])
    whole, streamed = _decode_both(f, monkeypatch)
    assert streamed[2]["truncated"] and 0 < streamed[0].height < 300
    _same(whole, streamed)


def test_malformed_json_mid_array_is_one_line(tmp_path, monkeypatch):
    text = json.dumps({"traceEvents": [_ev(i) for i in range(100)]})
    f = tmp_path / "rank0.json"
    f.write_text(text.replace('"dur": 1}', '"dur": 1', 1).replace('"dur": 1}, {"ph"', '"dur": 1}} {"ph"', 1))
    monkeypatch.setattr(kineto, "_scan", None)
    monkeypatch.setattr(kineto, "WHOLE_JSON_BYTES", 0)
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 300)
    monkeypatch.setattr(kineto.limits, "MAX_VALUE_BYTES", 4096)  # the retries stop at the value rule
    with pytest.raises(TraceFormatError, match="not valid JSON") as e:
        kineto.read_trace(f)
    assert "\n" not in str(e.value)
