"""Slowed runs of other frameworks' own pipelines (issue 32, Show; docs/whatif.md "Slowed foreign runs").

tests/data/whatif_foreign/NAME holds ``run/`` (the traces, torch.profiler's defaults: no stack, no shapes) and
``slow.json``: what tests/benchmarks/whatif_foreign.py did to the run — which stage's own module slept or computed X ms
more in each forward, or nothing (the unslowed twin, collected interleaved with the slowed runs). The expectations
come from slow.json, not from traceana: the slowed stage is named and nothing else; with every kind of work at 0 the
replay is ≤ 2 % of the measured step; and the slowed stage at the other stages' speed lands within the noise of the
twins' own what-if (the same ``--set`` on the twins: it takes out what the definition takes out on both, the last
stage's loss included), the noise being traceana's on the twins' traces here (their spread, at least 5 % of a step)
widened by the twins' range.

The ``*-dp2-*`` runs are pp 2 × dp 2 (4 processes) with one rank slowed instead (slow.json's ``"group": "rank"``): that
rank is named and nothing else (not its stage, not its replica), and the rank at its peers' speed (``rank=R:peers``:
the same stage in the other replica) lands within the noise of the twins' own what-if, as above.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import graph, replay
from traceana.causal.whatif import _ideals, changed, parse_set, whatif
from traceana.measure.analysis_cache import load_and_analyze

DATA = Path(__file__).parents[1] / "data" / "whatif_foreign"
RUNS = sorted(p.parent.name for p in DATA.glob("*/slow.json"))
ZERO = [parse_set(s) for s in ("forward=0", "backward=0", "optimizer=0", "collective=0", "p2p=0", "host=0")]


def facts(name: str) -> dict:
    return json.loads((DATA / name / "slow.json").read_text())


def group(name: str) -> str:
    """What was slowed: a whole ``stage`` (pp 2) or one ``rank`` (pp 2 × dp 2: one replica of one stage)."""
    return facts(name).get("group", "stage")


SLOWED = [n for n in RUNS if facts(n)["slow"] and group(n) == "stage"]
TWINS = [n for n in RUNS if not facts(n)["slow"] and group(n) == "stage"]
RANK_SLOWED = [n for n in RUNS if facts(n)["slow"] and group(n) == "rank"]
RANK_TWINS = [n for n in RUNS if not facts(n)["slow"] and group(n) == "rank"]


@pytest.fixture(scope="module")
def analysed():
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_and_analyze(str(DATA / name / "run"), cache=False)
        return cache[name]
    return get


def _at_peers(a, stage: int):
    return whatif(a, [parse_set(f"stage={stage}:peers")]).as_dict()


def test_the_runs_are_here():
    assert len(SLOWED) >= 2 and len(TWINS) >= 2
    assert len(RANK_SLOWED) >= 2 and len(RANK_TWINS) >= 2


@pytest.mark.parametrize("name", SLOWED)
def test_the_slowed_stage_is_named_and_nothing_else(analysed, name):
    stage = facts(name)["slow"][0]
    w = _at_peers(analysed(name), stage)
    named = {(g, str(e["id"])) for g in ("stage", "rank", "replica") for e in w[f"by_{g}"] if e["named"]}
    assert named == {("stage", str(stage))}, w["diagnosis"]
    # profiled with the defaults (no stack): the schedule is inferred from P2P order, the messages paired by place
    assert any("inferred from P2P order" in n for n in w["notes"])


@pytest.mark.parametrize("name", RUNS)
def test_every_kind_at_zero_leaves_no_frozen_time(analysed, name):
    g = graph.build(analysed(name))
    ops, edges = _ideals(g)
    zeroed = replay.replay_variants(g, ops, edges, [changed(ops, ZERO)])[0]
    measured = (g.ranks.group_by("step").agg((pl.col("end_ns") - pl.col("start_ns")).max()).sort("step")
                ["end_ns"].to_list())
    assert max(z / m for z, m in zip(zeroed, measured)) <= 0.02


# DeepSpeed's what-if: its 1F1B posts the activation send of micro-batch k+1 only after the gradient of k came back (a
# blocking recv); the graph now makes that send wait on the gradient's message and counts a lag's time inside P2P
# calls as a wait (docs/whatif.md "No frozen time"), which took stage 1 at its peer's speed from 54.0 / 49.8 ms to
# 13.8 / 8.8 ms — the twins' own what-if reads 9.9-12.5 ms ± 0.7: just outside on either side, still failing
# (docs/whatif.md "Slowed foreign runs"; the twins themselves measured 11.4 and 14.1 ms).
DEEPSPEED_FROZEN = pytest.mark.xfail(strict=True, reason="DeepSpeed: 13.8 / 8.8 ms against the twins' 9.2-13.2 window")


def kin(name: str) -> tuple:
    """What makes runs twins: the framework, the profile, the steps run (3 unless slow.json says)."""
    f = facts(name)
    return f["framework"], f["profile"], f.get("steps", 3)


# The deepspeed-steps6-* runs (6 steps: 4 measured, against 1 in the 3-step runs) land: with one measured step the
# twins' noise is the 5 % floor of that step (0.7 ms), with four it is their spread (0.3 and 4.2 ms) — see
# docs/whatif.md "Slowed foreign runs".
@pytest.mark.parametrize("name", [pytest.param(n, marks=DEEPSPEED_FROZEN) if kin(n) == ("deepspeed", "defaults", 3)
                                  else n for n in SLOWED])
def test_the_slowed_stage_at_its_peers_speed_lands_within_the_twins_noise(analysed, name):
    f = facts(name)
    twins = [t for t in TWINS if kin(t) == kin(name)]
    assert len(twins) >= 2
    stage = f["slow"][0]
    tw = [_at_peers(analysed(t), stage) for t in twins]
    noise = max(t["noise_ms"] for t in tw)
    lo, hi = min(t["changed_step_ms"] for t in tw) - noise, max(t["changed_step_ms"] for t in tw) + noise
    w = _at_peers(analysed(name), stage)
    # the slowdown (X ms in each of the micro-batches' forwards) is far outside that noise: the what-if removed it
    assert w["measured_step_ms"] > hi + f["microbatches"] * f["slow"][1] / 2
    assert lo <= w["changed_step_ms"] <= hi, (w["changed_step_ms"], lo, hi)


# -- pp 2 × dp 2 (4 processes), one rank slowed: rank R's own module (one replica of one stage) spends X ms more in each
# forward; its peers are the same stage's ranks in the other replica (rank = stage · dp + replica, as megatron-core's,
# DeepSpeed's topology and the script's own groups place them). slow.json: {"group": "rank", "slow": [R, X, kind]}.

def _rank_at_peers(a, rank: int):
    return whatif(a, [parse_set(f"rank={rank}:peers")]).as_dict()


# megatron-dp2-defaults-sleep-0: rank 3 (stage 1, replica 1, unslowed) is named beside rank 1. In its one measured
# step rank 3's gradient all-reduce ran 6.9 ms against its peer rank 2's 2.1 ms (both members arrived within 0.8 ms; rank
# 3's call ended 4.8 ms after rank 2's: the process descheduled, 4 processes on 2 loaded cores), so at rank 2's speed
# the step gains 5.9 ms, above the noise (5.1 ms: the 5 % floor of the single measured step). Right for what was
# measured, not the slowdown (docs/whatif.md "Slowed foreign runs").
RANK3_DESCHEDULED = pytest.mark.xfail(strict=True, reason="megatron dp2 sleep-0: rank 3's all-reduce 6.9 ms vs its "
                                      "peer's 2.1 ms, gain 5.9 ms > noise 5.1 ms: rank 3 named too")


@pytest.mark.parametrize("name", [pytest.param(n, marks=RANK3_DESCHEDULED) if n == "megatron-dp2-defaults-sleep-0"
                                  else n for n in RANK_SLOWED])
def test_the_slowed_rank_is_named_and_nothing_else(analysed, name):
    rank = facts(name)["slow"][0]
    w = _rank_at_peers(analysed(name), rank)
    named = {(g, str(e["id"])) for g in ("stage", "rank", "replica") for e in w[f"by_{g}"] if e["named"]}
    assert named == {("rank", str(rank))}, w["diagnosis"]
    assert w["diagnosis"].startswith(f"one rank: rank {rank} "), w["diagnosis"]


# megatron-dp2-steps6-*: rank 1 at its peers' speed reads 4.6 / 6.9 ms against the twins' 15.7-17.8 ms ± 7.8 (their
# spread over 4 measured steps): below. Within the run it is exact (the measured 85.5 / 87.8 ms less the 80 ms slept):
# while rank 1 sleeps, the other 3 processes have the 2 cores, and their P2P and all-reduce take 1.9 ms of the path a
# step against the twins' 8.5 (4 processes contending). The replay keeps measured durations; what a faster rank 1 does
# to the others' CPU share is not in any trace (docs/whatif.md "Slowed ranks").
UNCONTENDED = pytest.mark.xfail(strict=True, reason="megatron dp2 steps6: 4.6 / 6.9 ms against the twins' 15.7-17.8 "
                                "± 7.8: the slowed runs' others ran uncontended while rank 1 slept")


@pytest.mark.parametrize("name", [pytest.param(n, marks=UNCONTENDED) if kin(n) == ("megatron", "defaults", 6)
                                  else n for n in RANK_SLOWED])
def test_the_slowed_rank_at_its_peers_speed_lands_within_the_twins_noise(analysed, name):
    f = facts(name)
    twins = [t for t in RANK_TWINS if kin(t) == kin(name)]
    assert len(twins) >= 2
    rank = f["slow"][0]
    tw = [_rank_at_peers(analysed(t), rank) for t in twins]
    # the tolerance is measured: the twins' measured steps (collected interleaved with the slowed runs: slowed, twin,
    # slowed, twin), widened by traceana's noise on them (the spread of their steps, at least 5 % of a step). A rank's
    # peers hold the same stage, so unlike a stage at the other stages' speed the fix takes out no natural imbalance:
    # the twin's measured step is the reference.
    noise = max(t["noise_ms"] for t in tw)
    lo, hi = min(t["measured_step_ms"] for t in tw) - noise, max(t["measured_step_ms"] for t in tw) + noise
    w = _rank_at_peers(analysed(name), rank)
    assert w["measured_step_ms"] > hi + f["microbatches"] * f["slow"][1] / 2  # the slowdown is far outside it
    assert lo <= w["changed_step_ms"] <= hi, (w["changed_step_ms"], lo, hi)
