"""The bad-input corpus for ingest: every kind gives one clear line (file, problem, fix) or a warning and a correct
partial table — never a traceback, never a silently wrong table."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import polars as pl
import pytest
from tracebuilder import BASE_US, TraceBuilder

from traceana.cli import main as cli_main
from traceana.core import schema
from traceana.core.errors import BadInputError, RunDirError, TraceanaError, TraceFormatError
from traceana.ingest.kineto import read_trace
from traceana.ingest.run_dir import load_run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def good_trace(n: int = 5, **kw) -> TraceBuilder:
    tb = TraceBuilder(**kw)
    tb.step(0, 0.0, 100.0)
    for i in range(n):
        tb.cpu_op(f"op{i}", 1.0 + 10 * i, 5.0)
    return tb


def raw_trace(tmp_path: Path, events: list, name: str = "t.json") -> Path:
    f = tmp_path / name
    f.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": events}))
    return f


def x(name: str = "op", ts=BASE_US, dur=1.0, **kw) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, **kw}


def one_line(err: TraceanaError, path: Path) -> str:
    line = err.line()
    assert "\n" not in line and path.name in line and " — " in line, line  # file, problem — fix
    return line


# --- whole-file errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, content, expect",
    [
        ("zero_bytes", b"", "empty file"),
        ("whitespace", b"   \n\t ", "only whitespace"),
        ("binary_garbage", bytes(range(256)) * 4, "not JSON"),
        ("json_array", b"[1, 2, 3]", "JSON array"),
        ("json_scalar", b"42", "not JSON"),
        ("json_string", b'"traceEvents"', "not JSON"),
        ("object_without_traceEvents", b'{"schemaVersion": 1, "deviceProperties": []}', "without traceEvents"),
        ("traceEvents_not_a_list", b'{"traceEvents": {"ph": "X"}}', "not a Kineto trace"),
        ("nan_literal", b'{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}', "not valid JSON"),
        ("garbage_after_object", b'{"traceEvents": []} trailing', "not valid JSON"),
        ("truncated_before_events", b'{"schemaVersion": 1, "distributedInfo": {"rank"', "truncated before any"),
        ("gzip_bad_header", b"\x1f\x8b\x09garbage" * 10, "corrupt gzip"),
    ],
)
def test_unreadable_trace_is_one_line_error(tmp_path, kind, content, expect):
    f = tmp_path / f"{kind}.json"
    f.write_bytes(content)
    with pytest.raises(TraceFormatError) as e:
        read_trace(f)
    assert expect in one_line(e.value, f)


def test_corrupt_gzip_body(tmp_path):
    data = bytearray(gzip.compress(good_trace(200).to_bytes()))
    for i in range(20, 60):
        data[i] ^= 0x5A
    f = tmp_path / "rank0.json.gz"
    f.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError) as e:
        read_trace(f)
    assert "corrupt gzip" in one_line(e.value, f) or "not valid JSON" in e.value.line()


def test_missing_path(tmp_path):
    with pytest.raises(BadInputError) as e:
        read_trace(tmp_path / "nope.json")
    assert "no such file" in one_line(e.value, tmp_path / "nope.json")
    with pytest.raises(BadInputError) as e:
        load_run(tmp_path / "nope")
    assert "no such file or directory" in e.value.line()


def test_symlink_loop(tmp_path):
    loop = tmp_path / "rank0.json"
    loop.symlink_to(loop)
    with pytest.raises(BadInputError) as e:
        read_trace(loop)
    assert "rank0.json" in e.value.line()
    with pytest.raises(BadInputError):
        load_run(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path):
    f = good_trace().write(tmp_path / "rank0.json")
    f.chmod(0)
    with pytest.raises(BadInputError) as e:
        read_trace(f)
    assert "permission denied" in one_line(e.value, f)


def test_unreadable_file_even_as_root(tmp_path, monkeypatch):
    """Root reads mode-000 files, so the permission error is simulated where the OS would raise it."""
    f = good_trace().write(tmp_path / "rank0.json")

    real_open = os.open

    def denied(path, *args, **kwargs):
        if Path(path) == f:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(BadInputError) as e:
        read_trace(f)
    assert "permission denied" in one_line(e.value, f)


def test_directory_passed_as_trace(tmp_path):
    (tmp_path / "d.json").mkdir()
    with pytest.raises(BadInputError) as e:
        read_trace(tmp_path / "d.json")
    assert "directory" in e.value.line()


# --- recoverable damage: warning + correct partial table -------------------------------------------------------------
def test_truncated_json_keeps_every_complete_event(tmp_path):
    data = good_trace(20).to_bytes()
    cut = data.index(b'"op13"') + 3  # inside op13's event
    f = tmp_path / "rank0.pt.trace.json"
    f.write_bytes(data[:cut])
    events, _, row = read_trace(f)
    assert row["truncated"] is True
    assert events["name"].to_list() == ["ProfilerStep#0"] + [f"op{i}" for i in range(13)]
    assert any("truncated" in w and f.name in w for w in row["warnings"])


@pytest.mark.parametrize("cut_at", ["args_close", "after_comma", "last_event_done", "trailer"])
def test_truncation_at_awkward_places(tmp_path, cut_at):
    tb = good_trace(3)
    tb.events[-1]["args"]["nested"] = {"a": {"b": "}, {"}}
    data = tb.to_bytes()
    last = data.index(b'"op2"')
    cut = {
        "args_close": data.index(b'"b": "}, {"}', last) + 14,  # right after a nested '}'
        "after_comma": data.index(b'"op2"') - 2,
        "last_event_done": data.rindex(b"}]") + 1,
        "trailer": data.rindex(b'"traceName"') + 5,
    }[cut_at]
    f = tmp_path / "t.json"
    f.write_bytes(data[:cut])
    events, _, row = read_trace(f)
    assert row["truncated"] is True
    complete = ["ProfilerStep#0", "op0", "op1"] + (["op2"] if cut_at in ("last_event_done", "trailer") else [])
    assert events["name"].to_list() == complete


def test_truncated_gzip_is_recovered(tmp_path):
    data = gzip.compress(good_trace(3000).to_bytes())
    f = tmp_path / "rank0.pt.trace.json.gz"
    f.write_bytes(data[: len(data) * 2 // 3])
    events, _, row = read_trace(f)
    assert row["truncated"] is True and 100 < events.height < 3001
    names = events["name"].to_list()
    assert names == ["ProfilerStep#0"] + [f"op{i}" for i in range(len(names) - 1)]  # a prefix, in order


def test_trailing_nul_padding_after_a_crash(tmp_path):
    f = tmp_path / "t.json"
    f.write_bytes(good_trace(4).to_bytes()[:-30] + b"\x00" * 4096)
    events, _, row = read_trace(f)
    assert row["truncated"] and events.height >= 4


@pytest.mark.parametrize(
    "bad",
    [
        {"ts": None}, {"dur": None}, {"ts": -5.0}, {"dur": -1.0}, {"ts": "NaN"}, {"ts": "oops"}, {"dur": "NaN"},
        {"ts": 1e300}, {"dur": 1e300}, {"ts": 123456789012345678901234567890}, {"ts": [1]}, {"dur": {"a": 1}},
        {"name": 5}, {"args": [1, 2]}, {"ph": 7}, {"pid": [1]},
    ],
    ids=lambda d: "-".join(f"{k}={v!r}"[:20] for k, v in d.items()),
)
def test_bad_event_fields_drop_that_event_with_a_warning(tmp_path, bad):
    ev = x("bad")
    ev.update(bad)
    if bad.get("ts", 0) is None:
        del ev["ts"]
    if "dur" in bad and bad["dur"] is None:
        del ev["dur"]
    f = raw_trace(tmp_path, [x("a", BASE_US), ev, x("b", BASE_US + 5)])
    events, _, row = read_trace(f)
    assert events["name"].to_list() == ["a", "b"]
    assert len(row["warnings"]) == 1 and f.name in row["warnings"][0]
    schema.check(events, schema.EVENTS, "events")


def test_unknown_phases_are_ignored(tmp_path):
    f = raw_trace(tmp_path, [x("a"), {"ph": "Q", "name": "weird", "ts": BASE_US}, {"ph": "", "name": "e"},
                             {"name": "no ph"}, {"ph": "X", "name": "c", "ts": BASE_US + 1, "dur": 1}])
    events, _, row = read_trace(f)
    assert events["name"].to_list() == ["a", "c"] and not row["warnings"]
    assert events.filter(pl.col("name") == "c")["track"].to_list() == ["cpu::"]  # no pid/tid: empty, not null


def test_deeply_nested_args(tmp_path):
    text = json.dumps({"traceEvents": [x("a"), x("b", BASE_US + 2)]})
    f = tmp_path / "t.json"
    f.write_text(text.replace('"name": "b"', '"name": "b", "args": {"x": ' + "[" * 500 + "]" * 500 + "}"))
    events, _, row = read_trace(f)
    assert events["name"].to_list() == ["a", "b"] and not row["warnings"]
    f.write_text(text.replace('"name": "b"', '"name": "b", "args": {"x": ' + "[" * 5000 + "]" * 5000 + "}"))
    with pytest.raises(TraceFormatError) as e:
        read_trace(f)
    assert "nested too deeply" in one_line(e.value, f)


def test_deeply_nested_top_level(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{"other": ' + "[" * 100000 + "]" * 100000 + ', "traceEvents": []}')
    try:
        events, _, _ = read_trace(f)
        assert events.height == 0
    except TraceFormatError as e:
        one_line(e, f)


def test_non_utf8_event_names_are_kept_with_replacement_characters(tmp_path):
    f = tmp_path / "t.json"
    data = json.dumps({"traceEvents": [x("a"), x("XXbadXX", BASE_US + 1)]}).encode()
    f.write_bytes(data.replace(b"XXbadXX", b"bad\xff\xfename"))
    events, _, _ = read_trace(f)
    assert events["name"].to_list() == ["a", "bad\ufffd\ufffdname"]


def test_non_utf8_file_name(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    name = os.fsdecode(b"rank0-\xff.json")
    good_trace(world_size=1).write(d / name)
    run = load_run(d, cache=False)
    assert run.events.height == 6
    (d / os.fsdecode(b"rank1-\xfe.json")).write_bytes(b"not json")
    with pytest.raises(TraceFormatError) as e:
        load_run(d, cache=False)
    e.value.line().encode("utf-8")  # printable


def test_wrongly_typed_metadata_is_tolerated(tmp_path):
    tb = good_trace()
    tb.extra_top.update({"distributedInfo": "nope", "deviceProperties": 7, "baseTimeNanoseconds": "x",
                         "traceana": [1]})
    events, _, row = read_trace(tb.write(tmp_path / "rank3.json"))
    assert (row["rank"], row["rank_source"], row["world_size"], row["base_time_ns"]) == (3, "filename", None, None)
    assert events.height == 6


# --- run directories --------------------------------------------------------------------------------------------------
def test_directory_without_traces(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(RunDirError) as e:
        load_run(tmp_path)
    assert "no Kineto traces" in e.value.line()


def test_duplicate_ranks(tmp_path):
    good_trace(rank=1, world_size=2).write(tmp_path / "a.json")
    good_trace(rank=1, world_size=2).write(tmp_path / "b.json.gz")
    with pytest.raises(RunDirError) as e:
        load_run(tmp_path)
    line = e.value.line()
    assert "two traces claim rank 1" in line and "a.json" in line and "b.json.gz" in line


def test_mixed_world_sizes(tmp_path):
    good_trace(rank=0, world_size=2).write(tmp_path / "rank0.json")
    good_trace(rank=1, world_size=4).write(tmp_path / "rank1.json")
    with pytest.raises(RunDirError) as e:
        load_run(tmp_path)
    assert "different world sizes" in e.value.line()


def test_missing_ranks_warn_and_analyse_the_rest(tmp_path):
    good_trace(rank=0, world_size=4).write(tmp_path / "rank0.json")
    good_trace(rank=2, world_size=4).write(tmp_path / "rank2.json")
    with pytest.warns(UserWarning, match=r"2 of 4 ranks have no trace \(1, 3\)"):
        run = load_run(tmp_path)
    assert run.ranks == [0, 2] and run.world_size == 4


def test_rank_outside_world_size(tmp_path):
    good_trace(rank=5, world_size=4).write(tmp_path / "rank5.json")
    with pytest.raises(RunDirError, match="outside world size 4"):
        load_run(tmp_path)


def test_traces_without_ranks_cannot_be_told_apart(tmp_path):
    good_trace(distributed_info=False).write(tmp_path / "a.json")
    good_trace(distributed_info=False).write(tmp_path / "b.json")
    with pytest.raises(RunDirError, match="do not say their rank"):
        load_run(tmp_path)


def test_single_trace_without_rank_is_rank_zero_with_a_warning(tmp_path):
    f = good_trace(distributed_info=False).write(tmp_path / "trace.json")
    with pytest.warns(UserWarning, match="assuming rank 0"):
        run = load_run(f)
    assert run.ranks == [0]


def test_run_json_contradicting_the_traces(tmp_path):
    good_trace(rank=0, world_size=2).write(tmp_path / "rank0.json")
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 8}))
    with pytest.raises(RunDirError) as e:
        load_run(tmp_path)
    assert "run.json says world_size 8 but the traces say 2" in e.value.line()


def test_malformed_run_json(tmp_path):
    good_trace(rank=0, world_size=1).write(tmp_path / "rank0.json")
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(BadInputError, match="run.json"):
        load_run(tmp_path)


def test_one_bad_file_in_a_run_names_that_file(tmp_path):
    good_trace(rank=0, world_size=2).write(tmp_path / "rank0.json")
    (tmp_path / "rank1.json.gz").write_bytes(b"\x1f\x8b" + os.urandom(100))
    with pytest.raises(TraceFormatError) as e:
        load_run(tmp_path, workers=1)
    assert "rank1.json.gz" in e.value.line()


def test_a_bad_first_file_in_a_run_is_the_error_reported(tmp_path):
    (tmp_path / "rank0.json.gz").write_bytes(b"\x1f\x8b" + os.urandom(100))
    for r in (1, 2):
        good_trace(rank=r, world_size=3).write(tmp_path / f"rank{r}.json")
    with pytest.raises(TraceFormatError) as e:
        load_run(tmp_path, workers=1)
    assert "rank0.json.gz" in e.value.line()


def test_ranks_written_by_manifest_flags_partial_ranks(tmp_path):
    good_trace(rank=0, world_size=2).write(tmp_path / "rank0.json")
    good_trace(rank=1, world_size=2).write(tmp_path / "rank1.json")
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 2, "ranks_written": [0]}))
    with pytest.warns(UserWarning, match=r"ranks \[1\] did not finish writing"):
        load_run(tmp_path)


# --- through the CLI: exit 2 and one line -------------------------------------------------------------------------------
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    pytest.importorskip("traceana.commands.analyze")
    (tmp_path / "rank0.json").write_bytes(b"")
    code = cli_main(["analyze", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "rank0.json" in err and "empty file" in err


def test_other_json_files_in_a_run_directory_are_ignored_with_a_warning(tmp_path):
    good_trace(rank=0, world_size=1).write(tmp_path / "rank0.pt.trace.json.gz")
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1}))
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.warns(UserWarning, match="config.json: ignored"):
        run = load_run(tmp_path)
    assert run.ranks == [0] and len(run.warnings) == 2


def test_a_directory_of_only_other_json_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1}))
    with pytest.raises(RunDirError, match="only other JSON files"):
        load_run(tmp_path)


def test_a_trace_named_file_that_is_not_a_trace_is_an_error(tmp_path):
    good_trace(rank=0, world_size=2).write(tmp_path / "rank0.json")
    (tmp_path / "rank1.json").write_text(json.dumps({"lr": 0.1}))
    with pytest.raises(TraceFormatError, match="rank1.json.*without traceEvents"):
        load_run(tmp_path)
