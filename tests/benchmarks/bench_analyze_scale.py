"""`traceana analyze` of many small GPU-style ranks, stage by stage, against a baseline revision in the same run.

Each side runs in a child process of its own (its peak RSS alone): ``load_run`` (no cache), ``analyze``,
``graph.build`` and the diagnosis' what-if (``diagnosis.diagnose``, its ``WHATIF_MAX_OPERATIONS`` cap lifted, as
``traceana whatif`` runs it at any size). Prints per stage the wall and CPU seconds, the peak RSS, the ratios
new / baseline, whether both sides name the same diagnosis, and the load average before and after (the machine is
shared: CPU seconds are the figure to compare). The baseline is a git revision of this repository, exported with
``git archive`` into a temporary folder (the native scanner, when built here, copied beside it). Asserts nothing
(benchmarks are not tests).

    .venv/bin/python tests/benchmarks/bench_analyze_scale.py RUN_DIR --baseline efc145e
    .venv/bin/python tests/benchmarks/bench_analyze_scale.py /tmp/r4096 --make "--ranks 8 --dp 512 --mb 0.1 \\
        --microbatches 32 --kernels 1"     # RUN_DIR made first by gen_big_trace.py (4,096 ranks)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
t0, c0 = time.perf_counter(), time.process_time()
last = [t0, c0]
out = {}
def mark(what):
    t, c = time.perf_counter(), time.process_time()
    out[what] = {"wall_s": t - last[0], "cpu_s": c - last[1],
                 "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    last[:] = [t, c]
from dataclasses import replace
from traceana.causal import diagnosis, graph
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze
from traceana.measure.analysis_cache import run_name_rules
from traceana.measure.classify import name_table, rank_summary
diagnosis.WHATIF_MAX_OPERATIONS = 10**12
mark("imports")
path = sys.argv[1]
rules = run_name_rules(path, None)
run = load_run(path, cache=False)
mark("load_run")
by_name = name_table(run.events, rules)
result = replace(analyze(run, peak_flops=None, names=rules, by_name=by_name), rank_summary=rank_summary(run, by_name=by_name))
del run
mark("analyze")
g = graph.build(result, list(result.summary.steps))
mark("graph.build")
graph.build = lambda *a, **k: g  # (the diagnosis builds it again otherwise)
d = diagnosis.diagnose(result)
mark("what-if")
t, c = time.perf_counter(), time.process_time()
out["total"] = {"wall_s": t - t0, "cpu_s": c - c0, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
out["operations"] = g.ops.height
out["diagnosis"] = d.diagnosis
print("RESULT " + json.dumps(out))
'''


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def side(tree: Path, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-c", CHILD, str(run_dir)], env=env, cwd=tree, capture_output=True,
                       text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: the child failed:\n{p.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def baseline_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "traceana"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for so in (ROOT / "traceana" / "ingest").glob("_scan*.so"):  # the native scanner, built here (not in git)
        shutil.copy(so, into / "traceana" / "ingest" / so.name)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--baseline", default="efc145e", help="git revision to compare with (default: efc145e, before "
                    "the small ranks were finished together)")
    ap.add_argument("--make", default=None, help="gen_big_trace.py arguments: make RUN_DIR first")
    ap.add_argument("--new-only", action="store_true", help="run only this tree (no baseline)")
    a = ap.parse_args()
    if a.make is not None:
        subprocess.run([sys.executable, str(ROOT / "tests" / "benchmarks" / "gen_big_trace.py"), str(a.run_dir),
                        *shlex.split(a.make)], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                       stdout=subprocess.DEVNULL)
    print(f"load average before: {load()}")
    new = side(ROOT, a.run_dir)
    print(f"load average after this tree: {load()}")
    base = None
    if not a.new_only:
        with tempfile.TemporaryDirectory() as tmp:
            base = side(baseline_tree(a.baseline, Path(tmp)), a.run_dir)
        print(f"load average after the baseline ({a.baseline}): {load()}")
    print(f"{a.run_dir}: {new['operations']:,} operations")
    print(f"{'stage':12s} {'wall s':>8s} {'CPU s':>8s} {'peak MiB':>9s}" +
          ("" if base is None else f" | {'base wall':>9s} {'base CPU':>9s} {'base MiB':>9s} | {'CPU ratio':>9s}"
                                   f" {'MiB ratio':>9s}"))
    for stage in ("load_run", "analyze", "graph.build", "what-if", "total"):
        n = new[stage]
        row = f"{stage:12s} {n['wall_s']:8.2f} {n['cpu_s']:8.2f} {n['peak_mib']:9.0f}"
        if base is not None:
            b = base[stage]
            row += (f" | {b['wall_s']:9.2f} {b['cpu_s']:9.2f} {b['peak_mib']:9.0f} | "
                    f"{n['cpu_s'] / b['cpu_s']:9.2f} {n['peak_mib'] / b['peak_mib']:9.2f}")
        print(row)
    print(f"diagnosis: {new['diagnosis']}")
    if base is not None:
        print("same diagnosis as the baseline" if base["diagnosis"] == new["diagnosis"]
              else f"DIFFERENT diagnosis from the baseline: {base['diagnosis']}")


if __name__ == "__main__":
    main()
