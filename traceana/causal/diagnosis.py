"""The diagnosis: who holds the measured step back, as the what-if names it. Per stage the straggler (its replica
and rank, and the step were it ideal), the one line naming the bottleneck (or why none could be named), what it
names, and the time on the replayed step's critical path (docs/whatif.md "Naming").

The measured summary (traceana.measure.summary) holds figures only; its what-if fields are filled here, when a
surface that shows them asks (``diagnose``): ``analyze`` (unless ``--no-whatif``), ``merge`` (the critical-path
lane), ``report``. A surface that does not show them — ``validate``, ``watch``, ``estimate`` — does not pay for the
replays.
"""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from traceana.core.errors import TraceanaError
from traceana.measure.summary import WHATIF_COLUMNS, RunSummary

# ranks and replicas the diagnosis makes ideal (those whose work exceeds their peers' the most; traceana whatif makes
# every one ideal)
WHATIF_CANDIDATES = 8
# ... and not at all beyond this many operations in the measured steps: the measured replay and its critical path are
# Python over every operation, the what-ifs one batched evaluation (replay.replay_variants); a 1,024-rank step of
# 67,584 operations took 4.4 s on the 2-core machine (tests/benchmarks/bench_whatif_scale.py), a 4,096-rank one of
# 270,336 operations ~12 CPU-s (tests/benchmarks/bench_analyze_scale.py); traceana whatif runs it at any size
WHATIF_MAX_OPERATIONS = 300_000
NO_WHATIF = "no what-if: "  # how a diagnosis begins where none could be made (then nobody is named: not known)


def named_by_whatif(analysis, steps: list[int], graph=None) -> tuple[pl.DataFrame, str | None, dict | None,
                                                                     pl.DataFrame | None, pl.DataFrame | None]:
    """Per stage the straggler the what-if names (stage, straggler: its replica, straggler_rank, if_ideal_step_ms),
    the diagnosis, the bottleneck and the time on the critical path; an empty table and the reason where no what-if
    can run. ``graph``: the measured steps' graph where it was built already (causal.group_graph: one pipeline group
    a task, for an analysis assembled without its events), or the GraphError that building it gave."""
    # (cost: the graph, the engine and the what-if only where a diagnosis runs: --no-whatif, validate, watch load none)
    from traceana.causal.graph import build
    from traceana.causal.whatif import whatif

    empty = pl.DataFrame(schema={"stage": pl.Int32, "straggler": pl.Int32, "straggler_rank": pl.Int32,
                                 "if_ideal_step_ms": pl.Float64})
    if isinstance(graph, TraceanaError):
        return empty, f"{NO_WHATIF}{graph.what}", None, None, None
    if graph is None and analysis.events is None:
        return empty, None, None, None, None  # (assembled without its events and no graph: the collectives unknown)
    try:
        g = graph if graph is not None else build(analysis, steps)
        if g.ops.height > WHATIF_MAX_OPERATIONS:
            return empty, (f"{NO_WHATIF}not run here for {g.ops.height:,} operations (more than "
                           f"{WHATIF_MAX_OPERATIONS:,}): traceana whatif RUN_DIR runs it"), None, None, None
        w = whatif(analysis, graph=g, full=False, candidates=WHATIF_CANDIDATES)
    except TraceanaError as e:
        return empty, f"{NO_WHATIF}{e.what}", None, None, None
    ranks = w.per_rank.select(pl.col("rank").cast(pl.String).alias("id"), "stage", "replica")
    named = w.groups.filter(pl.col("named"))
    by_rank = named.filter(pl.col("group") == "rank").join(ranks, on="id").select(
        "stage", pl.col("replica").alias("straggler"), pl.col("id").cast(pl.Int32).alias("straggler_rank"),
        pl.col("if_peers_step_ms").alias("if_ideal_step_ms"), "peers_gain_ms")  # the straggler at its peers' speed
    table = (by_rank.sort("peers_gain_ms", descending=True).unique("stage", keep="first", maintain_order=True)
             .drop("peers_gain_ms").cast(empty.schema).select(list(empty.schema)))
    return table, w.summary["diagnosis"], w.summary["bottleneck"], w.path_time, w.paths


def diagnose(analysis, graph=None) -> RunSummary:
    """The analysis' summary with the diagnosis in: the straggler columns of ``per_stage``, ``diagnosis``,
    ``bottleneck``, ``critical_path`` and ``path`` (``diagnosed`` True). Kept as the analysis' summary
    (``Analysis.keep_summary``), so the report, export and the analysis cache read the same; asked again, it is
    returned as kept. ``graph``: as ``named_by_whatif``'s."""
    s = analysis.summary
    if s.diagnosed:
        return s
    named, line, bottleneck, path_time, path = named_by_whatif(analysis, list(s.steps), graph)
    per_stage = s.per_stage.drop(list(WHATIF_COLUMNS)).join(named, on="stage", how="left", nulls_equal=True)
    return analysis.keep_summary(replace(s, per_stage=per_stage, diagnosis=line, bottleneck=bottleneck,
                                         critical_path=path_time, path=path, diagnosed=True))
