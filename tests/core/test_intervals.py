"""Interval algebra: tiny hand-made cases with expected tables, and hypothesis properties against a brute-force grid."""

from __future__ import annotations

from unittest.mock import patch

import polars as pl
from hypothesis import example, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from traceana.core import intervals as iv


def frame(rows, keys=("g",)):
    cols = [*keys, "start", "end"]
    return pl.DataFrame([dict(zip(cols, r)) for r in rows], schema={c: pl.Int64 for c in cols}, orient="row")


def test_merge_joins_overlapping_and_touching_and_keeps_groups_apart():
    got = iv.merge(frame([(0, 0, 5), (0, 3, 7), (0, 7, 9), (0, 12, 13), (1, 1, 2), (1, 0, 1)]), "g")
    assert_frame_equal(got, frame([(0, 0, 9), (0, 12, 13), (1, 0, 2)]))


def test_merge_drops_empty_intervals():
    assert iv.merge(frame([(0, 5, 5), (0, 6, 4)]), "g").height == 0


def test_nested_intervals_merge_to_the_outer():
    assert_frame_equal(iv.merge(frame([(0, 0, 10), (0, 2, 3), (0, 4, 9)]), "g"), frame([(0, 0, 10)]))


def test_intersect():
    a = frame([(0, 0, 10), (0, 20, 30)])
    b = frame([(0, 5, 25), (1, 0, 100)])
    assert_frame_equal(iv.intersect(a, b, "g"), frame([(0, 5, 10), (0, 20, 25)]))


def test_subtract():
    a = frame([(0, 0, 10), (1, 0, 4)])
    b = frame([(0, 2, 3), (0, 8, 12)])
    assert_frame_equal(iv.subtract(a, b, "g"), frame([(0, 0, 2), (0, 3, 8), (1, 0, 4)]))


def test_gaps_are_the_idle_parts_of_the_window():
    busy = frame([(0, 1, 3), (0, 2, 4), (0, 6, 7)])
    assert_frame_equal(iv.gaps(busy, frame([(0, 0, 10)]), "g"), frame([(0, 0, 1), (0, 4, 6), (0, 7, 10)]))


def test_total():
    got = iv.total(frame([(0, 0, 5), (0, 3, 7), (1, 0, 1)]), "g")
    assert_frame_equal(got, pl.DataFrame({"g": [0, 1], "ns": [7, 1]}))


def test_clip_cuts_intervals_to_each_window_they_overlap():
    steps = pl.DataFrame({"g": [0, 0], "step": [1, 2], "start": [0, 10], "end": [10, 20]})
    got = iv.clip(frame([(0, 8, 12), (0, 25, 30), (1, 0, 5)]), steps, on="g", window_keys="step")
    assert_frame_equal(got.sort("start"), pl.DataFrame({"g": [0, 0], "start": [8, 10], "end": [10, 12],
                                                        "step": [1, 2]}))


def test_clip_gives_a_piece_to_each_of_two_overlapping_windows():
    # Windows 1 [0, 10) and 2 [5, 15) overlap (a trace's overlapping steps): an interval in both, by hand, is cut
    # once for each; an interval only in the later one stays whole there.
    steps = pl.DataFrame({"g": [0, 0], "step": [1, 2], "start": [0, 5], "end": [10, 15]})
    got = iv.clip(frame([(0, 6, 8), (0, 11, 12)]), steps, on="g", window_keys="step")
    assert_frame_equal(got.sort("step", "start"), pl.DataFrame({"g": [0, 0, 0], "start": [6, 6, 11],
                                                                "end": [8, 8, 12], "step": [1, 2, 2]}))


def test_partition_gives_priority_to_earlier_layers_and_default_to_the_rest():
    windows = frame([(0, 0, 10)])
    got = iv.partition(
        windows,
        [("compute", frame([(0, 2, 4)])), ("p2p", frame([(0, 3, 6), (0, 9, 12)]))],
        by="g", default="idle",
    )
    expected = pl.DataFrame(
        {"g": [0] * 5, "label": ["idle", "compute", "p2p", "idle", "p2p"], "start": [0, 2, 4, 6, 9],
         "end": [2, 4, 6, 9, 10]}
    )
    assert_frame_equal(got, expected)


# --- properties against a brute-force unit grid ------------------------------------------------------------------
ivl = st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12)).map(lambda t: (t[0], t[1], t[1] + t[2]))
sets = st.lists(ivl, max_size=12)


def cover(rows, g):
    return {t for gg, s, e in rows if gg == g for t in range(s, e)}


def grid(df: pl.DataFrame, g):
    return cover(df.select("g", "start", "end").rows(), g)


@settings(max_examples=80, deadline=None)
@given(sets, sets)
def test_set_operations_match_a_brute_force_grid(a_rows, b_rows):
    a, b = frame(a_rows), frame(b_rows)
    for g in range(3):
        ca, cb = cover(a_rows, g), cover(b_rows, g)
        assert grid(iv.merge(a, "g"), g) == ca
        assert grid(iv.intersect(a, b, "g"), g) == ca & cb
        assert grid(iv.subtract(a, b, "g"), g) == ca - cb
    m = iv.merge(a, "g")
    # merged intervals of a group are disjoint and do not touch
    assert m.filter(pl.col("start") <= pl.col("end").shift(1).over("g")).height == 0


@settings(max_examples=60, deadline=None)
@given(sets, sets, st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(1, 20)), max_size=3,
                            unique_by=lambda t: t[0]))
def test_partition_covers_each_window_exactly_once(a_rows, b_rows, w_rows):
    windows = frame([(g, s, s + d) for g, s, d in w_rows])
    segs = iv.partition(windows, [("a", frame(a_rows)), ("b", frame(b_rows))], by="g", default="rest")
    for g, s, d in w_rows:
        mine = segs.filter(pl.col("g") == g)
        assert int((mine["end"] - mine["start"]).sum()) == d
        covered = [t for r in mine.rows(named=True) for t in range(r["start"], r["end"])]
        assert sorted(covered) == list(range(s, s + d))
        ca, cb = cover(a_rows, g), cover(b_rows, g)
        for r in mine.rows(named=True):
            for t in range(r["start"], r["end"]):
                assert r["label"] == ("a" if t in ca else "b" if t in cb else "rest")


def apart(rows):
    """Windows ``(g, k, start, length)`` with those overlapping an earlier one of their group dropped."""
    kept = []
    for g, k, s, d in rows:
        if all(g != g2 or s + d <= s2 or s2 + d2 <= s for g2, _, s2, d2 in kept):
            kept.append((g, k, s, d))
    return kept


@settings(max_examples=100, deadline=None)
@given(sets, sets, st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 30), st.integers(0, 12)),
                            max_size=6, unique_by=lambda t: (t[0], t[1])).map(apart))
def test_partition_of_layers_keyed_by_group_covers_each_window_exactly_once(a_rows, b_rows, w_rows):
    """Several windows per group (steps of a rank: apart or touching, in or out of key order) and layers keyed by
    the group alone, each cut at the windows' boundaries; in one pass, and a few groups at a time as a large run
    is (iv.PARTITION_BATCH)."""
    windows = frame([(g, k, s, s + d) for g, k, s, d in w_rows], keys=("g", "k"))
    for batch in (iv.PARTITION_BATCH, 2):
        with patch.object(iv, "PARTITION_BATCH", batch):
            segs = iv.partition(windows, [("a", frame(a_rows)), ("b", frame(b_rows))], by=["g", "k"], on="g",
                                default="rest")
        check_group_partition(segs, a_rows, b_rows, w_rows)


@settings(max_examples=100, deadline=None)
@given(sets, sets, st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 30), st.integers(1, 12)),
                            max_size=6, unique_by=lambda t: (t[0], t[1])))
def test_partition_covers_each_of_overlapping_windows_exactly_once(a_rows, b_rows, w_rows):
    """Windows of a group that overlap (a trace's overlapping steps): each is still covered whole, by its own cut
    of the layers (the per-window axis and intervals.clip, not the rank axis)."""
    windows = frame([(g, k, s, s + d) for g, k, s, d in w_rows], keys=("g", "k"))
    segs = iv.partition(windows, [("a", frame(a_rows)), ("b", frame(b_rows))], by=["g", "k"], on="g", default="rest")
    check_group_partition(segs, a_rows, b_rows, w_rows)


def check_group_partition(segs, a_rows, b_rows, w_rows):
    assert segs.columns == ["g", "k", "label", "start", "end"]
    assert segs.height == segs.unique(["g", "k", "start"]).height
    for g, k, s, d in w_rows:
        mine = segs.filter((pl.col("g") == g) & (pl.col("k") == k)).sort("start")
        covered = [t for r in mine.rows(named=True) for t in range(r["start"], r["end"])]
        assert covered == list(range(s, s + d))
        ca, cb = cover(a_rows, g), cover(b_rows, g)
        for r in mine.rows(named=True):
            for t in range(r["start"], r["end"]):
                assert r["label"] == ("a" if t in ca else "b" if t in cb else "rest")
        # adjacent segments of one window differ in label (runs are merged)
        assert all(x != y for x, y in zip(mine["label"], mine["label"][1:]))
    assert segs.height == sum(segs.filter((pl.col("g") == g) & (pl.col("k") == k)).height for g, k, _, _ in w_rows)


@settings(max_examples=100, deadline=None)
@given(sets, sets, st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 30), st.integers(0, 12)),
                            max_size=6, unique_by=lambda t: (t[0], t[1])).map(apart), st.booleans())
def test_partition_of_layers_given_in_one_frame_covers_each_window_exactly_once(a_rows, b_rows, w_rows, in_order):
    """Two layers in one frame (``iv.LAYER``: each interval's index in the names), batched or not, and with the
    frame in group order (each batch then reads a slice of it) or not: the same brute-force check as two frames."""
    windows = frame([(g, k, s, s + d) for g, k, s, d in w_rows], keys=("g", "k"))
    both = pl.concat([frame(a_rows).with_columns(pl.lit(0, pl.UInt8).alias(iv.LAYER)),
                      frame(b_rows).with_columns(pl.lit(1, pl.UInt8).alias(iv.LAYER))])
    if in_order:
        both = both.sort("g", maintain_order=True)
    for batch in (iv.PARTITION_BATCH, 2):
        with patch.object(iv, "PARTITION_BATCH", batch):
            segs = iv.partition(windows, [(("a", "b"), both)], by=["g", "k"], on="g", default="rest")
        check_group_partition(segs, a_rows, b_rows, w_rows)


def _windows_and_points(kept, p_rows):
    """The frames of (group, start, duration) windows, numbered in order, and of (group, instant) points."""
    windows = pl.DataFrame({"g": [g for g, _, _ in kept], "start": [s for _, s, _ in kept],
                            "end": [s + d for _, s, d in kept], "id": list(range(len(kept)))},
                           schema={"g": pl.Int32, "start": pl.Int64, "end": pl.Int64, "id": pl.Int32})
    points = pl.DataFrame({"g": [g for g, _ in p_rows], "t": [t for _, t in p_rows]},
                          schema={"g": pl.Int32, "t": pl.Int64})
    return windows, points

@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(0, 12)), max_size=8),
       st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.one_of(st.none(), st.integers(-5, 45))),
                max_size=12), st.booleans())
@example([(0, 0, 1), (0, 0, 0)], [(0, 0)], False)  # an empty window at the instant another starts holds nothing
def test_containing_finds_the_window_holding_each_point(w_rows, p_rows, in_order):
    """Against a brute-force scan: each point (group, instant; either may be null) gets the id of the window of
    its group whose [start, end) holds it, else null; a group's windows do not overlap (later ones dropped).
    Points in (group, instant) order, as events come from ingest, or not."""
    if in_order:
        p_rows = sorted((g, t) for g, t in p_rows if g is not None and t is not None)
    kept = []
    for g, s, d in w_rows:
        if all(g != g2 or s + d <= s2 or s2 + d2 <= s for g2, s2, d2 in kept):
            kept.append((g, s, d))
    windows, points = _windows_and_points(kept, p_rows)
    got = iv.containing(points, "t", windows, by="g", columns=["id"])
    want = [next((i for i, (g2, s, d) in enumerate(kept) if g is not None and t is not None and g == g2
                  and s <= t < s + d), None) for g, t in p_rows]
    assert got["id"].to_list() == want
    assert got.schema == {"id": pl.Int32}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(0, 12)), max_size=8),
       st.lists(st.tuples(st.integers(0, 3), st.integers(-5, 45)), max_size=14))
def test_containing_of_points_in_order_takes_the_row_runs_and_agrees_with_a_brute_force_scan(w_rows, p_rows):
    """Points in (group, instant) order without nulls (events as ingest leaves them) are placed by the runs of
    rows each window holds (``_sorted_containing``), not on one searched axis: the window whose [start, end)
    holds each point, else null, as a brute-force scan finds it."""
    p_rows = sorted(p_rows)
    kept = []
    for g, s, d in w_rows:  # a group's windows do not overlap and start apart
        if all(g != g2 or (s != s2 and (s + d <= s2 or s2 + d2 <= s)) for g2, s2, d2 in kept):
            kept.append((g, s, d))
    windows, points = _windows_and_points(kept, p_rows)
    w = windows.select("g", pl.col("start").alias("_ws"), pl.col("end").alias("_we"), "id")
    assert not p_rows or iv._sorted_containing(points, "t", w, "g") is not None
    want = [next((i for i, (g2, s, d) in enumerate(kept) if g == g2 and s <= t < s + d), None) for g, t in p_rows]
    for groups in (iv.SORTED_CONTAINING_GROUPS, 0):  # (0: every group count takes the one searched axis)
        with patch.object(iv, "SORTED_CONTAINING_GROUPS", groups):
            got = iv.containing(points, "t", windows, by="g", columns=["id"])
        assert got["id"].to_list() == want
        assert got.schema == {"id": pl.Int32}
