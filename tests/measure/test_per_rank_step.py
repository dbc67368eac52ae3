"""``Analysis.per_rank_step``: the one per-(rank, step) table the stage table, the summary, validation and export read.
Expected values by hand."""

from __future__ import annotations

import polars as pl
import pytest
from tracebuilder import write_two_stage_run

from traceana.core.schema import ATTRIBUTION, STAGE_MEMORY, conform
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze, stage_table
from traceana.measure.summary import _per_stage, rank_steps


def _attribution(rows):
    return conform(pl.DataFrame(rows, schema=["rank", "step", "stage", "category", "ns"], orient="row")
                   .with_columns(fraction=pl.lit(0.0)), ATTRIBUTION)


def test_a_category_missing_from_a_step_counts_as_zero_in_every_mean():
    """Rank 0 over two steps of 100 µs: step 1 is 60 µs forward and 40 µs stall, step 2 all forward (no bubble
    row at all). Its mean bubble is (40 + 0) / 2 = 20 µs a step, 20 % of the step. The stage table and the summary
    pivoted the categories and averaged over the steps that had a row (40 µs, 40 %), measurement filled with 0: one
    table, one fill rule now. Rank 1 waits 10 µs for a P2P transfer in step 1 and sits in warm-up for 5 µs in each:
    bubble 5 µs, blocked (bubble + exposed P2P) 5 + 10 / 2 = 10 µs a step."""
    att = _attribution([
        (0, 1, 0, "forward", 60_000), (0, 1, 0, "bubble_stall", 40_000), (0, 2, 0, "forward", 100_000),
        (1, 1, 1, "forward", 85_000), (1, 1, 1, "p2p", 10_000), (1, 1, 1, "bubble_warmup", 5_000),
        (1, 2, 1, "forward", 95_000), (1, 2, 1, "bubble_warmup", 5_000),
    ])
    prs = rank_steps(att)
    assert prs.height == 4 and prs["step_ns"].to_list() == [100_000] * 4
    assert prs.filter((pl.col("rank") == 0) & (pl.col("step") == 2))["bubble_stall_ns"].item() == 0
    stages = pl.DataFrame({"rank": [0, 1], "stage": [0, 1], "stages": ["0", "1"], "stage_source": ["run.json"] * 2},
                          schema_overrides={"rank": pl.Int32, "stage": pl.Int32})
    mem = conform(pl.DataFrame(), STAGE_MEMORY).clear()
    mfu = pl.DataFrame(schema={"rank": pl.Int32, "mfu": pl.Float64, "hfu": pl.Float64})
    table = {r["rank"]: r for r in stage_table(prs, stages, mem, mfu).iter_rows(named=True)}
    assert table[0]["bubble_stall_ms"] == pytest.approx(0.020) and table[0]["bubble_stall_pct"] == pytest.approx(20)
    assert table[1]["p2p_ms"] == pytest.approx(0.005)
    per_stage = {r["stage"]: r for r in _per_stage(prs, stages, mem, [1, 2]).iter_rows(named=True)}
    assert per_stage[0]["bubble_ms"] == pytest.approx(0.020) and per_stage[0]["bubble_fraction"] == pytest.approx(0.2)
    means = prs.group_by("rank").agg(pl.col("bubble_ns", "blocked_ns").mean()).sort("rank")
    assert means.rows() == [(0, 20_000.0, 20_000.0), (1, 5_000.0, 10_000.0)]


def test_every_reader_takes_its_figures_from_the_one_table(tmp_path):
    """One tiny annotated two-stage step (tracebuilder: ProfilerStep 0–100 µs on both ranks): the step is 100 µs
    wherever it is shown, and the per-step export, the stage table and the summary give the table's bubble."""
    from traceana.commands.export import per_step_table

    a = analyze(load_run(write_two_stage_run(tmp_path), cache=False))
    prs = a.per_rank_step
    assert prs["step_ns"].to_list() == [100_000, 100_000]  # the generator's step, outside the code under test
    assert (prs["blocked_ns"] == prs["bubble_ns"] + prs["p2p_ns"]).all()
    exported = per_step_table(a)
    assert exported["step_ms"].to_list() == pytest.approx([0.1, 0.1])
    assert exported.sort("rank")["bubble_ms"].to_list() == pytest.approx((prs.sort("rank")["bubble_ns"] / 1e6).to_list())
    by_rank = dict(a.stages.select("rank", "bubble_stall_ms").rows())
    assert by_rank == {r: pytest.approx(ns / 1e6) for r, ns in prs.select("rank", "bubble_stall_ns").rows()}


def test_the_verdicts_bubble_term_holds_the_bubble_only():
    """The verdict's "bubble" term held warm-up + stall + cool-down + host, and its deltas added the exposed P2P,
    BPipe and collective time too. Stage 0 of a hand-made attribution: 600 ns forward, 300 ns cool-down, 50 ns host,
    20 ns exposed P2P: the terms are compute 600, bubble 300, host 50, communication 20 (ns), summing to the step."""
    from traceana.model.bpipe import TERMS, terms_of

    att = _attribution([(0, 1, 0, "forward", 600), (0, 1, 0, "bubble_cooldown", 300), (0, 1, 0, "host", 50),
                        (0, 1, 0, "p2p", 20), (1, 1, 1, "forward", 970)])
    got = {k: round(v * 1e9) for k, v in terms_of(att).items()}
    assert got == {"compute": 600, "recompute": 0, "bubble": 300, "host": 50, "communication": 20}
    assert TERMS == ("compute", "recompute", "bubble", "host", "communication", "transfer")
