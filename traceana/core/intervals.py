"""Interval algebra on polars frames: union, intersect, subtract, gaps, clip, partition.

An interval set is a frame with integer ``start`` / ``end`` columns (half-open ``[start, end)``, nanoseconds) plus
group-key columns (``by``, e.g. rank and step); operations act within each group. Everything is vectorised with the
sort + cumulative max + cumulative sum idiom (a new merged interval begins where ``start`` exceeds the running
maximum of earlier ``end``s; a sweep over boundary deltas gives the coverage count at every instant), so no
per-interval Python runs. Empty intervals (end <= start) are dropped on input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

START, END = "start", "end"
# The engine that runs traceana's lazy queries (``LazyFrame.collect(**COLLECT)``): polars' "auto" picks its
# streaming engine, which costs about twice the CPU of the in-memory one on a small frame (~1 ms a query) and was
# no faster on an 87 MB trace; the frames are in memory already (docs/performance.md "Fixed cost").
ENGINE = "in-memory"


def _lean_optimizer() -> dict:
    """``optimizations=`` for ``collect``: polars' optimizer without the passes that cost more than they save on
    traceana's queries. Common-subplan and common-subexpression elimination, the order-observation check, join
    reordering, row estimates and the clustering of ``with_columns`` are planned on every query, ~0.1 ms each on a
    small one, and find little to do on queries that select their columns and filter first, as these do (nothing
    when a run is small; on 4 x 200 MB the analysis' queries ran ~10% faster without them). Predicate, projection and
    slice pushdown and expression simplification stay (a large run's queries need them). Flags an older polars
    lacks are left out (docs/performance.md "Fixed cost")."""
    flags = getattr(pl, "QueryOptFlags", None)
    if flags is None:
        return {}
    lean = flags()
    for name in ("comm_subplan_elim", "comm_subexpr_elim", "check_order_observe", "join_order", "row_estimate",
                 "cluster_with_columns"):
        if hasattr(lean, name):
            setattr(lean, name, False)
    return {"optimizations": lean}


#: ``LazyFrame.collect(**COLLECT)``, ``pl.collect_all(frames, **COLLECT)``: the engine and optimizer every lazy
#: query of the analysis runs with.
COLLECT = {"engine": ENGINE, **_lean_optimizer()}


def _keys(by: Sequence[str] | str | None) -> list[str]:
    if by is None:
        return []
    return [by] if isinstance(by, str) else list(by)


def _over(expr: pl.Expr, keys: list[str]) -> pl.Expr:
    return expr.over(keys) if keys else expr


def _group_starts(keys: list[str]) -> pl.Expr:
    """True on the first row of each group of a frame sorted by ``keys``."""
    if not keys:
        return pl.int_range(pl.len()) == 0
    return pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift(1)) for k in keys]) | (pl.int_range(pl.len()) == 0)


def _runs(frame: pl.LazyFrame, new: pl.Expr, keep: list, last: list) -> pl.DataFrame:
    """Collapse runs of consecutive rows (a run begins where ``new`` is true): ``keep`` from each run's first row,
    ``last`` from its last row. Filters instead of a group-by: runs are contiguous, so the k-th first row and the
    k-th last row belong to the same run."""
    df = frame.with_columns(new.alias("_new")).with_columns(pl.col("_new").shift(-1, fill_value=True).alias("_last"))
    df = df.collect(**COLLECT).lazy()  # (once: both halves read it)
    return pl.concat([df.filter("_new").select(*keep), df.filter("_last").select(*last)],
                     how="horizontal").collect(**COLLECT)


def merge(frame: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Union per group: overlapping or touching intervals become one. Returns ``by + [start, end]``, sorted."""
    keys = _keys(by)
    if frame.height == 0:
        return frame.select(*keys, START, END)
    # Sorted by start, a new merged interval begins where start exceeds the running maximum of earlier ends (or
    # a group begins); the running maximum at its last interval is its end.
    sorted_ = (
        frame.lazy()
        .select(*keys, START, END)
        .filter(pl.col(END) > pl.col(START))
        .sort([*keys, START])
        .with_columns(_over(pl.col(END).cum_max(), keys).alias("_reach"))
    )
    new = _group_starts(keys) | (pl.col(START) > pl.col("_reach").shift(1))
    return _runs(sorted_, new, [*keys, START], [pl.col("_reach").alias(END)])


def total(frame: pl.DataFrame, by: Sequence[str] | str | None = None, *, name: str = "ns") -> pl.DataFrame:
    """Length of the union per group."""
    keys = _keys(by)
    merged = merge(frame, keys).with_columns((pl.col(END) - pl.col(START)).alias(name))
    if not keys:
        return pl.DataFrame({name: [int(merged[name].sum())]}, schema={name: pl.Int64})
    return merged.group_by(keys, maintain_order=True).agg(pl.col(name).sum())


def _sweep(sets: Sequence[pl.DataFrame], keys: list[str]) -> pl.LazyFrame:
    """Elementary segments ``[start, end)`` between consecutive boundaries of all sets, with ``_mask``: bit i is set
    where set i covers the segment.

    Each set is merged first, so its coverage is 0 or 1 and a boundary of set i adds ±2^i: the running sum over the
    sorted boundaries *is* the bitmask of the sets covering each segment — one cumulative sum for any number of
    sets. Each merged interval adds and removes its bit inside its own group, so the running sum returns to 0 at
    every group's end (no per-group window needed); the step from one group's last boundary to the next group's
    first has mask 0, and callers keep only segments with some bit set. Several boundaries may share an instant:
    the zero-length steps between them are dropped.
    """
    if len(sets) > 62:
        raise ValueError("at most 62 interval sets per sweep")
    deltas = []
    for i, s in enumerate(sets):
        m = merge(s, keys).lazy()
        bit = 1 << i
        deltas.append(m.select(*keys, pl.col(START).alias("_t"), pl.lit(bit, pl.Int64).alias("_d")))
        deltas.append(m.select(*keys, pl.col(END).alias("_t"), pl.lit(-bit, pl.Int64).alias("_d")))
    return _scan(pl.concat(deltas, how="vertical_relaxed"), keys)


def _scan(deltas: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    """``_sweep``'s segments from its boundary deltas (``keys``, ``_t``, ``_d``)."""
    return (
        deltas
        .sort([*keys, "_t"])
        .with_columns(pl.col("_d").cum_sum().alias("_mask"), pl.col("_t").shift(-1).alias("_next"))
        .filter((pl.col("_next") > pl.col("_t")) & (pl.col("_mask") != 0))
        .select(*keys, pl.col("_t").alias(START), pl.col("_next").alias(END), "_mask")
    )


def _sweep_stacked(stacked: pl.DataFrame, n_sets: int) -> pl.LazyFrame:
    """``_sweep`` without group keys, for sets stacked in one frame (``_set``: 0 … n_sets-1, ``start``, ``end``).

    Each set is lifted onto its own copy of the time line (set i is shifted by i × the span of all of them), so
    one merge — a single sort — merges every set apart from the others, where merging set by set costs a few
    polars calls each.
    """
    if n_sets > 62:
        raise ValueError("at most 62 interval sets per sweep")
    stacked = stacked.filter(pl.col(END) > pl.col(START))
    if stacked.height == 0:
        return pl.LazyFrame(schema={START: pl.Int64, END: pl.Int64, "_mask": pl.Int64})
    lo, span = stacked[START].min(), stacked[END].max() - stacked[START].min() + 1
    lifted = stacked.select(*((pl.col(c) - lo + pl.col("_set").cast(pl.Int64) * span).alias(c) for c in (START, END)))
    m = merge(lifted).lazy().with_columns((pl.col(START) // span).alias("_set"))
    bit = pl.lit(pl.Series([1 << i for i in range(n_sets)], dtype=pl.Int64)).gather("_set")
    back = pl.col("_set") * span - lo
    return _scan(pl.concat([m.select((pl.col(START) - back).alias("_t"), bit.alias("_d")),
                            m.select((pl.col(END) - back).alias("_t"), (-bit).alias("_d"))]), [])


def _has(i: int) -> pl.Expr:
    return (pl.col("_mask") & (1 << i)) != 0


def _combine(a: pl.DataFrame, b: pl.DataFrame, by, keep: pl.Expr) -> pl.DataFrame:
    keys = _keys(by)
    segs = _sweep([a, b], keys).filter(keep).select(*keys, START, END).collect(**COLLECT)
    return merge(segs, keys)


def intersect(a: pl.DataFrame, b: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Time covered by both ``a`` and ``b`` (per group)."""
    return _combine(a, b, by, _has(0) & _has(1))


def subtract(a: pl.DataFrame, b: pl.DataFrame, by: Sequence[str] | str | None = None) -> pl.DataFrame:
    """Time covered by ``a`` and not by ``b`` (per group)."""
    return _combine(a, b, by, _has(0) & ~_has(1))


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
    keep_order: bool = True,
) -> pl.DataFrame:
    """Cut each interval to every window it overlaps (joined on ``on``), adding the window's ``window_keys``.

    An interval overlapping two windows yields one piece in each; pieces outside all windows are dropped. Other
    columns of ``frame`` are kept, and so is its row order unless ``keep_order`` is False (cheaper: no sort back
    when the intervals are not already in (group, start) order). Windows of one ``on`` group should be few (steps
    of a rank): the join is intervals × windows per group.
    """
    on_, wk = _keys(on), _keys(window_keys)
    w = windows.lazy().select(*on_, *wk, pl.col(window_start).alias("_ws"), pl.col(window_end).alias("_we"))
    if frame.height == 0 or windows.height == 0:
        w = w.collect(**COLLECT)
        return frame.join(w.drop("_ws", "_we"), on=on_).head(0) if on_ else frame.head(0)
    # Most intervals lie inside the window that starts last before them: find it with an as-of join (cheap) and
    # send only the others (crossing a boundary, or outside every window) through the intervals × windows join.
    # That shortcut holds only where a group's windows do not overlap (an interval inside the later of two
    # overlapping windows is in the earlier one too): with any overlap every interval takes the join.
    # Three queries: both questions, the as-of join, the pieces (docs/performance.md "Fixed cost").
    f = frame.with_row_index("_clip_row")
    checks = [w.sort(*on_, "_ws").select(_windows_overlap_expr(on_).alias("_overlap"))]
    if len(on_) == 1:  # in time order, as ingest leaves events: no sort needed
        checks.append(f.lazy().select(_time_order_expr(on_[0], START).alias("_ordered")))
    overlap, *ordered = pl.concat(checks, how="horizontal").collect(**COLLECT).row(0)
    ordered = bool(ordered and ordered[0])
    inside = pl.col("_ws").is_not_null() & (pl.col(END) <= pl.col("_we"))
    if overlap:
        inside = pl.lit(False)
    located = (f.lazy() if ordered else f.lazy().sort(START)).join_asof(
        w.sort("_ws"), left_on=START, right_on="_ws", by=on_ or None, strategy="backward",
        check_sortedness=False).with_columns(inside.alias("_inside")).collect(**COLLECT)
    columns = [c for c in located.columns if c not in ("_ws", "_we", "_inside")]
    simple = located.lazy().filter(pl.col("_inside") & (pl.col(END) > pl.col(START))).select(columns)
    if bool(located["_inside"].all()):  # every interval inside one window: nothing to cut or join
        return (simple if ordered or not keep_order else simple.sort("_clip_row")).drop("_clip_row").collect(
            **COLLECT)
    rest = located.lazy().filter(~pl.col("_inside")).select(f.columns)
    spanning = (
        (rest.join(w, on=on_) if on_ else rest.join(w, how="cross"))
        .filter((pl.col(START) < pl.col("_we")) & (pl.col(END) > pl.col("_ws")))
        .with_columns(pl.max_horizontal(START, "_ws").alias(START), pl.min_horizontal(END, "_we").alias(END))
        .filter(pl.col(END) > pl.col(START))
        .select(columns)
    )
    if not keep_order:
        out = pl.concat([simple, spanning])
    elif ordered:  # both in row order already: interleave them instead of sorting
        out = simple.merge_sorted(spanning.sort("_clip_row"), "_clip_row")
    else:
        out = pl.concat([simple, spanning]).sort("_clip_row")
    return out.drop("_clip_row").collect(**COLLECT)


def _windows_overlap_expr(on: list[str]) -> pl.Expr:
    """On windows (``_ws``, ``_we``) sorted by ``on`` and ``_ws``: does any start before an earlier-starting window
    of its group has ended?"""
    prev_end = pl.col("_we").cum_max().shift(1)
    return (pl.col("_ws") < (prev_end.over(on) if on else prev_end)).any()


def _time_order_expr(by: str, at: str) -> pl.Expr:
    """``in_time_order`` as one boolean expression over a non-empty frame."""
    step = pl.col(by).diff()
    ordered = (step > 0) | ((step == 0) & (pl.col(at).diff() >= 0))
    return ordered.slice(1).all() & (pl.col(by).null_count() == 0) & (pl.col(at).null_count() == 0)


def in_time_order(frame: pl.DataFrame, by: str, at: str) -> bool:
    """Is ``frame`` sorted by ``(by, at)`` with no nulls? (Events come so from ingest: ranks in order, each by time.)"""
    return frame.height == 0 or bool(frame.select(_time_order_expr(by, at)).item())


def containing(
    points: pl.DataFrame,
    at: str,
    windows: pl.DataFrame,
    *,
    by: str,
    columns: Sequence[str],
    start: str = START,
    end: str = END,
) -> pl.DataFrame:
    """``columns`` of the window (same ``by`` value) whose ``[start, end)`` holds ``points[at]``, for every row of
    ``points`` in its order; null where none does. A group's windows must not overlap: the one starting last at or
    before the point is the only candidate (an as-of join)."""
    cols = list(columns)
    if windows.height == 0:
        return pl.DataFrame([pl.repeat(None, points.height, dtype=windows.schema[c], eager=True).alias(c)
                             for c in cols])
    # An empty window [s, s) holds no point; left in, it could hide the window starting at the same instant.
    w = (windows.select(by, pl.col(start).alias("_ws"), pl.col(end).alias("_we"), *cols)
         .filter(~(pl.col("_we") <= pl.col("_ws")).fill_null(False)))
    index = _sorted_containing(points, at, w, by)
    if index is not None:
        # (Window 0 of the gather is a null row: a point in no window.)
        picked = w.select(cols)
        return pl.concat([picked.clear(1), picked]).select(pl.all().gather(index))
    axis = group_axis([points[by], w[by]], [points[at], w["_ws"], w["_we"]])
    if axis is not None:
        # Every group's windows on one axis (``GroupAxis``), sorted: a point's candidate is found on it by an as-of
        # join without groups (points in group and time order, as ingest leaves events) or a binary search, with
        # neither a sort of the points (a rank's events are a million) nor an as-of join's grouping. On that axis
        # a point before its group's first window falls behind the end of the previous group's last one.
        w = (w.filter(pl.col(by).is_not_null() & pl.col("_ws").is_not_null())
             .select(axis.key(by, "_ws").alias("_key"), axis.key(by, "_we").alias("_end"), *cols).sort("_key"))
        p = points.select(axis.key(by, at).alias("_key"))
        pick = [pl.when(pl.col("_key") < pl.col("_end")).then(pl.col(c)).alias(c) for c in cols]
        if p["_key"].null_count() == 0 and p["_key"].is_sorted():
            return p.join_asof(w, on="_key", strategy="backward", check_sortedness=False).select(pick)
        i = w["_key"].search_sorted(p["_key"], side="right").cast(pl.Int64) - 1
        hit = w.drop("_key").gather(p.select(pl.when(pl.col("_key").is_not_null() & (pl.lit(i) >= 0)).then(pl.lit(i)))
                                     .to_series())
        return pl.DataFrame([p["_key"], *hit]).select(pick)
    w = w.sort("_ws")
    left = points.select(by, pl.col(at).alias("_at"))
    pick = [pl.when(pl.col("_at") < pl.col("_we")).then(pl.col(c)).alias(c) for c in cols]

    def match(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.join_asof(w, left_on="_at", right_on="_ws", by=by, strategy="backward", check_sortedness=False)

    if in_time_order(left, by, "_at"):  # the as-of join needs time order within each group only: no sorting
        return match(left).select(pick)
    hit = match(left.with_row_index("_row").filter(pl.col("_at").is_not_null()).sort("_at")).select("_row", *pick)
    return pl.DataFrame([pl.repeat(None, points.height, dtype=hit.schema[c], eager=True).alias(c)
                         .scatter(hit["_row"], hit[c]) for c in cols])


# ``_sorted_containing`` searches each group's times in turn (a few polars calls a group): above this many groups
# (a run of hundreds of small ranks) the one searched axis costs less.
SORTED_CONTAINING_GROUPS = 64


def _sorted_containing(points: pl.DataFrame, at: str, w: pl.DataFrame, by: str) -> pl.Series | None:
    """``containing``'s answer as one index per point (its window's row in ``w`` plus one, 0 where none) when the
    points are in (group, time) order without nulls, as ingest leaves events; None otherwise (or where a group's
    windows share a start). Each window's points are then one run of rows, found by two binary searches of its
    group's times, and the index is the running sum of +k at each run's first row and -k after its last: a few
    columns of the points' length, where placing every point on one axis and searching there takes about ten."""
    g, t = points[by], points[at]
    if points.height == 0 or not g.dtype.is_integer() or g.null_count() or t.null_count() or not g.is_sorted():
        return None
    w = w.with_row_index("_w").filter(pl.col(by).is_not_null() & pl.col("_ws").is_not_null()).sort(by, "_ws")
    if w[by].n_unique() > SORTED_CONTAINING_GROUPS:
        return None
    # A point belongs to the window starting last at or before it, if it is before that window's end: the rows
    # from the window's start up to its end or the next window's start, whichever is first.
    w = w.with_columns(pl.min_horizontal(pl.col("_we").fill_null(pl.col("_ws")),
                                         pl.col("_ws").shift(-1).over(by)).alias("_bound"))
    if w.select((pl.col("_ws").diff().over(by) == 0).any()).item():
        return None
    runs = []
    for (group,), part in w.partition_by(by, as_dict=True, maintain_order=True).items():
        lo, hi = int(g.search_sorted(group, side="left")), int(g.search_sorted(group, side="right"))
        times = t.slice(lo, hi - lo)
        if not times.is_sorted():
            return None
        runs.append(pl.DataFrame([part["_w"], (times.search_sorted(part["_ws"], side="left") + lo).alias("_from"),
                                  (times.search_sorted(part["_bound"], side="left") + lo).alias("_to")]))
    if not runs:  # no window: no point is in one
        return pl.repeat(0, points.height, dtype=pl.Int32, eager=True)
    runs = pl.concat(runs).filter(pl.col("_to") > pl.col("_from"))
    if w.height >= 2**31 - 1:
        return None
    k = (pl.col("_w").cast(pl.Int32) + 1)  # (int32: half the bytes of the points' length an int64 would take)
    steps = pl.concat([runs.select(pl.col("_from").alias("_at"), k.alias("_d")),
                       runs.select(pl.col("_to").alias("_at"), (-k).alias("_d"))]).group_by("_at").agg(pl.col("_d").sum())
    index = pl.repeat(0, points.height + 1, dtype=pl.Int32, eager=True).scatter(steps["_at"], steps["_d"])
    return index.cum_sum().head(points.height)


@dataclass(frozen=True)
class GroupAxis:
    """Integer groups' values laid end to end on one int64 axis (``group_axis``): ``key(group, value)`` orders as
    ``(group, value)`` does."""

    first: int  # the smallest group
    lo: int  # the smallest value
    span: int  # more than the values' range

    def key(self, group: str, value: str) -> pl.Expr:
        return (pl.col(value).cast(pl.Int64) - self.lo) + (pl.col(group).cast(pl.Int64) - self.first) * self.span


def group_axis(groups: Sequence[pl.Series], values: Sequence[pl.Series]) -> GroupAxis | None:
    """The axis on which ``GroupAxis.key`` orders every (group, value) of these columns as the pair does; None
    where a group column is not of integers, or where the axis would not fit in an int64."""
    if not all(g.dtype.is_integer() for g in groups) or not all(v.dtype.is_integer() for v in values):
        return None
    gs = [x for g in groups for x in (g.min(), g.max()) if x is not None]
    vs = [x for v in values for x in (v.min(), v.max()) if x is not None]
    if not gs or not vs:
        return None
    span = max(vs) - min(vs) + 1
    if (max(gs) - min(gs) + 1) * span >= 2**62:
        return None
    return GroupAxis(int(min(gs)), int(min(vs)), int(span))


def _end_to_end(frame: pl.DataFrame, lo: str, hi: str) -> pl.DataFrame:
    """``frame`` with ``_shift``: its rows' spans [lo, hi] laid end to end on one axis in row order, 1 ns apart (an
    instant t of a row sits at t + _shift). A LazyFrame gives a LazyFrame."""
    return (
        frame.with_columns(((pl.col(hi) - pl.col(lo)).clip(lower_bound=0) + 1).alias("_len"))
        .with_columns((pl.col("_len").cum_sum() - pl.col("_len") - pl.col(lo)).alias("_shift"))
        .drop("_len")
    )


def _group_axis(w: pl.DataFrame, group: list[str]) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """``partition``'s axis by group: ``w`` (windows sorted by their keys) with ``_shift``, its group's, and the
    groups (``group``, ``_lo``, ``_hi``: their extent, ``_shift``); None where that axis does not keep every window
    apart in key order (windows of a group overlapping or out of time order, null bounds)."""
    if any(w[c].null_count() for c in (*group, START, END)):
        return None
    groups = _end_to_end(
        w.lazy().group_by(group, maintain_order=True)
        .agg(pl.col(START).min().alias("_lo"), pl.col(END).max().alias("_hi")),
        "_lo", "_hi")
    w = w.lazy().join(groups.select(*group, "_shift"), on=group, maintain_order="left")
    on_axis = w.filter(pl.col(END) > pl.col(START)).select(pl.col(START, END) + pl.col("_shift"))
    groups, w, apart = pl.collect_all(  # one call (docs/performance.md "Fixed cost")
        [groups, w, on_axis.select((pl.col(START) >= pl.col(END).shift(1)).slice(1).all())], **COLLECT)
    if not bool(apart.item()):
        return None
    return w, groups


def partition(
    windows: pl.DataFrame,
    layers: Sequence[tuple[str | tuple[str, ...], pl.DataFrame]],
    *,
    by: Sequence[str] | str,
    default: str,
    label: str = "label",
    on: Sequence[str] | str | None = None,
    label_dtype: pl.DataType = pl.String,
) -> pl.DataFrame:
    """Split every window into segments labelled by the first layer (in priority order) covering each instant.

    ``windows`` has ``by + [start, end]`` with one window per group; every layer is an interval set with the ``by``
    columns (or only the ``on`` subset of them, e.g. rank for layers not yet cut into steps: each is then clipped to
    the windows of its group). Time covered by no layer gets ``default``. The segments of a window are disjoint and
    their lengths sum exactly to the window's length. Returns ``by + [label, start, end]`` with adjacent same-label
    segments merged, the label of type ``label_dtype`` (an enum of every layer name and ``default`` spares a text
    column per segment).

    A layer may also be several layers in one frame: ``(names, frame)`` with a tuple of names (consecutive in the
    priority order) and a column ``LAYER`` holding each interval's index in ``names`` (e.g. the busy intervals
    with their phase's code), which spares a copy of the intervals per layer.

    Groups are independent, and so are windows, so a large input is partitioned a batch at a time (about
    ``PARTITION_BATCH`` layer intervals each, in key order: whole ``on`` groups, or consecutive windows of one
    group too large for a batch, with the intervals of its layers that reach them): the sweep's intermediate
    frames then hold one batch, not the whole run (nor the whole of one large rank), and the concatenated result
    is the same. A layer sorted by its one ``on`` key (as the events come from ingest) gives each batch a slice
    of itself, not a copy.
    """
    keys = _keys(by)
    on_ = keys if on is None else _keys(on)
    if on_ == keys[:len(on_)] and sum(layer.height for _, layer in layers) > PARTITION_BATCH:
        batches = _batches(windows, layers, keys, on_)
        if len(batches) > 1:
            return pl.concat([_partition(*_of_batch(windows, layers, b, split, keys, on_), keys, on_, default, label,
                                         label_dtype)
                              for b, split in batches])
    return _partition(windows, layers, keys, on_, default, label, label_dtype)


# The column of a multi-layer frame (``partition``) giving each interval's layer: its index in the entry's names.
LAYER = "_layer"


def _layer_keys(layer: pl.DataFrame, keys: list[str], on: list[str]) -> list[str]:
    """The keys of a ``partition`` layer: every key where it has them (already cut into windows), else ``on``."""
    return keys if set(keys) <= set(layer.columns) else on


def _of_batch(windows: pl.DataFrame, layers: Sequence[tuple[str | tuple[str, ...], pl.DataFrame]],
              batch: pl.DataFrame, split: bool, keys: list[str],
              on: list[str]) -> tuple[pl.DataFrame, list[tuple[str | tuple[str, ...], pl.DataFrame]]]:
    """The windows of a batch (``batch``: their keys, consecutive in key order) and the rows of each layer they
    need: of a layer keyed by ``on`` alone, its batch's groups' (a zero-copy slice from the first group to the last
    where the layer is sorted by its single key; a slice may hold groups between them that have no window, which
    ``_partition`` drops as a semi-join would), and of a ``split`` batch (part of one group's windows) only the
    intervals reaching the batch's time span."""
    w = windows.join(batch, on=keys, how="semi")
    groups = batch.select(on).unique(maintain_order=True)
    lo, hi = w[START].min(), w[END].max()
    out = []
    for n, layer in layers:
        if _layer_keys(layer, keys, on) == keys:
            out.append((n, layer.join(batch, on=keys, how="semi")))
            continue
        part = None
        if len(on) == 1 and layer.height:
            k = layer[on[0]]
            if k.null_count() == 0 and k.is_sorted():
                first, last = groups[on[0]][0], groups[on[0]][-1]
                start, end = int(k.search_sorted(first, side="left")), int(k.search_sorted(last, side="right"))
                part = layer.slice(start, end - start)
        if part is None:
            part = layer.join(groups, on=on, how="semi")
        if split:
            part = part.filter((pl.col(END) > lo) & (pl.col(START) < hi)) if lo is not None else part.head(0)
        out.append((n, part))
    return w, out


# Layer intervals per batch of ``partition`` (docs/performance.md "How the analysis stays small"): large enough that
# a batch's few dozen polars operations are cheap beside its rows, small enough to bound the sweep's frames.
PARTITION_BATCH = 150_000


def _batches(windows: pl.DataFrame, layers: Sequence[tuple[str | tuple[str, ...], pl.DataFrame]], keys: list[str],
             on: list[str]) -> list[tuple[pl.DataFrame, bool]]:
    """The windows' keys in key order, cut into consecutive batches of about ``PARTITION_BATCH`` layer intervals:
    ``(keys of the batch's windows, split)``. Whole ``on`` groups share a batch; a group with more intervals is
    cut into batches of its own (``split``), each of an equal share of its windows (its intervals are assumed
    spread evenly over them: a rank's steps are alike)."""
    w = windows.select(keys).sort(keys)
    counts = pl.concat([layer.group_by(on).len() for _, layer in layers if layer.height], how="vertical_relaxed")
    w = w.join(counts.group_by(on).agg(pl.col("len").sum()), on=on, how="left", maintain_order="left")
    first = pl.int_range(pl.len()).over(on) == 0
    w = w.with_columns(pl.col("len").fill_null(0), pl.len().over(on).alias("_n"),
                       pl.int_range(pl.len()).over(on).alias("_i"))
    w = w.with_columns(pl.min_horizontal((pl.col("len") + PARTITION_BATCH - 1) // PARTITION_BATCH, "_n")
                       .clip(lower_bound=1).alias("_parts"))
    split = pl.col("_parts") > 1
    # Runs of whole groups between split ones share batches by their cumulative count; a split group's windows
    # are numbered by part. A batch begins where (run, split, number) changes.
    w = w.with_columns((split & first).cum_sum().alias("_run"), split.alias("_split"))
    w = w.with_columns(
        pl.when(split).then(pl.col("_i") * pl.col("_parts") // pl.col("_n"))
        .otherwise(pl.when(first & ~split).then(pl.col("len")).otherwise(0).cum_sum().over("_run") // PARTITION_BATCH)
        .alias("_part"))
    changed = pl.any_horizontal(pl.col(c).ne_missing(pl.col(c).shift(1)) for c in ("_run", "_split", "_part"))
    w = w.with_columns((changed | (pl.int_range(pl.len()) == 0)).cum_sum().alias("_batch"))
    return [(b.select(keys), bool(b["_split"][0]))
            for b in w.partition_by("_batch", maintain_order=True, include_key=False)]


def _partition(windows: pl.DataFrame, layers: Sequence[tuple[str | tuple[str, ...], pl.DataFrame]], keys: list[str],
               on_: list[str], default: str, label: str, label_dtype: pl.DataType) -> pl.DataFrame:
    """``partition`` of one batch."""
    names = [x for n, _ in layers for x in ((n,) if isinstance(n, str) else n)]
    w = windows.lazy().select(*keys, START, END).sort(keys).collect(**COLLECT)
    # Put every window on one time axis where no two groups' intervals cross or touch, so that the sweep needs one
    # sort by axis time instead of a sort by group keys and time; a window's instant t sits at t + _shift.
    # Where the windows of each ``on`` group are apart and in time order (a rank's steps), the groups are laid end
    # to end, 1 ns apart, each keeping its own times: a layer keyed by the group alone then needs only its group's
    # shift, and the sweep itself cuts it at the window boundaries. Otherwise every window is laid end to end.
    grouped = _group_axis(w, on_) if on_ != keys else None
    if grouped is None:
        w = _end_to_end(w.lazy(), START, END).collect(**COLLECT)
    else:
        w, groups = grouped

    # Cut the layers to the windows: one clip for all layers keyed alike (set i + 2 is layer i; sets 0 and 1 the
    # windows, alternately in axis order: touching windows of a group would merge into one within a set).
    by_keys: dict[tuple[str, ...], list[pl.DataFrame]] = {}
    i = 2
    for n, layer in layers:
        first, i = i, i + (1 if isinstance(n, str) else len(n))
        if layer.height == 0:  # covers nothing (most of a small run's layers): its sets just stay empty
            continue
        lk = keys if set(keys) <= set(layer.columns) else on_  # a layer may already be cut into windows
        set_ = pl.lit(first, pl.UInt8) if isinstance(n, str) else (pl.col(LAYER).cast(pl.UInt8) + first)
        by_keys.setdefault(tuple(lk), []).append(layer.lazy().select(*lk, START, END, set_.alias("_set")))
    # (Lazy up to the sweep: the layers' pieces are one query, docs/performance.md "Fixed cost".)
    cut = [w.lazy().filter(pl.col(END) > pl.col(START))
           .select((pl.int_range(pl.len()) % 2).cast(pl.UInt8).alias("_set"), START, END, "_shift")]
    for lk, frames in by_keys.items():
        layer = pl.concat(frames, how="vertical_relaxed")
        if grouped is not None and list(lk) == on_:  # kept within its group's extent: it must not reach another's
            if groups.height == 1 and len(on_) == 1:  # (a batch of one large group: its bounds as literals)
                (g, lo, hi, shift), = groups.select(*on_, "_lo", "_hi", "_shift").rows()
                cut.append(layer.filter(pl.col(on_[0]) == g).select(
                    "_set", pl.max_horizontal(START, pl.lit(lo)).alias(START),
                    pl.min_horizontal(END, pl.lit(hi)).alias(END), pl.lit(shift, pl.Int64).alias("_shift")))
                continue
            cut.append(layer.join(groups.lazy(), on=on_).select(
                "_set", pl.max_horizontal(START, "_lo").alias(START), pl.min_horizontal(END, "_hi").alias(END),
                "_shift"))
            continue
        rest = [k for k in keys if k not in lk]
        cut.append(clip(layer.collect(**COLLECT), w, on=list(lk), window_keys=[*rest, "_shift"],
                        keep_order=False).lazy())
    on_axis = pl.concat([c.select("_set", *((pl.col(e) + pl.col("_shift")).alias(e) for e in (START, END)))
                         for c in cut], how="vertical_relaxed").collect(**COLLECT)
    segs = _sweep_stacked(on_axis, len(names) + 2).filter(_has(0) | _has(1))
    # The first layer covering a segment is the lowest set bit above the windows' bits 0 and 1.
    # (One byte a segment: at most 62 sets.)
    layer_bits = pl.col("_mask") & ~pl.lit(3, pl.Int64)
    index = (layer_bits.bitwise_trailing_zeros() - 2).cast(pl.UInt8)
    labels = pl.Series([*names, default])
    choice = pl.when(layer_bits == 0).then(pl.lit(len(names), pl.UInt8)).otherwise(index)
    # Segments of a window are contiguous and sorted: merge runs of one label (boundaries of lower layers split
    # them needlessly), then name the labels on the (much shorter) result. A gap, or a window's start (windows of
    # a group may touch), begins a run too.
    w = w.lazy().filter(pl.col(END) > pl.col(START)).with_columns((pl.col(START) + pl.col("_shift")).alias("_at"))
    w = w.collect(**COLLECT)
    # A window's start: where the segment's window bits (0, 1) differ from the previous segment's, whose window
    # (alternating between the two sets) is another, or where there is a gap.
    window_bits = pl.col("_mask") & 3
    segs = segs.select(choice.alias("_label"), START, END,
                       (window_bits != window_bits.shift(1)).fill_null(True).alias("_window_start"))
    runs = _runs(segs, pl.col("_window_start") | (pl.col("_label") != pl.col("_label").shift(1))
                 | (pl.col(START) != pl.col(END).shift(1)), ["_label", START, "_window_start"], [END])
    # Back from the axis: every window is covered, so each begins a run, and a run's window is the count of window
    # starts up to it (in axis order, as ``w``): a running sum, where polars' binary search of every run's start
    # among the windows' takes a per-value path (~1% of the analysis' instructions on 4 x 200 MB). Should the counts
    # ever disagree, the window holding each run is the last one starting on the axis at or before it.
    starts = runs["_window_start"]
    if starts.sum() == w.height:
        at = starts.cum_sum().cast(pl.UInt32) - 1
    else:
        at = w["_at"].search_sorted(runs[START], side="right") - 1
    window = w.lazy().select(*keys, "_shift").select(pl.all().gather(at))
    return pl.concat([window, runs.lazy().drop("_window_start")], how="horizontal").select(
        *keys,
        pl.lit(pl.Series(labels.to_list(), dtype=label_dtype)).gather("_label").alias(label),  # (a lookup, no hash)
        (pl.col(START) - pl.col("_shift")).alias(START),
        (pl.col(END) - pl.col("_shift")).alias(END),
    ).collect(**COLLECT)


def coverage(frame: pl.DataFrame, by: Sequence[str] | str, item: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """How the ``item``s (a phase, a stream) of each group overlap one another in time.

    Returns ``(per_item, per_group)``: ``by + [item, own_ns, overlapped_ns]`` — the length of the union of the
    item's intervals, and the part of it during which at least one other item of the group covers it too — and
    ``by + [any_ns, overlapped_ns]``: the length covered by some item, and by two or more. One sweep over the merged
    intervals' boundaries counts the items covering every instant (as ``_sweep``); an item's overlapped time is its
    own merged intervals cut to the instants counted twice or more."""
    keys = _keys(by)
    merged = merge(frame, [*keys, item])
    per_item_schema = {**{k: frame.schema[k] for k in keys}, item: frame.schema[item], "own_ns": pl.Int64,
                       "overlapped_ns": pl.Int64}
    if merged.height == 0:
        return (pl.DataFrame(schema=per_item_schema),
                pl.DataFrame(schema={**{k: frame.schema[k] for k in keys}, "any_ns": pl.Int64,
                                     "overlapped_ns": pl.Int64}))
    m = merged.lazy()
    counted = _scan(pl.concat([m.select(*keys, pl.col(START).alias("_t"), pl.lit(1, pl.Int64).alias("_d")),
                               m.select(*keys, pl.col(END).alias("_t"), pl.lit(-1, pl.Int64).alias("_d"))]), keys)
    length = (pl.col(END) - pl.col(START))
    per_group, twice = pl.collect_all([
        counted.group_by(keys).agg(length.sum().alias("any_ns"),
                                   length.filter(pl.col("_mask") >= 2).sum().alias("overlapped_ns")),
        counted.filter(pl.col("_mask") >= 2).select(*keys, START, END),
    ], **COLLECT)
    own = merged.group_by([*keys, item]).agg(length.sum().alias("own_ns"))
    if twice.height == 0:  # nothing covered twice (one stream, or items one after another): no overlap to cut
        per_item = own.with_columns(pl.lit(0, pl.Int64).alias("overlapped_ns")).sort([*keys, item])
        return per_item.cast(per_item_schema), per_group.sort(keys)
    # Each item's merged intervals against the instants covered twice or more: the items of a group are few (phases,
    # streams), so the doubly covered segments are repeated once per item and intersected.
    items = merged.select(*keys, item).unique()
    twice = merge(twice, keys).join(items, on=keys) if keys else merge(twice).join(items, how="cross")
    shared = intersect(merged, twice, [*keys, item]).group_by([*keys, item]).agg(length.sum().alias("overlapped_ns"))
    per_item = (own.join(shared, on=[*keys, item], how="left", nulls_equal=True)
                .with_columns(pl.col("overlapped_ns").fill_null(0)).sort([*keys, item]))
    return per_item.cast(per_item_schema), per_group.sort(keys)
