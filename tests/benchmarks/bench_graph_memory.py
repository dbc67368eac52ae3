"""Where `graph.build`'s memory goes on a big run, step by step, against a baseline revision in the same run.

Each side (this tree, then the baseline: a git revision exported with ``git archive``, the native scanner copied
beside it) runs in a child process of its own on its analysis cache, as ``traceana whatif`` and
bench_group_replay.py read it: RUN_DIR's for this tree (a first child writes it, or finds it), the baseline's in
a folder of its own beside RUN_DIR (the run's files hard-linked, its caches written by the baseline first). A
cache hit holds no events: ``Analysis.events``
is recomputed on first use (``analysis_cache._Lazy``: the run's events through the ingest cache, then ``analyze``
again), and graph.build is the first to use it, so the child touches ``run.events`` and ``Analysis.events`` first,
each a stage of its own, then builds the graph with each of its steps (``graph._pairs``, ``graph._busy_in_gaps``,
``gpu_edges.on_gpu`` …) wrapped, then replays the last measured step on the engine and takes its critical path.
Per stage: CPU seconds and the stage's own peak RSS (Linux VmHWM, reset through /proc/self/clear_refs before each
stage), the RSS before and after it; per step of graph.build its peak above the RSS it started at. Prints the
ratios this tree / baseline and whether both give the same graph (ops, edges and ranks hashed) and the same
replayed step. ``--max-mib`` kills a child whose RSS passes it (the machine is shared). Asserts nothing
(benchmarks are not tests).

    .venv/bin/python tests/benchmarks/bench_graph_memory.py /tmp/r4096 --baseline 08f7918
    .venv/bin/python tests/benchmarks/bench_graph_memory.py /tmp/r16k --new-only --max-mib 16000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from guarded_child import run_guarded

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import functools, gc, hashlib, json, sys, time, warnings
warnings.simplefilter("ignore")
def status(key):
    for ln in open("/proc/self/status"):
        if ln.startswith(key + ":"):
            return int(ln.split()[1]) / 1024
def reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
out = {"stages": {}, "steps": []}
last = [time.process_time(), status("VmRSS")]
def mark(what):
    c = time.process_time()
    out["stages"][what] = {"cpu_s": c - last[0], "peak_mib": status("VmHWM"), "before_mib": last[1],
                           "rss_mib": status("VmRSS")}
    last[:] = [time.process_time(), status("VmRSS")]
    reset()
from traceana.causal import graph, gpu_edges
from traceana.causal.replay import replay
try:
    from traceana.causal.critical_path import critical_path
except ImportError:  # (before the split of graph.py: the critical path was the replay module's)
    from traceana.causal.replay import critical_path
from traceana.measure.analysis_cache import load_and_analyze
def wrap(mod, name):
    f = getattr(mod, name, None)
    if f is None:
        return
    @functools.wraps(f)
    def w(*a, **k):
        rss0, c0, hwm0 = status("VmRSS"), time.process_time(), status("VmHWM")
        reset()
        try:
            return f(*a, **k)
        finally:
            out["steps"].append({"step": f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", "cpu_s": time.process_time() - c0,
                                 "above_mib": status("VmHWM") - rss0, "after_mib": status("VmRSS")})
            # (the enclosing stage's peak: a step's reset must not hide what came before it)
            out["_hwm"] = max(out.get("_hwm", 0), hwm0, status("VmHWM"))
    setattr(mod, name, w)
for n in ("pass_durations", "_collectives", "_pairs", "_last_cpu", "_edges", "_blocking", "_after_receives",
          "_lag_waits", "_gaps", "_busy_in_gaps", "_order_cycles"):
    wrap(graph, n)
for n in ("on_gpu", "stream_order", "split_gaps"):
    wrap(gpu_edges, n)
path, mode = sys.argv[1], sys.argv[2]
reset()
a = load_and_analyze(path)
mark("cache hit")
if mode == "prepare":
    print("RESULT " + json.dumps(out)); sys.exit(0)
ev = a.run.events
out["events"] = ev.height
del ev
mark("run.events")
a.events
a.run.__dict__.pop("events", None)  # (graph.build reads the classified events only)
gc.collect()
mark("Analysis.events")
out["_hwm"] = 0
g = graph.build(a)
mark("graph.build")
out["stages"]["graph.build"]["peak_mib"] = max(out["stages"]["graph.build"]["peak_mib"], out.pop("_hwm"))
out["graph_frames_mib"] = sum(f.estimated_size() for f in (g.ops, g.edges, g.ranks)) / 2**20
r = replay(g, g.steps[-1])
mark("replay")
p = critical_path(g, r)
mark("critical path")
h = hashlib.sha256()
for f in (g.ops, g.edges, g.ranks):
    h.update(f.write_csv().encode())
out["graph"] = h.hexdigest()
out["replay"] = hashlib.sha256(r.ranks.write_csv().encode() + r.ops.write_csv().encode()).hexdigest()
out["path"] = hashlib.sha256(b"".join(f.write_csv().encode() for f in p)).hexdigest()
out["operations"] = g.ops.height
out["ranks"] = g.ranks["rank"].n_unique()
print("RESULT " + json.dumps(out))
'''


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def child(tree: Path, run_dir: Path, mode: str, max_mib: float | None) -> dict | None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    _, stdout, stderr, killed = run_guarded([sys.executable, "-c", CHILD, str(run_dir), mode], env=env, cwd=tree,
                                            max_mib=max_mib)
    if killed is not None:
        print(f"  {tree}: killed at {killed:,.0f} MiB RSS (over --max-mib {max_mib:,.0f})")
        return None
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: the child failed:\n{stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def baseline_tree(rev: str, into: Path) -> Path:
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "traceana"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for so in (ROOT / "traceana" / "ingest").glob("_scan*.so"):  # the native scanner, built here (not in git)
        (into / "traceana" / "ingest" / so.name).write_bytes(so.read_bytes())
    return into


def show(new: dict, base: dict | None) -> None:
    print(f"{new['ranks']:,} ranks, {new['operations']:,} operations, {new['events']:,} events; the graph's frames "
          f"{new['graph_frames_mib']:.0f} MiB")
    head = f"{'stage':16s} {'CPU s':>7s} {'peak MiB':>9s} {'before':>7s} {'after':>7s}"
    print(head + ("" if base is None
                  else f" | {'base CPU':>8s} {'base MiB':>8s} | {'CPU ratio':>9s} {'MiB ratio':>9s}"))
    for stage, n in new["stages"].items():
        row = f"{stage:16s} {n['cpu_s']:7.1f} {n['peak_mib']:9.0f} {n['before_mib']:7.0f} {n['rss_mib']:7.0f}"
        b = None if base is None else base["stages"].get(stage)
        if b is not None:
            row += (f" | {b['cpu_s']:8.1f} {b['peak_mib']:8.0f} | {n['cpu_s'] / max(b['cpu_s'], 1e-9):9.2f} "
                    f"{n['peak_mib'] / b['peak_mib']:9.2f}")
        print(row)
    print("graph.build's steps (peak above the RSS each started at):")
    base_steps = {} if base is None else {s["step"]: s for s in base["steps"]}
    for s in new["steps"]:
        b = base_steps.get(s["step"])
        print(f"  {s['step']:24s} {s['cpu_s']:6.2f} CPU-s {s['above_mib']:+7.0f} MiB"
              + ("" if b is None else f"   base {b['cpu_s']:6.2f} CPU-s {b['above_mib']:+7.0f} MiB"))
    st = new["stages"]
    per_op = ", ".join(f"{k} {(st[k]['peak_mib'] - st[k]['before_mib']) * 2**20 / new['operations']:,.0f}"
                       for k in ("graph.build", "replay", "critical path"))
    print(f"bytes per operation above the RSS each stage started at: {per_op}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--baseline", default="08f7918", help="git revision to compare with (default: 08f7918, the "
                    "tree of bench_group_replay's first 16,384-rank figures)")
    ap.add_argument("--prepare", action="store_true", help="(always done: a child that writes this tree's analysis "
                    "cache first, a hit when it is there; an entry of another revision is a miss)")
    ap.add_argument("--new-only", action="store_true", help="run only this tree")
    ap.add_argument("--max-mib", type=float, default=None, help="kill a child whose RSS passes this")
    a = ap.parse_args()
    ready = child(ROOT, a.run_dir, "prepare", a.max_mib)
    if ready is None:
        return
    print(f"prepare: {ready['stages']['cache hit']} (load {load()})", flush=True)
    before = load()
    new = child(ROOT, a.run_dir, "run", a.max_mib)
    print(f"this tree: load {before} → {load()}", flush=True)
    base = None
    if not a.new_only:
        with tempfile.TemporaryDirectory(dir=a.run_dir.parent) as tmp:
            # (its own caches: the run's files hard-linked into a folder of its own, prepared by the baseline)
            tree, run = baseline_tree(a.baseline, Path(tmp) / "tree"), Path(tmp) / "run"
            run.mkdir()
            for f in a.run_dir.iterdir():
                if f.is_file():
                    os.link(f, run / f.name)
            child(tree, run, "prepare", a.max_mib)
            before = load()
            base = child(tree, run, "run", a.max_mib)
        print(f"baseline {a.baseline}: load {before} → {load()}", flush=True)
    if new is None:
        return
    show(new, base)
    if base is not None:
        for k, what in (("graph", "graph (ops, edges, ranks)"), ("replay", "replayed step"),
                        ("path", "critical path")):
            print(f"the same {what} as the baseline" if base[k] == new[k] else f"DIFFERENT {what} from the baseline")


if __name__ == "__main__":
    main()
