"""Ingest benchmark (prints figures; not a timed test).

    python tests/benchmarks/bench_ingest.py [--mb 200] [--rank-mb 50] [--ranks 8] [--dir /tmp/traceana-bench]

Every measurement runs in a fresh Python process, so its peak RSS (VmHWM) is that of the measured work alone (plus
the interpreter and imports, reported separately as the baseline); worker processes' peak is ``ru_maxrss`` of the
children:

1. one generated GPU-style trace of ``--mb`` MB of raw JSON: ``json.load`` (stdlib baseline), the raw decode limit
   (``msgspec.json.decode`` to Python objects: the fastest decoder here), and ``traceana`` ``read_trace``;
2. the same trace gzipped;
3. a ``--ranks``-rank run of ``--rank-mb`` MB per rank: ``load_run`` with 1 worker vs all cores (no cache), then
   uncached vs cached re-load.

Targets (issue 2 / issue 7): >= 100 MB/s per process, peak RSS <= 3.5x the raw JSON size, parallel ingest of 8 ranks
close to 2x one core on 2 cores, cached re-load much faster than the first load. Generated files are removed at the
end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_trace import write_trace  # noqa: E402

MEASURE = r"""
import json, resource, sys, time

def peak_kb():
    # VmHWM (this process's own high-water mark): ru_maxrss would include the parent's RSS inherited at fork.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

mode, path = sys.argv[1], sys.argv[2]
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
t_import = time.perf_counter()
import polars, msgspec  # noqa: F401  (same imports in every mode: the baseline RSS is comparable)
from traceana.ingest.kineto import read_trace
from traceana.ingest.run_dir import load_run
rss_imports = peak_kb()

def cpu_s():
    # CPU seconds of this process and its finished workers: steadier than wall time on a loaded machine.
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

c0 = cpu_s()
t0 = time.perf_counter()
if mode == "json.load":
    with open(path, "rb") as f:
        obj = json.load(f)
    n = len(obj["traceEvents"])
elif mode == "msgspec.decode":
    with open(path, "rb") as f:
        obj = msgspec.json.decode(f.read())
    n = len(obj["traceEvents"])
elif mode == "msgspec.validate":
    class Top(msgspec.Struct):
        traceEvents: list[msgspec.Raw] = []
    with open(path, "rb") as f:
        n = len(msgspec.json.decode(f.read(), type=Top).traceEvents)
elif mode == "gunzip":
    import gzip
    with gzip.open(path, "rb") as f:
        n = len(f.read())
elif mode == "read_trace":
    events, memory, row = read_trace(path)
    n = events.height + memory.height
elif mode == "load_run":
    run = load_run(path, **extra)
    n = run.events.height + run.memory.height
elif mode == "imports":
    n = 0
wall = time.perf_counter() - t0
cpu = cpu_s() - c0
print(json.dumps({"wall": wall, "cpu": cpu, "rows": n, "rss_kb": peak_kb(),
                  "children_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "imports_rss_kb": rss_imports}))
"""


def measure(mode: str, path: Path, extra: dict | None = None) -> dict:
    cmd = [sys.executable, "-c", MEASURE, mode, str(path)] + ([json.dumps(extra)] if extra else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(label: str, raw_bytes: int, r: dict, baseline_kb: int | None = None) -> str:
    mb = raw_bytes / 1e6
    rss_mb = r["rss_kb"] / 1024
    ratio = r["rss_kb"] * 1024 / raw_bytes
    net = "" if baseline_kb is None else f"  (net of imports {(r['rss_kb'] - baseline_kb) * 1024 / raw_bytes:4.2f}x)"
    kids = f"  workers' peak {r['children_rss_kb'] / 1024:7.0f} MB" if r.get("children_rss_kb") else ""
    return (f"  {label:<34} {r['wall']:7.2f} s  {mb / r['wall']:7.1f} MB/s  cpu {r['cpu']:6.2f} s "
            f"{mb / max(r['cpu'], 1e-9):6.1f} MB/cpu-s  peak RSS {rss_mb:7.0f} MB = {ratio:4.2f}x raw{net}{kids}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=200.0, help="size of the single trace (raw JSON MB)")
    p.add_argument("--rank-mb", type=float, default=50.0, help="raw JSON MB per rank of the multi-rank run")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--style", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--dir", type=Path, default=None, help="where to write generated traces (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated traces")
    p.add_argument("--skip", nargs="*", default=[], choices=["single", "gzip", "run"], help="parts to skip")
    a = p.parse_args()

    work = a.dir or Path(tempfile.mkdtemp(prefix="traceana-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; traces in {work}")
        base = measure("imports", work)
        print(f"interpreter + polars + msgspec + traceana imports: peak RSS {base['rss_kb'] / 1024:.0f} MB")

        if "single" not in a.skip or "gzip" not in a.skip:
            single = work / f"single_{a.style}.json"
            t = time.perf_counter()
            write_trace(single, mb=a.mb, style=a.style, rank=0, world_size=8)
            raw = single.stat().st_size
            print(f"\n[1] one {a.style}-style trace: {raw / 1e6:.0f} MB raw JSON (generated in "
                  f"{time.perf_counter() - t:.1f} s)")
        if "single" not in a.skip:
            jl = measure("json.load", single)
            ms = measure("msgspec.decode", single)
            mv = measure("msgspec.validate", single)
            rt = measure("read_trace", single)
            print(row("json.load (stdlib baseline)", raw, jl, base["rss_kb"]))
            print(row("msgspec.json.decode, untyped", raw, ms, base["rss_kb"]))
            print(row("msgspec validate+split only (limit)", raw, mv, base["rss_kb"]))
            print(row("traceana read_trace", raw, rt, base["rss_kb"]))
            print(f"  -> traceana: {jl['wall'] / rt['wall']:.1f}x faster than json.load, "
                  f"{ms['wall'] / rt['wall']:.1f}x faster than an untyped msgspec decode, "
                  f"{rt['wall'] / mv['wall']:.1f}x the time of a bare validate pass; {rt['rows']:,} rows")
            print(f"  -> in CPU time: {jl['cpu'] / rt['cpu']:.1f}x less than json.load, "
                  f"{ms['cpu'] / rt['cpu']:.1f}x less than an untyped msgspec decode, "
                  f"{rt['cpu'] / mv['cpu']:.1f}x a bare validate pass")

        if "gzip" not in a.skip:
            gz = work / f"single_{a.style}.json.gz"
            subprocess.run(["gzip", "-1", "-k", "-f", str(single)], check=True)
            print(f"\n[2] the same trace gzipped: {gz.stat().st_size / 1e6:.0f} MB on disk")
            print(row("gzip.open().read() (stdlib)", raw, measure("gunzip", gz)))
            print(row("traceana read_trace (.json.gz)", raw, measure("read_trace", gz), base["rss_kb"]))
            gz.unlink()
        if "single" not in a.skip or "gzip" not in a.skip:
            single.unlink()

        if "run" not in a.skip:
            run_dir = work / "run"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir.mkdir()
            for r in range(a.ranks):
                write_trace(run_dir / f"rank{r}.pt.trace.json", mb=a.rank_mb, style=a.style, rank=r,
                            world_size=a.ranks)
            raw = sum(f.stat().st_size for f in run_dir.glob("rank*"))
            print(f"\n[3] a {a.ranks}-rank run, {raw / 1e6:.0f} MB raw JSON in all")
            one = measure("load_run", run_dir, {"workers": 1, "cache": False})
            allc = measure("load_run", run_dir, {"workers": os.cpu_count(), "cache": False})
            print(row("load_run, 1 worker, no cache", raw, one))
            print(row(f"load_run, {os.cpu_count()} workers, no cache", raw, allc))
            print(f"  -> parallel speed-up {one['wall'] / allc['wall']:.2f}x on {os.cpu_count()} cores")
            first = measure("load_run", run_dir, {"cache": True})
            cached = measure("load_run", run_dir, {"cache": True})
            print(row("load_run, first (writes cache)", raw, first))
            print(row("load_run, cached", raw, cached))
            print(f"  -> cached re-load {first['wall'] / cached['wall']:.1f}x faster than the first load")
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
