"""Interval algebra on polars frames: union, intersect, subtract, gaps, clip, partition.

An interval set is a frame with integer ``start`` / ``end`` columns (half-open ``[start, end)``, nanoseconds) plus
group-key columns (``by``, e.g. rank and step); operations act within each group. Everything is vectorised with the
sort + cumulative max + cumulative sum idiom (a new merged interval begins where ``start`` exceeds the running
maximum of earlier ``end``s; a sweep over boundary deltas gives the coverage count at every instant), so no
per-interval Python runs. Empty intervals (end <= start) are dropped on input.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

START, END = "start", "end"


def _keys(by: Sequence[str] | str | None) -> list[str]:
    if by is None:
        return []
    return [by] if isinstance(by, str) else list(by)


def _over(expr: pl.Expr, keys: list[str]) -> pl.Expr:
    return expr.over(keys) if keys else expr


def merge(frame: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Union per group: overlapping or touching intervals become one. Returns ``by + [start, end]``, sorted."""
    keys = _keys(by)
    if frame.height == 0:
        return frame.select(*keys, START, END)
    return (
        frame.lazy()
        .select(*keys, START, END)
        .filter(pl.col(END) > pl.col(START))
        .sort([*keys, START])
        .with_columns(_over(pl.col(END).cum_max().shift(1), keys).alias("_reach"))
        .with_columns(_over((pl.col("_reach").is_null() | (pl.col(START) > pl.col("_reach"))).cum_sum(), keys)
                      .alias("_island"))
        .group_by([*keys, "_island"], maintain_order=True)
        .agg(pl.col(START).min(), pl.col(END).max())
        .drop("_island")
        .collect()
    )


def total(frame: pl.DataFrame, by: Sequence[str] | str | None = None, *, name: str = "ns") -> pl.DataFrame:
    """Length of the union per group."""
    keys = _keys(by)
    merged = merge(frame, keys).with_columns((pl.col(END) - pl.col(START)).alias(name))
    if not keys:
        return pl.DataFrame({name: [int(merged[name].sum())]}, schema={name: pl.Int64})
    return merged.group_by(keys, maintain_order=True).agg(pl.col(name).sum())


def _sweep(sets: Sequence[pl.DataFrame], keys: list[str]) -> pl.LazyFrame:
    """Elementary segments ``[start, end)`` between consecutive boundaries of all sets, with a coverage count
    ``_c{i}`` per input set (each set merged first, so counts are 0 or 1)."""
    deltas = []
    for i, s in enumerate(sets):
        m = merge(s, keys).lazy()
        zero = {f"_d{j}": pl.lit(0, pl.Int32) for j in range(len(sets)) if j != i}
        deltas.append(m.select(*keys, pl.col(START).alias("_t"), pl.lit(1, pl.Int32).alias(f"_d{i}"), **zero))
        deltas.append(m.select(*keys, pl.col(END).alias("_t"), pl.lit(-1, pl.Int32).alias(f"_d{i}"), **zero))
    cols = [f"_d{i}" for i in range(len(sets))]
    return (
        pl.concat([d.select(*keys, "_t", *cols) for d in deltas], how="vertical_relaxed")
        .group_by([*keys, "_t"])
        .agg(pl.col(c).sum() for c in cols)
        .sort([*keys, "_t"])
        .with_columns(*(_over(pl.col(f"_d{i}").cum_sum(), keys).alias(f"_c{i}") for i in range(len(sets))),
                      _over(pl.col("_t").shift(-1), keys).alias("_next"))
        .filter(pl.col("_next").is_not_null())
        .select(*keys, pl.col("_t").alias(START), pl.col("_next").alias(END), *(f"_c{i}" for i in range(len(sets))))
    )


def _combine(a: pl.DataFrame, b: pl.DataFrame, by, keep: pl.Expr) -> pl.DataFrame:
    keys = _keys(by)
    segs = _sweep([a, b], keys).filter(keep).select(*keys, START, END).collect()
    return merge(segs, keys)


def intersect(a: pl.DataFrame, b: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Time covered by both ``a`` and ``b`` (per group)."""
    return _combine(a, b, by, (pl.col("_c0") > 0) & (pl.col("_c1") > 0))


def subtract(a: pl.DataFrame, b: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Time covered by ``a`` and not by ``b`` (per group)."""
    return _combine(a, b, by, (pl.col("_c0") > 0) & (pl.col("_c1") == 0))


def gaps(a: pl.DataFrame, windows: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Parts of ``windows`` not covered by ``a``: the idle time."""
    return subtract(windows, a, by)


def clip(
    frame: pl.DataFrame,
    windows: pl.DataFrame,
    *,
    on: Sequence[str] | str,
    window_keys: Sequence[str] | str,
    window_start: str = START,
    window_end: str = END,
) -> pl.DataFrame:
    """Cut each interval to every window it overlaps (joined on ``on``), adding the window's ``window_keys``.

    An interval overlapping two windows yields one piece in each; pieces outside all windows are dropped. Other
    columns of ``frame`` are kept. Windows of one ``on`` group should be few (steps of a rank): the join is
    intervals × windows per group.
    """
    on_, wk = _keys(on), _keys(window_keys)
    w = windows.select(*on_, *wk, pl.col(window_start).alias("_ws"), pl.col(window_end).alias("_we"))
    return (
        frame.lazy()
        .join(w.lazy(), on=on_)
        .filter((pl.col(START) < pl.col("_we")) & (pl.col(END) > pl.col("_ws")))
        .with_columns(pl.max_horizontal(START, "_ws").alias(START), pl.min_horizontal(END, "_we").alias(END))
        .filter(pl.col(END) > pl.col(START))
        .drop("_ws", "_we")
        .collect()
    )


def partition(
    windows: pl.DataFrame,
    layers: Sequence[tuple[str, pl.DataFrame]],
    *,
    by: Sequence[str] | str,
    default: str,
    label: str = "label",
) -> pl.DataFrame:
    """Split every window into segments labelled by the first layer (in priority order) covering each instant.

    ``windows`` has ``by + [start, end]`` with one window per group; every layer is an interval set with the ``by``
    columns. Time covered by no layer gets ``default``. The segments of a window are disjoint and their lengths sum
    exactly to the window's length. Returns ``by + [label, start, end]`` with adjacent same-label segments merged.
    """
    keys = _keys(by)
    names = [n for n, _ in layers]
    w = windows.select(*keys, START, END)
    clipped = [
        clip(layer.select(*keys, START, END), w, on=keys, window_keys=[], window_start=START, window_end=END)
        for _, layer in layers
    ]
    segs = _sweep([w, *clipped], keys).filter(pl.col("_c0") > 0)
    choice = pl.lit(default)
    for i in reversed(range(len(names))):
        choice = pl.when(pl.col(f"_c{i + 1}") > 0).then(pl.lit(names[i])).otherwise(choice)
    segs = segs.select(*keys, choice.alias(label), START, END).collect()
    # Merge runs of one label that touch (sweep boundaries of lower layers split them needlessly).
    return (
        merge(segs, [*keys, label])
        .sort([*keys, START])
        .select(*keys, label, START, END)
    )
