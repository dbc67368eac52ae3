"""Cross-run predictions with their noise floor (docs/model.md, "Validation that predicts").

    .venv/bin/python tests/benchmarks/cross_run_table.py [--out /tmp/traceana-xrun] [--collect-only]

Collects tiny-gpt runs with the reference trainer (CPU, gloo; runs already in --out are reused), then predicts each
target from its baseline alone (no duration of the target is used) and prints the error next to the noise floor: the
same configuration collected twice (``*_again``), |step₁ − step₂| / mean.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RUNS = {
    "p2_1f1b_m4": dict(pp=2, num_microbatches=4, schedule="1f1b"),
    "p2_1f1b_m4_again": dict(pp=2, num_microbatches=4, schedule="1f1b"),
    "p2_gpipe_m4": dict(pp=2, num_microbatches=4, schedule="gpipe"),
    "p2_1f1b_m8": dict(pp=2, num_microbatches=8, schedule="1f1b"),
    "p2_1f1b_m4_full": dict(pp=2, num_microbatches=4, schedule="1f1b", recompute="full"),
    "p4_1f1b_m8": dict(pp=4, num_microbatches=8, schedule="1f1b"),
    "p4_1f1b_m8_again": dict(pp=4, num_microbatches=8, schedule="1f1b"),
    "p4_1f1b_m8_bpipe": dict(pp=4, num_microbatches=8, schedule="1f1b", bpipe=True),
    "p4_gpipe_m8": dict(pp=4, num_microbatches=8, schedule="gpipe"),
}
PAIRS = [  # (baseline, target, noise pair)
    ("p2_1f1b_m4", "p2_gpipe_m4", ("p2_1f1b_m4", "p2_1f1b_m4_again")),
    ("p2_gpipe_m4", "p2_1f1b_m4", ("p2_1f1b_m4", "p2_1f1b_m4_again")),
    ("p2_1f1b_m4", "p2_1f1b_m8", ("p2_1f1b_m4", "p2_1f1b_m4_again")),
    ("p2_1f1b_m4_full", "p2_1f1b_m4", ("p2_1f1b_m4", "p2_1f1b_m4_again")),
    ("p4_1f1b_m8", "p4_gpipe_m8", ("p4_1f1b_m8", "p4_1f1b_m8_again")),
    ("p4_1f1b_m8", "p4_1f1b_m8_bpipe", ("p4_1f1b_m8", "p4_1f1b_m8_again")),
]


def collect_all(out: Path) -> None:
    from collectors.launch import collect
    from collectors.trainer.config import CollectConfig

    for name, kw in RUNS.items():
        if not (out / name / "run.json").is_file():
            collect(CollectConfig(preset="tiny-gpt", microbatch_size=1, steps=3, warmup_steps=1, **kw), out / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/traceana-xrun"))
    ap.add_argument("--collect-only", action="store_true")
    args = ap.parse_args()
    collect_all(args.out)
    if args.collect_only:
        return
    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.validation import cross_run

    a = {name: load_and_analyze(args.out / name) for name in RUNS}
    print("| baseline → target | baseline ms | predicted ms | measured ms | error | noise floor | within |")
    print("|---|---|---|---|---|---|---|")
    for base, target, (n1, n2) in PAIRS:
        x = cross_run(a[base], a[target], repeat=(a[n1], a[n2]))
        ok = abs(x["error"]) <= (0.10 if a[target].run.manifest.pp <= 2 else 0.15) or \
            abs(x["error"]) <= 1.5 * x["noise_floor"]
        print(f"| {base} → {target} | {x['baseline_step_ms']:.0f} | {x['predicted_step_ms']:.0f} | "
              f"{x['measured_step_ms']:.0f} | {x['error']:+.1%} | {x['noise_floor']:.1%} | {'yes' if ok else 'no'} |")


if __name__ == "__main__":
    main()
