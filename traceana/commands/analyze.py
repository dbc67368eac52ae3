"""Attribute each pipeline stage's step time to compute, P2P, BPipe transfers, collectives and bubbles.

Reads RUN_DIR (or one trace file), prints a per-rank summary and a per-stage table (step time, every category in
ms and % of the step, peak memory, MFU), and says what was inferred and what could not be determined.
`--json` prints the same as JSON; `--export DIR` writes every table (Parquet or CSV) for notebooks.
"""
# This module is imported to build the command's parser, before polars: the program's settings for a small run (one
# polars thread) and the read-ahead of its first trace come first (traceana.cli). What runs the command lives in
# traceana.commands.analyze_run (the analysis, the diagnosis, the output; polars at its top), imported by ``run``.

from __future__ import annotations

import argparse

from traceana.commands import options
# not traceana.commands.export: building the parser imports no polars (cli.py)
from traceana.core.files import TABLE_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    # (cost and order: polars and the analysis only once the command runs, after traceana.cli's program settings)
    from traceana.commands import analyze_run

    return analyze_run.run(args)


_RUN_SIDE = ("load_and_analyze", "_finish_ahead", "print_tables", "gpu_tables", "replicas_table", "path_table")


def __getattr__(name: str):
    """``load_and_analyze`` and the text output's functions, as this module held them: from
    traceana.commands.analyze_run and traceana.commands.analyze_text, imported when first asked for."""
    if name not in _RUN_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # (cost and order, as in ``run``)
    from traceana.commands import analyze_run, analyze_text

    return getattr(analyze_run if hasattr(analyze_run, name) else analyze_text, name)
