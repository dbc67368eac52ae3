"""Reading a run's first trace ahead (traceana.ingest.reading, started by the CLI before it imports polars) gives
exactly what reading it when asked gives: the same tables, the same warnings, the same one-line errors, the same
hand-back to the general decoder; a changed file is read again; a cached run is not read ahead at all."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polars.testing import assert_frame_equal
from tracebuilder import TraceBuilder, write_two_stage_run

from traceana.core.errors import TraceanaError
from traceana.ingest import kineto, reading
from traceana.ingest.run_dir import load_run

pytestmark = [pytest.mark.skipif(kineto._scan is None, reason="the native scanner is not built here"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def no_ahead_left():
    yield
    assert not reading._AHEAD and not kineto._FINISHED, "a read-ahead was left behind"
    kineto.drop_finished()
    reading.drop_ahead()


def _outcome(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except TraceanaError as e:
        return e


def assert_same_outcome(a, b) -> None:
    if isinstance(b, Exception):
        assert type(a) is type(b) and a.line() == b.line(), (a, b)
        return
    assert not isinstance(a, Exception), a
    assert_frame_equal(a[0], b[0])
    assert_frame_equal(a[1], b[1])
    assert a[2] == b[2]


def _ahead_then_read(f: Path):
    started = reading.read_ahead(f, cache=False)
    return started, _outcome(kineto.read_trace, f)


def _taken(monkeypatch) -> list:
    taken = []
    take = reading._take

    def recording(path):  # whether the file asked for had a read-ahead to take (used, or its error raised)
        taken.append(reading.key(path) in reading._AHEAD)
        return take(path)

    monkeypatch.setattr(reading, "_take", recording)
    return taken


def _big_trace(path: Path, n: int = 30_000) -> Path:
    tb = TraceBuilder(rank=0)
    for i in range(n):
        tb.cpu_op(f"aten::op_{i % 97}", 10.0 + i, 0.5, args={"External id": i})
        if i % 10 == 0:
            tb.memory(10.25 + i, i, 1)
    return tb.write(path)


def test_third_party_traces_read_ahead_read_the_same(third_party, monkeypatch):
    taken = _taken(monkeypatch)
    files = sorted(third_party.rglob("*.json*"))
    assert files
    for f in files:
        plain = _outcome(kineto.read_trace, f)
        started, ahead = _ahead_then_read(f)
        assert started == f
        assert_same_outcome(ahead, plain)
    assert taken == [False, True] * len(files)


@pytest.mark.parametrize("where", ["whole", "stopped after one call", "isal's gunzip thread"])
def test_a_read_ahead_stopped_part_way_is_finished_by_the_reader(tmp_path, monkeypatch, where):
    f = _big_trace(tmp_path / "rank0.pt.trace.json.gz")
    plain = kineto.read_trace(f)
    monkeypatch.setattr(reading, "NATIVE_CHUNK", 50_000)  # many calls; the window holds many more
    if where == "stopped after one call":
        monkeypatch.setattr(reading, "AHEAD_BYTES", 1)
    if where == "isal's gunzip thread":  # opened in this thread, read in the read-ahead's, finished in this one
        monkeypatch.setattr(reading, "AHEAD_THREADS_FROM", 0)
        monkeypatch.setattr(reading, "AHEAD_BYTES", 1)
        monkeypatch.setattr(reading, "READ_PIECE", 1 << 16)
    taken = _taken(monkeypatch)
    seen = []
    assert reading.read_ahead(f, cache=False) == f
    ahead = kineto.read_trace(f, on_progress=lambda done, total: seen.append((done, total)))
    assert taken == [True]
    assert_same_outcome(ahead, plain)
    assert seen and seen[-1] == (f.stat().st_size, f.stat().st_size)  # the progress still ends at the whole file


def _bad_files(d: Path) -> list[Path]:
    good = TraceBuilder(rank=0)
    good.step(0, 0.0, 100.0)
    for i in range(50):
        good.cpu_op(f"op{i}", 1.0 + i, 0.5)
    whole = gzip.compress(good.to_bytes())
    event = {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}
    files = {
        "empty.json": b"",
        "blank.json": b"  \n ",
        "garbage.json": bytes(range(256)) * 4,
        "array.json": b"[1, 2]",
        "no_events.json": b'{"schemaVersion": 1}',
        "events_not_a_list.json": b'{"traceEvents": {"ph": "X"}}',
        "nan.json": b'{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}',
        "not_utf8.json": json.dumps({"traceEvents": [event]}).encode().replace(b'"op"', b'"o\xffp"'),  # handed back
        "cut_json.json": good.to_bytes()[:-300],  # recovered by the general decoder
        "cut_gzip.json.gz": whole[: len(whole) // 2],
        "not_gzip.json.gz": b"\x1f\x8b" + b"\x00" * 50,
        "data_after.json": json.dumps({"traceEvents": [event]}).encode() + b" {}",
        "two_event_lists.json": b'{"traceEvents": [], "traceEvents": []}',
        "wrong_types.json": json.dumps({"traceEvents": [dict(event, ts="x", pid=[1])]}).encode(),
    }
    out = []
    for name, data in files.items():
        (d / name).write_bytes(data)
        out.append(d / name)
    return out


def test_bad_files_give_the_same_outcome_read_ahead(tmp_path, monkeypatch):
    taken = _taken(monkeypatch)
    files = _bad_files(tmp_path)
    for f in files:
        plain = _outcome(kineto.read_trace, f)
        _, ahead = _ahead_then_read(f)
        assert_same_outcome(ahead, plain)
    assert taken[1::2] == [True] * len(files)  # (not: a file handed back reads again, in the general decoder)


def test_tables_finished_in_the_background_are_read_trace_s(tmp_path, third_party, monkeypatch):
    files = [*_bad_files(tmp_path), *sorted(third_party.rglob("*.json*"))[:4], _big_trace(tmp_path / "big.json.gz")]
    for f in files:
        plain = _outcome(kineto.read_trace, f)
        reading.read_ahead(f, cache=False)
        kineto.finish_ahead()
        assert reading.key(f) in kineto._FINISHED
        assert_same_outcome(_outcome(kineto.read_trace, f), plain)
        assert not kineto._FINISHED
    # A rank given, or a file changed after it was finished, is read again.
    f = files[-1]
    reading.read_ahead(f, cache=False)
    kineto.finish_ahead()
    assert kineto.read_trace(f, rank=7)[2]["rank"] == 7
    assert kineto.read_trace(f)[2]["rank"] == 0
    reading.read_ahead(f, cache=False)
    kineto.finish_ahead()
    os.replace(_big_trace(tmp_path / "other.json.gz", 2_000), f)
    assert kineto.read_trace(f)[0].height == 2_000


def test_a_file_changed_after_its_read_ahead_is_read_again(tmp_path):
    f = _big_trace(tmp_path / "rank0.pt.trace.json.gz", 3_000)
    assert reading.read_ahead(f, cache=False) == f
    for ahead in list(reading._AHEAD.values()):
        ahead.thread.join()  # read to the end
    replaced = _big_trace(tmp_path / "other.json.gz", 2_000)
    os.replace(replaced, f)
    again = kineto.read_trace(f)
    assert again[0].height == 2_000
    assert_same_outcome(again, kineto.read_trace(f))


def test_a_cached_trace_is_not_read_ahead(tmp_path):
    run = _two_stage_run(tmp_path)
    assert reading.read_ahead(run, cache=True) == run / "rank0.pt.trace.json.gz"  # nothing cached yet
    first = load_run(run, cache=True)  # takes it, and writes the ingest cache
    assert not reading._AHEAD
    assert reading.read_ahead(run, cache=True) is None
    assert reading.read_ahead(run, cache=False) == run / "rank0.pt.trace.json.gz"  # --no-cache reads it all again
    again = load_run(run, cache=False)
    assert_frame_equal(first.events, again.events)


def test_load_run_takes_the_read_ahead_in_any_reading_thread(tmp_path, monkeypatch):
    run = _two_stage_run(tmp_path)
    plain = load_run(run, cache=False, workers=1)
    for workers in (1, 2):
        taken = _taken(monkeypatch)
        reading.read_ahead(run, cache=False)
        got = load_run(run, cache=False, workers=workers)
        assert taken.count(True) == 1  # rank0's: the first file, read ahead; rank1's read as always
        assert_frame_equal(got.events, plain.events)
        assert_frame_equal(got.traces, plain.traces)
        assert got.warnings == plain.warnings


def _two_stage_run(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    return write_two_stage_run(tmp_path / "run")


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from traceana.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("make", ["run", "bad"])
def test_the_cli_reads_ahead_with_the_same_output(tmp_path, monkeypatch, capsys, make):
    from traceana import cli

    if make == "run":
        target = _two_stage_run(tmp_path)
    else:
        target = tmp_path / "bad"
        target.mkdir()
        (target / "rank0.pt.trace.json").write_bytes(b'{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}')
    argv = ["analyze", str(target), "--no-cache", "--json"]
    taken = _taken(monkeypatch)
    ahead = _cli(argv, capsys)
    assert taken[0] is True  # the first trace was read ahead and taken (rank1's, if any, read as always)
    monkeypatch.setattr(cli, "_read_ahead", lambda args, **_: False)
    assert _cli(argv, capsys) == ahead
    assert ahead[0] == (0 if make == "run" else 2)


def test_a_cache_hit_reads_nothing_ahead(tmp_path, monkeypatch, capsys):
    run = _two_stage_run(tmp_path)
    argv = ["analyze", str(run), "--json"]
    first = _cli(argv, capsys)
    started = []
    monkeypatch.setattr(reading, "_Ahead", lambda path: started.append(path))  # fails if one is started
    assert _cli(argv, capsys) == first
    assert started == []


def test_building_the_parser_and_reading_ahead_import_no_polars(tmp_path):
    run = _two_stage_run(tmp_path)
    code = f"""
import sys
from traceana.cli import build_parser, _read_ahead
argv = ["analyze", {str(run)!r}, "--no-cache"]
assert _read_ahead(build_parser(argv).parse_args(argv))
from traceana.ingest import reading
for ahead in reading._AHEAD.values():
    ahead.thread.join()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("polars", "msgspec", "pyarrow")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("case", ["small", "user", "larger"])
def test_a_small_run_is_read_with_one_polars_thread_and_arena(tmp_path, case):
    """Before polars is imported, the traceana program gives a run of at most SMALL_RUN_BYTES of JSON one polars
    thread and one jemalloc arena (docs/performance.md "Fixed cost"); a value the user set is kept, and a larger run
    keeps polars' own. (Only the program: the library sets nothing in its host, tests/package/test_host_process.py.)"""
    run = _two_stage_run(tmp_path)
    if case == "larger":
        (run / "rank2.json").write_bytes(b" " * (reading.SMALL_RUN_BYTES + 1))
    env = {k: v for k, v in os.environ.items() if k not in ("POLARS_MAX_THREADS", "_RJEM_MALLOC_CONF")}
    if case == "user":
        env |= {"POLARS_MAX_THREADS": "2", "_RJEM_MALLOC_CONF": "dirty_decay_ms:5"}
    code = f"""
import os
from traceana.cli import program_settings
program_settings()
program_settings({str(run)!r})
print(os.environ.get("POLARS_MAX_THREADS"), os.environ.get("_RJEM_MALLOC_CONF"))
import polars  # (which puts its own allocator defaults before the value: later options win)
print(polars.thread_pool_size())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    threads, conf, pool = out.stdout.split()
    assert (threads, conf) == {
        "small": ("1", "narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0"),
        "user": ("2", "dirty_decay_ms:5"),
        "larger": ("None", "dirty_decay_ms:0,muzzy_decay_ms:0"),
    }[case]
    if threads != "None":
        assert pool == threads


def test_a_read_ahead_of_a_huge_trace_stops_early(tmp_path):
    # ~50 MB of JSON in tiny events (~600k): the read-ahead, which the memory rule does not watch, stops after
    # AHEAD_EVENTS events (plus what its last scanner call read) and waits; the rest is read under the rule.
    event = b'{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}'
    f = tmp_path / "rank0.json.gz"
    f.write_bytes(gzip.compress(b'{"traceEvents": [' + b",\n".join([event] * 600_000) + b"]}", 1))
    assert reading.read_ahead(f, cache=False) == f
    (ahead,) = reading._AHEAD.values()
    ahead.thread.join(timeout=60)
    assert not ahead.thread.is_alive() and ahead.error is None
    per_call = reading.NATIVE_CHUNK // len(event)
    assert reading.AHEAD_EVENTS <= ahead.scanned.rows < reading.AHEAD_EVENTS + per_call + 1
    assert kineto.read_trace(f)[0].height == 600_000


def test_a_run_of_several_traces_reads_its_first_ahead(tmp_path):
    """However large a run is, its first trace is read ahead (bounded by AHEAD_BYTES and AHEAD_EVENTS: the rest of
    the run is read by load_run), as is one trace alone."""
    run = _two_stage_run(tmp_path)
    assert reading.read_ahead(run, cache=False) == run / "rank0.pt.trace.json.gz"
    reading.drop_ahead()
    one = run / "rank1.pt.trace.json.gz"
    assert reading.read_ahead(one, cache=False) == one
    reading.drop_ahead()
