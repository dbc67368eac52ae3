"""The ``traceana analyze`` command of one checkout against another's (a baseline), in fresh processes, interleaved,
best of N; and the floor under the fixed-cost target: starting Python, and starting it plus ``import polars``.

    .venv/bin/python tests/benchmarks/bench_cli.py --baseline /work/main -n 7 \\
        /work/bench/tiny_run /work/bench/hta_data/df_index_resolver /work/bench/hta_data/mtia_trace_single_rank

Each round runs every job once, in the same order (so a burst of load from other jobs hits every job alike), and
each job keeps its best wall time, best CPU seconds (user + system of the process and its threads, from
``wait4``) and smallest peak RSS over the rounds. ``traceana analyze RUN --no-cache --quiet`` is run through each
checkout's own ``.venv/bin/traceana``, with its output thrown away. Bytecode is compiled once, first, into a
scratch ``PYTHONPYCACHEPREFIX`` (nothing is written into either checkout), as an installed package has it.

The floor: ``python -c pass`` (the interpreter start) and ``python -c 'import polars'`` with the checkout's own
interpreter (``import polars`` as traceana's own process does it: after ``traceana`` has set polars' allocator
option, which changes nothing measurable here). Whatever traceana does comes on top of the second. Prints figures;
asserts nothing (benchmarks are not tests).
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
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", type=Path, help="run directories (or trace files) to analyse")
    p.add_argument("--baseline", type=Path, help="another checkout (with its .venv) to compare with")
    p.add_argument("-n", type=int, default=7, help="rounds (best of N)")
    a = p.parse_args()

    trees = {"this": HERE} | ({"baseline": a.baseline.resolve()} if a.baseline else {})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="traceana-bench-cli-")
    python = str(HERE / ".venv" / "bin" / "python")
    jobs: dict[str, list[str]] = {
        "python -c pass": [python, "-c", "pass"],
        "python -c 'import polars'": [python, "-c", "import polars"],
        "python -c 'import traceana, polars'": [python, "-c", "import traceana, polars"],
    }
    for run in a.runs:
        for tree, root in trees.items():
            jobs[f"{tree}: analyze {run.name}"] = [str(root / ".venv" / "bin" / "traceana"), "analyze", str(run),
                                                    "--no-cache", "--quiet"]
    for cmd in jobs.values():  # compile bytecode into the scratch prefix, and check that every job runs
        rc = measure(cmd, env)[3]
        if rc:
            sys.exit(f"{' '.join(cmd)}: exit status {rc}")
    best = {name: [float("inf"), float("inf"), float("inf")] for name in jobs}
    for _ in range(a.n):
        for name, cmd in jobs.items():
            for i, v in enumerate(measure(cmd, env)[:3]):
                best[name][i] = min(best[name][i], v)
    load = os.getloadavg()
    print(f"best of {a.n} rounds, interleaved; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"(wall times measure the queue for the CPU on a busy machine; CPU seconds much less so)")
    print(f"{'job':<48} {'wall s':>8} {'CPU s':>8} {'peak MiB':>9}")
    for name, (wall, cpu, rss) in best.items():
        print(f"{name:<48} {wall:8.3f} {cpu:8.3f} {rss:9.1f}")
    if a.baseline:
        print("this checkout against the baseline (wall, CPU):")
        for run in a.runs:
            t, b = best[f"this: analyze {run.name}"], best[f"baseline: analyze {run.name}"]
            print(f"  {run.name:<40} {t[0] / b[0]:.2f}x wall, {t[1] / b[1]:.2f}x CPU")


if __name__ == "__main__":
    main()
