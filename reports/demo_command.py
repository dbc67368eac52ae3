"""The whole job on a tiny example: collect a CPU pipeline with and without BPipe, analyse, validate, report.

Trains a tiny GPT split into 4 pipeline stages (4 processes, gloo) under the profiler, with plain 1F1B and with
BPipe's activation eviction, each ``ROUNDS`` times interleaved with the order alternating per round (baseline BPipe,
BPipe baseline, …: traceana.measure.noise.round_order, so a machine that slows down or speeds up meets both alike), then
writes one HTML report comparing the two. The results go to stdout, what holds first (``results``): BPipe's memory
result, the bubbles, then the step time with its between-run interval (traceana.measure.noise: beyond the noise, within
it, or too few runs to tell) and the model's prediction against it (traceana.validation.prediction.repeated_comparison);
the last line is ``report: PATH``. Progress goes to the terminal (stderr). Needs torch; about 1–2 minutes on 2 cores.
Open the printed report in a browser.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

DEFAULT_OUT = Path("traceana-demo")
# Small enough for a 2-core laptop in seconds, big enough that the pipeline has a steady state to look at:
# 4 stages, 8 micro-batches (1F1B needs at least as many micro-batches as stages), 2 profiled steps.
# 3 profiled steps: the first is dropped (summary.measured_steps), two are measured — a spread for the noise rule.
DEMO = {"preset": "tiny-gpt", "pp": 4, "num_microbatches": 8, "microbatch_size": 2, "schedule": "1f1b", "steps": 3,
        "warmup_steps": 1, "attention": "naive", "recompute": "none"}
RUNS = (("baseline", False), ("bpipe", True))
# Each configuration collected this many times, interleaved. On this project's 2-core machine one configuration
# collected twice differed by 55–98 % (docs/field-notes.md "Noise floor"): with one run a side the step-time
# comparison was the machine's, not BPipe's.
ROUNDS = 3


def results(both: dict, *, rounds: int) -> list[str]:
    """The demo's result lines, what holds first: the activation peaks (memory does not feel the machine's load), the
    bubbles, each side's runs, then the step time with its between-run interval and the model against it (one
    statistic, traceana.measure.noise's, and one interval: the report's A/B table says the same)."""
    base, bp = both["baseline"], both["target"]
    lines = []
    headline = bpipe_headline(base["median_activation_peak_mib"], bp["median_activation_peak_mib"])
    if headline:
        spread = [max(s["activation_peak_mib"]) - min(s["activation_peak_mib"]) for s in (base, bp)
                  if s["activation_peak_mib"]]
        lines.append(headline + (f", the same in each of the {rounds} rounds" if max(spread, default=1) < 0.01
                                 else " (medians of the runs)"))
    if base.get("median_bubble") is not None and bp.get("median_bubble") is not None:
        lines.append(f"bubble (warm-up + stall + cool-down) {base['median_bubble']:.1%} of all ranks' step time "
                     f"without, {bp['median_bubble']:.1%} with (medians of the runs)")
    for name, side in (("baseline", base), ("bpipe", bp)):
        steps = " / ".join(f"{x:,.0f}" for x in side["step_ms"])
        lines.append(f"  {name:9s} {side['runs']} runs, step {steps} ms")
    lines.append(f"step time, {both['statistic']}: {both['base_step_ms']:,.0f} ms without BPipe, "
                 f"{both['other_step_ms']:,.0f} ms with; {both['headline']}")
    lines.extend(f"note: {n}" for n in both.get("counted_once") or ())
    return lines


def bpipe_headline(plain_mib: float | None, bpipe_mib: float | None) -> str | None:
    """The demo's headline: the largest stage's activation peak (MiB) without and with BPipe, and the change."""
    if not plain_mib or bpipe_mib is None:
        return None
    return (f"BPipe: largest stage's activation peak {plain_mib:,.2f} MiB without, {bpipe_mib:,.2f} MiB with "
            f"({bpipe_mib / plain_mib - 1:+.0%})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    options.output(parser, type=Path, default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for the runs and report.html (default: ./{DEFAULT_OUT})")
    parser.add_argument("--keep", action="store_true",
                        help="keep the collected run directories, not only the report")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def collect_run(out: Path, *, bpipe: bool, progress=None, log: Path | None = None, **overrides) -> Path:
    """Collect one demo run (``DEMO`` with ``overrides``) into ``out``; returns the run directory. The collection
    itself is the collect command's (``collectors.command.collect_run``, through the command registry): the demo
    imports neither the trainer nor torch. ``progress``: called with one line of text per event of the trainer
    (e.g. a rank finished a step); ``log``: where the trainer's processes write their stderr (default: ours)."""
    from traceana.commands.registry import provided

    return provided("collect", "collect_run")(out, progress=progress, log=log, **{**DEMO, **overrides, "bpipe": bpipe})


def _short(msg: str, width: int = 90) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= width else msg[: width - 1] + "…"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    out: Path = args.output
    log = out / "collect.log"
    # rich draws on its own duplicate of stderr, so it stays on the terminal while fd 2 goes to the log
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    try:
        return _run(args, Console(file=terminal, quiet=args.quiet), out=out, log=log)
    finally:
        terminal.close()


def _run(args: argparse.Namespace, console, *, out: Path, log: Path) -> int:
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    report = out / "report.html"
    runs_dir = out / "runs"
    t0 = time.perf_counter()
    console.print(f"[bold]traceana demo[/]: tiny GPT, {DEMO['pp']} pipeline stages × {DEMO['num_microbatches']} "
                  f"micro-batches, 1F1B with and without BPipe, {ROUNDS} runs each interleaved, on the CPU")
    dirs: dict[str, list[Path]] = {name: [] for name, _ in RUNS}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  disable=args.quiet) as progress:
        from traceana.measure.noise import round_order

        bpipe_of = dict(RUNS)
        for k0, name in round_order(ROUNDS, [n for n, _ in RUNS]):
            k, bpipe = k0 + 1, bpipe_of[name]
            label = f"{name} {k}/{ROUNDS}"
            task = progress.add_task(f"collecting {label} ({DEMO['pp']} processes under the profiler)",
                                     total=None)
            run_dir = runs_dir / f"{name}-{k}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            try:
                collect_run(run_dir, bpipe=bpipe, log=log, progress=lambda msg, task=task, label=label:
                            progress.update(task, description=escape(f"collecting {label}: {_short(msg)}")))
            except BaseException:
                console.print(escape(f"the trainer's own output is in {log}"))
                raise
            progress.update(task, description=f"collected {label}", completed=1, total=1)
            dirs[name].append(run_dir)
        from reports.command import analyse_runs
        from traceana.validation.prediction import distinct

        task = progress.add_task(f"analysing the {ROUNDS * len(RUNS)} runs", total=None)
        analysed, counted_once = {}, []  # a run given twice (a copy) counts once, in the report as in the results
        for name, ds in dirs.items():
            analysed[name], said = distinct(analyse_runs(ds, progress=False))
            counted_once += said
        progress.update(task, description=f"analysed the {ROUNDS * len(RUNS)} runs", completed=1, total=1)

        task = progress.add_task("validating against the model and rendering the report", total=None)
        from reports.build import write_report

        names = [n for n, _ in RUNS]
        write_report(report, [analysed[n][0] for n in names], names=names, repeats={n: analysed[n][1:] for n in names},
                     title="traceana demo: 1F1B with and without BPipe")
        progress.update(task, description="report written", completed=1, total=1)

    if not args.keep:
        shutil.rmtree(runs_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
    from traceana.validation.prediction import repeated_comparison

    both = repeated_comparison(analysed["baseline"], analysed["bpipe"])
    both["counted_once"] = counted_once + both["counted_once"]
    for line in results(both, rounds=ROUNDS):
        print(line, flush=True)
    from reports.validation import bpipe_verdict

    verdict = bpipe_verdict(analysed["baseline"][0])
    if verdict:
        print(f"the model's verdict, from the first baseline run alone: {verdict}", flush=True)
    kept = escape(f" (runs kept in {runs_dir})") if args.keep else ""
    console.print(f"done in {time.perf_counter() - t0:.0f} s{kept}")
    print(f"report: {report.resolve()}")
    return 0
