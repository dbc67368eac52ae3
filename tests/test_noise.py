"""The noise rule of every comparison (traceana.noise): hand-made step times whose answer is obvious."""

from __future__ import annotations

import polars as pl
import pytest

from traceana.noise import compare
from traceana.summary import RunSummary, compare_runs


def test_clearly_faster_runs_are_a_change_and_the_interval_lies_within_the_extreme_ratios():
    base, other = [100, 101, 99, 100], [50, 51, 49, 50]
    c = compare([base], [other])
    assert c.change == pytest.approx(50 / 100 - 1)
    assert c.within_noise is False and c.speedup == pytest.approx(2.0)
    # a resampled mean lies between a side's extremes, so the change between min/max and max/min
    assert 49 / 101 - 1 <= c.low <= c.change <= c.high <= 51 / 99 - 1
    assert "within noise" not in c.words() and "of one run each" in c.words()


def test_overlapping_step_times_are_within_noise():
    c = compare([[100, 140, 90, 120]], [[95, 130, 110, 100]])
    assert c.within_noise is True and c.low < 0 < c.high
    assert "within noise" in c.words()


def test_one_step_a_side_cannot_be_told_from_noise():
    c = compare([[100.0]], [[80.0]])
    assert c.within_noise is None and c.low is None and "cannot be told from noise" in c.words()


def test_repeated_runs_bring_the_spread_between_runs_into_the_interval():
    # each run is steady (±1 ms) but the two runs of the base configuration differ by a factor 2: one run of each
    # side reads as a clear change, all of them as noise
    base_runs, other = [[100, 101, 99], [200, 201, 199]], [[150, 151, 149], [152, 150, 151]]
    assert compare(base_runs[:1], other[:1]).within_noise is False
    both = compare(base_runs, other)
    assert both.from_runs and both.within_noise is True
    assert both.base_ms == pytest.approx(150) and "of 2 + 2 repeated runs" in both.words()
    one_side = compare(base_runs, other[:1])
    assert one_side.runs == (2, 1) and "on the repeated side only" in one_side.words()


def test_the_interval_is_the_same_every_time():
    a, b = [[10, 12, 11, 13, 9]], [[11, 12, 10, 14, 12]]
    assert compare(a, b) == compare(a, b)


def _summary(steps: tuple[float, ...]) -> RunSummary:
    per_stage = pl.DataFrame({"stage": [0], "step_ms": [sum(steps) / len(steps)], "bubble_ms": [1.0],
                              "bpipe_ms": [None], "peak_mib": [10.0], "activation_peak_mib": [5.0]},
                             schema_overrides={"stage": pl.Int32, "bpipe_ms": pl.Float64})
    return RunSummary(steps=tuple(range(len(steps))), step_ms=sum(steps) / len(steps), bubble_fraction=0.1,
                      bpipe_ms=None, largest_activation_stage=0, largest_activation_peak_mib=5.0, memory_balance=None,
                      per_stage=per_stage, step_times_ms=steps)


def test_compare_runs_carries_the_interval_and_says_within_noise():
    runs = [("a", _summary((100.0, 140.0, 90.0))), ("b", _summary((95.0, 130.0, 110.0))),
            ("c", _summary((50.0, 51.0, 49.0)))]
    overview, _ = compare_runs(runs)
    rows = {r["run"]: r for r in overview.to_dicts()}
    assert rows["b"]["within_noise"] is True and "within noise" in rows["b"]["step_change_words"]
    assert rows["c"]["within_noise"] is False and rows["c"]["step_change_high"] < 0
    assert rows["a"]["step_change"] == 0 and rows["a"]["step_change_words"] is None
    # repeats are runs of the same side: counted, and their spread enters the interval
    again, _ = compare_runs(runs, repeats={"a": [_summary((200.0, 210.0, 190.0))], "c": [_summary((52.0, 50.0))]})
    assert {r["run"]: r["runs"] for r in again.to_dicts()} == {"a": 2, "b": 1, "c": 2}
