"""Compare the model with what a run measured: step time and bubble per stage from the simulator fed with the run's
own durations, activation memory per stage from the memory model, and (with --baseline) the prediction of this run
from another run's measurements (e.g. a BPipe run predicted from its plain 1F1B baseline)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="the run to validate (a directory with run.json and rank traces)")
    p.add_argument("--baseline", type=Path, help="predict RUN_DIR from this run's measurements and compare")
    p.add_argument("--repeat", type=Path, nargs=2, metavar=("RUN1", "RUN2"),
                   help="one configuration collected twice: the noise floor printed next to the prediction's error")
    p.add_argument("--bpipe-baseline", default="as-configured",
                   choices=("as-configured", "best-without-bpipe", "full-recompute"),
                   help="what the BPipe verdict compares with (default: the run as configured)")
    p.add_argument("--peak-flops", type=float, help="device peak FLOP/s (for MFU in the analysis)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def render(v, cross: dict | None) -> str:
    s = v.summary
    lines = [
        f"{s['run']}: {s['schedule']}, pp {s['pp']}, {s['microbatches']} micro-batches, attention {s['attention']}, "
        f"recompute {s['recompute']}, BPipe {'on' if s['bpipe'] else 'off'} ({s['steps_used']} steps measured)",
        "replay (fed with this run's own durations; not a prediction):",
        f"step time: measured {s['measured_step_ms']:.1f} ms, replayed with mean durations "
        f"{s['simulated_step_ms']:.1f} ms, "
        f"error {_fmt(s['step_error'], '+.1%')}; with durations drawn from the measured ones "
        f"{s['sampled_step_ms']:.1f} ms, error {_fmt(s['sampled_error'], '+.1%')}",
        f"replay of the last step with its own durations "
        f"{_fmt(s['replay_step_ms'], '.1f')} ms, error {_fmt(s['replay_error'], '+.1%')}",
        "",
        f"{'stage':>5} {'rank':>4} {'step ms':>8} {'sim ms':>8} {'err':>7} {'wait ms':>9} {'sim':>8} {'err':>7} "
        f"{'act MB':>8} {'est MB':>8} {'err':>7}",
    ]
    for r in v.per_stage.iter_rows(named=True):
        mb = lambda x: None if x is None else x / 1e6  # noqa: E731
        lines.append(
            f"{r['stage']:>5} {r['rank']:>4} {r['measured_step_ms']:>8.1f} {_fmt(r['simulated_step_ms'], '8.1f')} "
            f"{_fmt(r['step_error'], '+7.1%')} {r['measured_bubble_ms']:>9.1f} "
            f"{_fmt(r['simulated_bubble_ms'], '8.1f')} {_fmt(r['bubble_error'], '+7.1%')} "
            f"{_fmt(mb(r['measured_activation_bytes']), '8.1f')} {_fmt(mb(r['estimated_activation_bytes']), '8.1f')} "
            f"{_fmt(r['memory_error'], '+7.1%')}"
        )
    lines += ["", *(f"note: {n}" for n in v.notes)]
    if cross:
        lines += [
            "",
            f"prediction (no duration of this run used): baseline {cross['baseline']} measured "
            f"{cross['baseline_step_ms']:.1f} ms; predicted {cross['predicted_step_ms']:.1f} ms for this run, measured "
            f"{cross['measured_step_ms']:.1f} ms (error {_fmt(cross['error'], '+.1%')}"
            + ("" if cross.get("noise_floor") is None else f", noise floor {cross['noise_floor']:.1%}")
            + f"); speedup predicted {_fmt(cross['predicted_speedup'], '.3f')}×, "
            f"measured {_fmt(cross['measured_speedup'], '.3f')}×",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from traceana.analysis_cache import load_and_analyze
    from traceana.errors import AnalysisError
    from traceana.validation import bpipe_verdict_from_run, cross_run, validate

    analysis = load_and_analyze(args.run_dir, peak_flops=args.peak_flops)
    v = validate(analysis)
    cross = None
    if args.baseline:
        repeat = tuple(load_and_analyze(r, peak_flops=args.peak_flops) for r in args.repeat) if args.repeat else None
        cross = cross_run(load_and_analyze(args.baseline, peak_flops=args.peak_flops), analysis, repeat=repeat)
    try:
        verdict = bpipe_verdict_from_run(analysis, policy=args.bpipe_baseline)
    except AnalysisError:
        verdict = None  # not a plain 1F1B run: nothing to say about BPipe
    if args.json:
        print(json.dumps({"summary": v.summary, "per_stage": v.per_stage.to_dicts(), "notes": list(v.notes),
                          "cross_run": cross,
                          "bpipe": None if verdict is None else {
                              "helps": verdict.helps, "speedup": verdict.speedup, "baseline": verdict.baseline,
                              "deciding_term": verdict.deciding_term, "deltas_s": verdict.deltas,
                              "sentence": verdict.sentence}}, indent=2, default=str))
    else:
        print(render(v, cross) + ("" if verdict is None else "\n\n" + verdict.sentence))
    return 0
