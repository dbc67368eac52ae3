"""First analysis of a run of many small rank files, against the same analysis with ``--no-cache`` and the cached
re-analysis (issue 29 item 9: writing the ingest cache must grow linearly with the ranks; before, every rank's
cache write listed the whole ingest folder, N² in all: 5,000 small ranks took 131–137 s first against 36 s with
``--no-cache``).

Writes N rank files (tests/tracebuilder.py: one ProfilerStep, a few CPU ops each, plain JSON, ~2 KB) into a scratch
folder, then times three fresh ``traceana analyze --json --quiet`` processes: ``--no-cache``, the first analysis
(both caches written), the cached re-analysis. Wall seconds and CPU seconds (user + system of the child, from
``getrusage(RUSAGE_CHILDREN)``: less inflated by a loaded machine than wall time). Prints figures; asserts nothing.

    .venv/bin/python tests/benchmarks/bench_many_ranks.py --ranks 5000 [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
ROOT = HERE.parent.parent


def write_run(d: Path, n: int) -> None:
    from tracebuilder import TraceBuilder

    d.mkdir(parents=True, exist_ok=True)
    for r in range(n):
        tb = TraceBuilder(rank=r, world_size=n, pid=r, tid=r)
        tb.step(1, 0, 100)
        for i in range(4):
            tb.cpu_op("aten::mm", 2 + 20 * i, 15)
        tb.write(d / f"rank{r}.pt.trace.json")


def timed(args: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "traceana", *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="many-ranks-") as tmp:
        run = Path(tmp) / "run"
        write_run(run, args.ranks)
        size = sum(p.stat().st_size for p in run.iterdir())
        print(f"{args.ranks} ranks, {size / 1e6:.1f} MB of JSON")
        for i in range(args.repeat):
            shutil.rmtree(run / ".traceana", ignore_errors=True)
            for label, extra in (("--no-cache", ["--no-cache"]), ("first (caches written)", []),
                                 ("cached re-analysis", [])):
                wall, cpu = timed(["analyze", str(run), "--json", "--quiet", *extra])
                print(f"  [{i}] {label:24s} wall {wall:7.1f} s   CPU {cpu:7.1f} s")


if __name__ == "__main__":
    main()
