"""The fixed cost of a tiny ``traceana analyze`` against ``import polars``, measured in one run (issue 34, Build 6:
target ≤ 2× in time and in peak RSS).

    .venv/bin/python tests/benchmarks/bench_fixed_cost.py [RUN_DIR ...] [-n 9] [--baseline OTHER_CHECKOUT]

RUN_DIR defaults to the two-stage run of tests/tracebuilder.py (two ranks, a dozen events each: what is left is the
fixed cost). Each round runs every job once, in the same order, in a fresh process (so a burst of load hits every
job alike); each job records its wall time, CPU seconds (user + system of the process and its threads, from
``wait4``) and peak RSS in every round, and the ratios to ``import polars`` are taken round by round (a job over the
same round's ``import polars``), then summarised as median and range. The jobs: ``python -c 'import polars'`` (the floor: what any
polars program pays), ``python -m traceana analyze RUN --no-cache --quiet`` (with the what-if's diagnosis, as
analyze prints it by default), the same with ``--no-whatif``, with ``--cached`` a repeated analyze of a copy of
the run (its analysis cache warm: what a second look at a run costs), and with ``--baseline`` the first of those run from
another checkout (``PYTHONPATH`` set to it), for a before/after in the same loop. Bytecode is compiled once, first,
into a scratch ``PYTHONPYCACHEPREFIX``. Prints figures and the ratios; asserts nothing (benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MiB, exit status) of one run of ``cmd``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    return (time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
            os.waitstatus_to_exitcode(status))


def _stats(xs: list[float]) -> tuple[float, float, float]:
    """(best, median, worst) of the samples."""
    xs = sorted(xs)
    return xs[0], statistics.median(xs), xs[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", type=Path,
                   help="run directories (default: tests/tracebuilder.py's two-stage run); each gets its own jobs "
                        "in the same interleaved rounds")
    p.add_argument("-n", type=int, default=9, help="rounds")
    p.add_argument("--baseline", type=Path, help="another checkout, its analyze run in the same loop")
    p.add_argument("--cached", action="store_true",
                   help="also a repeated analyze of a copy of each run, its analysis cache warm (a hit)")
    a = p.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="traceana-fixed-cost-"))
    runs = list(a.runs)
    if not runs:
        sys.path.insert(0, str(HERE / "tests"))
        from tracebuilder import write_two_stage_run

        (scratch / "run").mkdir()
        runs = [write_two_stage_run(scratch / "run")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        "import polars": ([sys.executable, "-c", "import polars"], env)}
    for i, run in enumerate(runs):
        tag = f"[{i}] " if len(runs) > 1 else ""
        analyze = [sys.executable, "-m", "traceana", "analyze", str(run), "--no-cache", "--quiet"]
        jobs[f"{tag}analyze"] = (analyze, env | {"PYTHONPATH": str(HERE)})
        jobs[f"{tag}analyze --no-whatif"] = ([*analyze, "--no-whatif"], env | {"PYTHONPATH": str(HERE)})
        if a.cached:  # a copy of the run, its analysis cached by the check below: every round a hit
            copy = scratch / f"cached{i}"
            shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".traceana"))
            jobs[f"{tag}analyze, cache hit"] = ([sys.executable, "-m", "traceana", "analyze", str(copy), "--quiet"],
                                                env | {"PYTHONPATH": str(HERE)})
        if a.baseline:
            jobs[f"{tag}baseline: analyze"] = (analyze, env | {"PYTHONPATH": str(a.baseline.resolve())})
            if a.cached:  # its own copy: an entry of one checkout is not the other's (the tool version is in its key)
                copy = scratch / f"cached{i}-baseline"
                shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".traceana"))
                jobs[f"{tag}baseline: cache hit"] = (
                    [sys.executable, "-m", "traceana", "analyze", str(copy), "--quiet"],
                    env | {"PYTHONPATH": str(a.baseline.resolve())})
    for name, (cmd, e) in jobs.items():  # compile bytecode into the scratch prefix, and check that every job runs
        if measure(cmd, e)[3]:
            sys.exit(f"{name}: {' '.join(cmd)} failed (PYTHONPATH={e.get('PYTHONPATH')})")
    samples: dict[str, list[list[float]]] = {name: [[], [], []] for name in jobs}
    loads = [os.getloadavg()[0]]
    for _ in range(a.n):
        for name, (cmd, e) in jobs.items():
            for i, v in enumerate(measure(cmd, e)[:3]):
                samples[name][i].append(v)
        loads.append(os.getloadavg()[0])
    for i, run in enumerate(runs):
        print(f"[{i}] {run}" if len(runs) > 1 else run)
    print(f"{a.n} rounds, interleaved; 1-minute load average {min(loads):.1f}–{max(loads):.1f} "
          f"({os.cpu_count()} CPUs; on a busy machine wall times measure the queue, CPU seconds much less)")
    print(f"{'job':<28} {'wall s best/median/worst':>25} {'CPU s best/median/worst':>25} {'peak MiB median (range)':>25}")
    for name, (wall, cpu, rss) in samples.items():
        w, c, r = _stats(wall), _stats(cpu), _stats(rss)
        print(f"{name:<28} {w[0]:7.3f} {w[1]:7.3f} {w[2]:7.3f}   {c[0]:7.3f} {c[1]:7.3f} {c[2]:7.3f}   "
              f"{r[1]:7.1f} ({r[0]:.1f}–{r[2]:.1f})")
    floor = samples["import polars"]
    print("÷ import polars (each round's job over the same round's import polars; median, and range over rounds):")
    print(f"{'job':<28} {'wall':>20} {'CPU':>20} {'peak RSS':>20}")
    verdicts = []
    for name, metrics in samples.items():
        if name == "import polars":
            continue
        cols = []
        med = []
        for m, f in zip(metrics, floor):
            lo, md, hi = _stats([x / y for x, y in zip(m, f)])
            cols.append(f"{md:.2f}x ({lo:.2f}–{hi:.2f})")
            med.append(md)
        print(f"{name:<28} {cols[0]:>20} {cols[1]:>20} {cols[2]:>20}")
        if name.split("] ")[-1] == "analyze":
            verdicts.append(f"{name}: {med[1]:.2f}x CPU, {med[0]:.2f}x wall, {med[2]:.2f}x RSS — "
                            f"{'met' if med[1] <= 2 and med[2] <= 2 else 'not met'}")
    print("target ≤ 2x import polars (time and peak RSS; medians of the per-round ratios):")
    for v in verdicts:
        print("  " + v)


if __name__ == "__main__":
    main()
