"""Reliability (issue 13): outputs never over inputs and never half-written, caches never through a symlink nor
deleting what traceana did not write, regular files only, one clear line (exit 2) instead of an internal error.

Expected values are by hand from tests/tracebuilder.py's two-stage run: each rank's step is 100 µs; rank 0 runs
F0 for 20 µs, then B0 for 20 µs."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import polars as pl
import pytest
from tracebuilder import TraceBuilder, write_two_stage_run

from traceana.cli import main
from traceana.core import files
from traceana.core.errors import BadInputError, printable
from traceana.ingest.cache import CACHE_DIR, TAG_NAME
from traceana.ingest.run_dir import load_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run2(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return write_two_stage_run(d)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _cli(args, capsys) -> tuple[int, str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning printed each time, as in a fresh process
        rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# --- outputs never over inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["rank0.pt.trace.json.gz", "../run/./rank1.pt.trace.json.gz", "run.json"])
def test_merge_refuses_to_write_over_an_input(run2, capsys, target):
    (run2 / "run.json").unlink(missing_ok=True)
    before = _snapshot(run2)
    rc, _, err = _cli(["merge", run2, "-o", run2 / target, "--no-cache"], capsys)
    assert rc == 2 and "the output is an input" in err and err.count("\n") == 1
    assert _snapshot(run2) == before  # not a byte changed, and no run.json created


def test_outputs_through_symlinks_and_hard_links_are_refused(run2, tmp_path, capsys):
    link = tmp_path / "alias.json.gz"
    link.symlink_to(run2 / "rank0.pt.trace.json.gz")
    hard = tmp_path / "hard.json.gz"
    os.link(run2 / "rank1.pt.trace.json.gz", hard)
    before = _snapshot(run2)
    for out in (link, hard):
        rc, _, err = _cli(["merge", run2, "-o", out, "--no-cache"], capsys)
        assert rc == 2 and "the output is an input" in err
    assert _snapshot(run2) == before


def test_report_on_a_single_file_refuses_that_file_as_output(run2, capsys):
    f = run2 / "rank0.pt.trace.json.gz"
    before = f.read_bytes()
    rc, _, err = _cli(["report", f, "-o", f], capsys)
    assert rc == 2 and "the output is an input" in err
    assert f.read_bytes() == before


def test_a_failed_write_keeps_the_older_file_and_leaves_no_partial_one(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("older report")
    with pytest.raises(OSError):
        with files.atomic_path(out) as tmp:
            tmp.write_bytes(b"half of a new rep")
            raise OSError(28, "No space left on device")
    assert out.read_text() == "older report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    # An interrupt (Ctrl-C, or SIGTERM raised as an exception by the CLI) cleans up the same way.
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(out) as tmp:
            tmp.write_bytes(b"x")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_export_on_a_full_disk_is_one_line_and_keeps_older_tables(run2, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tables"
    assert _cli(["analyze", run2, "--export", out, "--quiet", "--no-cache"], capsys)[0] == 0
    before = _snapshot(out)
    real = pl.DataFrame.write_parquet

    def full_disk(self, file, *args, **kwargs):
        Path(file).write_bytes(b"PAR1 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", full_disk)
    rc, _, err = _cli(["analyze", run2, "--export", out, "--quiet", "--no-cache"], capsys)
    monkeypatch.setattr(pl.DataFrame, "write_parquet", real)
    assert rc == 2 and "No space left on device" in err and "nothing partial" in err
    assert _snapshot(out) == before  # same files, same bytes, no temporary


def test_merged_trace_in_a_run_folder_is_skipped_with_a_warning(run2, capsys):
    assert _cli(["merge", run2, "-o", run2 / "merged.json.gz", "--quiet", "--no-cache"], capsys)[0] == 0
    rc, out, err = _cli(["analyze", run2, "--json", "--no-cache"], capsys)
    assert rc == 0 and "traceana's own merged trace" in err
    stages = {s["rank"]: s for s in json.loads(out)["stages"]}
    assert sorted(stages) == [0, 1] and stages[0]["step_ms"] == pytest.approx(0.1)
    rc, _, err = _cli(["analyze", run2 / "merged.json.gz", "--no-cache"], capsys)
    assert rc == 2 and "merged trace" in err


# --- caches: no symlinks followed, nothing deleted that traceana did not write -----------------------------------
@pytest.mark.parametrize("link", [CACHE_DIR, f"{CACHE_DIR}/ingest"])
def test_a_symlinked_cache_directory_is_never_written_or_cleaned(run2, tmp_path, capsys, link):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Files a stale-entry clean-up would have matched, had it followed the link.
    (elsewhere / "rank0.pt.trace.json.gz.0123456789abcdef0123.events.parquet").write_bytes(b"keep me")
    (elsewhere / "run.0123456789abcdef0123").mkdir()
    (elsewhere / "run.0123456789abcdef0123" / "meta.json").write_text("{}")
    if link == CACHE_DIR:
        (run2 / CACHE_DIR).symlink_to(elsewhere, target_is_directory=True)
    else:
        (run2 / CACHE_DIR).mkdir()
        (run2 / link).symlink_to(elsewhere, target_is_directory=True)
    before = _snapshot(elsewhere)
    for _ in range(2):
        rc, _, err = _cli(["analyze", run2, "--quiet"], capsys)
        assert rc == 0 and "symlink" in err and "cache is not used" in err
    assert _snapshot(elsewhere) == before


def test_stale_entry_clean_up_removes_only_what_the_cache_wrote(run2, capsys):
    assert _cli(["analyze", run2, "--quiet"], capsys)[0] == 0
    ingest = run2 / CACHE_DIR / "ingest"
    assert (run2 / CACHE_DIR / TAG_NAME).is_file()
    mine = ingest / "rank0.pt.trace.json.gz.my-notes.txt"  # a user's file with the trace's name as prefix
    mine.write_text("mine")
    dead = ingest / ".rank0.pt.trace.json.gz.999999999.deadbeef.tmp"  # a writer killed long ago (no such pid)
    dead.write_bytes(b"x" * 100)
    os.utime(dead, (1, 1))
    young = ingest / ".rank1.pt.trace.json.gz.999999999.deadbeef.tmp"  # maybe another host's write in progress
    young.write_bytes(b"x")
    (run2 / "rank0.pt.trace.json.gz").touch()  # a new fingerprint: the entry is rewritten, the stale one removed
    assert _cli(["analyze", run2, "--quiet"], capsys)[0] == 0
    assert mine.read_text() == "mine" and young.exists() and not dead.exists()
    assert len(list(ingest.glob("rank0.pt.trace.json.gz.*.events.parquet"))) == 1


def test_a_foreign_dot_traceana_folder_is_left_alone(run2, capsys):
    (run2 / CACHE_DIR).mkdir()
    (run2 / CACHE_DIR / "my-config.toml").write_text("x = 1")
    rc, _, err = _cli(["analyze", run2, "--quiet"], capsys)
    assert rc == 0 and "did not write" in err
    assert sorted(p.name for p in (run2 / CACHE_DIR).iterdir()) == ["my-config.toml"]


def test_an_in_place_edit_with_the_mtime_restored_misses_the_cache(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    f = d / "rank0.json"

    def write(end_us: float) -> None:
        tb = TraceBuilder(rank=0, world_size=1)
        tb.step(0, 0, end_us)
        tb.cpu_op("aten::mm", 1, 5)
        f.write_bytes(tb.to_bytes())

    write(100.0)
    st = f.stat()
    assert load_run(d).events.filter(pl.col("name") == "ProfilerStep#0")["dur_ns"].to_list() == [100_000]
    write(200.0)  # the same number of bytes ("100.0" → "200.0")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -r`: size and mtime as before, ctime not
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert load_run(d).events.filter(pl.col("name") == "ProfilerStep#0")["dur_ns"].to_list() == [200_000]


# --- regular files only ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
@pytest.mark.parametrize("name", ["rank0.pt.trace.json.gz", "run.json"])
def test_fifos_and_devices_are_refused_before_reading(run2, capsys, kind, name):
    target = run2 / name
    target.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    t0 = time.monotonic()
    rc, _, err = _cli(["analyze", run2, "--no-cache", "--quiet"], capsys)
    assert rc == 2 and "not a regular file" in err and err.count("\n") == 1
    assert ("FIFO" if kind == "fifo" else "character device") in err
    assert time.monotonic() - t0 < 30  # it did not wait for a writer nor read an endless device


def test_terminal_escapes_in_file_names_are_printed_escaped(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "rank0\x1b[2J\x1b]0;pwned\x07.json").write_text("{not json")
    rc, _, err = _cli(["analyze", d, "--no-cache"], capsys)
    assert rc == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b[2J" in err
    assert printable("a\u202eb\tc") == "a\\u202eb\\tc"
    # A run folder with an escape in its name: the tables' title shows it escaped.
    e = tmp_path / "run\x1b[31mred"
    e.mkdir()
    write_two_stage_run(e)
    rc, out, err = _cli(["analyze", e, "--no-cache"], capsys)
    assert rc == 0 and "\x1b" not in out + err and "run\\x1b[31mred" in "".join(out.split())  # (rich may wrap)


# --- internal errors: a clear line (exit 2) or a correct answer --------------------------------------------------
def _empty_rank(d: Path, rank: int, world: int) -> None:
    (d / f"rank{rank}.json").write_text(json.dumps({"traceEvents": [],
                                                    "distributedInfo": {"rank": rank, "world_size": world}}))


@pytest.mark.parametrize("command", ["analyze", "merge"])
def test_every_rank_empty_is_one_clear_line(tmp_path, capsys, command):
    d = tmp_path / "run"
    d.mkdir()
    _empty_rank(d, 0, 2)
    (d / "rank1.json").write_text(json.dumps({  # its only event has no usable ts: dropped
        "traceEvents": [{"ph": "X", "name": "a", "ts": "soon", "dur": 1, "pid": 1, "tid": 1}],
        "distributedInfo": {"rank": 1, "world_size": 2}}))
    args = [command, d, "--no-cache"] + (["-o", tmp_path / "m.json"] if command == "merge" else [])
    rc, _, err = _cli(args, capsys)
    assert rc == 2 and "none of the 2 traces holds a usable event" in err
    assert not (tmp_path / "m.json").exists()


def test_one_empty_rank_is_named_and_the_others_analysed(run2, capsys):
    (run2 / "rank1.pt.trace.json.gz").unlink()
    _empty_rank(run2, 1, 2)
    rc, out, err = _cli(["analyze", run2, "--json", "--no-cache"], capsys)
    assert rc == 0 and "rank 1 has no usable event" in err
    stages = {s["rank"]: s for s in json.loads(out)["stages"]}
    # F0 spans 0–20 µs and waits on nothing: all of it is forward (its aten::mm 2–18 µs and its own overhead).
    assert stages[0]["step_ms"] == pytest.approx(0.1) and stages[0]["forward_ms"] == pytest.approx(0.020)


def test_an_annotation_number_beyond_int32_is_not_an_annotation(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(0, 0, 100)
    tb.annotation("PP:0F0", 0, 30)
    tb.cpu_op("aten::mm", 2, 24)
    tb.annotation("PP:1F99999999999999999999999", 40, 20)
    tb.cpu_op("aten::mm", 42, 16)
    tb.write(d / "rank0.json")
    rc, out, _ = _cli(["analyze", d, "--json", "--no-cache"], capsys)
    assert rc == 0
    (stage,) = json.loads(out)["stages"]
    # Only PP:0F0 is a forward (its window, 30 µs); the mm under the out-of-range name is other compute (16 µs).
    assert stage["forward_ms"] == pytest.approx(0.030) and stage["other_compute_ms"] == pytest.approx(0.016)


@pytest.mark.parametrize("manifest, words", [
    ({"world_size": 2, "extra": json.loads("[" * 500 + "]" * 500)}, "nested more than 32 levels"),
    ({"world_size": 2, "peak_flops": "fast"}, "peak_flops must be a number"),
    ({"world_size": 2, "peak_flops": -1e12}, "peak_flops must be a number"),
    ({"world_size": 2, "microbatch_size": 0}, "microbatch_size must be a positive integer"),
    ({"world_size": 2, "pp": 2, "bpipe": [[0, 9]]}, "bpipe pair [0, 9] names a stage outside 0..1"),
    ({"world_size": 2, "pp": 8, "schedule": "1f1b"}, "pp 8 is larger than world_size 2"),
    ({"world_size": 2, "num_microbatches": "4"}, "num_microbatches must be a positive integer"),
    ({"world_size": 2, "stage_of_rank": [0, 1.5]}, "not an integer"),
])
def test_wrong_run_json_values_are_one_line_in_every_command(run2, capsys, manifest, words):
    (run2 / "run.json").write_text(json.dumps(manifest))
    for command in ("analyze", "validate"):
        rc, _, err = _cli([command, run2, "--no-cache"] if command == "analyze" else [command, run2], capsys)
        assert rc == 2 and words in err and "run.json" in err, (command, err)
        assert err.count("\n") == 1


def test_run_json_deeper_than_python_recursion_is_one_line(run2, capsys):
    (run2 / "run.json").write_text('{"world_size": 2, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, _, err = _cli(["analyze", run2, "--no-cache"], capsys)
    assert rc == 2 and "nested more than 32 levels" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e-300", "0", "1e30"])
def test_peak_flops_flag_must_be_a_plausible_finite_number(run2, capsys, value):
    rc, out, err = _cli(["analyze", run2, "--json", "--no-cache", f"--peak-flops={value}"], capsys)
    assert rc == 2 and "--peak-flops must be a number of FLOP/s" in err and out == ""


def test_json_output_always_parses_strictly(run2, capsys):
    (run2 / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, "peak_flops": 1e12}))
    rc, out, _ = _cli(["analyze", run2, "--json", "--per-step", "--no-cache"], capsys)

    def no_constant(name):
        raise AssertionError(f"{name} in --json output")

    assert rc == 0 and json.loads(out, parse_constant=no_constant)["stages"]


# --- interrupts ----------------------------------------------------------------------------------------------
_SLOW_CACHE_WRITE = """
import sys, time
from pathlib import Path
import polars as pl
real = pl.DataFrame.write_parquet
def slow(self, file, *a, **k):
    real(self, file, *a, **k)
    Path(sys.argv[2]).write_text("writing")  # tell the test a temporary exists now
    time.sleep(60)
pl.DataFrame.write_parquet = slow
from traceana.cli import main
sys.exit(main(["analyze", sys.argv[1], "--quiet"]))
"""


@pytest.mark.parametrize("sig, code, words", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_during_a_cache_write_exits_cleanly_and_leaves_no_temporary(run2, tmp_path, sig, code, words):
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CACHE_WRITE, str(run2), str(flag)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert flag.exists(), proc.communicate()[1]
        assert any(p.name.endswith(".tmp") for p in (run2 / CACHE_DIR).rglob("*"))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code and err.strip() == f"traceana: {words}" + (" (SIGTERM)" if code == 143 else "")
    assert not [p for p in (run2 / CACHE_DIR).rglob("*") if p.name.endswith(".tmp")]
    assert not (run2 / "rank0.pt.trace.json.gz").with_name("x").exists()


def test_refuse_inputs_compares_files_not_spellings(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("{}")
    files.refuse_inputs(tmp_path / "b.json", [a])  # another file: fine
    with pytest.raises(BadInputError, match="the output is an input"):
        files.refuse_inputs(tmp_path / "." / ".." / tmp_path.name / "a.json", [a])
