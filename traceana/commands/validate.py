"""Compare the model with what a run measured: step time and bubble per stage from the simulator fed with the run's
own durations, activation memory per stage from the memory model, and (with --baseline) the prediction of this run
from another run's measurements (e.g. a BPipe run predicted from its plain 1F1B baseline)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run to validate (a directory with run.json and rank traces)")
    p.add_argument("--baseline", type=Path, metavar="RUN_DIR",
                   help="predict RUN_DIR from this run's measurements and compare (default: no cross-run check)")
    p.add_argument("--repeat", type=Path, nargs=2, metavar=("RUN1", "RUN2"),
                   help="one configuration collected twice: the noise floor printed next to the prediction's error "
                        "(default: none)")
    p.add_argument("--bpipe-baseline", default="as-configured",
                   choices=("as-configured", "best-without-bpipe", "full-recompute"),
                   help="what the BPipe verdict compares with (as-configured: the run as configured)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    options.peak_flops(p)
    options.names(p)
    options.reading(p)


def render(v, cross: dict | None, *, console) -> None:
    """Print the validation of one run (and the cross-run prediction) on ``console``: sentences, then the table."""
    from traceana.tables import cell as _fmt
    from traceana.tables import mib, plural, print_line, print_table

    s = v.summary
    mbs = plural(s["microbatches"], "micro-batch", "micro-batches")
    v_ = s.get("virtual_stages") or 1
    layout = f"pp {s['pp']}" + (f" ({s['pp'] * v_} stages, {v_} a rank)" if v_ > 1 else "")
    print_line(console, f"{s['run']}: {s['schedule']}, {layout}, {mbs}, attention {s['attention']}, "
               f"recompute {s['recompute']}, BPipe {'on' if s['bpipe'] else 'off'} "
               f"({plural(s['steps_used'], 'step')} measured)")
    print_line(console, "replay (fed with this run's own durations; not a prediction):")
    print_line(console, f"step time: measured {s['measured_step_ms']:.1f} ms, replayed with mean durations "
               f"{s['simulated_step_ms']:.1f} ms, error {_fmt(s['step_error'], '+.1%')}; with durations drawn from "
               f"the measured ones {s['sampled_step_ms']:.1f} ms, error {_fmt(s['sampled_error'], '+.1%')}")
    print_line(console, f"replay of the last step with its own durations {_fmt(s['replay_step_ms'], '.1f')} ms, "
               f"error {_fmt(s['replay_error'], '+.1%')}")
    headers = ["stage", "rank", "step ms\nmeasured", "step ms\nreplayed", "step\nerror", "blocked ms\nmeasured",
               "blocked ms\nreplayed", "blocked\nerror", "activation\npeak MiB", "estimate\nMiB", "memory\nerror"]
    rows = [[_fmt(r["stage"], "d"), str(r["rank"]), _fmt(r["measured_step_ms"], ",.1f"),
             _fmt(r["simulated_step_ms"], ",.1f"), _fmt(r["step_error"], "+.1%"), _fmt(r["measured_blocked_ms"], ",.1f"),
             _fmt(r["simulated_blocked_ms"], ",.1f"), _fmt(r["blocked_error"], "+.1%"),
             mib(r["measured_activation_bytes"]), mib(r["estimated_activation_bytes"]),
             _fmt(r["memory_error"], "+.1%")]
            for r in v.per_stage.iter_rows(named=True)]  # one row per stage: display only
    print_table(console, "Per stage: measured vs replayed", headers, rows, keys=2, justify=["right"] * len(headers))
    for n in v.notes:
        print_line(console, n, prefix="note: ")
    if cross:
        noise = "" if cross.get("noise_floor") is None else f", noise floor {cross['noise_floor']:.1%}"
        how = " from the baseline's measured what-if" if cross.get("measured_whatif") else ""
        print_line(console, f"prediction{how} (no duration of this run used): baseline {cross['baseline']} "
                   f"measured "
                   f"{cross['baseline_step_ms']:.1f} ms; predicted {cross['predicted_step_ms']:.1f} ms for this run, "
                   f"measured {cross['measured_step_ms']:.1f} ms (error {_fmt(cross['error'], '+.1%')}{noise}); "
                   f"speed-up predicted {_fmt(cross['predicted_speedup'], '.3f')}×, measured "
                   f"{_fmt(cross['measured_speedup'], '.3f')}×")
        agrees = {True: "the predicted change lies inside that interval",
                  False: "the predicted change lies outside that interval",
                  None: "nothing to judge the prediction by"}[cross.get("prediction_within_noise")]
        over = "with the repeats on their side" if cross["noise_runs"] != [1, 1] else "these two runs"
        print_line(console, f"measured, {over}: {cross['measured_change_words']}; {agrees}")
        if cross.get("measured_change_words"):  # the measured change with its noise (traceana.noise)
            inside = {True: "inside", False: "outside", None: None}[cross.get("prediction_within_noise")]
            print_line(console, f"measured change: {cross['measured_change_words']}; predicted "
                       f"{1 / cross['predicted_speedup'] - 1:+.1%}"
                       + (f", {inside} the measured interval" if inside else ""))
        if cross.get("machine_note"):
            print_line(console, cross["machine_note"], prefix="note: ")


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze import load_and_analyze
    from traceana.errors import AnalysisError
    from traceana.validation import bpipe_verdict_from_run, cross_run, validate

    progress = not args.quiet and not args.json and sys.stderr.isatty()
    read = dict(peak_flops=args.peak_flops, workers=args.workers, cache=not args.no_cache, progress=progress,
                names=args.names)
    if args.repeat and not args.baseline:  # the noise floor is printed next to a prediction's error
        from traceana.errors import ConfigError

        raise ConfigError("--repeat gives the noise floor of a prediction, and there is none without --baseline",
                          fix="add --baseline OTHER_RUN, or drop --repeat")
    analysis = load_and_analyze(str(args.run_dir), **read)
    v = validate(analysis)
    cross = None
    if args.baseline:
        repeat = tuple(load_and_analyze(str(r), **read) for r in args.repeat) if args.repeat else None
        cross = cross_run(load_and_analyze(str(args.baseline), **read), analysis, repeat=repeat)
    why_none = None
    try:
        verdict = bpipe_verdict_from_run(analysis, policy=args.bpipe_baseline)
    except AnalysisError as e:  # not a plain 1F1B run: a line says why there is no verdict, never silence
        verdict, why_none = None, e.what.removeprefix("no BPipe verdict for this run: ")
    if args.json:
        from traceana.export import json_fractions

        print(json.dumps(json_fractions({
            "summary": v.summary, "per_stage": v.per_stage.to_dicts(), "notes": list(v.notes), "cross_run": cross,
            "bpipe": {"verdict": None, "why_none": why_none} if verdict is None else {
                "verdict": "helps" if verdict.helps else "does not help",
                "helps": verdict.helps, "speedup": verdict.speedup, "baseline": verdict.baseline,
                "deciding_term": verdict.deciding_term, "deltas_s": verdict.deltas,
                "flips": verdict.flips, "flip_notes": verdict.flip_notes,
                "sentence": verdict.sentence}}), indent=2, default=str))
    else:
        from traceana.tables import console as output_console
        from traceana.tables import print_line

        console = output_console()
        render(v, cross, console=console)
        print_line(console, verdict.sentence if verdict is not None else f"BPipe verdict: none — {why_none}")
    return 0
