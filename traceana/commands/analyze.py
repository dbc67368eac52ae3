"""Attribute each pipeline stage's step time to compute, P2P, BPipe transfers, collectives and bubbles.

Reads RUN_DIR (or one trace file), prints a per-rank summary and a per-stage table (step time, every category in
ms and % of the step, peak memory, MFU), and says what was inferred and what could not be determined.
`--json` prints the same as JSON; `--export DIR` writes every table (Parquet or CSV) for notebooks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traceana.core.errors import BadInputError
from traceana.core.errors import shown as printable_path
# not traceana.commands.export: building the parser imports no polars (cli.py)
from traceana.core.files import TABLE_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    parser.add_argument("--per-step", action="store_true", help="also show every (rank, step), not only means")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of tables")
    parser.add_argument("--export", metavar="DIR", help="write every table into DIR (default: no export)")
    parser.add_argument("--format", choices=TABLE_FORMATS, default="parquet", help="table format for --export")
    options.peak_flops(parser)
    options.names(parser)
    options.reading(parser)
    parser.add_argument("--no-whatif", action="store_true",
                        help="skip the what-if replays behind the straggler, bottleneck and critical-path lines "
                             "(traceana whatif runs them on their own) (default: run them)")
    parser.add_argument("--dask", metavar="ADDRESS",
                        help="analyse on a dask.distributed cluster (e.g. tcp://host:8786): one task per rank, then "
                             "one per pipeline; workers must see RUN_DIR at the same path (docs/performance.md) "
                             "(default: in this process)")


def load_and_analyze(path: str, *, peak_flops: float | None, workers: int | None, cache: bool, progress: bool,
                     dask: str | None = None, names: str | None = None, diagnose: bool = True):
    """The command's checks, then ``traceana.measure.analysis_cache.load_and_analyze`` (cached unless ``cache`` is
    False), or with ``dask`` (a scheduler address) ``traceana.measure.partitioned.analyze_partitioned`` on that
    cluster; with ``diagnose``, the causal layer's diagnosis in its summary (``traceana.causal.diagnosis``: the
    straggler, the bottleneck, the critical path; a cached entry holds it)."""
    from traceana.causal import diagnosis

    if not Path(path).exists():
        raise BadInputError("no such run directory or trace file", path=path, fix="check the path")
    _finish_ahead()
    from traceana.core.manifest import check_peak_flops

    check_peak_flops(peak_flops)
    from traceana.measure.analysis_cache import run_name_rules

    rules = run_name_rules(path, names)  # a bad rules file is refused before any trace is read
    if dask is not None:
        from traceana.measure import partitioned
        from traceana.ingest.cache import CACHE_DIR

        if not Path(path).is_dir():
            raise BadInputError("--dask analyses a run directory, not a single trace file", path=path,
                                fix="pass the folder of the run's traces, or drop --dask")
        with partitioned.connect(dask) as client:
            result = partitioned.analyze_partitioned(path, Path(path) / CACHE_DIR / partitioned.PARTITIONS_DIR,
                                                     map=partitioned.dask_map(client), peak_flops=peak_flops,
                                                     names=rules)
        if diagnose:
            diagnosis.diagnose(result)
        return result
    from traceana.measure.analysis_cache import load_and_analyze as cached

    return cached(path, peak_flops=peak_flops, workers=workers, cache=cache, progress=progress, names=rules,
                  diagnose=diagnosis.diagnose if diagnose else None)


def _finish_ahead() -> None:
    """The trace the CLI is reading ahead (``traceana.ingest.reading``) gets its tables built in a thread as soon as
    polars is imported, while this thread imports the analysis (``kineto.finish_ahead``)."""
    from traceana.ingest import reading

    if reading.ahead_files():
        from traceana.ingest import kineto

        kineto.finish_ahead()


def print_tables(analysis, *, per_step: bool) -> None:
    from traceana.measure.classify import rank_summary
    from traceana.core.schema import CATEGORIES, CATEGORY_LABELS
    from traceana.core.tables import UNKNOWN, print_line, print_table
    from traceana.core.tables import console as output_console
    from traceana.core.tables import cell as _num
    from traceana.core.tables import mib

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
    from traceana.core.tables import stage_label

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
        from traceana.core.flops import HFU_COUNTS, MFU_COUNTS

        hfu = any(r["hfu"] is not None and r["hfu"] != r["mfu"] for r in stages)
        print_line(console, f"MFU: {MFU_COUNTS}" + (f"; HFU: {HFU_COUNTS}" if hfu else ""))
    from traceana.measure import gpu
    from traceana.measure.summary import headline

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
    import polars as pl

    from traceana.measure import gpu
    from traceana.core.schema import CATEGORY_LABELS
    from traceana.core.tables import print_line, print_table
    from traceana.core.tables import cell as _num

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
    import polars as pl

    ps = summary.per_stage
    if "replicas" not in ps.columns or not (ps["replicas"].fill_null(1) > 1).any():
        return
    from traceana.causal.diagnosis import NO_WHATIF
    from traceana.causal.whatif import ms
    from traceana.core.tables import cell as _num
    from traceana.core.tables import print_line, print_table

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
    """Time on the replayed step's critical path by kind and stage (traceana.causal.graph.critical_path; whatif has
    more)."""
    import polars as pl

    from traceana.core.tables import print_table

    pt = summary.critical_path
    if pt is None or not pt.height:
        return
    rows = [[grp if grp == "kind" else f"{grp} {r['id']}", r["id"] if grp == "kind" else "", f"{r['ms']:,.2f}",
             f"{100 * (r['fraction'] or 0):.0f}%"]
            for grp in ("kind", "stage") for r in pt.filter(pl.col("group") == grp).iter_rows(named=True)]
    rows = [[f"{a} {b}".strip(), c, d] for a, b, c, d in rows]  # a few rows: display only
    print_table(console, "Critical path of the replayed step (ms per step, share of the path; traceana whatif for "
                         "slack and what-ifs)", ["on the path", "ms", "share"], rows, keys=1)


def run(args: argparse.Namespace) -> int:
    progress = not args.quiet and not args.json and sys.stderr.isatty()
    if args.export:  # before any work: never export over a trace or run.json
        from traceana.commands.export import export_paths
        from traceana.core.files import refuse_inputs
        from traceana.ingest.run_dir import input_files

        inputs = input_files(args.run_dir)
        for target in export_paths(args.export, ["notes"], args.format):  # the names checked again when written
            refuse_inputs(target, inputs, flag="--export")
    analysis = load_and_analyze(args.run_dir, peak_flops=args.peak_flops, workers=args.workers,
                                cache=not args.no_cache, progress=progress, dask=args.dask, names=args.names,
                                diagnose=not args.no_whatif)
    if args.export:
        from traceana.commands.export import write_tables
        from traceana.core.tables import plural

        written = write_tables(analysis, args.export, fmt=args.format)
        if not args.json:
            print(f"wrote {plural(len(written), 'file')} to {args.export}", file=sys.stderr)
    if args.json:  # (export only for --json, --export and --per-step: a plain analysis does not import it)
        from traceana.commands.export import summary

        json.dump(summary(analysis, per_step=args.per_step), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_tables(analysis, per_step=args.per_step)
    return 0
