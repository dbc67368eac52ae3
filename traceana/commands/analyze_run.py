"""``traceana analyze`` once its arguments are parsed: the analysis (cached, or on a Dask cluster), the causal
layer's diagnosis where the output shows it, and the output. traceana.commands.analyze holds the parser and is
imported to build it, before polars (the program's settings and the read-ahead come first: traceana.cli); this
module imports polars and the analysis, and is imported only when the command runs. The other commands that
analyse a run (describe, merge, validate, whatif) call ``load_and_analyze`` from here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from traceana.causal import diagnosis
from traceana.core.errors import BadInputError
from traceana.core.files import refuse_inputs
from traceana.core.manifest import check_peak_flops
from traceana.ingest import reading
from traceana.measure.analysis_cache import input_files  # (run_dir's, loaded only when called: a cache hit reads no trace)
from traceana.measure.analysis_cache import load_and_analyze as cached
from traceana.measure.analysis_cache import run_name_rules


def load_and_analyze(path: str, *, peak_flops: float | None, workers: int | None, cache: bool, progress: bool,
                     dask: str | None = None, names: str | None = None, diagnose: bool = True):
    """The command's checks, then ``traceana.measure.analysis_cache.load_and_analyze`` (cached unless ``cache`` is
    False), or with ``dask`` (a scheduler address) ``traceana.measure.partitioned.analyze_partitioned`` on that
    cluster; with ``diagnose``, the causal layer's diagnosis in its summary (``traceana.causal.diagnosis``: the
    straggler, the bottleneck, the critical path; a cached entry holds it)."""
    if not Path(path).exists():
        raise BadInputError("no such run directory or trace file", path=path, fix="check the path")
    _finish_ahead()
    check_peak_flops(peak_flops)
    rules = run_name_rules(path, names)  # a bad rules file is refused before any trace is read
    if dask is not None:
        # (cost: the partitioned analysis and its Dask client only for --dask)
        check_run_directory(path)
        from traceana.measure import partitioned

        with partitioned.connect(dask) as client:
            result, graph = analyze_on_cluster(path, client, peak_flops=peak_flops, names=rules)
        if diagnose:
            diagnosis.diagnose(result, graph)
        return result
    return cached(path, peak_flops=peak_flops, workers=workers, cache=cache, progress=progress, names=rules,
                  diagnose=diagnosis.diagnose if diagnose else None)


def check_run_directory(path: str) -> None:
    """``--dask`` analyses a run directory: a single trace file is refused in one line, before any connection."""
    if not Path(path).is_dir():
        raise BadInputError("--dask analyses a run directory, not a single trace file", path=path,
                            fix="pass the folder of the run's traces, or drop --dask")


def analyze_on_cluster(path: str, client, *, peak_flops: float | None, names):
    """``causal.group_graph.analyze_with_graph`` through a dask.distributed ``client`` (``partitioned.connect``):
    (the analysis, one pipeline group a task, and the measured steps' graph or the GraphError building it gave)."""
    from traceana.causal import group_graph
    from traceana.ingest.cache import CACHE_DIR
    from traceana.measure import partitioned

    return group_graph.analyze_with_graph(path, Path(path) / CACHE_DIR / partitioned.PARTITIONS_DIR,
                                          map=partitioned.dask_map(client), peak_flops=peak_flops, names=names)


def _finish_ahead() -> None:
    """The trace the CLI is reading ahead (``traceana.ingest.reading``) gets its tables built in a thread as soon as
    polars is imported, while this thread imports the analysis (``kineto.finish_ahead``)."""
    if reading.ahead_files():
        # (cost: the trace decoder only where a trace is being read ahead; a cache hit reads none)
        from traceana.ingest import kineto

        kineto.finish_ahead()


def run(args) -> int:
    """The command, once its arguments are parsed (``traceana.commands.analyze.run``)."""
    progress = not args.quiet and not args.json and sys.stderr.isatty()
    if args.export:  # before any work: never export over a trace or run.json
        # (cost: export, its tables and writers, only for --export, --json and --per-step)
        from traceana.commands.export import export_paths

        inputs = input_files(args.run_dir)
        for target in export_paths(args.export, ["notes"], args.format):  # the names checked again when written
            refuse_inputs(target, inputs, flag="--export")
    analysis = load_and_analyze(args.run_dir, peak_flops=args.peak_flops, workers=args.workers,
                                cache=not args.no_cache, progress=progress, dask=args.dask, names=args.names,
                                diagnose=not args.no_whatif)
    if args.export:
        # (cost: export as above; the table helpers only where something is said: --json draws nothing)
        from traceana.commands.export import write_tables
        from traceana.core.tables import plural

        written = write_tables(analysis, args.export, fmt=args.format)
        if not args.json:
            print(f"wrote {plural(len(written), 'file')} to {args.export}", file=sys.stderr)
    if args.json:  # (export only for --json, --export and --per-step: a plain analysis does not import it)
        from traceana.commands.export import summary  # (cost: as above)

        json.dump(summary(analysis, per_step=args.per_step), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        # (cost: the tables' module and what the text shows only for the text: --json draws nothing)
        from traceana.commands.analyze_text import print_tables

        print_tables(analysis, per_step=args.per_step)
    return 0
