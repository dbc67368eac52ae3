"""Collect a matrix of real CPU pipeline runs, validate the model on each, and print the whole table.

    .venv/bin/python tests/benchmarks/validation_matrix.py [--out /tmp/traceana-validation] [--recollect]

For every run: the simulator fed with the run's own measured durations vs the measured step time and per-stage
waiting (bubbles + exposed P2P), and the memory model's activation peak vs the measured one. Cross-run: measure a
baseline run, predict a target run (BPipe on, recompute off) from it alone, compare with the target's measurement.
Runs already in --out are reused (delete them or pass --recollect to measure again). Takes ~8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze
from traceana.validation import cross_run, validate

# name: (preset, pp, num_microbatches, schedule, attention, recompute, bpipe)
MATRIX = {
    "gpipe_pp2_m4": ("tiny-gpt", 2, 4, "gpipe", "naive", "none", False),
    "1f1b_pp2_m4": ("tiny-gpt", 2, 4, "1f1b", "naive", "none", False),
    "1f1b_pp2_m8_sdpa_sel": ("tiny-gpt", 2, 8, "1f1b", "sdpa", "selective", False),
    "gpipe_pp4_m8": ("tiny-gpt", 4, 8, "gpipe", "naive", "none", False),
    "gpipe_pp4_m4_sdpa": ("tiny-gpt", 4, 4, "gpipe", "sdpa", "none", False),
    "1f1b_pp4_m8": ("tiny-gpt", 4, 8, "1f1b", "naive", "none", False),
    "1f1b_pp4_m8_bpipe": ("tiny-gpt", 4, 8, "1f1b", "naive", "none", True),
    "1f1b_pp4_m8_full": ("tiny-gpt", 4, 8, "1f1b", "naive", "full", False),
    "1f1b_pp4_m8_sdpa": ("tiny-gpt", 4, 8, "1f1b", "sdpa", "none", False),
    "1f1b_pp4_m8_sdpa_bpipe": ("tiny-gpt", 4, 8, "1f1b", "sdpa", "none", True),
    "1f1b_pp4_m8_llama": ("tiny-llama", 4, 8, "1f1b", "naive", "none", False),
    "1f1b_pp4_m8_llama_bpipe": ("tiny-llama", 4, 8, "1f1b", "naive", "none", True),
}
CROSS = [  # (baseline, target): predict the target from the baseline's measurements
    ("1f1b_pp4_m8", "1f1b_pp4_m8_bpipe"),
    ("1f1b_pp4_m8_sdpa", "1f1b_pp4_m8_sdpa_bpipe"),
    ("1f1b_pp4_m8_llama", "1f1b_pp4_m8_llama_bpipe"),
    ("1f1b_pp4_m8_full", "1f1b_pp4_m8"),
]


def collect_all(out: Path, *, recollect: bool, steps: int) -> None:
    from collectors.launch import collect
    from collectors.trainer.config import CollectConfig

    for name, (preset, pp, m, schedule, attention, recompute, bpipe) in MATRIX.items():
        run_dir = out / name
        if (run_dir / "run.json").exists() and not recollect:
            continue
        t0 = time.time()
        cfg = CollectConfig(preset=preset, pp=pp, num_microbatches=m, schedule=schedule, attention=attention,
                            recompute=recompute, bpipe=bpipe, steps=steps)
        collect(cfg, run_dir)
        print(f"collected {name} in {time.time() - t0:.0f} s", file=sys.stderr)


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/traceana-validation"))
    ap.add_argument("--recollect", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per run (the first is dropped)")
    args = ap.parse_args()
    t0 = time.time()
    collect_all(args.out, recollect=args.recollect, steps=args.steps)
    t_collect = time.time() - t0
    analyses, rows = {}, []
    step_errors, wait_errors, mem_errors, sampled_errors, last_step_errors = [], [], [], [], []
    print("| run | schedule | pp | m | attention | recompute | BPipe | measured ms | simulated ms | step error | "
          "sampled error | last-step prediction error | wait error per stage | activation MB per stage (measured) | "
          "memory error per stage |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (preset, pp, m, schedule, attention, recompute, bpipe) in MATRIX.items():
        a = analyses[name] = analyze(load_run(args.out / name))
        v = validate(a)
        s, ps = v.summary, v.per_stage
        step_errors.append(abs(s["step_error"]))
        sampled_errors.append(abs(s["sampled_error"]))
        if s["last_step_error"] is not None:
            last_step_errors.append(abs(s["last_step_error"]))
        wait_errors += [abs(x) for x in ps["blocked_error"].drop_nulls().to_list()]
        mem_errors += [abs(x) for x in ps["memory_error"].drop_nulls().to_list()]
        rows.append(name)
        print(f"| {name} ({preset}) | {schedule} | {pp} | {m} | {attention} | {recompute} | {'on' if bpipe else 'off'} | "
              f"{s['measured_step_ms']:.0f} | {s['simulated_step_ms']:.0f} | {pct(s['step_error'])} | "
              f"{pct(s['sampled_error'])} | {pct(s['last_step_error'])} | "
              f"{' '.join(pct(x) for x in ps['blocked_error'].to_list())} | "
              f"{' '.join('—' if x is None else f'{x / 1e6:.2f}' for x in ps['measured_activation_bytes'].to_list())} | "
              f"{' '.join(pct(x) for x in ps['memory_error'].to_list())} |")
    print("\n| baseline → target | baseline ms | predicted ms | measured ms | error | predicted speedup | "
          "measured speedup | target/baseline F+B time per micro-batch |")
    print("|---|---|---|---|---|---|---|---|")
    cross_errors = []
    for base, target in CROSS:
        c = cross_run(analyses[base], analyses[target])
        cross_errors.append(abs(c["error"]))
        print(f"| {base} → {target} | {c['baseline_step_ms']:.0f} | {c['predicted_step_ms']:.0f} | "
              f"{c['measured_step_ms']:.0f} | {pct(c['error'])} | {c['predicted_speedup']:.3f}× | "
              f"{c['measured_speedup']:.3f}× | {c['compute_ratio']:.2f} |")
    print(f"\nmedian |step error| {statistics.median(step_errors):.1%} (max {max(step_errors):.1%}) over "
          f"{len(step_errors)} runs (means fed); sampled {statistics.median(sampled_errors):.1%} "
          f"(max {max(sampled_errors):.1%}); last-step prediction {statistics.median(last_step_errors):.1%} "
          f"(max {max(last_step_errors):.1%}); median |wait error| per stage {statistics.median(wait_errors):.1%}; "
          f"median |memory error| per stage {statistics.median(mem_errors):.1%} (max {max(mem_errors):.1%}); "
          f"median |cross-run error| {statistics.median(cross_errors):.1%}")
    print(f"collection {t_collect:.0f} s, analysis and validation {time.time() - t0 - t_collect:.0f} s")


if __name__ == "__main__":
    main()
