"""``traceana analyze``'s text output: the ranks, where each stage's step time goes, the headline, the GPU's phases
and streams, the data-parallel replicas and stragglers, the critical path, notes. Imported only for the text
(``--json`` draws nothing), after the analysis: polars and the measured summary are loaded by then.
"""

from __future__ import annotations

import polars as pl

from traceana.causal.diagnosis import NO_WHATIF
from traceana.core.errors import shown as printable_path
from traceana.core.flops import HFU_COUNTS, MFU_COUNTS
from traceana.core.schema import CATEGORIES, CATEGORY_LABELS
from traceana.core.tables import UNKNOWN, mib, print_line, print_table, stage_label
from traceana.core.tables import cell as _num
from traceana.core.tables import console as output_console
from traceana.measure import gpu
from traceana.measure.classify import rank_summary
from traceana.measure.summary import headline


def print_tables(analysis, *, per_step: bool) -> None:
    def _ms_pct(ms, pct, step_ms) -> str:
        if ms is None:
            return UNKNOWN
        if not ms:
            return "·"
        return f"{ms:,.2f} ({pct:.0f}%)" if step_ms else f"{ms:,.2f}"

    def _unknown(category: str, stage) -> bool:
        # without a stage there is no schedule, so idle time cannot be told apart as warm-up, stall or cool-down
        return stage is None and category.startswith("bubble")

    console = output_console()
    ranks = analysis.rank_summary if analysis.rank_summary is not None else rank_summary(analysis.run)
    # What the trace holds: every ProfilerStep span and their mean duration, the warm-up steps and an empty last one
    # included. The step time of the stage table and the headline is another fact (over the measured steps), so it
    # is not named alike here (README, summary.measured_steps).
    headers = ["rank", "backend", "devices", "ProfilerStep\nspans", "their mean\nms", "events", "kernels",
               "P2P ops", "collectives", "trace"]
    rows = [[str(r["rank"]), str(r["backend"] or UNKNOWN), str(r["devices"] or UNKNOWN), str(r["steps"]),
             _num(r["mean_step_ms"]), f"{r['n_events']:,}", f"{r['kernels']:,}", f"{r['p2p_ops']:,}",
             f"{r['collectives']:,}", "truncated" if r["truncated"] else "complete"]
            for r in ranks.iter_rows(named=True)]  # one row per rank: display only
    print_table(console, f"Ranks of {printable_path(analysis.run.path)}", headers, rows, keys=1,
                justify=["right", "left", "left", *["right"] * 6, "left"])

    # Stages as columns, categories as rows; more stages than the terminal holds are split into several tables.
    st = analysis.stages
    shown = [c for c in CATEGORIES if st.height and (st[f"{c}_ms"].fill_null(0) > 0).any()]
    stages = st.to_dicts()  # one dict per rank: display only
    headers = ["", *(f"{stage_label(r['stage'], r.get('stages'))}\nrank {r['rank']}" for r in stages)]
    rows = [["steps", *(str(r["steps"] or 0) for r in stages)],
            ["step ms", *(_num(r["step_ms"]) for r in stages)]]
    rows += [[CATEGORY_LABELS[c], *(UNKNOWN if _unknown(c, r["stage"]) else _ms_pct(r[f"{c}_ms"], r[f"{c}_pct"],
                                                                                      r["step_ms"]) for r in stages)]
             for c in shown]
    rows += [["peak memory MiB", *(mib(r["peak_memory_bytes"]) for r in stages)],
             ["activation peak MiB", *(mib(r["activation_peak_bytes"]) for r in stages)],
             ["MFU (model FLOPs)", *(UNKNOWN if r["mfu"] is None else f"{100 * r['mfu']:.1f}%" for r in stages)],
             *([["HFU (+ recompute)", *(UNKNOWN if r["hfu"] is None else f"{100 * r['hfu']:.1f}%" for r in stages)]]
               if any(r["hfu"] is not None and r["hfu"] != r["mfu"] for r in stages) else []),
             ["stage from", *(str(r["stage_source"]) for r in stages)]]
    print_table(console, "Where each stage's step time goes (mean per step: ms and % of the step)", headers, rows,
                keys=1, sections=[1])
    if any(r["mfu"] is not None for r in stages):
        hfu = any(r["hfu"] is not None and r["hfu"] != r["mfu"] for r in stages)
        print_line(console, f"MFU: {MFU_COUNTS}" + (f"; HFU: {HFU_COUNTS}" if hfu else ""))
    is_pipeline = analysis.summary.pipeline_found
    if not is_pipeline:
        print_line(console, f"{gpu.NO_PIPELINE}; the time per GPU stream follows")
    for line in headline(analysis.summary):
        print_line(console, line)
    gpu_tables(console, analysis, pipeline=is_pipeline)
    if is_pipeline:  # (replicas of a stage: without stages, ranks are not replicas of anything)
        replicas_table(console, analysis.summary)
    path_table(console, analysis.summary)

    if per_step:
        from traceana.commands.export import per_step_table  # (only here: a plain analysis imports no export)

        ps = per_step_table(analysis)
        cols = [c for c in ps.columns if c.endswith("_ms") and c != "step_ms" and (ps[c].fill_null(0) > 0).any()]
        headers = ["stage", "rank", "step", "step time", *(c.removesuffix("_ms").replace("_", " ") for c in cols)]
        rows = [[_num(r["stage"], "d"), str(r["rank"]), _num(r["step"], "d"), _num(r["step_ms"], ",.3f"),
                 *(UNKNOWN if _unknown(c, r["stage"]) else "·" if not r[c] else f"{r[c]:,.3f}" for c in cols)]
                for r in ps.iter_rows(named=True)]  # one row per (rank, step): display only
        print_table(console, "Per step (ms)", headers, rows, keys=3, justify=["right"] * len(headers))

    offsets = analysis.clock_offsets
    if offsets.height and offsets["offset_ns"].abs().max():
        print_line(console, "clock corrections (ns): " + ", ".join(f"rank {r}: {o:+,}" for r, o, _ in offsets.rows()))
    for n in analysis.notes:
        print_line(console, n, prefix="[yellow]note:[/] ")


def gpu_tables(console, analysis, *, pipeline: bool) -> None:
    """GPU ranks: each phase's own GPU time beside the partition where phases ran at once (traceana.measure.gpu), and,
    for a trace that is not a pipeline, the time per stream."""
    steps = analysis.summary.steps
    if analysis.phase_time is not None:
        pm = gpu.phase_means(analysis.phase_time, analysis.attribution, steps)
        shown = pm.filter(pl.col("shared_fraction") > gpu.OVERLAP_SHOWN_ABOVE)
        if shown.height:
            rows = [[str(r["rank"]), CATEGORY_LABELS.get(r["phase"], r["phase"]), _num(r["own_ms"]),
                     _num(r["overlapped_ms"]), _num(r["partition_ms"]), f"{100 * r['shared_fraction']:.0f}%"]
                    for r in shown.iter_rows(named=True)]  # a few rows per rank: display only
            print_table(console, "Phases running at once on the GPU (mean per step, ms): each phase's own GPU time "
                                 "(its kernels' union), the part of it beside another phase's kernels, and what the "
                                 "per-instant attribution above gave it (docs/architecture.md \"Overlap\")",
                        ["rank", "phase", "own GPU\ntime", "overlapped", "in the\npartition", "rank's step\nshared"],
                        rows, keys=2)
    if not pipeline and analysis.stream_time is not None and analysis.stream_time.height:
        sm = gpu.stream_means(analysis.stream_time, steps)
        rows = [[str(r["rank"]), str(r["stream"]), _num(r["compute_ms"]), _num(r["communication_ms"]),
                 _num(r["memcpy_ms"]), _num(r["idle_ms"]), _num(r["overlapped_ms"])]
                for r in sm.iter_rows(named=True)]  # one row per (rank, stream): display only
        print_table(console, "Time per GPU stream (mean per step, ms)",
                    ["rank", "stream", "compute", "communi-\ncation", "memory\ncopies", "idle",
                     "beside another\nstream's work"], rows, keys=2)
    elif not pipeline:
        print_line(console, "no GPU work in the trace: its time is the CPU's (the table above)")


def replicas_table(console, summary) -> None:
    """Data-parallel pipelines: per stage across its replicas (traceana.measure.summary: own time) and the straggler the
    what-if names (traceana.causal.whatif)."""
    ps = summary.per_stage
    if "replicas" not in ps.columns or not (ps["replicas"].fill_null(1) > 1).any():
        return
    # (cost: causal.whatif, and the graph and engine it imports, only where replicas are shown: with --no-whatif
    # nothing else loads it)
    from traceana.causal.whatif import ms

    ps = ps.filter(pl.col("replicas") > 1)
    reps = summary.replicas
    # eq_missing: ranks of unknown stage of a pure data-parallel run are replicas of stage '–'; == null matches nothing
    collective = {s: ", ".join(f"r{r}: {t:,.2f}" for _, r, t in
                               reps.filter(pl.col("stage").eq_missing(s)).select("stage", "replica", "collective_ms")
                               .rows())
                  for s in ps["stage"].to_list()}
    known = summary.diagnosis is not None and not summary.diagnosis.startswith(NO_WHATIF)
    none = "none" if known else "–"  # the what-if ran and named nobody; or it could not run (not determined)
    headers = ["stage", "replicas", "mean step\nms", "mean own\nms", "slowest\nreplica", "its own\nms",
               "straggler\n(what-if)", "collective exposed\nms per replica"]
    rows = [[_num(r["stage"], "d"), str(r["replicas"]), _num(r["step_ms"]), _num(r["own_ms"]),
             f"{r['slowest_replica']} (rank {r['slowest_rank']})", _num(r["slowest_own_ms"]),
             (none if r["straggler"] is None else f"replica {r['straggler']} (rank {r['straggler_rank']})"),
             collective[r["stage"]]]
            for r in ps.iter_rows(named=True)]  # one row per stage: display only
    print_table(console, "Data-parallel replicas per stage (own time = step − exposed collective; median over "
                         "steps)", headers, rows,
                keys=1)
    for r in summary.stragglers.iter_rows(named=True):  # one per stage at most: display only
        print_line(console, f"straggler: rank {r['straggler_rank']} (replica {r['straggler']}) on stage {r['stage']}: "
                            f"at its peers' speed the step would be {ms(r['if_ideal_step_ms'])} ms instead of "
                            f"{ms(summary.step_ms)} ms (the what-if names a rank only when that gain exceeds the "
                            f"noise in every measured step; traceana whatif)"
                   if r["if_ideal_step_ms"] is not None else f"straggler: rank {r['straggler_rank']}")
    if not known:
        print_line(console, "straggler: not known — " + (summary.diagnosis or (
            "the what-if did not run" if summary.diagnosed else "not looked for (--no-whatif)")))
    elif not len(summary.stragglers):
        print_line(console, "no straggler: no rank or replica made ideal shortens the step by more than "
                            "the noise in every measured step (traceana whatif)")


def path_table(console, summary) -> None:
    """Time on the replayed step's critical path by kind and stage (traceana.causal.critical_path; whatif has
    more)."""
    pt = summary.critical_path
    if pt is None or not pt.height:
        return
    rows = [[grp if grp == "kind" else f"{grp} {r['id']}", r["id"] if grp == "kind" else "", f"{r['ms']:,.2f}",
             f"{100 * (r['fraction'] or 0):.0f}%"]
            for grp in ("kind", "stage") for r in pt.filter(pl.col("group") == grp).iter_rows(named=True)]
    rows = [[f"{a} {b}".strip(), c, d] for a, b, c, d in rows]  # a few rows: display only
    print_table(console, "Critical path of the replayed step (ms per step, share of the path; traceana whatif for "
                         "slack and what-ifs)", ["on the path", "ms", "share"], rows, keys=1)
