"""Merge all ranks into one Chrome/Perfetto trace on an aligned clock.

Each rank becomes a process ("rank R (stage S)") with its own threads and streams, plus added tracks: the pipeline
phases (forward/backward per micro-batch), one lane per micro-batch, and the attribution of idle time (bubbles,
P2P, BPipe, collectives, host). Open the result in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    parser.add_argument("-o", "--output", default="merged.json.gz", metavar="FILE",
                        help="where to write the merged trace (default: merged.json.gz; .json for plain text)")
    parser.add_argument("--workers", type=int, default=None, help="parallel trace parsers (default: automatic)")
    parser.add_argument("--no-cache", action="store_true", help="do not read or write the .traceana/ cache")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze import load_and_analyze
    from traceana.export import write_merged_trace
    from traceana.files import refuse_inputs
    from traceana.ingest.run_dir import input_files

    refuse_inputs(args.output, input_files(args.run_dir))  # before any work: never write over a trace or run.json
    progress = not args.quiet and sys.stderr.isatty()
    analysis = load_and_analyze(args.run_dir, peak_flops=None, workers=args.workers, cache=not args.no_cache,
                                progress=progress)
    path = write_merged_trace(analysis, args.output)
    if not args.quiet:
        print(f"wrote {path} ({len(analysis.run.ranks)} ranks) — open it in https://ui.perfetto.dev", file=sys.stderr)
    return 0
