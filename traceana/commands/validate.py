"""Compare the model with what a run measured: the model's in-sample prediction of step time and blocked time per stage
(the simulator fed with the run's own durations), activation memory per stage from the memory model, and (with
--baseline) the cross-run prediction of this run from another run's measurements (e.g. a BPipe run predicted from its
plain 1F1B baseline) against the measured change, whose interval comes from repeated runs (--repeat;
traceana.measure.noise). "Replay" is only the what-if's replay of the measured step's graph (traceana whatif), never the
simulator here."""

# Function-local imports here: order and cost. This module is imported to build the parser, before polars;
# polars, and what imports it, must come after the program's settings for a small run (traceana.cli), so
# they are imported in ``run`` and the functions it calls (docs/architecture.md "Function-local imports").

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traceana.commands import options
from traceana.core.errors import AnalysisError, ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run to validate (a directory with run.json and rank traces)")
    p.add_argument("--baseline", type=Path, metavar="RUN_DIR",
                   help="predict RUN_DIR from this run's measurements and compare (default: no cross-run check)")
    p.add_argument("--repeat", type=Path, nargs="+", action="extend", metavar="RUN",
                   help="more collections of the baseline's or RUN_DIR's configuration, in the order collected "
                        "(interleaved: round k's runs the k-th of each side): the measured change's interval comes "
                        "from the runs of each side; a run given twice counts once (default: none — one run a side, "
                        "the between-run noise unknown)")
    p.add_argument("--bpipe-baseline", default="as-configured",
                   choices=("as-configured", "best-without-bpipe", "full-recompute"),
                   help="what the BPipe verdict compares with (as-configured: the run as configured)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    options.peak_flops(p)
    options.names(p)
    options.reading(p)


def render(v, cross: dict | None, *, console) -> None:
    """Print the validation of one run (and the cross-run prediction) on ``console``: sentences, then the table."""
    from traceana.core.tables import cell as _fmt
    from traceana.core.tables import mib, plural, print_line, print_table

    s = v.summary
    mbs = plural(s["microbatches"], "micro-batch", "micro-batches")
    v_ = s.get("virtual_stages") or 1
    layout = f"pp {s['pp']}" + (f" ({s['pp'] * v_} stages, {v_} a rank)" if v_ > 1 else "")
    print_line(console, f"{s['run']}: {s['schedule']}, {layout}, {mbs}, attention {s['attention']}, "
               f"recompute {s['recompute']}, BPipe {'on' if s['bpipe'] else 'off'} "
               f"({plural(s['steps_used'], 'step')} measured)")
    print_line(console, "the model's prediction from this run's own durations (in sample: the simulator fed with "
               "them; a cross-run prediction uses none, --baseline):")
    print_line(console, f"step time: measured {s['measured_step_ms']:.1f} ms; predicted from mean durations "
               f"{s['simulated_step_ms']:.1f} ms, error {_fmt(s['step_error'], '+.1%')}; from durations drawn from "
               f"the measured ones {s['sampled_step_ms']:.1f} ms, error {_fmt(s['sampled_error'], '+.1%')}; from the "
               f"last step's own durations {_fmt(s['last_step_predicted_ms'], '.1f')} ms, error "
               f"{_fmt(s['last_step_error'], '+.1%')} (against that step)")
    headers = ["stage", "rank", "step ms\nmeasured", "step ms\npredicted", "step\nerror", "blocked ms\nmeasured",
               "blocked ms\npredicted", "blocked\nerror", "activation\npeak MiB", "estimate\nMiB", "memory\nerror"]
    rows = [[_fmt(r["stage"], "d"), str(r["rank"]), _fmt(r["measured_step_ms"], ",.1f"),
             _fmt(r["simulated_step_ms"], ",.1f"), _fmt(r["step_error"], "+.1%"), _fmt(r["measured_blocked_ms"], ",.1f"),
             _fmt(r["simulated_blocked_ms"], ",.1f"), _fmt(r["blocked_error"], "+.1%"),
             mib(r["measured_activation_bytes"]), mib(r["estimated_activation_bytes"]),
             _fmt(r["memory_error"], "+.1%")]
            for r in v.per_stage.iter_rows(named=True)]  # one row per stage: display only
    print_table(console, "Per stage: measured vs predicted (in sample)", headers, rows, keys=2,
                justify=["right"] * len(headers))
    for n in v.notes:
        print_line(console, n, prefix="note: ")
    if cross:
        render_cross(cross, console=console)


def render_cross(cross: dict, *, console) -> None:
    """The cross-run prediction: one statistic (each side's geometric mean of runs), one measured change with its
    between-run interval, the predicted change beside it; speed-ups are 1/(1 + change) of the same numbers."""
    from traceana.core.tables import cell as _fmt
    from traceana.core.tables import print_line

    how = "the baseline's measured what-if" if cross.get("measured_whatif") else "the model"
    runs = cross["noise_runs"]
    stat = (lambda n: "one run" if n == 1 else f"geometric mean of {n} runs")  # noqa: E731  (traceana.measure.noise)
    print_line(console, f"cross-run prediction by {how}, from the baseline's durations alone (none of this run's): "
               f"baseline {cross['baseline']} step {cross['baseline_step_ms']:.1f} ms "
               f"({stat(runs[0])}); predicted {cross['predicted_step_ms']:.1f} ms, measured "
               f"{cross['measured_step_ms']:.1f} ms ({stat(runs[1])}), error "
               f"{_fmt(cross['error'], '+.1%')}")
    print_line(console, f"{cross['measured_change_words']}; {cross['prediction_words']}")
    for n in cross.get("counted_once") or ():
        print_line(console, n, prefix="note: ")
    if cross.get("machine_note"):
        print_line(console, cross["machine_note"], prefix="note: ")


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze_run import load_and_analyze
    from traceana.validation import bpipe_verdict_from_run, cross_run, validate

    progress = not args.quiet and not args.json and sys.stderr.isatty()
    read = dict(peak_flops=args.peak_flops, workers=args.workers, cache=not args.no_cache, progress=progress,
                names=args.names, diagnose=False)  # (validate shows no straggler: it does not pay for the what-if)
    if args.repeat and not args.baseline:  # the noise floor is printed next to a prediction's error
        raise ConfigError("--repeat gives the between-run noise of a cross-run prediction, and there is none "
                          "without --baseline",
                          fix="add --baseline OTHER_RUN, or drop --repeat")
    analysis = load_and_analyze(str(args.run_dir), **read)
    v = validate(analysis)
    cross = None
    if args.baseline:
        repeat = tuple(load_and_analyze(str(r), **read) for r in args.repeat) if args.repeat else None  # in order
        cross = cross_run(load_and_analyze(str(args.baseline), **read), analysis, repeat=repeat)
    why_none = None
    try:
        verdict = bpipe_verdict_from_run(analysis, policy=args.bpipe_baseline)
    except AnalysisError as e:  # not a plain 1F1B run: a line says why there is no verdict, never silence
        verdict, why_none = None, e.what.removeprefix("no BPipe verdict for this run: ")
    if args.json:
        from traceana.commands.export import json_fractions

        print(json.dumps(json_fractions({
            "summary": v.summary, "per_stage": v.per_stage.to_dicts(), "notes": list(v.notes), "cross_run": cross,
            "bpipe": {"verdict": None, "why_none": why_none} if verdict is None else {
                "verdict": "helps" if verdict.helps else "does not help",
                "helps": verdict.helps, "speedup": verdict.speedup, "baseline": verdict.baseline,
                "deciding_term": verdict.deciding_term, "deltas_s": verdict.deltas,
                "flips": verdict.flips, "flip_notes": verdict.flip_notes,
                "sentence": verdict.sentence}}), indent=2, default=str))
    else:
        from traceana.core.tables import console as output_console
        from traceana.core.tables import print_line

        console = output_console()
        render(v, cross, console=console)
        print_line(console, verdict.sentence if verdict is not None else f"BPipe verdict: none — {why_none}")
    return 0
