"""The what-if on real collected runs with a delay the test injects (the collector's ``slow_rank``: a sleep inside each
of that rank's forwards; nothing in the trace or run.json says so): pp=2, rank 1 (stage 1) sleeping SLOW_MS in each
of its MICROBATCHES forwards, and the same configuration without. The truth is the injection: by hand each step then
holds MICROBATCHES × SLOW_MS more on stage 1, every one of them on the step's path (stage 1 runs every micro-batch's
forward in turn), and the undelayed collection's step, measured with its own noise.
"""

from __future__ import annotations

import warnings

import polars as pl
import pytest

from collected_runs import RUNS
from traceana.analysis import analyze
from traceana.ingest.run_dir import load_run
from traceana.whatif import plan_whatif, whatif

pytestmark = pytest.mark.slow

SLOW_RANK, SLOW_MS = RUNS["1f1b_pp2_slow"]["slow_rank"]
MICROBATCHES = RUNS["1f1b_pp2_slow"]["microbatches"]


def _analysed(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return analyze(load_run(path, cache=False))


def test_a_delayed_stage_is_named_and_its_ideal_is_the_undelayed_step(collected_run):
    plain_run = _analysed(collected_run("1f1b_pp2"))
    slow = whatif(_analysed(collected_run("1f1b_pp2_slow")))
    plain = whatif(plain_run)
    s, p = slow.summary, plain.summary
    # the delayed stage is the bottleneck; the rank feeding it (stage 0), which only waits, is not named
    assert s["bottleneck"] is not None and (s["bottleneck"]["group"], s["bottleneck"]["id"]) == ("stage", 1), s
    named = slow.groups.filter(pl.col("named"))
    assert named.select("group", "id").rows() == [("stage", "1")], named
    # making it ideal takes out (nearly all of) what was injected on the path, within the run's own noise (a loaded
    # run once recovered 318 of the 400 ms injected: its peers' forwards, the ideal, ran slower than unloaded) ...
    stage1 = slow.groups.filter((pl.col("group") == "stage") & (pl.col("id") == "1")).row(0, named=True)
    assert (s["measured_step_ms"] - stage1["if_ideal_step_ms"]
            >= 0.8 * MICROBATCHES * SLOW_MS - s["noise_ms"]), (s, stage1)
    # ... and predicts the undelayed collection's step within the noise of both runs and the stages' own
    # imbalance (stage 1 "at stage 0's speed" is what the what-if can know; the undelayed run measures how far apart
    # the two stages are without the delay: its stage-1 gain)
    natural = abs(plain.groups.filter((pl.col("group") == "stage") & (pl.col("id") == "1"))["gain_ms"][0])
    allowed = s["noise_ms"] + p["noise_ms"] + natural
    assert abs(stage1["if_ideal_step_ms"] - p["measured_step_ms"]) <= allowed, (stage1, p, natural)
    # the undelayed run names nothing beyond its noise on stage 1 (no injected delay there)
    assert not plain.groups.filter((pl.col("group") == "stage") & (pl.col("id") == "1"))["named"][0], plain.groups

    # another plan from the run's own durations: the plan it ran is its own step; GPipe instead of 1F1B, by hand the
    # same (m + p − 1)(F + B) of passes with these stage times (Huang et al. 2019, Narayanan et al. 2021), within the
    # optimizer and host time the two orders place differently
    same = plan_whatif(plain_run)
    assert same["predicted_step_ms"] == pytest.approx(same["measured_step_ms"]) and same["speedup"] == 1
    gpipe = plan_whatif(plain_run, schedule="gpipe")
    assert gpipe["speedup"] == pytest.approx(1.0, abs=0.15), gpipe
