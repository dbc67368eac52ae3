"""Finishing a trace's table (traceana/ingest/kineto.py ``_finish``) takes two shortcuts for speed; each must give
exactly what the plain definition gives, computed here in plain Python."""

from __future__ import annotations

from unittest import mock

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from traceana.core import schema
from traceana.ingest import kineto

small = st.integers(min_value=0, max_value=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(small, small), max_size=60))
def test_the_time_order_is_the_stable_sort_by_start_then_longest_first(rows):
    # Few distinct starts and durations: many ties, in every arrangement.
    times = pl.DataFrame(rows, schema={"ts_ns": pl.Int64, "dur_ns": pl.Int64}, orient="row")
    plain = sorted(range(len(rows)), key=lambda i: (rows[i][0], -rows[i][1]))  # Python's sort is stable
    assert kineto._time_order(times).to_list() == plain


optional = st.one_of(st.none(), st.sampled_from([0, 1, 7, -3, 2**40]))


tracks_rows = st.lists(st.tuples(st.booleans(), optional, optional, st.integers(0, 2), st.integers(0, 3)), max_size=40)


def check_tracks(rows):
    x = pl.DataFrame(rows, schema={"is_gpu": pl.Boolean, "device": pl.Int64, "stream": pl.Int64, "pid": pl.UInt32,
                                   "tid": pl.UInt32}, orient="row")
    pid_text = pl.Series("value", ["1000", "Spans", ""])
    tid_text = pl.Series("value", ["4242", "stream 7", "PyTorch Profiler", ""])
    # What schema.EVENTS says a track is, event by event: "gpu:{device}:{stream}" or "cpu:{pid}:{tid}", the pid's
    # and tid's text where device or stream is missing.
    plain = [f"{'gpu' if gpu else 'cpu'}:{pid_text[p] if d is None else d}:{tid_text[t] if s is None else s}"
             for gpu, d, s, p, t in rows]
    got = kineto._tracks(x, pid_text, tid_text)
    assert got.dtype == schema.EVENTS["track"]
    assert got.cast(pl.String).to_list() == plain


@settings(max_examples=200, deadline=None)
@given(tracks_rows)
def test_tracks_are_formatted_once_per_distinct_track_as_for_every_event(rows):
    check_tracks(rows)


@settings(max_examples=50, deadline=None)
@given(tracks_rows)
def test_tracks_of_parts_too_many_to_pack_are_joined_to_the_same_texts(rows):
    with mock.patch.object(kineto.math, "prod", return_value=2**62):  # as if the packed key could overflow
        check_tracks(rows)


def _both_sorts(path, monkeypatch):
    """read_trace's events as the one-query path of small tables gives them, and as the column-at-a-time path of
    large tables gives them (forced for a small file by lowering the size switch)."""
    whole = kineto.read_trace(path)[0]
    with monkeypatch.context() as m:
        m.setattr(kineto, "SORT_WHOLE_ROWS", 0)
        by_columns = kineto.read_trace(path)[0]
    return whole, by_columns


def test_small_and_large_tables_are_sorted_and_filled_alike(tmp_path, monkeypatch):
    import json

    def x(name, ts, dur, **args):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": dur, "args": args}

    events = [x("a", 5, 1), x("b", 3, 2), x("c", 3, 4), x("d", 3, 4), x("e", None, 1),
              x("record_param_comms", 4, 1, **{"Collective name": "send", "Dst Rank": 1, "dtype": "Float",
                                               "In msg nelems": 8})]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": events}))
    for got in _both_sorts(f, monkeypatch):
        # By start; of equal starts the longer first, then file order; "e" (no start) dropped; the facts stay with
        # their event: 8 float32 elements = 32 bytes to rank 1.
        assert got["name"].to_list() == ["c", "d", "b", "record_param_comms", "a"]
        assert got["peer"].to_list() == [None, None, None, 1, None]
        assert got["nbytes"].to_list() == [None, None, None, 32, None]
        assert got.schema == pl.Schema(schema.EVENTS)


def test_third_party_tables_are_the_same_either_way(third_party, monkeypatch):
    from polars.testing import assert_frame_equal

    for f in sorted(third_party.rglob("*.json*")):
        whole, by_columns = _both_sorts(f, monkeypatch)
        assert_frame_equal(whole, by_columns)
