"""traceana.core.keyed: a frame as the keyed dict an engine reads (expected dicts written by hand)."""

from __future__ import annotations

import polars as pl

from traceana.core.keyed import keyed


def test_the_other_columns_in_order_are_the_key_and_values_are_floats():
    f = pl.DataFrame({"op": ["F", "B"], "stage": [0, 1], "microbatch": [2, 3], "ns": [10, 20]},
                     schema={"op": pl.String, "stage": pl.Int32, "microbatch": pl.Int32, "ns": pl.Int64})
    got = keyed(f, "ns")
    assert got == {("F", 0, 2): 10.0, ("B", 1, 3): 20.0}
    assert all(type(v) is float for v in got.values()) and all(type(k[1]) is int for k in got)
    # the value column need not be last; one key column gives bare keys
    assert keyed(f.select("ns", "stage"), "ns") == {0: 10.0, 1: 20.0}


def test_convert_none_keeps_lists_and_nulls_and_the_last_row_wins():
    f = pl.DataFrame({"stage": [0, 1, 0], "d": [[1, 2], None, [3]]})
    assert keyed(f, "d", convert=None) == {0: [3], 1: None}
    assert keyed(f.head(0), "d", convert=None) == {}
    assert keyed(pl.DataFrame({"a": [], "b": [], "x": []}), "x") == {}


def test_keys_shaped_in_polars():
    f = pl.DataFrame({"phase": ["forward", "backward"], "stage": [0, 0], "t": [1.5, 2.5]})
    kind = pl.when(pl.col("phase") == "forward").then(pl.lit("F")).otherwise(pl.lit("B"))
    assert keyed(f.select(kind, "stage", "t"), "t") == {("F", 0): 1.5, ("B", 0): 2.5}
    assert keyed(f.select(pl.lit("R"), "stage", "t"), "t") == {("R", 0): 2.5}
