"""A 1,024-rank run (pp=8 × dp=128, small ranks) analysed on a real dask.distributed cluster, next to one process.

    .venv/bin/python tests/benchmarks/bench_partitioned.py --work /work/bench          # pp=8, dp=128
    .venv/bin/python tests/benchmarks/bench_partitioned.py --work /tmp/b --dp 8        # quick: 64 ranks

In one run, on the same files:
1. writes the run (``gen_big_trace.write_run``: global rank = stage * dp + replica, P2P within a replica, an
   all-reduce across replicas), unless it is there already;
2. baseline: ``traceana analyze RUN --no-cache --json --export DIR`` in one process (wall time, peak RSS);
3. starts a real cluster — ``dask scheduler`` and ``dask worker --nworkers N --nthreads 1`` as separate processes,
   talking TCP — and runs ``traceana analyze RUN --dask tcp://… --no-cache --json --export DIR`` against it:
   wall time, the client's peak RSS (the CLI process), each worker process's peak RSS (``ru_maxrss``, asked of
   the workers after the run) and its RSS when idle before the run;
4. checks the exported tables of 2 and 3 are equal, and prints every figure side by side.

Peak RSS of a process is its ``ru_maxrss`` (the CLI is one process in both modes: the native scanner reads ranks
in threads). No timings are asserted: the figures are printed as measured, with the ratios of this run.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gen_big_trace import write_run  # noqa: E402

BIN = Path(sys.executable).parent


def _run(cmd: list[str]) -> dict:
    """Run ``cmd`` to completion: wall seconds, its peak RSS (MiB), CPU seconds, stdout (checked: exit 0)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall": wall, "stdout": out, "stderr": err}


def _measured(cmd: list[str]) -> dict:
    """``_run`` with the child's own rusage (peak RSS and CPU of that process alone)."""
    # Children's maxrss is the largest child's: run each measured job in a fresh helper so it is this job's alone.
    helper = ("import resource,subprocess,sys,json,time;t=time.perf_counter();"
              "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);w=time.perf_counter()-t;"
              "r=resource.getrusage(resource.RUSAGE_CHILDREN);"
              "sys.stderr.write(p.stderr);sys.stdout.write(p.stdout);"
              "print(json.dumps({'rc':p.returncode,'wall':w,'maxrss_kb':r.ru_maxrss,'cpu':r.ru_utime+r.ru_stime}),"
              "file=sys.stderr);sys.exit(p.returncode)")
    res = _run([sys.executable, "-c", helper, *cmd])
    facts = json.loads(res["stderr"].strip().splitlines()[-1])
    return {**facts, "stdout": res["stdout"]}


def _start_cluster(work: Path, n_workers: int) -> tuple[list[subprocess.Popen], str, Path]:
    sched_file = work / "scheduler.json"
    sched_file.unlink(missing_ok=True)
    logs = work / "dask-logs"
    logs.mkdir(exist_ok=True)
    sched = subprocess.Popen([str(BIN / "dask"), "scheduler", "--scheduler-file", str(sched_file), "--no-dashboard",
                              "--host", "127.0.0.1"],
                             stdout=open(logs / "scheduler.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        if sched_file.exists() and sched_file.stat().st_size:
            break
        time.sleep(0.1)
    address = json.loads(sched_file.read_text())["address"]
    worker = subprocess.Popen([str(BIN / "dask"), "worker", address, "--nworkers", str(n_workers), "--nthreads", "1",
                               "--memory-limit", "0", "--no-dashboard", "--local-directory", str(work / "dask-tmp")],
                              stdout=open(logs / "workers.log", "w"), stderr=subprocess.STDOUT)
    return [worker, sched], address, sched_file


def _worker_facts(address: str) -> dict[str, dict]:
    from distributed import Client

    def facts():
        import resource as r

        rss_kb = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
        return {"maxrss_kb": r.getrusage(r.RUSAGE_SELF).ru_maxrss, "rss_kb": rss_kb}

    with Client(address, timeout=60) as c:
        return c.run(facts)


def _wait_workers(address: str, n: int) -> None:
    from distributed import Client

    with Client(address, timeout=120) as c:
        c.wait_for_workers(n, timeout=300)


def _tables_equal(a: Path, b: Path) -> list[str]:
    import polars as pl

    diffs = []
    for f in sorted(a.glob("*.parquet")):
        x, y = pl.read_parquet(f), pl.read_parquet(b / f.name) if (b / f.name).exists() else None
        if y is None:
            diffs.append(f"{f.name}: missing from the distributed export")
        elif not x.equals(y):
            diffs.append(f"{f.name}: differs ({x.shape} vs {y.shape})")
    return diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="folder for the generated run and outputs (default: a temp dir)")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--dp", type=int, default=128)
    p.add_argument("--mb", type=float, default=0.2, help="raw JSON MB per rank")
    p.add_argument("--workers", type=int, default=2, help="dask worker processes (one thread each)")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="traceana-bench-part-"))
    run = work / f"run_pp{a.pp}_dp{a.dp}"
    world = a.pp * a.dp
    if len(list(run.glob("rank*.pt.trace.json.gz"))) != world:
        shutil.rmtree(run, ignore_errors=True)
        t = time.perf_counter()
        facts = write_run(run, ranks=a.pp, dp=a.dp, mb=a.mb, microbatches=2, kernels=4)
        print(f"wrote {world} ranks, {sum(f['raw_bytes'] for f in facts) / 1e6:.0f} MB raw JSON "
              f"({sum(f['file_bytes'] for f in facts) / 1e6:.1f} MB gz) in {time.perf_counter() - t:.0f} s")
    raw = sum(1 for _ in run.glob("rank*"))
    shutil.rmtree(run / ".traceana", ignore_errors=True)
    exp_single, exp_dask = work / "export-single", work / "export-dask"
    for d in (exp_single, exp_dask):
        shutil.rmtree(d, ignore_errors=True)

    traceana = str(BIN / "traceana")
    single = _measured([traceana, "analyze", str(run), "--no-cache", "--json", "--quiet", "--export", str(exp_single)])

    procs, address, _ = _start_cluster(work, a.workers)
    try:
        _wait_workers(address, a.workers)
        idle = _worker_facts(address)
        dist = _measured([traceana, "analyze", str(run), "--no-cache", "--json", "--quiet", "--dask", address,
                          "--export", str(exp_dask)])
        after = _worker_facts(address)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    diffs = _tables_equal(exp_single, exp_dask)
    notes = json.loads(dist["stdout"]).get("notes", [])
    groups = next((n for n in notes if "pipeline groups" in n), "?")

    mib = lambda kb: kb / 1024  # noqa: E731
    print(f"\n{raw} ranks (pp={a.pp} x dp={a.dp}), {a.mb} MB raw per rank; {os.cpu_count()} cores here; "
          f"{a.workers} dask workers x 1 thread")
    print(f"{groups}")
    print(f"{'':36} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>13}")
    print(f"{'one process (traceana analyze)':36} {single['wall']:8.1f} {single['cpu']:8.1f} "
          f"{mib(single['maxrss_kb']):13.0f}")
    print(f"{'dask client (traceana analyze --dask)':36} {dist['wall']:8.1f} {dist['cpu']:8.1f} "
          f"{mib(dist['maxrss_kb']):13.0f}")
    for i, (w, f) in enumerate(sorted(after.items())):
        print(f"{'  dask worker ' + str(i) + ' (peak; idle before)':36} {'':8} {'':8} "
              f"{mib(f['maxrss_kb']):13.0f}  ({mib(idle.get(w, {}).get('maxrss_kb', 0)):.0f} idle)")
    print(f"client / one process peak RSS: {dist['maxrss_kb'] / single['maxrss_kb']:.2f}; "
          f"wall dask / one process: {dist['wall'] / single['wall']:.2f}")
    print("tables equal to the single-process analysis: " + ("yes, every exported table" if not diffs
                                                             else "NO: " + "; ".join(diffs)))


if __name__ == "__main__":
    main()
