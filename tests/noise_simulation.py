"""Simulated pairs of configurations for the comparison rule's calibration (traceana.measure.noise.log_intervals): each
comparison is ``rounds`` interleaved rounds of two configurations, A and B, collected one after the other on a
machine whose speed drifts and whose runs carry heavy-tailed noise. Vectorised: thousands of comparisons at once.

A run's log step time = log 500 ms + drift + noise + deschedule (+ log ``effect`` for B):
- drift: a random walk over the collections (step sd ``walk``) plus a steady trend (``trend`` per collection);
- noise: ``sigma`` × Student-t with ``df`` degrees of freedom, scaled to unit variance (heavy tails);
- deschedule: with probability ``outlier_p`` a run is slowed by a factor uniform in ``outlier`` (one-sided).
The defaults are the field notes' shared 2-core machine (docs/field-notes.md "Noise floor": run-to-run CV 30–40 %,
now and then one run 2–3× the others). Rounds alternate their order (traceana.measure.noise.round_order) unless
``alternate`` is False (A B, A B, …).
"""

from __future__ import annotations

import math

import numpy as np

from traceana.measure.noise import log_intervals

NOISE = {"sigma": 0.25, "df": 3, "outlier_p": 0.1, "outlier": (1.5, 3.0), "walk": 0.05, "trend": 0.02}


def simulate(rng: np.random.Generator, comparisons: int, rounds: int, effect: float = 1.0, *,
             alternate: bool = True, **noise) -> tuple[np.ndarray, np.ndarray]:
    """(A, B): each comparisons × rounds, the log step times of each side's runs in the order collected."""
    p = {**NOISE, **noise}
    n = 2 * rounds
    drift = p["walk"] * rng.standard_normal((comparisons, n)).cumsum(axis=1) + p["trend"] * np.arange(n)
    eps = p["sigma"] * rng.standard_t(p["df"], (comparisons, n)) / math.sqrt(p["df"] / (p["df"] - 2))
    slow = np.where(rng.random((comparisons, n)) < p["outlier_p"], np.log(rng.uniform(*p["outlier"], (comparisons, n))),
                    0.0)
    logt = math.log(500.0) + drift + eps + slow
    a_first = (np.arange(rounds) % 2 == 0) if alternate else np.ones(rounds, bool)
    pos_a = 2 * np.arange(rounds) + (~a_first)
    pos_b = 2 * np.arange(rounds) + a_first
    return logt[:, pos_a], logt[:, pos_b] + math.log(effect)


def rates(seed: int, comparisons: int, rounds: int, effect: float, **kw) -> tuple[float, float]:
    """(the fraction of comparisons called different in either direction, the fraction called different in the
    direction of ``effect``) under the rule."""
    a, b = simulate(np.random.default_rng(seed), comparisons, rounds, effect, **kw)
    _, low, high = log_intervals(a, b)
    different = (low > 0) | (high < 0)
    right = (low > 0) if effect > 1 else (high < 0)
    return float(different.mean()), float(right.mean())
