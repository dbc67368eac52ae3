"""Print the paper-scale table of docs/model.md: per-stage memory, fit and BPipe verdicts on 80 GB GPUs.

    .venv/bin/python tests/benchmarks/model_paper_table.py [--sequence-parallel] [--device a100-80gb]

Everything is computed by traceana.model (memory per stage, simulator, BPipe verdict); nothing here is measured.
"""

from __future__ import annotations

import argparse

from traceana.model.bpipe import EfficiencyCurve, Network, bpipe_verdict, estimate_step
from traceana.model.config import TrainingConfig
from traceana.model.memory import estimate_stage_memory
from traceana.model.presets import DEVICES, MODELS

GiB = 2**30
SETUPS = [  # (preset, tp, pp, sequences per pipeline per step)
    ("gpt3-175b", 8, 8, 64),
    ("llama-65b", 8, 4, 64),
    ("llama2-70b", 8, 4, 64),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--device", default="a100-80gb")
    args = ap.parse_args()
    dev = DEVICES[args.device]
    curve = EfficiencyCurve()
    sp = args.sequence_parallel
    print(f"device {dev.name}: {dev.memory_bytes / GiB:.0f} GiB, {dev.peak_flops / 1e12:.0f} TFLOP/s; "
          f"sequence parallel {'on' if sp else 'off'}; 1F1B; bf16 mixed-precision Adam (16 B/param); no recompute\n")
    print("| model | tp×pp | b | m | attention | BPipe | stage memory GiB (0 … p−1) | max GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tp, pp, per_pipe in SETUPS:
        for att in ("naive", "sdpa"):
            for b in (1, 2, 4):
                for bp in (False, True):
                    cfg = TrainingConfig(model=MODELS[name], tp=tp, pp=pp, microbatch_size=b,
                                         num_microbatches=per_pipe // b, attention=att, bpipe=bp,
                                         sequence_parallel=sp)
                    mem = estimate_stage_memory(cfg)
                    tot = [m.total_bytes / GiB for m in mem]
                    fits = max(tot) <= dev.memory_bytes / GiB
                    print(f"| {MODELS[name].name} | {tp}×{pp} | {b} | {per_pipe // b} | {att} | "
                          f"{'on' if bp else 'off'} | {' '.join(f'{x:.0f}' for x in tot)} | {max(tot):.1f} | "
                          f"{'yes' if fits else '**no**'} |")
    for label, net in (("InfiniBand-class 25 GB/s", Network(bpipe_bytes_per_s=25e9)),
                       ("NVLink-class 300 GB/s", Network(bpipe_bytes_per_s=300e9)),
                       ("free (infinite bandwidth)", Network(bpipe_bytes_per_s=1e30))):
        print(f"\nBPipe transfers {label}, overlapped with compute:\n")
        print("| model | attention | best without BPipe | step s | best with BPipe | step s | speedup | "
              "Δ compute | Δ recompute | Δ bubble | Δ transfer | deciding | vs b=1 full recompute |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, tp, pp, per_pipe in SETUPS:
            for att in ("naive", "sdpa"):
                cfg = TrainingConfig(model=MODELS[name], tp=tp, pp=pp, microbatch_size=1, num_microbatches=per_pipe,
                                     attention=att, sequence_parallel=sp)
                v = bpipe_verdict(cfg, device=dev, curve=curve, network=net)
                wb = v.with_bpipe
                full = estimate_step(cfg.replace(recompute="full"), device=dev, curve=curve, network=net)
                d = v.deltas
                print(f"| {MODELS[name].name} | {att} | {v.reference.describe()} | {v.reference.step_s:.2f} | "
                      f"{wb.describe() if wb else '—'} | {wb.step_s if wb else float('nan'):.2f} | "
                      f"{v.speedup:.3f}× | {d.get('compute', 0):+.2f} | {d.get('recompute', 0):+.2f} | "
                      f"{d.get('bubble', 0):+.2f} | {d.get('transfer', 0):+.2f} | {v.deciding_term} | "
                      f"{full.step_s / wb.step_s if wb else float('nan'):.3f}× |")
    print("\nassumptions: " + "; ".join(v.assumptions[:1] + v.assumptions[2:]) + "; P2P 25 GB/s")


if __name__ == "__main__":
    main()
