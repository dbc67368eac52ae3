"""The fixed cost of a tiny ``traceana analyze`` against ``import polars``, measured in one run (issue 34, Build 6:
target ≤ 2× in time and in peak RSS).

    .venv/bin/python tests/benchmarks/bench_fixed_cost.py [RUN_DIR] [-n 9] [--baseline OTHER_CHECKOUT]

RUN_DIR defaults to the two-stage run of tests/tracebuilder.py (two ranks, a dozen events each: what is left is the
fixed cost). Each round runs every job once, in the same order, in a fresh process (so a burst of load hits every
job alike); each job keeps its best wall time, best CPU seconds (user + system of the process and its threads, from
``wait4``) and smallest peak RSS over the rounds. The jobs: ``python -c 'import polars'`` (the floor: what any
polars program pays), ``python -m traceana analyze RUN --no-cache --quiet`` (with the what-if's diagnosis, as
analyze prints it by default), the same with ``--no-whatif``, and with ``--baseline`` the first of those run from
another checkout (``PYTHONPATH`` set to it), for a before/after in the same loop. Bytecode is compiled once, first,
into a scratch ``PYTHONPYCACHEPREFIX``. Prints figures and the ratios; asserts nothing (benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", type=Path, help="run directory (default: tests/tracebuilder.py's two-stage run)")
    p.add_argument("-n", type=int, default=9, help="rounds (best of N)")
    p.add_argument("--baseline", type=Path, help="another checkout, its analyze run in the same loop")
    a = p.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="traceana-fixed-cost-"))
    run = a.run
    if run is None:
        sys.path.insert(0, str(HERE / "tests"))
        from tracebuilder import write_two_stage_run

        (scratch / "run").mkdir()
        run = write_two_stage_run(scratch / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    analyze = [sys.executable, "-m", "traceana", "analyze", str(run), "--no-cache", "--quiet"]
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        "import polars": ([sys.executable, "-c", "import polars"], env),
        "analyze": (analyze, env | {"PYTHONPATH": str(HERE)}),
        "analyze --no-whatif": ([*analyze, "--no-whatif"], env | {"PYTHONPATH": str(HERE)}),
    }
    if a.baseline:
        jobs["baseline: analyze"] = (analyze, env | {"PYTHONPATH": str(a.baseline.resolve())})
    for name, (cmd, e) in jobs.items():  # compile bytecode into the scratch prefix, and check that every job runs
        if measure(cmd, e)[3]:
            sys.exit(f"{name}: {' '.join(cmd)} failed (PYTHONPATH={e.get('PYTHONPATH')})")
    best = {name: [float("inf")] * 3 for name in jobs}
    for _ in range(a.n):
        for name, (cmd, e) in jobs.items():
            for i, v in enumerate(measure(cmd, e)[:3]):
                best[name][i] = min(best[name][i], v)
    load = os.getloadavg()
    print(f"{run}: best of {a.n} rounds, interleaved; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"({os.cpu_count()} CPUs; on a busy machine wall times measure the queue, CPU seconds much less)")
    floor = best["import polars"]
    print(f"{'job':<24} {'wall s':>7} {'CPU s':>7} {'peak MiB':>9}   {'÷ import polars: wall, CPU, RSS':>32}")
    for name, (wall, cpu, rss) in best.items():
        ratios = f"{wall / floor[0]:.2f}x  {cpu / floor[1]:.2f}x  {rss / floor[2]:.2f}x"
        print(f"{name:<24} {wall:7.3f} {cpu:7.3f} {rss:9.1f}   {ratios:>32}")
    cpu, rss = best["analyze"][1] / floor[1], best["analyze"][2] / floor[2]
    print(f"target ≤ 2x import polars (time and peak RSS): analyze {cpu:.2f}x CPU, {rss:.2f}x RSS — "
          f"{'met' if cpu <= 2 and rss <= 2 else 'not met'}")


if __name__ == "__main__":
    main()
