"""One engine (issue 34, Build 2): the batched evaluator (replay.replay_variants) gives the engine's step
(replay.replay_steps_ns: causal.scheduler.run_schedule) to the nanosecond on graphs of more than 10^4 operations built
from traces — a synthetic GPU pipeline written as Kineto writes it (tests/benchmarks/gen_big_trace.py: annotated
passes, NCCL send/recv launches between neighbouring stages, a data-parallel all-reduce of every rank, the optimizer),
read, analysed and made a graph by the same code as a real run's — on the variants a what-if replays: a stage slowed,
kinds scaled, P2P zeroed, everything ideal but one group. The engine is the reference: the claim under test is that the
two are one semantics, so the expected value is the engine's replay of the same frames, exact (both add the same
float64 durations in the same order; steps are rounded to whole ns once, at the end).

And the run-time invariant: the evaluator checks its replay of the graph's own durations against the engine's, rank
by rank, on every call; a deliberately broken evaluator is caught and named as a bug with both figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import graph, replay
from traceana.causal.whatif import _ideals, all_ideal_except, changed, materialize, parse_set
from traceana.measure.analysis_cache import load_and_analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

# (pipeline stages, data-parallel replicas, micro-batches, raw MB per rank: how many steps are written)
SHAPES = {
    # one measured step (the first is warm-up) of 64 ranks × (2 · 80 passes + all-reduce + optimizer) = 10,368 ops
    "pp8_dp8_m80_one_step": (8, 8, 80, 1.0),
    # three measured steps of 32 ranks × 130 ops = 12,480 ops, each step replayed from its own origin
    "pp4_dp8_m64_three_steps": (4, 8, 64, 2.5),
}
SETS = [
    ["stage=3:forward*2"],  # a stage slowed
    ["forward*0.5", "backward*1.5"],  # kinds scaled
    ["p2p=0"],  # P2P zeroed
    ["collective=0", "optimizer*3"],
    ["rank=5:host*4"],  # one rank's host time (its lags and tail scale with it)
    ["replica=2:ideal"],
    ["stage=0:peers"],
    ["forward=0", "backward=0", "optimizer=0", "collective=0", "p2p=0", "host=0"],  # nothing left but the waits
]


@pytest.fixture(scope="module", params=list(SHAPES))
def big(request, tmp_path_factory) -> graph.StepGraph:
    pp, dp, m, mb = SHAPES[request.param]
    out = tmp_path_factory.mktemp(request.param) / "run"
    write_run(out, ranks=pp, dp=dp, mb=mb, gz=False, microbatches=m, kernels=1)
    g = graph.build(load_and_analyze(str(out), cache=False))
    assert g.ops.height >= 10_000, g.ops.height
    assert g.ranks["rank"].n_unique() == pp * dp
    return g


def test_the_batched_evaluator_is_the_engine_on_traces_of_ten_thousand_operations(big):
    g = big
    ops, edges = _ideals(g)
    variants = [changed(ops, [parse_set(s) for s in sets]) for sets in SETS]
    variants += [all_ideal_except("stage", 1, None, peers=True), all_ideal_except(None, None, "p2p")]
    assert ops.height >= replay.BATCH_FROM_OPS
    batched = replay.replay_variants(g, ops, edges, variants, chunk=4)  # (several chunks)
    assert all(replay._levels(g, step) is not None for step in g.steps)  # (batched: not the engine's fallback)
    engine = [replay.replay_steps_ns(g, ops=o, edges=e) for o, e in (materialize(ops, edges, v) for v in variants)]
    assert batched == engine
    measured = replay.replay_steps_ns(g)
    # the variants move the step the way they say (not a check of the two against each other, which is above)
    slowed, halved, no_p2p, *_, nothing, _, _ = batched
    assert all(s > m for s, m in zip(slowed, measured))
    assert all(x < m for x, m in zip(no_p2p, measured))
    assert all(x < 0.02 * m for x, m in zip(nothing, measured)), (nothing, measured)


def test_the_invariant_catches_an_evaluator_that_is_not_the_engine(big, monkeypatch):
    # a bug in the evaluator (here: every host gap read as 1 ns longer) is said as one, with both figures; the engine
    # is not involved in the variants, so only the run-time check can see it
    g = big
    ops, edges = _ideals(g)
    real = replay._evaluate

    def off_by_one(levels, work, gap, transfer, **kw):
        return real(levels, work, gap + 1.0, transfer, **kw)

    monkeypatch.setattr(replay, "_evaluate", off_by_one)
    with pytest.raises(replay.EngineMismatch) as e:
        replay.replay_variants(g, ops, edges, [(pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns"))])
    assert "batched" in str(e.value) and "engine" in str(e.value) and "rank" in str(e.value)


def test_the_invariant_catches_a_scale_the_measured_durations_cannot_show(big, monkeypatch):
    # a bug in how a variant scales what the graph holds no operation for (here: each rank's tail kept as measured,
    # frozen) leaves the measured durations' replay right (ratios of 1) and is caught by the doubled probe
    g = big
    ops, edges = _ideals(g)
    real = replay._evaluate

    def frozen_tail(levels, work, gap, transfer, **kw):
        n, by_level, offset, last, origin, tail, *rest = levels
        host_free = real(levels, work, gap, transfer, **kw)
        total0 = levels[6]  # (the measured work, gaps and transfers: rho's denominator)
        ratio = (work.sum(axis=1) + gap.sum(axis=1) + transfer.sum(axis=1)) / total0
        return host_free - (tail[None, :] * (ratio[:, None] - 1)).round().astype(host_free.dtype)

    monkeypatch.setattr(replay, "_evaluate", frozen_tail)
    with pytest.raises(replay.EngineMismatch, match="doubled"):
        replay.replay_variants(g, ops, edges, [(pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns"))])


def test_a_step_of_nothing_but_waits_is_no_mismatch(monkeypatch):
    # two ranks, one op each, no work, gaps or transfers, a wait of 1 ms before rank 1's op and a message of no lag:
    # by _scales' rule the ratios of a step with nothing to scale are 1, so doubling its (zero) durations leaves its
    # replay (1 ms) as it is; the doubled probe must not call that a mismatch
    ms = 1_000_000
    o = pl.DataFrame([(r, 0, 0, "F", "forward", r, 0, 0, 0, 0, 0, None, None, "hand", False, ms * r) for r in (0, 1)],
                     schema={**graph.OPS, **graph.WAIT}, orient="row")
    e = pl.DataFrame([(0, "p2p", 0, 0, 1, 0, None, 0, 0, 0)], schema=graph.EDGES, orient="row")
    rk = pl.DataFrame([(r, 0, 0, 0, 0, r, 0) for r in (0, 1)], schema=graph.RANK_STEPS, orient="row")
    g = graph.StepGraph(ops=o, edges=e, ranks=rk, steps=(0,))
    monkeypatch.setattr(replay, "BATCH_FROM_OPS", 0)
    same = (pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns"))
    assert replay.replay_variants(g, o, e, [same]) == [[ms]] == [replay.replay_steps_ns(g)]
