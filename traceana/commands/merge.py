"""Merge all ranks into one Chrome/Perfetto trace on an aligned clock.

Each rank becomes a process ("rank R (stage S)") with its own threads and streams, plus added tracks: the pipeline
phases (forward/backward per micro-batch), one lane per micro-batch, and the attribution of idle time (bubbles,
P2P, BPipe, collectives, host). Open the result in https://ui.perfetto.dev.
"""

# Function-local imports here: order and cost. This module is imported to build the parser, before polars;
# polars, and what imports it, must come after the program's settings for a small run (traceana.cli), so
# they are imported in ``run`` and the functions it calls (docs/architecture.md "Function-local imports").

from __future__ import annotations

import argparse
import sys

from traceana.commands import options
from traceana.core.files import descriptor_of, refuse_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    options.output(parser, default="merged.json.gz",
                   help="where to write the merged trace (.json.gz compressed, .json plain text; - for standard "
                        "output, plain JSON); never onto a device, FIFO or socket")
    options.names(parser)
    options.reading(parser)


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze_run import load_and_analyze
    from traceana.commands.export import write_merged_trace
    from traceana.ingest.run_dir import input_files
    from traceana.core.tables import plural

    if descriptor_of(args.output) is None:  # before any work: never write over a trace, run.json or a device/FIFO
        refuse_inputs(args.output, input_files(args.run_dir))
    progress = not args.quiet and sys.stderr.isatty()
    analysis = load_and_analyze(args.run_dir, peak_flops=None, workers=args.workers, cache=not args.no_cache,
                                progress=progress, names=args.names)
    path = write_merged_trace(analysis, args.output)
    if not args.quiet and descriptor_of(args.output) is None:
        print(f"wrote {path} ({plural(len(analysis.run.ranks), 'rank')}) — open it in https://ui.perfetto.dev", file=sys.stderr)
    return 0
