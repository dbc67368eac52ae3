"""The diagnosis' what-if on a big run, its variants replayed in one process and one pipeline group a task
(traceana.causal.group_replay), each side in a child process of its own (its peak RSS alone), alternating.

Each child reads the run's analysis from the cache (``--prepare`` writes it first), builds the graph, replays the
measured steps on the engine and runs the diagnosis' what-if (``whatif(full=False, candidates=...)``, as
``diagnosis.named_by_whatif`` does, its ``WHATIF_MAX_OPERATIONS`` cap not applied) with ``per_group`` None or the
builtin ``map``. Prints per child and stage the wall and CPU seconds, the peak RSS so far and the stage's own (Linux:
VmHWM, reset through /proc/self/clear_refs after each stage, which resets the child's maximum RSS that
``/usr/bin/time -v`` reports too: that is then the last stage's), the load average beside, and
whether both modes give the same what-if tables. Asserts nothing (benchmarks are not tests).

    .venv/bin/python tests/benchmarks/bench_group_replay.py /tmp/r16k --prepare --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import hashlib, json, resource, sys, time, warnings
warnings.simplefilter("ignore")
if __name__ == "__main__":
    t0, c0 = time.perf_counter(), time.process_time()
    last = [t0, c0]
    out = {}
    def status(key):
        for ln in open("/proc/self/status"):
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) / 1024
    def mark(what):
        t, c = time.perf_counter(), time.process_time()
        out[what] = {"wall_s": t - last[0], "cpu_s": c - last[1],
                     "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "stage_peak_mib": status("VmHWM"), "rss_mib": status("VmRSS")}
        last[:] = [t, c]
        try:  # (the peak RSS of the next stage alone: writing 5 to clear_refs resets VmHWM to the current RSS)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    from traceana.causal import diagnosis, graph
    from traceana.causal.whatif import whatif
    from traceana.measure.analysis_cache import load_and_analyze
    path, mode = sys.argv[1], sys.argv[2]
    a = load_and_analyze(path)
    mark("load (cache)")
    if mode == "prepare":
        print("RESULT " + json.dumps(out)); sys.exit(0)
    g = graph.build(a)
    mark("graph.build")
    w = whatif(a, graph=g, full=False, candidates=diagnosis.WHATIF_CANDIDATES,
               per_group=map if mode == "per" else None)
    mark("what-if")
    t, c = time.perf_counter(), time.process_time()
    out["total"] = {"wall_s": t - t0, "cpu_s": c - c0,
                    "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out["operations"] = g.ops.height
    out["ranks"] = g.ranks["rank"].n_unique()
    out["tables"] = hashlib.sha256(w.groups.write_csv().encode()
                                   + json.dumps(w.summary, sort_keys=True, default=str).encode()).hexdigest()
    out["diagnosis"] = w.summary.get("diagnosis")
    print("RESULT " + json.dumps(out))
'''


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def child(run_dir: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", CHILD, str(run_dir), mode], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the {mode} child failed:\n{p.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    for ln in p.stderr.splitlines():  # /usr/bin/time -v: the whole child's figures
        k, _, v = ln.strip().partition(": ")
        if k in ("User time (seconds)", "System time (seconds)", "Elapsed (wall clock) time (h:mm:ss or m:ss)",
                 "Maximum resident set size (kbytes)"):
            out.setdefault("time_v", {})[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prepare", action="store_true", help="write the analysis cache first (one child)")
    ap.add_argument("--rounds", type=int, default=1, help="one-process / per-group pairs (default 1)")
    a = ap.parse_args()
    if a.prepare:
        print(f"prepare: {child(a.run_dir, 'prepare')} (load {load()})", flush=True)
    seen = {}
    for i in range(a.rounds):
        for mode in ("one", "per"):
            before = load()
            r = child(a.run_dir, mode)
            seen.setdefault(mode, set()).add(r["tables"])
            print(f"round {i} {mode}: load {before} → {load()}; {r['ranks']:,} ranks, {r['operations']:,} operations",
                  flush=True)
            for stage in ("load (cache)", "graph.build", "what-if", "total"):
                s = r[stage]
                print(f"  {stage:13s} {s['wall_s']:8.1f} s wall {s['cpu_s']:8.1f} CPU-s  peak {s['peak_mib']:7.0f} MiB"
                      + (f"; this stage's own peak {s['stage_peak_mib']:7.0f} MiB, {s['rss_mib']:7.0f} MiB after it"
                         if s.get("stage_peak_mib") else ""), flush=True)
            print(f"  /usr/bin/time -v: {r.get('time_v')}; diagnosis: {r['diagnosis']}", flush=True)
    same = len(seen.get("one", set()) | seen.get("per", set())) == 1
    print("the same what-if tables and summary in both modes" if same else f"DIFFERENT tables: {seen}")


if __name__ == "__main__":
    main()
