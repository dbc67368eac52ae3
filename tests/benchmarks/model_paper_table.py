"""Reproduce the BPipe re-evaluation through the CLI, and write the table into docs/model.md.

    .venv/bin/python tests/benchmarks/model_paper_table.py            # print the table
    .venv/bin/python tests/benchmarks/model_paper_table.py --write    # and replace it in docs/model.md

Paper-like settings (Kim et al. 2023, BPipe; Huang et al. 2024, arXiv 2401.02088): A100 80 GB, tp 8, pp 4–8,
sequence length 2048, 64 sequences per pipeline per step, bf16 mixed-precision Adam, 1F1B. Every figure is what
``traceana estimate … --json`` prints for the command line shown with the row, at the CLI's defaults (the reserve
included) unless the row says otherwise; nothing here is measured. tests/model/test_model_paper.py asserts the findings
the table shows, with their conditions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path

from traceana.cli import main as cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"
BEGIN, END = "<!-- paper-table:begin -->", "<!-- paper-table:end -->"
# GPT-3-like shapes of the BPipe paper's 96B and 134B sizes, heads of 128 and divisible by tp 8 (12·L·h² ≈ 95.6e9
# and 134.0e9 parameters in the blocks).
SETTINGS = [  # (label, model flags, pp)
    ("GPT-3 175B", ["--model", "gpt3-175b"], 8),
    ("GPT 134B-like", ["--family", "gpt", "--layers", "88", "--hidden", "11264", "--heads", "88", "--vocab", "50257",
                       "--seq", "2048"], 6),
    ("GPT 96B-like", ["--family", "gpt", "--layers", "76", "--hidden", "10240", "--heads", "80", "--vocab", "50257",
                      "--seq", "2048"], 4),
    ("LLaMA-65B", ["--model", "llama-65b"], 4),
    ("Llama-2-70B", ["--model", "llama2-70b", "--seq", "2048"], 4),
]
LINKS = (25, 300)  # GB/s: one InfiniBand HDR port; NVLink-class
RESERVES = (2, 4, 6, 8, 10)  # GiB, for the sensitivity grid (8 is the default: 10 % of 80 GiB)


def argv(model: list[str], pp: int, attention: str, *, baseline: str, link: float, reserve: float | None = None):
    return ["estimate", *model, "--tp", "8", "--pp", str(pp), "--microbatch-size", "1", "--microbatches", "64",
            "--attention", attention, "--bpipe-baseline", baseline, "--bpipe-gbps", f"{link:g}",
            *([] if reserve is None else ["--reserve-gib", f"{reserve:g}"]), "--json"]


def estimate(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if cli(args) != 0:
            sys.exit(f"traceana {' '.join(args)} failed")
    return json.loads(out.getvalue())


def gib(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**30:.1f}"


def table() -> str:
    out = [
        "| model | tp×pp | attention | baseline | baseline config | s | BPipe config (best at 300 GB/s) | s | "
        "speedup 25 GB/s | speedup 300 GB/s | deciding | margin GiB | flips at reserve GiB | flips at link GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    grid = ["| model | attention | " + " | ".join(f"reserve {r} GiB" for r in RESERVES) + " |",
            "|---|---|" + "---|" * len(RESERVES)]
    whys, device, assumptions = [], None, None
    for label, model, pp in SETTINGS:
        for att in ("naive", "sdpa"):
            for baseline in ("full-recompute", "best-without-bpipe"):
                slow, fast = (estimate(argv(model, pp, att, baseline=baseline, link=x)) for x in LINKS)
                b, f = fast["bpipe"], fast["bpipe"]["flips"]
                device = device or fast["device"]
                assumptions = assumptions or b["assumptions"]
                out.append(
                    f"| {label} | 8×{pp} | {'flash' if att == 'sdpa' else 'naive'} | {baseline} | {b['reference']} | "
                    f"{b['reference_step_s']:.2f} | {b['with_bpipe'] or '—'} | {_bpipe_s(fast)} | "
                    f"{_x(slow['bpipe'])} | {_x(b)} | {b['deciding_term']} | {gib(b['margin_bytes'])} | "
                    f"{gib(f['reserve_bytes'])} | "
                    f"{'—' if f['bpipe_bytes_per_s'] is None else format(f['bpipe_bytes_per_s'] / 1e9, ',.0f')} |")
            speed = [estimate(argv(model, pp, att, baseline="full-recompute", link=300, reserve=r))["bpipe"]
                     for r in RESERVES]
            grid.append(f"| {label} | {'flash' if att == 'sdpa' else 'naive'} | "
                        + " | ".join(_x(v) for v in speed) + " |")
        whys.append(f"- {label}: " + fast["bpipe"]["why"].split(": ", 1)[1])
    usable, reserve = device["memory_bytes"], device["reserve_bytes"]
    flags = "`traceana estimate MODEL --tp 8 --pp P --microbatch-size 1 --microbatches 64 --attention A " \
            "--bpipe-baseline B --bpipe-gbps 25|300 --json`"
    return "\n".join([
        f"Made with {flags} (every other flag at its default). {device['name']}: {gib(usable + reserve)} GiB, "
        f"{gib(reserve)} GiB of it kept free (the default reserve: 10 %), {device['peak_flops'] / 1e12:g} TFLOP/s; "
        "seq 2048, 64 sequences per pipeline per step, 1F1B, bf16 mixed-precision Adam, no sequence parallelism. "
        "Assumptions: " + "; ".join(a for a in assumptions if not a.startswith(("device memory", "baseline:", "P2P")))
        + "; P2P 25 GB/s. Speed-ups are against the baseline; "
        "* marks a verdict where the baseline does not fit without BPipe (BPipe helps by making it fit). "
        "**margin**: the deciding configuration's distance to the fit line at the default reserve (negative: short "
        "by that much); **flips at**: the reserve and the BPipe link bandwidth (at 300 GB/s's fit) at which the "
        "300 GB/s verdict turns over (— none within reach).",
        "", *out, "",
        "Sensitivity to the reserve (speed-up against full-recompute at 300 GB/s; the link's is the last column "
        "above):", "", *grid, "", "Why, in numbers (the memory model at b = 1, the default reserve):", "", *whys])


def _x(b: dict) -> str:
    star = "" if b.get("fits_without_bpipe", True) else "*"
    return f"{b['speedup']:.3f}×{star}" + (" ✓" if b["helps"] else "")


def _bpipe_s(out: dict) -> str:
    s = out["bpipe"]["with_bpipe_step_s"]
    return "—" if s is None else f"{s:.2f}"


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
