"""A frame as the keyed Python dict an engine reads: ``{(action, stage, micro-batch): ns}`` for the simulator's
per-operation durations and per-message times, ``{stage: value}`` for a per-stage figure.

One way to make them, instead of a comprehension over ``iter_rows()`` at each place that feeds an engine: shape the
key in polars (``select`` with expressions: an action letter from a phase, a constant kind, a cast), then
``keyed(frame, value)``. These frames hold one row per operation or message of a step (hundreds, not events)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl


def keyed(frame: pl.DataFrame, value: str, *, convert: Callable[[Any], Any] | None = float) -> dict:
    """``{key: convert(value)}`` per row of ``frame``: the key is the row's other columns, in the frame's order — a
    tuple, or the bare value where there is one other column. ``convert`` None keeps the values as polars gives
    them (a list column's lists, nulls as None). A key met twice keeps its last row's value."""
    keys = [c for c in frame.columns if c != value]
    values = frame[value].to_list()
    if convert is not None:
        values = [convert(v) for v in values]
    if len(keys) == 1:
        return dict(zip(frame[keys[0]].to_list(), values))
    return dict(zip(zip(*(frame[c].to_list() for c in keys)), values))
