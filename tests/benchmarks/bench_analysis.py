"""How much attribution adds on top of ingest, for an 8-rank run (target: at most +50%); and, with ``--cached RUN``,
first analysis vs cached re-analysis (target: the cached one ≥ 10× faster).

Generates an 8-rank run with tests/benchmarks/gen_trace.py (GPU/NCCL or CPU/gloo style) into a scratch folder outside the
repo, then times, in this process: ingest (``load_run`` without cache), and ``analyze`` on the loaded run. Prints
figures; asserts nothing (benchmarks are not tests).

    .venv/bin/python tests/benchmarks/bench_analysis.py --mb 25 --style cpu
    .venv/bin/python tests/benchmarks/bench_analysis.py --cached /work/runs/1f1b_pp4_bpipe --cached /tmp/gen_4x50

``--cached``: copies each run (its traces and run.json, no cache) into the scratch folder and runs, each in a fresh
subprocess (CPU seconds = user + system of that child, from ``getrusage(RUSAGE_CHILDREN)``, which a loaded machine
does not inflate the way it does wall time; ingest with one worker, whose CPU that count sees): the first analysis (``traceana analyze --json``: ingest, analysis,
both caches written), the re-analysis as it was before the analysis cache (ingest cache hit, analysis recomputed:
``.traceana/analysis`` removed), and the cached re-analysis (analysis cache hit).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_trace import write_trace  # noqa: E402

from traceana.ingest.run_dir import load_run  # noqa: E402
from traceana.measure.analysis import analyze  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--mb", type=float, default=25.0, help="raw JSON MB per rank")
    p.add_argument("--style", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--workers", type=int, default=None, help="ingest workers (default: automatic)")
    p.add_argument("--work", default="/tmp/traceana-bench-analysis", help="scratch folder for the generated run")
    p.add_argument("--repeat", type=int, default=2, help="best of N for each phase")
    p.add_argument("--run", help="measure this existing run directory instead of generating one (e.g. a collected "
                                 "pipeline run, whose P2P pairs and schedule are real)")
    p.add_argument("--cached", action="append", metavar="RUN", help="first vs cached analysis of this run (repeatable)")
    a = p.parse_args()
    if a.cached:
        for run in a.cached:
            bench_cached(Path(run), Path(a.work), a.repeat)
        return

    if a.run:
        run_dir = Path(a.run)
        print(f"run: {run_dir}")
    else:
        # gen_trace's ranks exchange messages in a ring, not a pipeline: pairing and schedule inference are
        # exercised (and refuse, with notes); use --run on a collected run for a pipeline's full path.
        run_dir = Path(a.work) / f"{a.style}_{a.ranks}x{a.mb:g}mb"
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for r in range(a.ranks):
            path = run_dir / f"rank{r}.pt.trace.json.gz"
            if not path.exists():
                write_trace(path, mb=a.mb, style=a.style, rank=r, world_size=a.ranks)
        print(f"run: {run_dir} ({a.ranks} ranks × {a.mb:g} MB raw, {a.style}); ready in "
              f"{time.perf_counter() - t0:.1f} s")

    ingest_s, analyze_s = [], []
    for _ in range(a.repeat):
        t = time.perf_counter()
        run = load_run(run_dir, workers=a.workers, cache=False)
        ingest_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        result = analyze(run)
        analyze_s.append(time.perf_counter() - t)
    ing, ana = min(ingest_s), min(analyze_s)
    print(f"events: {run.events.height:,}  steps: {result.steps.height}  p2p pairs: {result.p2p.height:,}  "
          f"schedule rows: {result.schedule.height:,}  segments: {result.segments.height:,}")
    print(f"ingest  (load_run, no cache): {ing:7.2f} s")
    print(f"analyze (attribution etc.):   {ana:7.2f} s   = +{100 * ana / ing:.0f}% on top of ingest (target ≤ +50%)")
    for n in result.notes:
        print(f"  note: {n}")


def _child(cmd: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def bench_cached(src: Path, work: Path, repeat: int) -> None:
    run_dir = work / f"cached_{src.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    size = 0
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, run_dir / f.name)
            size += f.stat().st_size
    # --workers 1: forkserver workers are not children this process reaps, so RUSAGE_CHILDREN would miss their CPU.
    cmd = [sys.executable, "-m", "traceana", "analyze", str(run_dir), "--json", "--workers", "1"]
    cache = run_dir / ".traceana"
    first, before, cached = [], [], []
    for _ in range(repeat):
        shutil.rmtree(cache, ignore_errors=True)
        first.append(_child(cmd))
        shutil.rmtree(cache / "analysis")
        before.append(_child(cmd))  # ingest cache only: what a re-analysis cost before the analysis cache
        cached.append(_child(cmd))  # analysis cache hit
    f, b, c = min(first), min(before), min(cached)  # best of N by CPU seconds
    load = os.getloadavg()[0]
    print(f"run: {src} ({size / 1e6:.1f} MB on disk; load average {load:.1f}; best of {repeat})")
    print(f"  first analysis (ingest + analysis, caches written): {f[0]:6.2f} CPU-s  wall {f[1]:6.2f} s")
    print(f"  re-analysis with the ingest cache only (before):    {b[0]:6.2f} CPU-s  wall {b[1]:6.2f} s  "
          f"= {f[0] / b[0]:.1f}x faster than first")
    print(f"  cached re-analysis (analysis cache hit):            {c[0]:6.2f} CPU-s  wall {c[1]:6.2f} s  "
          f"= {f[0] / c[0]:.1f}x faster than first (target ≥ 10x)")


if __name__ == "__main__":
    main()
