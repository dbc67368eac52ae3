"""The measured step's graph built one pipeline group a task (causal.group_graph) against one process, same run.

Two children, one after the other, each a process of its own so each peak is its own (Linux VmHWM):

- ``one``: ``load_run`` (no cache, ``workers=1``), ``analyze``, ``graph.build`` — every rank's events in one process;
- ``groups``: ``group_graph.analyze_with_graph`` with the builtin ``map`` — the partitioned analysis' rounds (one
  rank, then one pipeline group at a time, ``measure.partitioned``), each group task building its part of the
  graph while it holds that group's events, then the parts assembled. With ``--dask`` the tasks run on a cluster
  and this process holds only the results; here they run in the child itself, one after another, so its peak is
  one group's working set plus the results.

Prints each child's CPU seconds, wall seconds and peak RSS, the ratios groups / one, and whether both built the same
graph (ops, edges, ranks hashed after sorting). Asserts nothing (benchmarks are not tests); the machine's load is
printed beside the figures (CPU seconds are the figure to compare on a shared machine).

    .venv/bin/python tests/benchmarks/bench_group_graph.py /work/bigmem_runs/r1024
    .venv/bin/python tests/benchmarks/bench_group_graph.py RUN_16K --modes groups --max-mib 16000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from guarded_child import run_guarded

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import hashlib, json, sys, tempfile, time, warnings
warnings.simplefilter("ignore")
def peak():
    for ln in open("/proc/self/status"):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) / 1024
def digest(g):
    parts = [f.sort(f.columns, nulls_last=True).write_csv() for f in (g.ops, g.edges, g.ranks)]
    return hashlib.sha1("".join(parts).encode()).hexdigest()[:16]
mode, run, out = sys.argv[1], sys.argv[2], sys.argv[3]
c0, t0 = time.process_time(), time.perf_counter()
from traceana.causal import graph, group_graph
if mode == "one":
    from traceana.ingest.run_dir import load_run
    from traceana.measure.analysis import analyze
    g = graph.build(analyze(load_run(run, cache=False, workers=1)))  # (one process: its CPU and peak are its own)
else:
    _, g = group_graph.analyze_with_graph(run, out)
    if not isinstance(g, graph.StepGraph):
        raise SystemExit(f"refused: {g.what}")
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0, "peak_mib": peak(),
                  "ops": g.ops.height, "hash": digest(g)}))
'''


def child(mode: str, run: Path, out: Path, max_mib: float | None) -> dict | None:
    """One mode in a process of its own; None where it passed ``max_mib`` of RSS (killed: the machine is shared)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code, stdout, stderr, killed = run_guarded([sys.executable, "-c", CHILD, mode, str(run), str(out)], env=env,
                                               max_mib=max_mib, poll_s=0.5)
    if killed is not None:
        print(f"  {mode}: killed at {killed:,.0f} MiB RSS (over --max-mib {max_mib:,.0f})")
        return None
    if code:
        raise SystemExit(f"{mode}: {stderr.strip().splitlines()[-1] if stderr.strip() else code}")
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--modes", default="one,groups", help="which children to run, in order (default: one,groups)")
    ap.add_argument("--max-mib", type=float, default=None, help="kill a child whose RSS passes this")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_group_graph") as tmp:
        res = {m: child(m, args.run_dir, Path(tmp) / "parts", args.max_mib) for m in args.modes.split(",")}
    load1 = os.getloadavg()[0]
    ops = next((r["ops"] for r in res.values() if r), None)
    print(f"{args.run_dir}: {ops or 0:,} operations; load average {load0:.1f} → {load1:.1f} on "
          f"{os.cpu_count()} cores")
    for m, r in res.items():
        if r:
            print(f"  {m:6s}  {r['cpu_s']:7.1f} CPU-s  {r['wall_s']:7.1f} s wall  peak {r['peak_mib']:8,.0f} MiB")
    one, grp = res.get("one"), res.get("groups")
    if one and grp:
        print(f"  groups / one: CPU {grp['cpu_s'] / one['cpu_s']:.2f}x, peak {grp['peak_mib'] / one['peak_mib']:.2f}x; "
              f"same graph: {one['hash'] == grp['hash']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
