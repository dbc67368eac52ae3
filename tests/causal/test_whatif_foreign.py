"""Slowed runs of other frameworks' own pipelines (issue 32, Show; docs/whatif.md "Slowed foreign runs").

tests/data/whatif_foreign/NAME holds ``run/`` (the traces, torch.profiler's defaults: no stack, no shapes) and
``slow.json``: what tests/benchmarks/whatif_foreign.py did to the run — which stage's own module slept or computed X ms
more in each forward, or nothing (the unslowed twin, collected interleaved with the slowed runs). The expectations
come from slow.json, not from traceana: the slowed stage is named and nothing else; with every kind of work at 0 the
replay is ≤ 2 % of the measured step; and the slowed stage at the other stages' speed lands within the noise of the
twins' own what-if (the same ``--set`` on the twins: it takes out what the definition takes out on both, the last
stage's loss included), the noise being traceana's on the twins' traces here (their spread, at least 5 % of a step)
widened by the twins' range.
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


SLOWED = [n for n in RUNS if facts(n)["slow"]]
TWINS = [n for n in RUNS if not facts(n)["slow"]]


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


@pytest.mark.parametrize("name", [pytest.param(n, marks=DEEPSPEED_FROZEN) if facts(n)["framework"] == "deepspeed"
                                  else n for n in SLOWED])
def test_the_slowed_stage_at_its_peers_speed_lands_within_the_twins_noise(analysed, name):
    f = facts(name)
    twins = [t for t in TWINS if facts(t)["framework"] == f["framework"] and facts(t)["profile"] == f["profile"]]
    assert len(twins) >= 2
    stage = f["slow"][0]
    tw = [_at_peers(analysed(t), stage) for t in twins]
    noise = max(t["noise_ms"] for t in tw)
    lo, hi = min(t["changed_step_ms"] for t in tw) - noise, max(t["changed_step_ms"] for t in tw) + noise
    w = _at_peers(analysed(name), stage)
    # the slowdown (X ms in each of the micro-batches' forwards) is far outside that noise: the what-if removed it
    assert w["measured_step_ms"] > hi + f["microbatches"] * f["slow"][1] / 2
    assert lo <= w["changed_step_ms"] <= hi, (w["changed_step_ms"], lo, hi)
