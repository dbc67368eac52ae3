"""Finishing a trace's table (traceana/ingest/kineto.py ``_finish``) takes two shortcuts for speed; each must give
exactly what the plain definition gives, computed here in plain Python."""

from __future__ import annotations

from unittest import mock

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from traceana import schema
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
