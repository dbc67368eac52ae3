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

from traceana.errors import BadInputError
from traceana.errors import shown as printable_path
from traceana.export import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    parser.add_argument("--per-step", action="store_true", help="also show every (rank, step), not only means")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of tables")
    parser.add_argument("--export", metavar="DIR", help="write every table into DIR (Parquet by default)")
    parser.add_argument("--format", choices=FORMATS, default="parquet", help="table format for --export")
    parser.add_argument("--peak-flops", type=float, metavar="FLOP/S",
                        help="peak FLOP/s per device for MFU, when run.json does not say")
    parser.add_argument("--workers", type=int, default=None, help="parallel trace parsers (default: automatic)")
    parser.add_argument("--no-cache", action="store_true", help="do not read or write the .traceana/ cache")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument("--dask", metavar="ADDRESS",
                        help="analyse on a dask.distributed cluster (e.g. tcp://host:8786): one task per rank, then "
                             "one per pipeline; workers must see RUN_DIR at the same path (docs/performance.md)")


def load_and_analyze(path: str, *, peak_flops: float | None, workers: int | None, cache: bool, progress: bool,
                     dask: str | None = None):
    """The command's checks, then ``traceana.analysis_cache.load_and_analyze`` (cached unless ``cache`` is False),
    or with ``dask`` (a scheduler address) ``traceana.partitioned.analyze_partitioned`` on that cluster."""
    from traceana.manifest import check_peak_flops

    if not Path(path).exists():
        raise BadInputError("no such run directory or trace file", path=path, fix="check the path")
    check_peak_flops(peak_flops)
    if dask is not None:
        from traceana import partitioned
        from traceana.ingest.cache import CACHE_DIR

        if not Path(path).is_dir():
            raise BadInputError("--dask analyses a run directory, not a single trace file", path=path,
                                fix="pass the folder of the run's traces, or drop --dask")
        with partitioned.connect(dask) as client:
            return partitioned.analyze_partitioned(path, Path(path) / CACHE_DIR / partitioned.PARTITIONS_DIR,
                                                   map=partitioned.dask_map(client), peak_flops=peak_flops)
    from traceana.analysis_cache import load_and_analyze as cached

    return cached(path, peak_flops=peak_flops, workers=workers, cache=cache, progress=progress)


def _ms_pct(ms, pct) -> str:
    if ms is None:
        return "–"
    return f"{ms:,.2f} ({pct:.0f}%)" if ms else "·"


def print_tables(analysis, *, per_step: bool) -> None:
    import polars as pl
    from rich.console import Console
    from rich.table import Table

    from traceana.export import per_step_table
    from traceana.ingest.run_dir import summarize_ranks
    from traceana.schema import CATEGORIES

    console = Console()
    ranks = analysis.rank_summary if analysis.rank_summary is not None else summarize_ranks(analysis.run)
    t = Table(title=f"Ranks of {printable_path(analysis.run.path)}", title_justify="left")  # escapes printed inert
    for c in ("rank", "backend", "devices", "steps", "mean step ms", "events", "kernels", "P2P ops", "collectives",
              "trace"):
        t.add_column(c, justify="right" if c not in ("backend", "devices", "trace") else "left")
    for r in ranks.iter_rows(named=True):  # one row per rank: display only
        t.add_row(str(r["rank"]), str(r["backend"] or "–"), r["devices"], str(r["steps"]),
                  "–" if r["mean_step_ms"] is None else f"{r['mean_step_ms']:,.2f}", f"{r['n_events']:,}",
                  f"{r['kernels']:,}", f"{r['p2p_ops']:,}", f"{r['collectives']:,}",
                  "truncated" if r["truncated"] else "complete")
    console.print(t)

    # Stages as columns, categories as rows: fits a terminal for any pipeline depth up to ~8 stages.
    st = analysis.stages
    shown = [c for c in CATEGORIES if st.height and (st[f"{c}_ms"].fill_null(0) > 0).any()]
    rows = st.to_dicts()  # one dict per rank: display only
    t = Table(title="Where each stage's step time goes (mean per step: ms and % of the step)", title_justify="left")
    t.add_column("")
    for r in rows:
        label = "?" if r["stage"] is None else (r.get("stages") or str(r["stage"])).replace(",", "+")
        t.add_column(f"stage{'s' if '+' in label else ''} {label}\nrank {r['rank']}", justify="right")
    t.add_row("steps", *(str(r["steps"] or 0) for r in rows))
    t.add_row("step ms", *("–" if r["step_ms"] is None else f"{r['step_ms']:,.2f}" for r in rows), end_section=True)
    for c in shown:
        t.add_row(c.replace("_", " "), *(_ms_pct(r[f"{c}_ms"], r[f"{c}_pct"]) for r in rows))
    t.add_row("peak MiB", *("–" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:,.1f}"
                            for r in rows), end_section=False)
    t.add_row("activation MiB", *("–" if r["activation_peak_bytes"] is None
                                  else f"{r['activation_peak_bytes'] / 2**20:,.1f}" for r in rows))
    t.add_row("MFU", *("–" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%" for r in rows))
    t.add_row("stage from", *(str(r["stage_source"]) for r in rows))
    console.print(t)
    for line in headline(analysis.summary):
        console.print(line, markup=False, highlight=False)

    if per_step:
        ps = per_step_table(analysis)
        cols = [c for c in ps.columns if c.endswith("_ms") and c != "step_ms" and (ps[c].fill_null(0) > 0).any()]
        t = Table(title="Per step (ms)", title_justify="left")
        for c in ("stage", "rank", "step", "step_ms", *cols):
            t.add_column(c.removesuffix("_ms").replace("_", " "), justify="right")
        for r in ps.with_columns(pl.col(pl.Float64).round(3)).iter_rows():  # display only
            t.add_row(*("–" if v is None else str(v) for v in r[:4]),
                      *("·" if not r[ps.columns.index(c)] else str(r[ps.columns.index(c)]) for c in cols))
        console.print(t)

    offsets = analysis.clock_offsets
    if offsets.height and offsets["offset_ns"].abs().max():
        console.print("clock corrections (ns): " + ", ".join(f"rank {r}: {o:+,}" for r, o, _ in offsets.rows()))
    for n in analysis.notes:
        console.print(f"[yellow]note:[/] {n}")


def headline(summary) -> list[str]:
    """The run's headline figures (traceana.summary), one per line, in the words every surface uses."""
    from traceana.summary import STEP_TIME_LABEL

    def num(x, fmt):
        return "–" if x is None else format(x, fmt)

    lines = [f"{STEP_TIME_LABEL}: {num(summary.step_ms, ',.2f')} ms over steps "
             f"{', '.join(map(str, summary.steps)) or '–'}",
             f"bubble (warm-up + stall + cool-down, all ranks): "
             f"{num(None if summary.bubble_fraction is None else 100 * summary.bubble_fraction, '.1f')} % of step time"]
    if summary.bpipe_ms is not None:
        lines.append(f"exposed BPipe transfer (largest stage): {summary.bpipe_ms:,.2f} ms per step")
    if summary.largest_activation_peak_mib is not None:
        lines.append(f"largest activation peak: {summary.largest_activation_peak_mib:,.2f} MiB on stage "
                     f"{summary.largest_activation_stage}")
    if summary.memory_balance is not None:
        lines.append(f"memory balance across stages (max/min peak): {summary.memory_balance:.2f}")
    return lines


def run(args: argparse.Namespace) -> int:
    from traceana.export import summary, write_tables

    progress = not args.quiet and not args.json and sys.stderr.isatty()
    if args.export:  # before any work: never export over a trace or run.json
        from traceana.export import export_paths
        from traceana.files import refuse_inputs
        from traceana.ingest.run_dir import input_files

        inputs = input_files(args.run_dir)
        for target in export_paths(args.export, ["notes"], args.format):  # the names checked again when written
            refuse_inputs(target, inputs, flag="--export")
    analysis = load_and_analyze(args.run_dir, peak_flops=args.peak_flops, workers=args.workers,
                                cache=not args.no_cache, progress=progress, dask=args.dask)
    if args.export:
        written = write_tables(analysis, args.export, fmt=args.format)
        if not args.json:
            print(f"wrote {len(written)} files to {args.export}", file=sys.stderr)
    if args.json:
        json.dump(summary(analysis, per_step=args.per_step), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_tables(analysis, per_step=args.per_step)
    return 0
