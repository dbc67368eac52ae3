"""Noise in a comparison of measured runs: the one rule every comparison uses (the report's A/B, ``traceana demo``,
``validate --baseline``, ``watch``'s running comparison; summary.compare_runs).

A run's step time is the mean of its measured steps' times (the slowest rank per step, summary.RunSummary.step_ms);
a side with repeated runs is the median of its runs' step times (one run descheduled by another job does not move
it). Comparing two sides, the **change** is other/base − 1, and its **interval** is a 95 % bootstrap percentile
interval: ``RESAMPLES`` times, each side's step times are drawn again with replacement — with repeated runs of a
side, first its runs, then the steps within each drawn run (so the spread between runs counts, not only the spread
within one) — and the change recomputed; the interval is the 2.5th and 97.5th percentiles. The draws use a fixed
seed, so one pair of sides always gets one interval.

- The change is **within noise** when its interval contains 0: the runs cannot be told apart, and no speed-up or
  slow-down is claimed. Otherwise it is a change, with its interval.
- With fewer than 2 step times on a side there is no spread to judge: ``within_noise`` is None and the words say so.
- With one run a side the interval holds only the spread over steps; runs of one configuration can differ by more
  (on this project's 2-core machine the same configuration collected twice differed by 55–98 %, docs/field-notes.md
  "Noise floor"), which the words say: give repeated runs for an interval that includes it.

Within one run (what-if naming, ``noise_ms``): a what-if gain must exceed the spread (max − min) of the run's
measured steps, the slowest left out when there are three or more, and at least ``NOISE_FLOOR`` of the median step.

JSON names (every surface): ``step_change`` (fraction), ``step_change_low`` / ``step_change_high`` (the interval,
fractions), ``within_noise`` (bool or null), ``noise_from`` ("steps" or "runs"), ``noise_samples`` (step times on
each side), ``noise_runs`` (runs on each side).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

RESAMPLES = 2000
LEVEL = 0.95
SEED = 27


@dataclass(frozen=True)
class Change:
    """other/base − 1 of two sides' mean step times, with its bootstrap interval (see the module docstring)."""

    base_ms: float
    other_ms: float
    change: float  # other/base − 1 (negative: the other side is faster)
    low: float | None  # the interval of ``change``; None without spread on a side
    high: float | None
    within_noise: bool | None  # the interval contains 0; None: no spread to judge
    from_runs: bool  # repeated runs on both sides: the interval includes the spread between runs
    samples: tuple[int, int]  # step times on each side
    runs: tuple[int, int] = (1, 1)  # runs on each side

    @property
    def speedup(self) -> float:
        """base/other: > 1 when the other side is faster."""
        return self.base_ms / self.other_ms if self.other_ms else float("nan")

    @property
    def speedup_interval(self) -> tuple[float, float] | None:
        if self.low is None or self.high is None or self.high <= -1:
            return None
        return 1 / (1 + self.high), 1 / (1 + self.low)

    def words(self, *, what: str = "step time") -> str:
        """"step time −25.3 % (95 % interval −40.1 … −5.2 %, over 3 + 3 steps of one run each)" or "… within
        noise …"."""
        over = f"over {self.samples[0]} + {self.samples[1]} steps"
        if self.runs == (1, 1):
            over += (" of one run each: runs of one configuration can differ by more; repeat them for an interval "
                     "that includes that")
        elif self.from_runs:
            over += f" of {self.runs[0]} + {self.runs[1]} repeated runs"
        else:
            over += (f" of {self.runs[0]} + {self.runs[1]} runs: the spread between runs counts on the repeated "
                     "side only")
        if self.within_noise is None:
            return (f"{what} {self.change:+.1%}, which cannot be told from noise: a side has fewer than 2 measured "
                    f"steps (profile more steps)")
        interval = f"95 % interval {self.low:+.1%} … {self.high:+.1%}, {over}"
        if self.within_noise:
            return f"{what} {self.change:+.1%}, within noise ({interval})"
        return f"{what} {self.change:+.1%} ({interval})"

    def as_dict(self) -> dict:
        return {"step_change": self.change, "step_change_low": self.low, "step_change_high": self.high,
                "within_noise": self.within_noise, "noise_from": "runs" if self.from_runs else "steps",
                "noise_samples": list(self.samples), "noise_runs": list(self.runs)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _side_mean(runs: Sequence[Sequence[float]]) -> float:
    """A side's step time: its run's mean step, or the median of its runs' mean steps."""
    return statistics.median([_mean(r) for r in runs])


def _draw(runs: Sequence[Sequence[float]], rng: random.Random) -> float:
    picked = [runs[rng.randrange(len(runs))] for _ in runs] if len(runs) > 1 else runs
    return statistics.median([_mean([r[rng.randrange(len(r))] for _ in r]) for r in picked])


def compare(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> Change:
    """The change from ``base`` to ``other``, each a list of runs, each run its measured steps' times (ms)."""
    base = [list(r) for r in base if len(r)]
    other = [list(r) for r in other if len(r)]
    if not base or not other:
        raise ValueError("compare needs at least one measured step on each side")
    b, o = _side_mean(base), _side_mean(other)
    change = o / b - 1 if b else float("nan")
    samples = (sum(map(len, base)), sum(map(len, other)))
    from_runs = len(base) > 1 and len(other) > 1
    if min(samples) < 2 or not b:
        return Change(b, o, change, None, None, None, from_runs, samples, (len(base), len(other)))
    rng = random.Random(SEED)
    draws = sorted(_draw(other, rng) / _draw(base, rng) - 1 for _ in range(RESAMPLES))
    tail = (1 - LEVEL) / 2
    low, high = draws[int(tail * (RESAMPLES - 1))], draws[int((1 - tail) * (RESAMPLES - 1))]
    low, high = min(low, change), max(high, change)
    return Change(b, o, change, low, high, low <= 0 <= high, from_runs, samples, (len(base), len(other)))


NOISE_FLOOR = 0.05  # the least noise a within-run gain must exceed: 5 % of the median step


def noise_ms(steps_ms: Sequence[float]) -> float:
    """The noise a what-if gain must exceed within one run (whatif's naming rule): the spread (max − min) of the
    measured step over the measured steps, the slowest left out when there are three or more (one descheduled step is
    noise by itself, and a gain counts only when it is there in every step), and at least NOISE_FLOOR of the median
    step."""
    ordered = sorted(steps_ms)
    kept = ordered[:-1] if len(ordered) >= 3 else ordered
    return max(kept[-1] - kept[0], NOISE_FLOOR * ordered[len(ordered) // 2])
