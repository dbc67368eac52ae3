"""The comparison rule (traceana.measure.noise): hand-worked step-time sets whose verdict follows from Student's t by
hand (quantiles from the published table), and the rule's calibration on simulated interleaved pairs under drifting,
heavy-tailed noise (tests/noise_simulation.py)."""

from __future__ import annotations

import math

import polars as pl
import pytest
from noise_simulation import rates

from traceana.measure.noise import DETECTS_2X_FROM, between_runs, compare_steps, round_order, t_quantile, twice
from traceana.measure.summary import RunSummary, compare_runs

# Student's t, two-sided 95 % (the 0.975 quantile), from the published table
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042}


def test_t_quantiles_are_the_tables():
    for df, t in T975.items():
        assert t_quantile(0.975, df) == pytest.approx(t, abs=6e-4)


def test_three_rounds_growing_by_ten_percent_are_within_noise():
    # per-round log ratios k·ln 1.1 (k = 1, 2, 3): mean 2 ln 1.1, sd ln 1.1, so the interval is
    # 2 ln 1.1 ± t(2) · ln 1.1 / √3 → −4.5 % … +53.3 %: it holds 0, whereas the change itself is 1.1² − 1 = +21 %
    c = between_runs([100, 100, 100], [110, 121, 133.1])
    ln = math.log(1.1)
    assert c.change == pytest.approx(0.21) and c.paired and c.runs == (3, 3)
    assert c.low == pytest.approx(math.exp(2 * ln - T975[2] * ln / math.sqrt(3)) - 1, abs=1e-3)
    assert c.high == pytest.approx(math.exp(2 * ln + T975[2] * ln / math.sqrt(3)) - 1, abs=1e-3)
    assert round(c.low, 3) == -0.045 and round(c.high, 3) == 0.533
    assert c.within_noise is True and "within noise" in c.words() and "3 + 3 runs, paired by round" in c.words()


def test_runs_that_double_in_every_round_are_beyond_the_noise_and_slower():
    # each round's ratio is exactly 2: no spread between rounds, the interval is the point +100 %
    c = between_runs([100, 300], [200, 600])
    assert c.base_ms == pytest.approx(math.sqrt(100 * 300)) and c.other_ms == pytest.approx(math.sqrt(200 * 600))
    assert c.change == pytest.approx(1.0) and c.low == pytest.approx(1.0) and c.high == pytest.approx(1.0)
    assert c.within_noise is False and c.direction == "slower" and c.speedup == pytest.approx(0.5)
    assert "beyond the noise: slower" in c.words() and "speed-up 0.500×" in c.words()


def test_one_run_on_a_side_makes_no_verdict_however_many_steps():
    c = between_runs([100.0], [300.0, 310.0])
    assert c.within_noise is None and c.low is None and c.high is None and not c.paired
    assert "between-run noise unknown (one run on a side): repeat to tell" in c.words()
    assert c.as_dict()["noise_from"] == "unknown"
    # a run of many steady steps each: steps never make the interval (the summary's step times are not used)
    steady = lambda ms: _summary((ms,) * 20)  # noqa: E731
    overview, _ = compare_runs([("a", steady(100.0)), ("b", steady(200.0))])
    b = overview.row(1, named=True)
    assert b["within_noise"] is None and "repeat to tell" in b["step_change_words"] and b["noise_from"] == "unknown"


def test_welch_with_two_runs_against_three_is_humble():
    # logs: base {0, 0.2}, other ln 2 + {0, 0.1, 0.2}: centre ln 2; variances of the means 0.02/2 and 0.01/3;
    # Welch's df (0.01 + 0.00333)² / (0.01²/1 + 0.00333²/2) = 1.68 → 1 → t 12.706: low exp(ln 2 − 1.467) − 1 = −0.539
    c = between_runs([100, 100 * math.exp(0.2)], [200 * math.exp(x) for x in (0, 0.1, 0.2)])
    assert c.change == pytest.approx(1.0) and not c.paired
    se = math.sqrt(0.02 / 2 + 0.01 / 3)
    assert c.low == pytest.approx(math.exp(math.log(2) - T975[1] * se) - 1, abs=1e-3)
    assert c.within_noise is True


def test_welch_detects_a_doubling_with_four_runs_against_three():
    # logs: base {0, .02, .04, .06}, other ln 2 + {0, .02, .04}: centre ln 2 − 0.01, variances of the means
    # 0.000667/4 and 0.0004/3, Welch's df 4.96 → 4, t 2.776: ln 2 − 0.01 ± 0.0481 → +88.8 % … +109.8 %
    c = between_runs([100 * math.exp(x) for x in (0, .02, .04, .06)], [200 * math.exp(x) for x in (0, .02, .04)])
    se = math.sqrt(0.002 / 3 / 4 + 0.0008 / 2 / 3)
    centre = math.log(2) - 0.01
    assert c.low == pytest.approx(math.exp(centre - T975[4] * se) - 1, abs=1e-3)
    assert c.high == pytest.approx(math.exp(centre + T975[4] * se) - 1, abs=1e-3)
    assert c.within_noise is False and c.direction == "slower"


@pytest.mark.parametrize("base, other", [([100, 120], [60, 70]), ([100, 90, 95], [150, 160, 140]),
                                         ([100], [80]), ([100, 130], [101, 128])])
def test_a_speed_up_and_a_change_always_agree_in_sign(base, other):
    c = between_runs(base, other)
    assert c.speedup == pytest.approx(1 / (1 + c.change))
    assert (c.speedup < 1) == (c.change > 0)
    if c.speedup_interval:
        lo, hi = c.speedup_interval
        assert lo <= c.speedup <= hi and (lo > 1) == (c.high < 0)


def test_the_same_run_twice_is_found_by_folder_or_by_content():
    assert twice([("/r/a", (1.0, 2.0)), ("/r/b", (1.5, 2.5)), ("/r/a", (1.0, 2.0))]) == (0, 2)
    assert twice([("/r/a", (1.0, 2.0)), ("/r/copy", (1.0, 2.0))]) == (0, 1)  # a copy: the same measured steps
    assert twice([("/r/a", (1.0, 2.0)), ("/r/b", (1.0, 2.000001))]) is None


def test_rounds_alternate_their_order():
    assert round_order(3, ("a", "b")) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_within_one_job_the_windows_steps_are_the_samples():
    # watch's windows: four steps each around 100 ms and 50 ms; a resampled mean lies between a window's extremes
    c = compare_steps([100, 101, 99, 100], [50, 51, 49, 50])
    assert c.within_noise is False and 49 / 101 - 1 <= c.low <= c.change <= c.high <= 51 / 99 - 1
    assert compare_steps([100.0], [80.0]).within_noise is None


def _summary(steps: tuple[float, ...]) -> RunSummary:
    per_stage = pl.DataFrame({"stage": [0], "step_ms": [sum(steps) / len(steps)], "bubble_ms": [1.0],
                              "bpipe_ms": [None], "peak_mib": [10.0], "activation_peak_mib": [5.0]},
                             schema_overrides={"stage": pl.Int32, "bpipe_ms": pl.Float64})
    return RunSummary(steps=tuple(range(len(steps))), step_ms=sum(steps) / len(steps), bubble_fraction=0.1,
                      bpipe_ms=None, largest_activation_stage=0, largest_activation_peak_mib=5.0, memory_balance=None,
                      per_stage=per_stage, step_times_ms=steps)


def test_compare_runs_gives_each_side_one_statistic_and_one_interval():
    a = [_summary((100.0, 102.0)), _summary((300.0, 302.0))]  # run means 101, 301
    b = [_summary((200.0, 204.0)), _summary((600.0, 604.0))]  # run means 202, 602: the ratio 2 in both rounds
    overview, _ = compare_runs([("a", a[0]), ("b", b[0])], repeats={"a": a[1:], "b": b[1:]})
    rows = {r["run"]: r for r in overview.to_dicts()}
    assert rows["a"]["runs"] == 2 and rows["a"]["step_ms"] == pytest.approx(math.sqrt(101 * 301))
    assert rows["a"]["run_step_ms"] == pytest.approx(101) and rows["a"]["step_change_words"] is None
    assert rows["b"]["step_change"] == pytest.approx(1.0, abs=1e-3) and rows["b"]["within_noise"] is False
    assert rows["b"]["paired"] is True and rows["b"]["speedup"] == pytest.approx(0.5, abs=1e-3)


# --- calibration: simulated identical and 2×-apart configurations (NOISE: the field notes' shared machine) -------
COMPARISONS = 4000


@pytest.mark.parametrize("rounds", [2, 3, 5, 10])
@pytest.mark.parametrize("alternate", [True, False])
def test_identical_configurations_read_different_at_most_5_percent(rounds, alternate):
    false_alarm, _ = rates(rounds, COMPARISONS, rounds, 1.0, alternate=alternate)
    assert false_alarm <= 0.05, false_alarm


@pytest.mark.parametrize("effect", [2.0, 0.5])
def test_a_real_2x_is_detected_at_least_95_percent_from_the_stated_rounds(effect):
    _, detected = rates(100 + int(effect), COMPARISONS, DETECTS_2X_FROM, effect)
    assert detected >= 0.95, detected
    # a quieter machine (CV ~8 %, one run in twenty descheduled) needs 6 rounds
    _, quiet = rates(200 + int(effect), COMPARISONS, 6, effect, sigma=0.08, outlier_p=0.05, walk=0.02, trend=0.01)
    assert quiet >= 0.95, quiet
