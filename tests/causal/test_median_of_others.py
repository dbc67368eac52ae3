"""whatif.median_of_others (the peers' and the other stages' medians without a self-join) against the median of
the others taken by brute force: Python's statistics.median over each row's other values, and the self-join it
replaced (each row joined with every other row of its key), on small frames with ties, nulls, lone rows and keys
whose values are all null."""

from __future__ import annotations

import statistics

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from traceana.causal.whatif import median_of_others


def _brute(rows: list[tuple[int, int, float | None]]) -> dict[tuple[int, int], float | None]:
    """(key, who) -> the median of the other rows' non-null values of the key (None where there is none)."""
    out = {}
    for key, who, _ in rows:
        others = [v for k, w, v in rows if k == key and w != who and v is not None]
        out[key, who] = statistics.median(others) if others else None
    return out


def _self_join(frame: pl.DataFrame) -> dict[tuple[int, int], float | None]:
    """The query median_of_others replaced (whatif._ideals before it)."""
    lf = frame.lazy()
    others = (lf.join(lf, on="key", suffix="_o", nulls_equal=True).filter(pl.col("who") != pl.col("who_o"))
              .group_by("key", "who").agg(pl.col("v_o").median().alias("m")))
    got = frame.join(others.collect(), on=["key", "who"], how="left")
    return {(r["key"], r["who"]): r["m"] for r in got.to_dicts()}


def _frame(rows) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={"key": pl.Int64, "who": pl.Int64, "v": pl.Float64}, orient="row")


def _ours(frame: pl.DataFrame) -> dict[tuple[int, int], float | None]:
    got = median_of_others(frame.lazy(), ["key"], "who", "v", "m").collect()
    assert got.height == frame.height and got.columns == [*frame.columns, "m"]
    assert got.select("key", "who", "v").equals(frame)  # the rows, in their order, beside the medians
    return {(r["key"], r["who"]): r["m"] for r in got.to_dicts()}


# durations in ns and their medians: integers and halves (exact in float64, as the graph's are)
_value = st.one_of(st.none(), st.integers(0, 40).map(float), st.integers(0, 10**12).map(lambda x: x / 2))


@st.composite
def _rows(draw, value=_value):
    rows = []
    for key in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 9))
        whos = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n, unique=True))
        rows += [(key, w, draw(value)) for w in whos]
    return draw(st.permutations(rows))


@settings(max_examples=200, deadline=None)
@given(_rows())
def test_median_of_others_is_the_median_of_the_other_rows(rows):
    assert _ours(_frame(rows)) == _brute(rows)


@settings(max_examples=100, deadline=None)
@given(_rows(st.one_of(st.none(), st.floats(-1e15, 1e15, allow_nan=False))))
def test_median_of_others_equals_the_self_join_bit_for_bit(rows):
    frame = _frame(rows)
    assert _ours(frame) == _self_join(frame)


def test_median_of_others_by_hand():
    # key 0: 1, 2, 3, 10 — without 1: 3; without 2: 3; without 3: 2; without 10: 2. Key 1: a lone row (no other),
    # key 2: 5, null, 7 — without 5: 7; the null row removes nothing: 6; without 7: 5. Key 3: only nulls.
    rows = [(0, 4, 10.0), (0, 1, 2.0), (0, 2, 1.0), (0, 3, 3.0), (1, 9, 8.0), (2, 0, 5.0), (2, 1, None), (2, 2, 7.0),
            (3, 0, None), (3, 1, None)]
    assert _ours(_frame(rows)) == {(0, 4): 2.0, (0, 1): 3.0, (0, 2): 3.0, (0, 3): 2.0, (1, 9): None, (2, 0): 7.0,
                                   (2, 1): 6.0, (2, 2): 5.0, (3, 0): None, (3, 1): None}
