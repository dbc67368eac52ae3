"""The comparison rule's calibration (traceana.measure.noise; docs/comparisons.md): simulated, and on real collections.

    .venv/bin/python tests/benchmarks/comparison_calibration.py simulate [--comparisons 4000]
    .venv/bin/python tests/benchmarks/comparison_calibration.py collect --out /tmp/traceana-calib [--pairs 10]
        [--rounds 3] [--forward-ms 20] [--backward-ms 40] [--pp 2] [--microbatches 4] [--effect 2]

``simulate`` prints the false "different" rate on identical configurations and the detection rate of a 2× change,
by rounds, under the simulated drifting heavy-tailed noise of tests/noise_simulation.py (the table in
docs/comparisons.md).

``collect`` runs the known workload (``traceana collect --work sleep --forward-ms F --backward-ms B``: each pass holds
a stated time, so two collections of one configuration differ only by the machine): ``--pairs`` comparisons of two
identical configurations A and B, each collected ``--rounds`` times interleaved (A B, B A, …:
traceana.measure.noise.round_order), then the rule on each comparison — how many were called different (the
false-positive rate, with its 95 % upper bound from the binomial). ``--effect K`` adds as many comparisons in which B's
passes hold K times as long (the detection rate). Runs already in --out are reused; the load (``os.getloadavg``) is
printed beside each figure, because the load, not the collector, sets the noise. Needs the ``--work sleep`` flag (branch
``workload``); without it this says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tests/: noise_simulation
sys.path.insert(0, str(HERE.parents[2]))  # the repository: traceana


def simulate(comparisons: int) -> None:
    from noise_simulation import NOISE, rates

    quiet = {"sigma": 0.08, "outlier_p": 0.05, "walk": 0.02, "trend": 0.01}
    print(f"noise (tests/noise_simulation.py): {NOISE}; quiet machine: {quiet}; {comparisons} comparisons per cell")
    print("| rounds | false 'different' (alternating) | (A B, A B) | 2× detected | ½× detected "
          "| quiet: false | quiet: 2× detected |")
    print("|---|---|---|---|---|---|---|")
    for r in (2, 3, 4, 5, 6, 8, 10, 12):
        fp = rates(r, comparisons, r, 1.0)[0]
        fp_ab = rates(r, comparisons, r, 1.0, alternate=False)[0]
        up = rates(100 + 2, comparisons, r, 2.0)[1]
        down = rates(100, comparisons, r, 0.5)[1]
        qfp = rates(300 + r, comparisons, r, 1.0, **quiet)[0]
        qup = rates(200 + 2, comparisons, r, 2.0, **quiet)[1]
        print(f"| {r} | {fp:.1%} | {fp_ab:.1%} | {up:.1%} | {down:.1%} | {qfp:.1%} | {qup:.1%} |")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[2])}
    return subprocess.run([sys.executable, "-m", "traceana", *args], capture_output=True, text=True, env=env)


def _collect(run: Path, a: argparse.Namespace, scale: float) -> Path:
    if (run / "run.json").exists():
        return run
    done = _cli("collect", "--pp", str(a.pp), "--microbatches", str(a.microbatches), "--steps", "3",
                "--work", "sleep", "--forward-ms", f"{a.forward_ms * scale:g}",
                "--backward-ms", f"{a.backward_ms * scale:g}", "-o", str(run))
    if done.returncode:
        sys.exit(f"collecting {run} failed: {done.stderr.strip().splitlines()[-1:]}")
    return run


def upper_95(k: int, n: int) -> float:
    """The exact (Clopper–Pearson) one-sided 95 % upper bound of a rate seen k times in n, by bisection."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        tail = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        lo, hi = (p, hi) if tail > 0.05 else (lo, p)
    return hi


def collect(a: argparse.Namespace) -> int:
    if "--work" not in _cli("collect", "--help").stdout:
        print("traceana collect has no --work sleep here (the known workload, branch workload): merge it first",
              file=sys.stderr)
        return 2
    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.measure.noise import between_runs, round_order

    out: Path = a.out
    kinds = [("same", 1.0)] + ([("effect", a.effect)] if a.effect else [])
    for kind, scale in kinds:
        called = []
        for p in range(a.pairs):
            steps: dict[str, list[float]] = {"A": [], "B": []}
            load = os.getloadavg()[0]
            for k, side in round_order(a.rounds, ("A", "B")):
                run = _collect(out / f"{kind}-{p}-{side}{k}", a, scale if side == "B" else 1.0)
                steps[side].append(load_and_analyze(run).summary.step_ms)
            c = between_runs(steps["A"], steps["B"])
            called.append(c.within_noise is False)
            print(f"{kind} pair {p}: A {' / '.join(f'{x:,.1f}' for x in steps['A'])} ms, "
                  f"B {' / '.join(f'{x:,.1f}' for x in steps['B'])} ms (load {load:.1f}): {c.words()}", flush=True)
        k, n = sum(called), len(called)
        if kind == "same":
            print(f"identical configurations: {k} of {n} pairs called different ({k / n:.0%}; 95 % upper bound "
                  f"{upper_95(k, n):.0%}), {a.rounds} rounds each")
        else:
            print(f"a real {scale:g}× change: detected in {k} of {n} pairs ({k / n:.0%}), {a.rounds} rounds each")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("simulate")
    s.add_argument("--comparisons", type=int, default=4000)
    c = sub.add_parser("collect")
    c.add_argument("--out", type=Path, default=Path("/tmp/traceana-calibration"))
    c.add_argument("--pairs", type=int, default=10)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--forward-ms", type=float, default=20.0)
    c.add_argument("--backward-ms", type=float, default=40.0)
    c.add_argument("--pp", type=int, default=2)
    c.add_argument("--microbatches", type=int, default=4)
    c.add_argument("--effect", type=float, default=None, help="also compare against B's passes K times as long")
    a = p.parse_args()
    if a.what == "simulate":
        simulate(a.comparisons)
        return 0
    return collect(a)


if __name__ == "__main__":
    sys.exit(main())
