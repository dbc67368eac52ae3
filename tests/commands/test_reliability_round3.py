"""Reliability, round 3 (issue 29): outputs only onto regular files or new paths, no run written into by a new
collection and no mixed runs, clean signals and streams, bounded on absurd metadata, attach/collect owning their
children, user files in run folders, temporaries.

Each test's expectation is by hand: what the file system must hold afterwards (a device stays a device), the
conventional exit codes (130 SIGINT, 143 SIGTERM, 141 a closed pipe), one line on stderr."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from tracebuilder import TraceBuilder, write_two_stage_run

from traceana.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def run2(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return write_two_stage_run(d)


def _cli(args, capsys) -> tuple[int, str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _traceana(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traceana", *map(str, args)], cwd=kw.pop("cwd", ROOT), env=ENV,
                          capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if not ln.startswith("traceana: warning:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- 1. outputs only onto regular files or new paths ---------------------------------------------------------------
def _special(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"out-{kind}"
    if kind == "device":
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a copy of /dev/null (we run as root in CI)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "link-to-device":
        os.mknod(tmp_path / "dev", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        p.symlink_to(tmp_path / "dev")
    return p


@pytest.mark.parametrize("kind", ["device", "fifo", "link-to-device"])
def test_merge_never_replaces_a_device_fifo_or_link_to_one(run2, tmp_path, capsys, kind):
    if kind != "fifo" and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    out = _special(tmp_path, kind)
    before = os.lstat(out)
    rc, _, err = _cli(["merge", run2, "-o", out, "--no-cache"], capsys)
    assert rc == 2 and "regular files" in _one_line(err)
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)  # still the device / FIFO / link
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_never_replaces_a_fifo_among_its_tables(run2, tmp_path, capsys):
    d = tmp_path / "tables"
    d.mkdir()
    os.mkfifo(d / "steps.parquet")
    rc, _, err = _cli(["analyze", run2, "--export", d, "--no-cache"], capsys)
    assert rc == 2 and "steps.parquet" in _one_line(err)
    assert stat.S_ISFIFO(os.lstat(d / "steps.parquet").st_mode) and sorted(os.listdir(d)) == ["steps.parquet"]


def test_merge_to_standard_output_streams_the_trace(run2):
    r = _traceana("merge", run2, "-o", "-", "--no-cache")
    assert r.returncode == 0, r.stderr
    trace = json.loads(r.stdout)
    assert trace["otherData"]["producer"] == "traceana merge" and {e.get("pid") for e in trace["traceEvents"]} >= {0, 1}
    assert not (ROOT / "-").exists()


def test_a_legal_long_output_name_is_written(run2, tmp_path, capsys):
    d = tmp_path / "out"
    d.mkdir()
    out = d / ("m" * 240 + ".json.gz")  # 248 bytes: legal; the temporary's name must fit in 255 too
    rc, _, err = _cli(["merge", run2, "-o", out, "--no-cache", "--quiet"], capsys)
    assert rc == 0, err
    assert json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert [p.name for p in d.iterdir()] == [out.name]


def test_merge_creates_its_folder_or_says_it_cannot(run2, tmp_path, capsys):
    rc, _, err = _cli(["merge", run2, "-o", tmp_path / "new" / "sub" / "m.json", "--no-cache", "--quiet"], capsys)
    assert rc == 0 and (tmp_path / "new" / "sub" / "m.json").is_file()
    (tmp_path / "file").write_text("x")
    rc, _, err = _cli(["merge", run2, "-o", tmp_path / "file" / "m.json", "--no-cache"], capsys)
    line = _one_line(err)
    assert rc == 2 and "cannot create the folder" in line and "disk space" not in line


def test_a_killed_merges_temporary_is_swept_by_the_next(run2, tmp_path, capsys):
    out = tmp_path / "m.json.gz"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.json.gz.{int(dead.stdout)}.0123abcd.tmp"  # as kill -9 during a merge leaves it
    stale.write_bytes(b"\0" * 4096)
    other = tmp_path / f".other.json.gz.{int(dead.stdout)}.0123abcd.tmp"  # another target's: not this merge's
    other.write_bytes(b"x")
    old = time.time() - 3600
    for p in (stale, other):
        os.utime(p, (old, old))
    rc, _, err = _cli(["merge", run2, "-o", out, "--no-cache", "--quiet"], capsys)
    assert rc == 0, err
    assert not stale.exists() and other.exists() and out.is_file()


# --- 2. a run folder is never written into by a new collection ------------------------------------------------------
def test_collect_refuses_a_folder_holding_a_run(run2, capsys):
    before = {p.name: p.read_bytes() for p in run2.iterdir()}
    rc, _, err = _cli(["collect", "--pp", "2", "-o", run2], capsys)
    assert rc == 2 and "not empty" in _one_line(err)
    assert {p.name: p.read_bytes() for p in run2.iterdir()} == before  # no collect.log, nothing replaced


def test_collect_under_torchrun_accepts_its_own_launchs_folder_only(tmp_path, monkeypatch):
    from collectors.command import OWNER, refuse_used_output
    from traceana.core.errors import ConfigError

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a"
                 }.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    refuse_used_output(out)  # the first rank marks it
    refuse_used_output(out)  # another rank of the same launch: its own output
    assert os.listdir(out) == [OWNER]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b")  # another launch
    with pytest.raises(ConfigError, match="not empty"):
        refuse_used_output(out)


# --- 3. mixed runs -------------------------------------------------------------------------------------------------
def _edit_trace(path: Path, edit) -> None:
    trace = json.loads(gzip.decompress(path.read_bytes()))
    edit(trace)
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))


def _shift(seconds: float):
    def edit(trace):
        for e in trace["traceEvents"]:
            if "ts" in e:
                e["ts"] += seconds * 1e6
    return edit


def test_a_rank_from_a_later_collection_is_refused(run2, capsys):
    # rank 1 from the same configuration collected a minute later: its events start 60 s after rank 0's end
    _edit_trace(run2 / "rank1.pt.trace.json.gz", _shift(60))
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    line = _one_line(err)
    assert rc == 2 and "different collections" in line and "rank 1" in line and "rank 0" in line


def test_ranks_a_few_seconds_apart_are_named_not_refused(run2, capsys):
    _edit_trace(run2 / "rank1.pt.trace.json.gz", _shift(3))
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    assert rc == 0 and "different collections?" in err


def test_traces_of_different_configurations_are_refused(run2, capsys):
    for r, schedule in ((0, "1f1b"), (1, "gpipe")):
        _edit_trace(run2 / f"rank{r}.pt.trace.json.gz",
                    lambda t, s=schedule, r=r: t.update(traceana={"rank": r, "pp": 2, "world_size": 2, "schedule": s}))
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    line = _one_line(err)
    assert rc == 2 and "different collections" in line and "schedule" in line


# --- 9. many small ranks: the cache's folder is listed once per run, not once per rank ------------------------------
def test_writing_the_cache_of_many_ranks_lists_its_folder_once(tmp_path, monkeypatch):
    from traceana.ingest.cache import CACHE_DIR
    from traceana.ingest.run_dir import load_run

    n = 120
    for r in range(n):
        tb = TraceBuilder(rank=r, world_size=n, pid=r, tid=r)
        tb.step(1, 0, 10)
        tb.cpu_op("aten::mm", 1, 5)
        tb.write(tmp_path / f"rank{r}.pt.trace.json")
    ingest = tmp_path / CACHE_DIR / "ingest"
    listed = []
    real = os.scandir

    def counting(path=".", *a):
        if Path(path) == ingest:
            listed.append(path)
        return real(path, *a)

    monkeypatch.setattr(os, "scandir", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = load_run(tmp_path, workers=1)
    times = len(listed)
    rows = list(ingest.glob("batch-*.rows.json"))  # (small ranks: their entries written in one batch)
    assert len(run.traces) == n and len(rows) == 1 and len(json.loads(rows[0].read_text())) == n
    assert times <= 2  # once (and the sweep), not once per rank: writing grows linearly with the ranks


# --- 4. signals, broken pipes, closed streams -----------------------------------------------------------------------
# Injected at the end of the interpreter's start-up (sitecustomize), before traceana runs: a signal sent by the
# process to itself when a chosen module starts being imported, or a cache write that waits to be interrupted.
_AT_IMPORT = """
import os, signal, sys
class _Trip:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["TRIP_MODULE"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), getattr(signal, os.environ["TRIP_SIGNAL"]))
        return None
sys.meta_path.insert(0, _Trip())
"""

_SLOW_WRITE = """
import os, sys, time
from pathlib import Path
import polars as pl
real = pl.DataFrame.write_parquet
def slow(self, file, *a, **k):
    real(self, file, *a, **k)
    Path(os.environ["TRIP_FLAG"]).write_text("writing")
    try:
        time.sleep(60)
    except BaseException:  # as polars did once: the interrupt comes back as another error (or twice)
        raise TypeError("'<unprintable str object>' is not a Polars data type")
pl.DataFrame.write_parquet = slow
"""


def _with_site(tmp_path: Path, code: str) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(code)
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


@pytest.mark.parametrize("module, sig, code", [("traceana.commands.analyze", "SIGINT", 130),
                                               ("traceana.cli", "SIGINT", 130)])
def test_a_signal_during_the_imports_is_one_line(run2, tmp_path, module, sig, code):
    env = {**_with_site(tmp_path, _AT_IMPORT), "TRIP_MODULE": module, "TRIP_SIGNAL": sig}
    r = subprocess.run([sys.executable, "-m", "traceana", "analyze", str(run2), "--no-cache"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code and _one_line(r.stderr) in ("traceana: interrupted", "traceana: terminated (SIGTERM)")


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_the_console_scripts_imports_is_one_line(run2, tmp_path, sig, code):
    # `traceana` as pip installs it (a script doing `from traceana.cli import main`), not `python -m traceana`: the
    # signal lands while traceana imports, before cli.main takes the signals over (a traceback and death by the signal,
    # before the script was counted as the program).
    script = tmp_path / "bin" / "traceana"
    script.parent.mkdir()
    script.write_text("import sys\nfrom traceana.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    env = {**_with_site(tmp_path, _AT_IMPORT), "TRIP_MODULE": "traceana.core.errors", "TRIP_SIGNAL": sig}
    r = subprocess.run([sys.executable, str(script), "analyze", str(run2), "--no-cache"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code and _one_line(r.stderr) in ("traceana: interrupted", "traceana: terminated (SIGTERM)")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_during_a_cache_write_end_at_once_with_no_temporary(run2, tmp_path, sig, code):
    flag = tmp_path / "flag"
    env = {**_with_site(tmp_path, _SLOW_WRITE), "TRIP_FLAG": str(flag)}
    proc = subprocess.Popen([sys.executable, "-m", "traceana", "analyze", str(run2), "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert flag.exists(), proc.communicate()[1]
        for _ in range(5):  # a burst, as a user pressing Ctrl-C again and again
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code and _one_line(err).startswith("traceana: ")
    assert not [p for p in run2.rglob("*") if p.name.endswith(".tmp")]


_CONVERTED = """
import os, sys, time
from pathlib import Path
import traceana.measure.analysis_cache as C
def analyze(*a, **k):
    Path(sys.argv[2]).write_text("in")
    try:
        time.sleep(60)
    except KeyboardInterrupt:  # a library turning the interrupt into its own error, as polars once did
        raise TypeError("'<unprintable str object>' is not a Polars data type")
C.analyze = analyze
from traceana.cli import main
sys.exit(main(["analyze", sys.argv[1], "--no-cache", "--quiet"]))
"""


def test_an_interrupt_a_library_turns_into_its_own_error_is_still_an_interrupt(run2, tmp_path):
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", _CONVERTED, str(run2), str(flag)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and _one_line(err) == "traceana: interrupted"


def test_a_closed_stdout_is_one_line_and_a_merge_still_works(run2, tmp_path):
    analyze = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m traceana analyze "{run2}" --no-cache >&-'],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert analyze.returncode == 2 and "standard output is closed" in _one_line(analyze.stderr)  # (1 until issue 35)
    out = tmp_path / "m.json"
    merge = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m traceana merge "{run2}" -o "{out}" --no-cache '
                                        '--quiet >&-'], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert merge.returncode == 0 and merge.stderr == "" and json.loads(out.read_text())["traceEvents"]


@pytest.mark.parametrize("args", [["analyze", "--json"], ["merge", "-o", "-"]])
def test_a_reader_gone_is_exit_141_quietly(run2, args):
    proc = subprocess.Popen([sys.executable, "-m", "traceana", args[0], str(run2), *args[1:], "--no-cache"], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is printed (``| head -c0``)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 141 and err == ""


# --- 5. numbers that size memory or time: checked against what is present -------------------------------------------
def _set_in_traces(run: Path, edit) -> None:
    for r in (0, 1):
        _edit_trace(run / f"rank{r}.pt.trace.json.gz", edit)


@pytest.mark.parametrize("number", ["99999999999999999999", "2147483648"])
def test_a_step_number_beyond_int32_is_one_line(run2, capsys, number):
    def edit(trace):
        for e in trace["traceEvents"]:
            if e.get("name", "").startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{number}"
    _set_in_traces(run2, edit)
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    assert rc == 2 and "ProfilerStep" in _one_line(err) and "internal error" not in err


@pytest.mark.skipif(not os.path.exists("/usr/bin/prlimit"), reason="needs prlimit")
def test_a_declared_world_size_is_checked_not_allocated(run2):
    # 3·10^7 ranks declared in a 2-rank run of a few KB: under a 2 GiB address-space cap it is named, not allocated
    _set_in_traces(run2, lambda t: t["distributedInfo"].update(world_size=30_000_000))
    r = subprocess.run(["prlimit", f"--as={2 << 30}", sys.executable, "-m", "traceana", "analyze", str(run2),
                        "--no-cache"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "distributedInfo.world_size" in _one_line(r.stderr)


def test_many_missing_ranks_are_counted_not_listed(run2, capsys):
    _set_in_traces(run2, lambda t: t["distributedInfo"].update(world_size=1_000_000))
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    assert rc == 0 and "999,998 of 1,000,000 ranks have no trace (2, 3, 4, 5, 6, 7, 8, 9, 10, 11 …)" in err


@pytest.mark.skipif(not os.path.exists("/usr/bin/prlimit"), reason="needs prlimit")
def test_run_json_world_size_beyond_any_job_is_named(run2):
    _set_in_traces(run2, lambda t: t["distributedInfo"].pop("world_size"))  # run.json is the only word on it
    (run2 / "run.json").write_text(json.dumps({"world_size": 10**9}))
    r = subprocess.run(["prlimit", f"--as={2 << 30}", sys.executable, "-m", "traceana", "analyze", str(run2),
                        "--no-cache"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "world_size" in _one_line(r.stderr) and "memory" not in r.stderr


@pytest.mark.parametrize("flags, field", [(["--pp", "2048", "--layers", "2048"], "pp 2,048"),
                                          (["--pp", "8192", "--layers", "8192"], "pp 8,192"),
                                          (["--pp", "2", "--microbatches", str(10**8)], "micro-batches 100,000,000")])
def test_estimate_of_an_absurd_pipeline_answers_at_once(flags, field):
    # "at once" in the child's CPU seconds (it once ran 150 s before being killed), not wall time, which other jobs
    # on a loaded machine stretch; the wall timeout only guards against a hang
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _traceana("estimate", "--model", "llama-7b", *flags, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert r.returncode == 2 and field in _one_line(r.stderr) and cpu_s < 30, cpu_s


# --- 6. attach owns its job -----------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _attach(tmp_path: Path, job: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "traceana", "attach", "-o", str(tmp_path / "out"), *extra, "--",
                             sys.executable, "-c", job], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    return int(path.read_text())


_JOB = """
import os, signal, sys, time
{ignore}
child = os.fork()  # a process of the job's own
if child == 0:
    {ignore_child}
    time.sleep(300)
    os._exit(0)
open(sys.argv[1] if len(sys.argv) > 1 else {pids!r}, "w").write(str(child))
time.sleep(300)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_attach_reaches_every_process_of_the_job(tmp_path, sig, code):
    pids = tmp_path / "pids"
    quiet = "signal.signal(signal.SIGINT, signal.SIG_DFL)"  # (the job's own KeyboardInterrupt traceback: not ours)
    proc = _attach(tmp_path, _JOB.format(ignore=quiet, ignore_child="", pids=str(pids)))
    try:
        child = _wait_for(pids, proc)
        proc.send_signal(sig)  # what a scheduler sends (SIGTERM) or a Ctrl-C on attach alone
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code and "Traceback" not in err
    assert not _alive(child)


def test_a_job_that_ignores_signals_is_killed_after_the_grace_period(tmp_path):
    pids = tmp_path / "pids"
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    proc = _attach(tmp_path, _JOB.format(ignore=ignore, ignore_child="", pids=str(pids)), "--kill-after", "1")
    try:
        child = _wait_for(pids, proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "SIGKILL" in err and took < 20  # 1 s grace (+ polling), not the job's 300 s
    assert not _alive(child)


def test_a_job_killed_by_a_signal_is_named(tmp_path):
    proc = _attach(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + 11 and "SIGSEGV" in err and "status -11" not in err


def test_processes_the_job_leaves_behind_are_stopped(tmp_path):
    pids = tmp_path / "pids"
    job = ("import os, sys, time\nchild = os.fork()\nif child == 0:\n    time.sleep(300)\n    os._exit(0)\n"
           f"open({str(pids)!r}, 'w').write(str(child))\n")  # exits at once, its child still sleeping
    proc = _attach(tmp_path, job, "--kill-after", "1")
    _, err = proc.communicate(timeout=60)
    child = int(pids.read_text())
    assert proc.returncode == 0 and "left processes" in err
    assert not _alive(child)


def _group_running(pgid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) == pgid and f[0] != "Z":
                out.append(int(e))
    return out


@pytest.mark.multiprocess
def test_sigterm_to_collect_leaves_nothing_of_its_group_running(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.Popen([sys.executable, "-m", "traceana", "collect", "--pp", "2", "--microbatches", "2",
                             "--steps", "50", "--model", "tiny-gpt", "-o", str(tmp_path / "run")], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_group_running(proc.pid)) < 4 and time.monotonic() < deadline:  # collect, forkserver, 2 ranks
            time.sleep(0.2)
        assert len(_group_running(proc.pid)) >= 4
        proc.send_signal(signal.SIGTERM)  # to collect alone, as a scheduler sends it
        # (on a loaded 2-core machine the ranks and the forkserver took over 60 s to wind down once)
        _, err = proc.communicate(timeout=180)
        time.sleep(0.5)
        left = _group_running(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "Traceback" not in err and left == []


@pytest.mark.multiprocess
def test_sigkill_to_collect_leaves_no_rank_waiting_for_its_peers(tmp_path):
    # SIGKILL runs no clean-up of collect's: the ranks must end by themselves once their launcher has gone (an orphan
    # rank held collect's stdout open and waited for its rendezvous: the caller's read of the output hung)
    pytest.importorskip("torch")
    proc = subprocess.Popen([sys.executable, "-m", "traceana", "collect", "--pp", "2", "--microbatches", "2",
                             "--model", "tiny-gpt", "--work", "sleep", "--forward-ms", "500", "--backward-ms", "500",
                             "--warmup-steps", "30", "--profile-steps", "1",  # about a minute of holds
                             "-o", str(tmp_path / "run")], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_group_running(proc.pid)) < 5 and time.monotonic() < deadline:  # + the resource tracker
            time.sleep(0.2)
        assert len(_group_running(proc.pid)) >= 5
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # returns once no process holds collect's output
            proc.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while _group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _group_running(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == []


# --- 7. files the user adds to a run folder -------------------------------------------------------------------------
def test_analysis_json_written_into_the_run_folder_does_not_break_the_next_run(run2):
    # the shell creates RUN/analysis.json (empty) before traceana runs, then fills it with the JSON summary
    with open(run2 / "analysis.json", "w") as out:
        first = subprocess.run([sys.executable, "-m", "traceana", "analyze", str(run2), "--json"], cwd=ROOT, env=ENV,
                               stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert json.loads((run2 / "analysis.json").read_text())["stages"]
    again = _traceana("analyze", run2, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["stages"]
    assert [ln for ln in again.stderr.splitlines() if "analysis.json" in ln] == [
        ln for ln in again.stderr.splitlines() if "ignored" in ln] and "analysis.json" in again.stderr


@pytest.mark.parametrize("name, content", [("analysis.json", b""), ("notes.json", b"remember: rerun with pp 4\n"),
                                           ("config.json", b'{"lr": 0.1}'), ("results.json", b"[1, 2]")])
def test_a_users_file_in_the_run_folder_is_skipped_with_one_warning(run2, capsys, name, content):
    (run2 / name).write_bytes(content)
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    warned = [ln for ln in err.splitlines() if name in ln]
    assert rc == 0 and len(warned) == 1 and "ignored" in warned[0]


def test_a_trace_saved_with_a_utf8_bom_is_read(run2, capsys, decoder):
    for r in (0, 1):
        p = run2 / f"rank{r}.pt.trace.json.gz"
        p.write_bytes(gzip.compress(b"\xef\xbb\xbf" + gzip.decompress(p.read_bytes())))
    rc, out, err = _cli(["analyze", run2, "--no-cache", "--json"], capsys)
    assert rc == 0, err
    assert {s["rank"] for s in json.loads(out)["stages"]} == {0, 1}


# --- 8. messages that say what happened ------------------------------------------------------------------------------
def test_watch_once_names_the_fifo_that_blocks_it(run2, capsys):
    os.mkfifo(run2 / "rank2.pt.trace.json")
    old = time.time() - 3600
    for p in run2.iterdir():
        os.utime(p, (old, old), follow_symlinks=False)
    rc, _, err = _cli(["watch", run2, "--once"], capsys)
    assert "rank2.pt.trace.json is a FIFO" in err


def test_a_full_disk_during_the_cache_write_says_so(run2, capsys, monkeypatch):
    import polars as pl

    def full(self, file, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", full)
    rc, _, err = _cli(["analyze", run2], capsys)
    cache_lines = [ln for ln in err.splitlines() if "could not write the ingest cache" in ln]
    assert rc == 0 and cache_lines and "free disk space" in cache_lines[0] and "writable" not in cache_lines[0]


def test_a_failed_export_says_which_tables_were_written(run2, tmp_path, capsys, monkeypatch):
    import polars as pl

    real, calls = pl.DataFrame.write_parquet, []

    def full_on_third(self, file, *a, **k):
        calls.append(file)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, file, *a, **k)

    monkeypatch.setattr(pl.DataFrame, "write_parquet", full_on_third)
    rc, _, err = _cli(["analyze", run2, "--export", tmp_path / "t", "--no-cache", "--quiet"], capsys)
    line = _one_line(err)
    assert rc == 2 and "2 file(s) before it" in line and "free disk space" in line
    assert len(list((tmp_path / "t").iterdir())) == 2


def test_traces_in_nanoseconds_are_named(run2, capsys):
    def to_ns(trace):  # another exporter's trace: epoch ns where the format holds µs
        trace.pop("baseTimeNanoseconds", None)
        for e in trace["traceEvents"]:
            for k in ("ts", "dur"):
                if k in e:
                    e[k] = int(round(e[k] * 1000))
    _set_in_traces(run2, to_ns)
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    line = _one_line(err)
    assert rc == 2 and "nanoseconds" in line and "÷ 1000" in line


def test_ctrl_c_still_ends_watch_normally(run2, tmp_path):
    from child_wait import wait_unless_hung

    proc = subprocess.Popen([sys.executable, "-m", "traceana", "watch", str(tmp_path), "--interval", "0.1"], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # once it watches (run2's window printed: a Ctrl-C in the imports is "interrupted", 130, by design), as
        # long as a loaded machine takes to get there
        for line in proc.stdout:
            if "window 1" in line:
                break
        time.sleep(0.5)  # back in its polling loop
        proc.send_signal(signal.SIGINT)
        # ends by itself: a hang guard in the child's own CPU and blocked time, not the wall clock (child_wait.py)
        assert wait_unless_hung(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.read()
    assert "Traceback" not in proc.stderr.read()
