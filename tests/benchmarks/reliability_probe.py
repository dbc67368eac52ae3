"""The issue-29 probe as a table: each scenario run against a traceana checkout, its exit code, last stderr line,
what changed on disk, peak RSS and time (``os.wait4`` of the child). Run it against an old checkout and this one:

    .venv/bin/python tests/benchmarks/reliability_probe.py --root /path/to/old --root . > table.md

Scenarios that need torch (collect) are left to tests/commands/test_reliability_round3.py. Prints markdown; asserts
nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def two_stage(d: Path) -> Path:
    from tracebuilder import write_two_stage_run

    d.mkdir(parents=True)
    return write_two_stage_run(d)


def edit(path: Path, fn) -> None:
    t = json.loads(gzip.decompress(path.read_bytes()))
    fn(t)
    path.write_bytes(gzip.compress(json.dumps(t).encode()))


def snapshot(d: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(d))] = (stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return out


def changed(before: dict, after: dict) -> str:
    new = sorted(set(after) - set(before))
    gone = sorted(set(before) - set(after))
    kind = sorted(k for k in set(before) & set(after) if before[k][0] != after[k][0])
    words = []
    if kind:
        words.append("replaced: " + ", ".join(kind))
    tmp = [n for n in new if n.endswith(".tmp")]
    if tmp:
        words.append(f"{len(tmp)} temporar{'y' if len(tmp) == 1 else 'ies'} left")
    if gone:
        words.append("removed: " + ", ".join(gone[:3]))
    return "; ".join(words) or "nothing"


def run(root: Path, argv: list[str], *, cwd: Path, env_extra=None, stdin=None, stdout=subprocess.DEVNULL,
        signals=(), wait_for: Path | None = None, timeout: float = 180, shell_closed_stdout=False):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*(env_extra or {}).pop("_site", []), str(root)]),
           **(env_extra or {})}
    cmd = [sys.executable, "-m", "traceana", *argv]
    if shell_closed_stdout:
        cmd = ["sh", "-c", " ".join(f"'{c}'" for c in cmd) + " >&-"]
    t0 = time.monotonic()
    err_file = tempfile.TemporaryFile("w+")  # (not a pipe: an orphaned job holding it would block the read)
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=err_file, text=True)
    if stdout == subprocess.PIPE:
        p.stdout.close()
    if wait_for is not None:
        while not wait_for.exists() and _running(p.pid) and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        time.sleep(0.3)
    for sig in signals:
        if _running(p.pid):
            p.send_signal(sig)
            time.sleep(0.05)
    err, rss = "", 0
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            rc = os.waitstatus_to_exitcode(status)
            rss = usage.ru_maxrss
            break
        if time.monotonic() > deadline:
            os.kill(p.pid, signal.SIGKILL)
            _, status, usage = os.wait4(p.pid, 0)
            rc, rss = "killed (timeout)", usage.ru_maxrss
            break
        time.sleep(0.02)
    p.returncode = 0
    err_file.seek(0)
    err = err_file.read()
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return rc, (lines[-1] if lines else ""), rss, time.monotonic() - t0, "Traceback" in err


def _running(pid: int) -> bool:
    """Not ended yet (without reaping it: its rusage is read by wait4 below)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


SLOW_WRITE = """
import os, time
from pathlib import Path
import polars as pl
real = pl.DataFrame.write_parquet
def slow(self, file, *a, **k):
    real(self, file, *a, **k)
    Path(os.environ["TRIP_FLAG"]).write_text("x")
    time.sleep(60)
pl.DataFrame.write_parquet = slow
"""
AT_IMPORT = """
import os, signal, sys
class _Trip:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["TRIP_MODULE"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Trip())
"""


def scenarios(tmp: Path):
    """(name, setup(d) -> (argv, options)) for each scenario; d is a fresh folder."""
    def dev(d):
        run2 = two_stage(d / "run")
        os.mknod(d / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return ["merge", run2, "-o", d / "null", "--no-cache"], {}

    def fifo(d):
        run2 = two_stage(d / "run")
        os.mkfifo(d / "out.json")
        return ["merge", run2, "-o", d / "out.json", "--no-cache"], {}

    def link(d):
        run2 = two_stage(d / "run")
        os.mknod(d / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (d / "out.json").symlink_to(d / "null")
        return ["merge", run2, "-o", d / "out.json", "--no-cache"], {}

    def export_fifo(d):
        run2 = two_stage(d / "run")
        (d / "t").mkdir()
        os.mkfifo(d / "t" / "steps.parquet")
        return ["analyze", run2, "--export", d / "t", "--no-cache"], {}

    def long_name(d):
        run2 = two_stage(d / "run")
        return ["merge", run2, "-o", d / ("m" * 240 + ".json.gz"), "--no-cache"], {}

    def to_stdout(d):
        return ["merge", two_stage(d / "run"), "-o", "-", "--no-cache"], {}

    def mixed(d):
        run2 = two_stage(d / "run")
        edit(run2 / "rank1.pt.trace.json.gz",
             lambda t: [e.update(ts=e["ts"] + 60e6) for e in t["traceEvents"] if "ts" in e])
        return ["analyze", run2, "--no-cache"], {}

    def sigint_import(d):
        site = d / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(AT_IMPORT)
        return ["analyze", two_stage(d / "run"), "--no-cache"], {
            "env_extra": {"_site": [str(site)], "TRIP_MODULE": "traceana.commands.analyze"}}

    def sig_cache(sig):
        def setup(d):
            site = d / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(SLOW_WRITE)
            return ["analyze", two_stage(d / "run"), "--quiet"], {
                "env_extra": {"_site": [str(site)], "TRIP_FLAG": str(d / "flag")}, "wait_for": d / "flag",
                "signals": [sig] * 5}
        return setup

    def closed_stdout(d):
        return ["analyze", two_stage(d / "run"), "--no-cache"], {"shell_closed_stdout": True}

    def broken_pipe(d):
        return ["analyze", two_stage(d / "run"), "--json", "--no-cache"], {"stdout": subprocess.PIPE}

    def step_number(d):
        run2 = two_stage(d / "run")
        for r in (0, 1):
            edit(run2 / f"rank{r}.pt.trace.json.gz", lambda t: [e.update(name="ProfilerStep#99999999999999999999")
                 for e in t["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")])
        return ["analyze", run2, "--no-cache"], {}

    def world(n):
        def setup(d):
            run2 = two_stage(d / "run")
            for r in (0, 1):
                edit(run2 / f"rank{r}.pt.trace.json.gz", lambda t: t["distributedInfo"].update(world_size=n))
            return ["analyze", run2, "--no-cache"], {}
        return setup

    def run_json_world(d):
        run2 = two_stage(d / "run")
        for r in (0, 1):
            edit(run2 / f"rank{r}.pt.trace.json.gz", lambda t: t["distributedInfo"].pop("world_size"))
        (run2 / "run.json").write_text(json.dumps({"world_size": 10**9}))
        return ["analyze", run2, "--no-cache"], {"prlimit": 4 << 30}

    def estimate(*flags):
        return lambda d: (["estimate", "--model", "llama-7b", *flags], {"timeout": 150})

    def analysis_json(d):
        run2 = two_stage(d / "run")
        (run2 / "analysis.json").write_text("")
        return ["analyze", run2, "--no-cache"], {}

    def bom(d):
        run2 = two_stage(d / "run")
        for r in (0, 1):
            p = run2 / f"rank{r}.pt.trace.json.gz"
            p.write_bytes(gzip.compress(b"\xef\xbb\xbf" + gzip.decompress(p.read_bytes())))
        return ["analyze", run2, "--no-cache"], {}

    def stale_tmp(d):
        run2 = two_stage(d / "run")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        t = d / f".m.json.gz.{int(dead.stdout)}.0123abcd.tmp"
        t.write_bytes(b"\0" * 4_000_000)
        os.utime(t, (time.time() - 3600,) * 2)
        return ["merge", run2, "-o", d / "m.json.gz", "--no-cache"], {}

    def watch_fifo(d):
        run2 = two_stage(d / "run")
        os.mkfifo(run2 / "rank2.pt.trace.json")
        for p in run2.iterdir():
            os.utime(p, (time.time() - 3600,) * 2, follow_symlinks=False)
        return ["watch", run2, "--once"], {}

    def attach_term(d):
        job = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
        return ["attach", "-o", d / "out", "--", sys.executable, "-c", job, str(d / "pid")], {
            "wait_for": d / "pid", "signals": [signal.SIGTERM], "after": "job"}

    def attach_segv(d):
        return ["attach", "-o", d / "out", "--", sys.executable, "-c",
                "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], {}

    return [
        ("merge -o onto a character device (mknod copy of /dev/null)", dev),
        ("merge -o onto a FIFO", fifo),
        ("merge -o onto a symlink to a device", link),
        ("analyze --export with a FIFO as a table's name", export_fifo),
        ("merge -o a legal 248-byte name", long_name),
        ("merge -o - (standard output)", to_stdout),
        ("rank 1 from a collection 60 s later", mixed),
        ("SIGINT during the CLI's imports", sigint_import),
        ("5 x SIGINT during a cache write", sig_cache(signal.SIGINT)),
        ("5 x SIGTERM during a cache write", sig_cache(signal.SIGTERM)),
        ("analyze with stdout closed (>&-)", closed_stdout),
        ("analyze --json, reader gone", broken_pipe),
        ("ProfilerStep#99999999999999999999", step_number),
        ("distributedInfo.world_size 3e7 (2-rank run)", world(30_000_000)),
        ("distributedInfo.world_size 1e6 (2-rank run)", world(1_000_000)),
        ("run.json world_size 1e9 (traces silent; 4 GiB cap)", run_json_world),
        ("estimate llama-7b --pp 2048 --layers 2048", estimate("--pp", "2048", "--layers", "2048")),
        ("estimate llama-7b --pp 2 --microbatches 1e8", estimate("--pp", "2", "--microbatches", str(10**8))),
        ("empty analysis.json in the run folder", analysis_json),
        ("traces saved with a UTF-8 BOM", bom),
        ("merge after a kill -9'd merge's 4 MB temporary", stale_tmp),
        ("watch --once, a FIFO named like a trace", watch_fifo),
        ("SIGTERM to attach (job sleeping)", attach_term),
        ("attach, job dies of SIGSEGV", attach_segv),
    ]


def probe(root: Path) -> dict[str, str]:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        for i, (name, setup) in enumerate(scenarios(Path(tmp))):
            d = Path(tmp) / f"s{i}"
            d.mkdir()
            argv, opts = setup(d)
            argv = [str(a) for a in argv]
            before = snapshot(d)
            after_check = opts.pop("after", None)
            cap = opts.pop("prlimit", None)
            if cap:
                argv = argv  # the cap goes on the interpreter through prlimit
                opts["env_extra"] = {**opts.get("env_extra", {})}
            rc, last, rss, secs, tb = run(root, argv, cwd=d, **opts) if not cap else _capped(root, argv, d, cap)
            disk = changed(before, snapshot(d))
            if after_check == "job" and (d / "pid").exists():
                pid = int((d / "pid").read_text())
                alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
                disk += "; job still running" if alive else "; job ended"
                if alive:
                    os.kill(pid, signal.SIGKILL)
            last = (last[:110] + "…") if len(last) > 110 else last
            rows[name] = f"{rc} | {'TRACEBACK ' if tb else ''}{last.replace('|', '/')} | {disk} | {rss / 1024:.0f} MB | {secs:.1f} s"
            print(f"  {name}: {rows[name]}", file=sys.stderr)
    return rows


def _capped(root: Path, argv: list[str], d: Path, cap: int):
    t0 = time.monotonic()
    p = subprocess.Popen(["prlimit", f"--as={cap}", sys.executable, "-m", "traceana", *argv], cwd=d,
                         env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = 0
    err = p.stderr.read()
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return (os.waitstatus_to_exitcode(status), lines[-1] if lines else "", usage.ru_maxrss,
            time.monotonic() - t0, "Traceback" in err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", action="append", type=Path, required=True, help="a traceana checkout (repeatable)")
    args = ap.parse_args()
    results = [probe(r.resolve()) for r in args.root]
    print("| scenario | " + " | ".join(f"{r}: exit · last line · on disk · peak RSS · time" for r in args.root) + " |")
    print("|---|" + "---|" * len(args.root))
    for name in results[0]:
        print(f"| {name} | " + " | ".join(r[name].replace(" | ", " · ") for r in results) + " |")


if __name__ == "__main__":
    main()
