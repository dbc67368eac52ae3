"""Render a self-contained HTML report of one or more runs.

Each RUN_DIR (or single trace file) is read and analysed; with two or more, the report adds an A/B comparison
against the first (e.g. `traceana report baseline/ bpipe/ -o report.html`). Step times compare between runs: a
side's step time is the geometric mean of its runs (the run and its --repeat collections), its change carries a
95 % interval from the spread between those runs, and with one run on a side the noise is unknown and no difference
is claimed (docs/comparisons.md). The file needs no network to open.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from traceana.core.errors import BadInputError
from traceana.core.units import MIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (or trace files); the first is the baseline")
    options.output(parser, default="report.html", help="where to write the report")
    parser.add_argument("--name", action="append", default=None, metavar="NAME",
                        help="a label per run, in order (default: the directory names)")
    parser.add_argument("--title", default=None, help="the report's title (default: 'traceana report')")
    options.peak_flops(parser)
    options.names(parser)
    parser.add_argument("--no-validate", action="store_true", help="leave out the estimate-vs-measured section")
    parser.add_argument("--repeat", nargs="+", action="append", default=None, metavar=("RUN_DIR", "OTHER_RUN"),
                        help="RUN_DIR (one of the runs) then more collections of its configuration, in the order "
                             "collected: the A/B comparison's step time is then the geometric mean of each side's runs "
                             "and its interval the spread between them (paired by round when both sides have as "
                             "many); each run once; repeatable (default: one run a side, the between-run noise "
                             "unknown and no difference claimed)")
    options.reading(parser)


def analyse_runs(paths: Sequence[str | Path], *, peak_flops: float | None = None, progress: bool = True,
                 cache: bool = True, workers: int | None = None, names: str | None = None) -> list:
    """Load and analyse each run, with a progress display. Returns ``traceana.measure.analysis.Analysis`` objects.
    ``cache``/``workers``: as ``traceana.measure.analysis_cache.load_and_analyze``."""
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from traceana.causal.diagnosis import diagnose
    from traceana.measure.analysis_cache import load_and_analyze

    for p in paths:
        if not Path(p).exists():
            raise BadInputError("no such run directory or trace file", path=p, fix="check the path")
    rules = None
    if names is not None:  # one rules file for every run, refused before any trace is read
        from traceana.core.names import load_rules

        rules = load_rules(names)
    out = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), disable=not progress,
                  transient=True) as bar:
        for p in paths:
            task = bar.add_task(escape(f"reading {p}"), total=None)
            # cached under p/.traceana/analysis unless cache is False
            out.append(load_and_analyze(p, peak_flops=peak_flops, cache=cache, workers=workers, names=rules,
                                        diagnose=diagnose))  # (the report shows the straggler and critical path)
            bar.remove_task(task)
    return out


def _repeat_groups(repeat: list[list[str]], runs: list[str]) -> dict[int, list[str]]:
    """--repeat groups → {position of the run in RUN_DIR…: its other collections}; refused (one line) when the
    first of a group is not one of the runs or has no other run."""
    out: dict[int, list[str]] = {}
    where = {str(Path(r).resolve()): i for i, r in enumerate(runs)}
    for group in repeat:
        first, more = group[0], group[1:]
        i = where.get(str(Path(first).resolve()))
        if i is None or not more:
            raise BadInputError(f"--repeat {' '.join(group)}: " + ("give the other runs after it" if i is not None
                                                                      else f"{first} is not one of the runs"),
                                fix="write --repeat RUN_DIR OTHER_RUN…, RUN_DIR one of the report's runs")
        out.setdefault(i, []).extend(more)
    for i, more in out.items():  # a run given twice is one run: it adds no spread between runs
        side = [runs[i], *more]
        resolved = [str(Path(r).resolve()) for r in side]
        again = next((r for k, r in enumerate(side) if resolved[k] in resolved[:k]), None)
        if again is not None:
            raise BadInputError(f"--repeat: {again} is given more than once for {runs[i]}'s side; one run counts "
                                "once (a run given again adds no spread between runs)",
                                fix="give --repeat other collections of the configuration, each once")
    return out


def _not_twice(first, more: list) -> list:
    """``more`` unless a run of the side (``first`` and ``more``) is a copy of another (the same measured steps,
    traceana.measure.noise.twice): refused in one line, as the same folder given twice is."""
    from traceana.measure.noise import twice

    side = [first, *more]
    hit = twice([(str(Path(a.run.path).resolve()), a.summary.step_times_ms) for a in side])
    if hit is not None:
        raise BadInputError(f"--repeat: {side[hit[1]].run.path} is a copy of {side[hit[0]].run.path} (the same "
                            "measured steps); one run counts once", path=side[hit[1]].run.path,
                            fix="give --repeat other collections of the configuration, each once")
    return more


def _same_configuration(first, more: list) -> list:
    """``more`` if every run is ``first``'s configuration (run.json as the traces show it), else a one-line error:
    the difference between two configurations is not noise."""
    from traceana.core.errors import AnalysisError, TraceanaError

    try:
        want = first.config.training_config(path=first.run.path)
        for a in more:
            if a.config.training_config(path=a.run.path) != want:
                raise AnalysisError(f"--repeat: not a collection of {first.run.path}'s configuration, so its "
                                    "difference is not noise", path=a.run.path,
                                    fix="give --repeat only runs collected with the same flags")
    except AnalysisError:
        raise
    except TraceanaError as e:
        raise AnalysisError(f"--repeat needs each run's configuration (run.json): {e.what}", path=e.path,
                            fix="collect the runs with `traceana collect`, or leave out --repeat") from None
    return more


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True, quiet=args.quiet)
    if args.name and len(args.name) != len(args.runs):
        raise BadInputError(f"{len(args.name)} --name labels for {len(args.runs)} runs",
                            fix="give one --name per run, or none")
    if args.name and len(set(args.name)) != len(args.name):  # the A/B tables tell the runs apart by their labels
        twice = sorted({n for n in args.name if args.name.count(n) > 1})
        raise BadInputError(f"--name {', '.join(map(repr, twice))} labels more than one run",
                            fix="give each run its own --name")
    from traceana.measure.analysis_cache import input_files
    from traceana.core.files import refuse_inputs

    for r in args.runs:  # before any work: never write the report over a trace or run.json
        refuse_inputs(args.output, input_files(r))
    groups = _repeat_groups(args.repeat or [], args.runs)
    t0 = time.perf_counter()
    analyses = analyse_runs(args.runs, peak_flops=args.peak_flops, progress=not args.quiet, cache=not args.no_cache,
                            workers=args.workers, names=args.names)
    read = dict(peak_flops=args.peak_flops, progress=False, cache=not args.no_cache, workers=args.workers,
                names=args.names)
    repeats = {i: _not_twice(analyses[i], _same_configuration(analyses[i], analyse_runs(more, **read)))
               for i, more in groups.items()}
    with console.status("rendering the report (holoviews + bokeh)"):
        from reports.build import run_name, write_report

        taken: set[str] = set()
        names = list(args.name) if args.name else [run_name(a, taken) for a in analyses]
        kwargs = {"names": names, "title": args.title, "repeats": {names[i]: rs for i, rs in repeats.items()}}
        if args.no_validate:
            kwargs["validation"] = kwargs["cross_run"] = None
        path = write_report(args.output, analyses, **kwargs)
    size = path.stat().st_size / MIB
    print(f"report: {path} ({size:.1f} MiB, {time.perf_counter() - t0:.1f} s)")
    return 0
