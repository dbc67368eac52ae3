"""Reproduce the BPipe re-evaluation with the model, and write the table into docs/model.md.

    .venv/bin/python tests/benchmarks/model_paper_table.py            # print the table
    .venv/bin/python tests/benchmarks/model_paper_table.py --write    # and replace it in docs/model.md

Paper-like settings (Kim et al. 2023, BPipe; Huang et al. 2024, arXiv 2401.02088): A100 80 GB, tp 8, pp 4–8,
sequence length 2048, 64 sequences per pipeline per step, bf16 mixed-precision Adam, 1F1B. Everything is computed by
traceana.model (memory per stage, simulator, ``bpipe_verdict``); nothing here is measured. tests/test_model_paper.py
asserts the three qualitative findings the table shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

from traceana.manifest import ModelShape
from traceana.model.bpipe import BASELINES, EfficiencyCurve, Network, bpipe_verdict
from traceana.model.config import TrainingConfig
from traceana.model.presets import DEVICES, MODELS

DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"
BEGIN, END = "<!-- paper-table:begin -->", "<!-- paper-table:end -->"
SEQ = 2048
SEQUENCES_PER_PIPELINE = 64
# GPT-3-like shapes of the BPipe paper's 96B and 134B sizes, heads of 128 and divisible by tp 8 (12·L·h² ≈ 95.6e9
# and 134.0e9 parameters in the blocks).
GPT_96B = ModelShape("gpt", layers=76, hidden=10240, heads=80, vocab=50257, seq=SEQ, name="GPT 96B-like")
GPT_134B = ModelShape("gpt", layers=88, hidden=11264, heads=88, vocab=50257, seq=SEQ, name="GPT 134B-like")
SETTINGS = [  # (shape, tp, pp)
    (MODELS["gpt3-175b"], 8, 8),
    (GPT_134B, 8, 6),
    (GPT_96B, 8, 4),
    (MODELS["llama-65b"], 8, 4),
    (dataclasses.replace(MODELS["llama2-70b"], seq=SEQ), 8, 4),
]
LINKS = (("25 GB/s", 25e9), ("300 GB/s", 300e9))
RESERVE_GIB = 2.0  # kept free on every GPU: CUDA context, allocator slack, NCCL buffers


def config(shape: ModelShape, tp: int, pp: int, attention: str) -> TrainingConfig:
    return TrainingConfig(model=shape, tp=tp, pp=pp, microbatch_size=1, num_microbatches=SEQUENCES_PER_PIPELINE,
                          attention=attention)


def verdicts(shape: ModelShape, tp: int, pp: int, attention: str, *, baseline: str, link: float):
    return bpipe_verdict(config(shape, tp, pp, attention), device=DEVICES["a100-80gb"], curve=EfficiencyCurve(),
                         network=Network(bpipe_bytes_per_s=link), baseline=baseline, reserve_bytes=RESERVE_GIB * 2**30)


def table() -> str:
    out = [
        "| model | tp×pp | attention | baseline | baseline config | s | BPipe config (best at 300 GB/s) | s | speedup 25 GB/s | "
        "deciding | speedup 300 GB/s | deciding |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    whys = []
    for shape, tp, pp in SETTINGS:
        for att in ("naive", "sdpa"):
            for baseline in ("full-recompute", "best-without-bpipe"):
                slow, fast = (verdicts(shape, tp, pp, att, baseline=baseline, link=x) for _, x in LINKS)
                b = fast.with_bpipe
                out.append(
                    f"| {shape.name} | {tp}×{pp} | {'flash' if att == 'sdpa' else 'naive'} | {baseline} | "
                    f"{fast.reference.describe()} | {fast.reference.step_s:.2f} | "
                    f"{b.describe() if b else '—'} | {b.step_s if b else float('nan'):.2f} | "
                    f"{slow.speedup:.3f}× | {slow.deciding_term} | {fast.speedup:.3f}× | {fast.deciding_term} |")
        whys.append(f"- {fast.why}")
    return "\n".join([
        f"A100-SXM4-80GB (80 GiB, {RESERVE_GIB:g} GiB of it reserved; 312 TFLOP/s), seq 2048, 64 sequences per pipeline per step, 1F1B, bf16 "
        "mixed-precision Adam, no sequence parallelism; compute efficiency E(b) assumed (0.6·n/(n + 512), n = b·s "
        "tokens); BPipe transfers overlapped. Baselines: " + "; ".join(
            f"**{k}** — {v}" for k, v in BASELINES.items() if k != "as-configured") + ".",
        "", *out, "", "Why, in numbers (the memory model at b = 1):", "", *whys])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help=f"replace the table between the markers in {DOC.name}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    text = table()
    print(text)
    print(f"\n({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.write:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"{DOC}: no {BEGIN} … {END} markers; add them where the table goes")
        DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END),
                              lambda _: f"{BEGIN}\n{text}\n{END}", doc, flags=re.S))


if __name__ == "__main__":
    main()
