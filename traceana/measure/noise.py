"""Noise in a comparison of measured runs: the one rule every cross-run comparison uses (the report's A/B table and
cards, ``traceana demo``, ``validate --baseline/--repeat``; summary.compare_runs, validation.prediction), and the
within-run rules (``watch``'s windows of one job, the what-if's naming).

**Between runs (``between_runs``).** The unit is the run: two collections of one configuration differ by more than
the steps of one collection do (on this project's 2-core machine by 55–98 %, docs/field-notes.md "Noise floor"), so
the steps of one run say nothing about the next run and never make an interval here.

- A run's step time is ``summary.RunSummary.step_ms`` (the slowest rank per step, the mean of the measured steps).
- A side's step time is the **geometric mean of its runs' step times** (one run: that run's); the **change** is
  other/base − 1 of the two sides' step times, and the **speed-up** is base/other = 1/(1 + change): a change of
  +50 % is a speed-up of 0.667× (slower), −50 % one of 2× (faster). Both come from the same two numbers everywhere.
- The **interval** (95 %) is Student's t on the logarithms of the run step times. With as many runs on each side
  (n ≥ 2, given in the order collected: round k's runs are the k-th of each side) the runs are **paired by round**:
  the interval is mean(dᵢ) ± t₀.₉₇₅,ₙ₋₁ · sd(dᵢ)/√n of the per-round log ratios dᵢ, so a machine that speeds up or
  slows down between rounds meets both sides alike. With unequal counts (≥ 2 each) it is Welch's interval (degrees
  of freedom rounded down). The interval of the change is exp(·) − 1 of the log interval: it contains the change.
- **Different** only when the interval excludes 0 (``within_noise`` False); otherwise "within noise" — the runs cannot
  be told apart and no speed-up or slow-down is claimed. With one run on a side the between-run noise is unknown:
  ``within_noise`` is None, no interval, no verdict, and the words say "repeat to tell".
- The same run given twice is not two runs (``twice`` finds it: one folder, or a copy with the same measured steps):
  it adds no spread and would narrow the interval; the callers refuse it or count it once, with a word.

Calibration (tests/measure/test_noise.py, docs/comparisons.md): simulated interleaved rounds whose run step times carry
heavy-tailed (Student-t, 3 df) log noise, one run in ten descheduled (×1.5–3) and a drifting machine (a random walk
plus a steady trend); identical configurations read "different" at most 5 % of the time, and a real 2× difference
is detected in ≥ 95 % of comparisons from ``DETECTS_2X_FROM`` rounds on at that noise (from 6 on a quiet machine;
3 rounds, the demo's, detect it 39 % of the time on the noisy one: the rest read "within noise", never a false
number). Rounds alternate their order (A B, B A, …: ``round_order``) so that a steady trend does not fall on one
side.

**Within one run.** ``compare_steps`` (``watch``: the latest window of one job against its first) bootstraps the
windows' step times: there the steps of the one job are the samples. ``noise_ms`` (what-if naming): a what-if gain
must exceed the spread (max − min) of the run's measured steps, the slowest left out when there are three or more,
and at least ``NOISE_FLOOR`` of the median step.

JSON names (every cross-run surface): ``step_change`` (fraction, other/base − 1), ``step_change_low`` /
``step_change_high`` (the interval, fractions; null with one run on a side), ``within_noise`` (bool; null: unknown),
``speedup`` (base/other), ``noise_from`` ("runs", or "unknown" with one run on a side), ``noise_runs`` (runs on each
side), ``paired`` (paired by round), ``statistic`` ("geometric mean of runs").
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where a comparison runs: every analyze reads noise_ms, which needs none
    import numpy as np

LEVEL = 0.95
STATISTIC = "geometric mean of runs"
# rounds from which the calibration detects a 2× change ≥ 95 % of the time (tests/measure/test_noise.py)
DETECTS_2X_FROM = 10


# --- Student's t quantile (no scipy): the regularized incomplete beta by its continued fraction ------------------
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


@functools.lru_cache(maxsize=512)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom, by bisection of ``t_cdf``."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _t_crit(df: np.ndarray) -> np.ndarray:
    import numpy as np

    q = (1 + LEVEL) / 2
    return np.array([t_quantile(q, int(d)) for d in df.ravel()]).reshape(df.shape) if df.size else df * 0.0


# --- the rule, vectorised over comparisons (the calibration simulates thousands at once) --------------------------
def log_intervals(base: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule on M comparisons at once: ``base`` (M × nb) and ``other`` (M × no) hold the logarithms of each
    comparison's run step times, in the order collected (nb, no ≥ 2). Returns (centre, low, high) of the log ratio
    other/base per comparison: paired by round when nb == no, else Welch's (module docstring)."""
    import numpy as np

    nb, no = base.shape[1], other.shape[1]
    if min(nb, no) < 2:
        raise ValueError("the between-run interval needs at least 2 runs on each side")
    centre = other.mean(axis=1) - base.mean(axis=1)
    if nb == no:
        d = other - base
        se = d.std(axis=1, ddof=1) / math.sqrt(nb)
        df = np.full(len(d), nb - 1)
    else:
        vb, vo = base.var(axis=1, ddof=1) / nb, other.var(axis=1, ddof=1) / no
        se = np.sqrt(vb + vo)
        with np.errstate(divide="ignore", invalid="ignore"):
            df = (vb + vo) ** 2 / (vb ** 2 / (nb - 1) + vo ** 2 / (no - 1))
        df = np.floor(np.nan_to_num(df, nan=min(nb, no) - 1)).clip(min(nb, no) - 1, nb + no - 2).astype(int)
    half = _t_crit(df) * se
    return centre, centre - half, centre + half


@dataclass(frozen=True)
class Change:
    """A cross-run change of step time, other/base − 1, with its between-run interval (the module docstring)."""

    base_ms: float  # each side's step time: the geometric mean of its runs' step times
    other_ms: float
    change: float  # other/base − 1 (negative: the other side is faster)
    low: float | None  # the 95 % interval of ``change``; None with one run on a side (the noise is unknown)
    high: float | None
    within_noise: bool | None  # the interval contains 0; None: one run on a side, no verdict
    runs: tuple[int, int]  # runs on each side
    paired: bool  # paired by round (as many runs on each side)

    @property
    def speedup(self) -> float:
        """base/other = 1/(1 + change): > 1 when the other side is faster, < 1 when it is slower."""
        return self.base_ms / self.other_ms if self.other_ms else float("nan")

    @property
    def speedup_interval(self) -> tuple[float, float] | None:
        if self.low is None or self.high is None:
            return None
        return 1 / (1 + self.high), 1 / (1 + self.low)

    @property
    def direction(self) -> str:
        """"slower", "faster", or "" when within noise or unknown."""
        if self.within_noise is not False:
            return ""
        return "slower" if self.change > 0 else "faster"

    def over(self) -> str:
        how = ", paired by round" if self.paired else ""
        return f"{self.runs[0]} + {self.runs[1]} runs{how}"

    def words(self, *, what: str = "step time") -> str:
        """"step time +25.3 % (speed-up 0.798×), beyond the noise: slower (95 % interval +5.2 … +40.1 % over 5 + 5
        runs, paired by round)", "… within noise (…)", or "…, between-run noise unknown (one run on a side): repeat
        to tell"."""
        said = f"{what} {self.change:+.1%} (speed-up {self.speedup:.3f}×)"
        if self.within_noise is None:
            one = "each side" if self.runs == (1, 1) else "a side"
            return (f"{said}, between-run noise unknown (one run on {one}): repeat to tell — collect each side at "
                    "least twice, interleaved")
        interval = f"95 % interval {self.low:+.1%} … {self.high:+.1%} over {self.over()}"
        if self.within_noise:
            return f"{said}, within noise ({interval})"
        return f"{said}, beyond the noise: {self.direction} ({interval})"

    def as_dict(self) -> dict:
        return {"step_change": self.change, "step_change_low": self.low, "step_change_high": self.high,
                "within_noise": self.within_noise, "speedup": self.speedup,
                "noise_from": "unknown" if self.within_noise is None else "runs", "noise_runs": list(self.runs),
                "paired": self.paired, "statistic": STATISTIC}


def between_runs(base: Sequence[float], other: Sequence[float]) -> Change:
    """The change from ``base`` to ``other``, each the step times (ms) of its runs in the order collected."""
    import numpy as np

    b = np.log(np.asarray([x for x in base if x is not None], dtype=float))
    o = np.log(np.asarray([x for x in other if x is not None], dtype=float))
    if not len(b) or not len(o) or not (np.isfinite(b).all() and np.isfinite(o).all()):
        raise ValueError("between_runs needs a positive step time for at least one run on each side")
    base_ms, other_ms = math.exp(b.mean()), math.exp(o.mean())
    change = other_ms / base_ms - 1
    runs, paired = (len(b), len(o)), len(b) == len(o) >= 2
    if min(runs) < 2:
        return Change(base_ms, other_ms, change, None, None, None, runs, False)
    _, low, high = (float(v[0]) for v in log_intervals(b[None, :], o[None, :]))
    low, high = math.expm1(low), math.expm1(high)
    return Change(base_ms, other_ms, change, low, high, low <= 0 <= high, runs, paired)


def twice(runs: Sequence[tuple[str, Sequence[float]]]) -> tuple[int, int] | None:
    """The first (i, j), i < j, of ``runs`` ((resolved path, measured step times) each) that are one run given twice:
    the same folder, or the same measured step times to the nanosecond (a copy; two collections never agree so)."""
    seen: dict[object, int] = {}
    for j, (path, steps) in enumerate(runs):
        for key in (("path", str(path)), ("steps", tuple(round(x, 6) for x in steps)) if steps else None):
            if key is None:
                continue
            if key in seen:
                return seen[key], j
            seen[key] = j
    return None


def round_order(rounds: int, sides: Sequence[str]) -> list[tuple[int, str]]:
    """The order to collect ``rounds`` rounds of two sides: A B, B A, A B, … (round, side): a machine that slows down
    steadily then meets both sides alike (module docstring)."""
    return [(k, s) for k in range(rounds) for s in (sides if k % 2 == 0 else tuple(reversed(sides)))]


# --- within one run -----------------------------------------------------------------------------------------------
RESAMPLES = 2000
SEED = 27


@dataclass(frozen=True)
class StepsChange:
    """Within one job (``watch``'s windows): other/base − 1 of two windows' mean step times, with a bootstrap
    interval over their steps."""

    base_ms: float
    other_ms: float
    change: float
    low: float | None
    high: float | None
    within_noise: bool | None  # the interval contains 0; None: fewer than 2 steps in a window
    samples: tuple[int, int]

    def words(self, *, what: str = "step time") -> str:
        if self.within_noise is None:
            return (f"{what} {self.change:+.1%}, which cannot be told from noise: a window has fewer than 2 measured "
                    "steps")
        interval = f"95 % interval {self.low:+.1%} … {self.high:+.1%} over {self.samples[0]} + {self.samples[1]} steps"
        return f"{what} {self.change:+.1%}, within noise ({interval})" if self.within_noise else \
            f"{what} {self.change:+.1%} ({interval})"

    def as_dict(self) -> dict:
        return {"step_change": self.change, "step_change_low": self.low, "step_change_high": self.high,
                "within_noise": self.within_noise, "noise_from": "steps", "noise_samples": list(self.samples)}


def compare_steps(base: Sequence[float], other: Sequence[float]) -> StepsChange:
    """Two windows of one job, each its measured steps' times (ms): the change of the mean, with a 95 % percentile
    bootstrap interval over the steps (``RESAMPLES`` draws, seed ``SEED``: one pair of windows, one interval)."""
    base, other = list(base), list(other)
    if not base or not other:
        raise ValueError("compare_steps needs at least one measured step in each window")
    b, o = statistics.fmean(base), statistics.fmean(other)
    change = o / b - 1 if b else float("nan")
    samples = (len(base), len(other))
    if min(samples) < 2 or not b:
        return StepsChange(b, o, change, None, None, None, samples)
    rng = random.Random(SEED)

    def draw(xs: list[float]) -> float:
        return statistics.fmean(xs[rng.randrange(len(xs))] for _ in xs)

    draws = sorted(draw(other) / draw(base) - 1 for _ in range(RESAMPLES))
    tail = (1 - LEVEL) / 2
    low, high = draws[int(tail * (RESAMPLES - 1))], draws[int((1 - tail) * (RESAMPLES - 1))]
    low, high = min(low, change), max(high, change)
    return StepsChange(b, o, change, low, high, low <= 0 <= high, samples)


NOISE_FLOOR = 0.05  # the least noise a within-run gain must exceed: 5 % of the median step


def noise_ms(steps_ms: Sequence[float]) -> float:
    """The noise a what-if gain must exceed within one run (whatif's naming rule): the spread (max − min) of the
    measured step over the measured steps, the slowest left out when there are three or more (one descheduled step is
    noise by itself, and a gain counts only when it is there in every step), and at least NOISE_FLOOR of the median
    step."""
    ordered = sorted(steps_ms)
    kept = ordered[:-1] if len(ordered) >= 3 else ordered
    return max(kept[-1] - kept[0], NOISE_FLOOR * ordered[len(ordered) // 2])
