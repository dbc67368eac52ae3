"""The native scanner (traceana/ingest/_scan.c) gives exactly the tables of the general decoder, or hands back.

Every trace is read twice, with the scanner and without it, and the two results must be equal: on the third-party
traces, on real collected runs, on hand-written edge cases and on random valid traces (hypothesis). Where the
scanner does not take a file (a type it leaves to the general decoder), the result is still that decoder's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal
from tracebuilder import TraceBuilder

from traceana.core.errors import TraceanaError
from traceana.ingest import kineto, reading

pytestmark = pytest.mark.skipif(kineto._scan is None, reason="the native scanner is not built here")


def _read(path: Path, native: bool, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        if not native:
            m.setattr(kineto, "_scan", None)
        try:
            return kineto.read_trace(path)
        except TraceanaError as e:
            return e


def _uses_native(path: Path) -> bool:
    try:
        kineto._scan_file(path, kineto._Batches(), None)
    except (kineto._scan.Unsupported, kineto._NotNative):
        return False
    return True


def assert_same(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native, general = _read(path, True, monkeypatch), _read(path, False, monkeypatch)
    if isinstance(general, Exception):
        assert type(native) is type(general) and str(native) == str(general)
        return
    assert not isinstance(native, Exception), native
    assert_frame_equal(native[0], general[0])
    assert_frame_equal(native[1], general[1])
    assert native[2] == general[2]


def test_third_party_traces_read_the_same(third_party, monkeypatch):
    files = sorted(p for p in third_party.rglob("*.json*"))
    assert files
    for f in files:
        assert_same(f, monkeypatch)
    # Every third-party trace is taken by the scanner (ROCm's "stream": "0x0" goes through the odd-value path).
    assert all(_uses_native(f) for f in files)


@pytest.mark.parametrize("name", ["1f1b_bpipe"])
def test_collected_runs_read_the_same(collected_run, monkeypatch, name):
    run = collected_run(name)
    files = sorted(run.glob("*.json.gz"))
    assert files
    for f in files:
        assert_same(f, monkeypatch)
        assert _uses_native(f)


def _write(tmp_path: Path, events: list, *, gz: bool = False, **top) -> Path:
    text = json.dumps({"schemaVersion": 1, **top, "traceEvents": events, "traceName": "x"}, indent=1)
    f = tmp_path / ("t.json.gz" if gz else "t.json")
    f.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return f


X = {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 2, "ts": 10.5, "dur": 2.25}


@pytest.mark.parametrize("case", [
    {"name": "caf\u00e9 \u65e5\u672c \U0001F600 \"q\" \\ \n \t \u0001"},  # escapes, multi-byte UTF-8, a surrogate pair
    {"pid": "Spans", "tid": "stream 7 7"},
    {"pid": None, "tid": -3, "cat": None},
    {"ts": 1712195495519689.047, "dur": 1e-3},  # epoch µs (exact digits), an exponent
    {"ts": 123.4567, "dur": 0.0005},  # digits beyond the nanosecond
    {"ts": None},
    {"dur": -1.0},
    {"ts": 9.3e18},
    {"args": {"External id": "12", "correlation": 1.5, "stream": "0x0", "device": 2.0}},  # odd types, as ROCm writes
    {"args": {"Collective name": 7, "dtype": "Float", "In msg nelems": 1 << 62, "Src Rank": None}},
    {"args": {"External id": 18446744073709551615}},  # beyond int64
    {"name": "c10d::send", "args": {"Concrete Inputs": ["", "", "1", "7"], "Input Dims": [[[2, 3]], [], [], []],
                                    "Input type": ["TensorList", "", "Int", "Int"]}},
    {"args": {"grid": [1, 2, {"deep": [[[]]]}], "extra": {"a": {"b": None}}, "flag": True}},
    {"unknown": {"x": [1, "two", False]}, "ph": "X"},
    {"ph": "X", "ph ": "i"},
    {"args": {"Exte\u006ernal id": 5}},  # an escaped key
])
def test_edge_cases_read_the_same(tmp_path, monkeypatch, case):
    for gz in (False, True):
        f = _write(tmp_path, [dict(X, **case), {"ph": "i", "name": "[memory]", "ts": 11.0, "pid": 1, "tid": 2,
                                                 "args": {"Total Allocated": 5, "Bytes": "x", "Device Id": -1,
                                                          "Addr": "0x7f"}}], gz=gz)
        assert_same(f, monkeypatch)


# Number literals as a writer may spell them, each read both ways (the scanner's one-pass path takes the short ones,
# the general path the rest): the padding after the event keeps the one-pass path's look-ahead inside the buffer.
_NUMBERS = ["0", "-0", "-0.5", "7", "12345678", "-87654321", "123456789", "99999999.5", "1234567812345678.25", "12.5", "-12.125", "5173640930990.000", "5173640930990.0005", "999999999999999",
            "1000000000000000", "123456789012345678", "8796093022207.999", "8796093022208.5", "1.0e3", "1E-3",
            "2.25E+2", "0.001", "0.0001", "1669783687464181", "-1669783687464181", "1669783687464181.5",
            "8999999999999999.999", "9000000000000000", "12345678901234567", "9223372036854775807", "-9223372036854775808", "9223372036854775808"]


@pytest.mark.parametrize("num", _NUMBERS)
def test_number_literals_read_the_same(tmp_path, monkeypatch, num):
    pad = '{"ph": "M", "name": "padding", "args": {"name": "' + "p" * 40 + '"}}'
    for field in ("ts", "dur", "correlation", "External id", "stream"):
        ev = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "TS", "dur": "DUR",
              "args": {"correlation": "CORR", "External id": "EXT", "stream": "STREAM", "device": 0}}
        text = json.dumps({"traceEvents": [ev]})
        values = {"TS": "10.5", "DUR": "2", "CORR": "3", "EXT": "4", "STREAM": "7"}
        values[{"ts": "TS", "dur": "DUR", "correlation": "CORR", "External id": "EXT", "stream": "STREAM"}[field]] = num
        for k, v in values.items():
            text = text.replace(f'"{k}"', v)
        f = tmp_path / "t.json"
        f.write_text(text.replace("}]}", "}, " + pad + "]}"))
        assert _uses_native(f)
        assert_same(f, monkeypatch)


def _raw_events(*events: str) -> bytes:
    pad = '{"ph": "M", "name": "padding", "args": {"name": "' + "p" * 40 + '"}}'
    return ('{"traceEvents": [' + ", ".join(events) + ", " + pad + "]}").encode()


def _x(name: str, cat: str = '"kernel"', pid: str = "0", tid: str = "7", args: str = '{"correlation": 1}') -> str:
    return f'{{"ph": "X", "cat": {cat}, "name": {name}, "pid": {pid}, "tid": {tid}, "ts": 1.5, "dur": 2, "args": {args}}}'


# The scanner takes a name, category, pid or tid it has seen before (and args keys it does not read) by comparing the
# bytes as written with the text it holds: each case repeats values spelled alike, spelled otherwise, or nearly alike.
@pytest.mark.parametrize("events", [
    [_x('"void kernel_long_name<int>(int)"'), _x('"void kernel_long_name<int>(int)x"'), _x('"void kernel_long_name"'),
     _x('"void kernel_long_name<int>(int)"')],
    [_x('"caf\\u00e9 au lait"'), _x('"café au lait"'), _x('"caf\\u00e9 au lait"'), _x('"café au lai\\u0074"')],
    [_x('"quote \\" inside"'), _x('"quote \\" inside"'), _x('"quote "')],
    [_x('"op"', pid="7", tid="7"), _x('"op"', pid='"7"', tid='"7"'), _x('"op"', pid="70", tid="-7"),
     _x('"op"', pid='"70"', tid='"-7"'), _x('"op"', pid="7", tid="7")],
    [_x('"op"', pid='"-x"'), _x('"op"', pid='"0"', tid='"00"'), _x('"op"', pid="0", tid="0"), _x('"op"', pid='"-"')],
    [_x('"op"', cat='"cpu_op"'), _x('"op"', cat='"cpu_op2"'), _x('"op"', cat='"cpu_o"'), _x('"op"', cat="null"),
     _x('"op"', cat='"cpu\\u005fop"'), _x('"op"', cat='"cpu_op"')],
    [_x('"op"', args='{"queued": 0, "queue": 1, "queued2": [1, {"a": "b"}], "queued": 3, "correlation": 4}'),
     _x('"op"', args='{"queued": 0, "queue": 1, "queued2": 2, "q\\u0075eued": 3, "correlation": 5}'),
     _x('"op"', args='{"correlatio": 1, "correlation2": 2, "correlation": 6, "Correlation": 7}')],
    [_x('"op"').replace('"name": "op"', '"name": "op", "name": "second"'), _x('"op"'), _x('"second"'),
     _x('"op"').replace('"name": "op"', '"name": "op", "na\\u006de": "third"')],
])
def test_repeated_values_read_the_same(tmp_path, monkeypatch, events):
    f = tmp_path / "t.json"
    f.write_bytes(_raw_events(*events))
    assert _uses_native(f)
    assert_same(f, monkeypatch)


@pytest.mark.parametrize("bad", [
    _raw_events(_x('"op"', pid="0"), _x('"op"', pid="01")),  # a known pid, then a number with a leading zero
    _raw_events(_x('"op"', pid="7"), _x('"op"', pid="7.5")),  # a known pid, then a float
    _raw_events(_x('"op"', pid='"-x"'), _x('"op"', pid="-x")),  # a known text, then the same bytes unquoted
    _raw_events(_x('"kernel_name"'), _x('"kernel_name\\x"')),  # a known name, then a bad escape after it
])
def test_repeated_values_spelled_wrong_are_handed_back(tmp_path, monkeypatch, bad):
    f = tmp_path / "t.json"
    f.write_bytes(bad)
    assert not _uses_native(f)
    assert_same(f, monkeypatch)


@pytest.mark.parametrize("bad", [
    b'{"traceEvents": [{"ph": "X", "ts": "10"}]}',  # a string time: the general decoder skips the event
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "args": null}]}',
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "pid": 1.5}]}',
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "name": "\\ud800"}]}',  # a lone surrogate
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "name": "\xff"}]}',  # not UTF-8
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1},]}',  # a trailing comma
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1}]} x',
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1}], "traceEvents": []}',
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1}, {"ph": "X", "ts": 2, "d',  # truncated
    b'{"traceEvents": [{"ph": "X", "ts": 01}]}',
    b'{"traceEvents": [{"ph": "X", "ts": 01.5, "dur": 1, "name": "a long enough name to look ahead"}]}',
    b'{"traceEvents": [{"ph": "X", "ts": 1., "dur": 1, "name": "a long enough name to look ahead"}]}',
    b'{"traceEvents": [{"ph": "X", "ts": -, "dur": 1, "name": "a long enough name to look ahead"}]}',
    b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "args": {"correlation": 012, "External id": 1234567}}]}',
    b'{"traceEvents": {}}',
    b'{"traceEvents": [' + b"[" * 300 + b"]" * 300 + b"]}",
    b"[]",
])
def test_input_the_scanner_hands_back_reads_as_before(tmp_path, monkeypatch, bad):
    f = tmp_path / "t.json"
    f.write_bytes(bad)
    assert not _uses_native(f)
    assert_same(f, monkeypatch)


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3), max_leaves=6)
_args = st.dictionaries(
    st.sampled_from(["correlation", "External id", "device", "stream", "Total Allocated", "Bytes", "Device Id", "Addr",
                     "Collective name", "In msg nelems", "dtype", "Src Rank", "Dst Rank", "Process Group Name",
                     "Concrete Inputs", "Input Dims", "Input type", "other"]),
    _value, max_size=5)
_event = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "i", "s", "M"])},
    optional={
        "name": st.sampled_from(["op", "[memory]", "c10d::send", "gloo:recv", "record_param_comms", "k\u00e9"]),
        "cat": st.one_of(st.none(), st.sampled_from(["cpu_op", "kernel", "gpu_memcpy"])),
        "pid": st.one_of(st.none(), st.integers(-5, 2**40), st.sampled_from(["Spans", "7"])),
        "tid": st.one_of(st.none(), st.integers(-5, 2**40), st.sampled_from(["stream 7", "x"])),
        "ts": st.one_of(st.none(), st.integers(-10, 2**53), st.floats(-1e3, 2e15, allow_nan=False)),
        "dur": st.one_of(st.none(), st.integers(-10, 10**9), st.floats(-1.0, 1e6, allow_nan=False)),
        "args": _args,
        "extra": _value,
    })


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(_event, min_size=1, max_size=8), indent=st.sampled_from([None, 1, 2]))
def test_random_traces_read_the_same(tmp_path, monkeypatch, events, indent):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"baseTimeNanoseconds": 1000, "traceEvents": events}, indent=indent))
    assert_same(f, monkeypatch)


def test_a_big_trace_in_pieces_reads_the_same(tmp_path, monkeypatch):
    tb = TraceBuilder()
    for i in range(400):
        tb.cpu_op(f"op{i % 7}", float(i), 0.5, args={"External id": i})
        tb.memory(i + 0.25, i, 1, addr=140_000_000_000_000 + 64 * i)
    f = tmp_path / "t.json.gz"
    f.write_bytes(gzip.compress(tb.to_bytes()))
    whole = kineto.read_trace(f)
    monkeypatch.setattr(reading, "READ_PIECE", 1000)  # gunzipped 1000 bytes at a time, events cut at every piece
    monkeypatch.setattr(reading, "NATIVE_CHUNK", 3000)
    pieces = kineto.read_trace(f)
    assert_frame_equal(whole[0], pieces[0])
    assert_frame_equal(whole[1], pieces[1])
    assert pieces[0].height == 400 and pieces[1].height == 400


def test_version_says_whether_the_scanner_is_built(capsys):
    from traceana.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert "native trace scanner: built" in capsys.readouterr().out


def test_a_large_gzip_cut_short_is_handed_back_and_recovered(tmp_path, monkeypatch):
    # Big enough (over 64 KB of gzip) for the scanner's window to be a memory mapping (kineto.MMAP_WINDOW_BYTES),
    # which a failing read must not leave unclosable: the general decoder then recovers the complete events.
    tb = TraceBuilder(rank=0)
    for i in range(40_000):
        tb.cpu_op(f"aten::op_{i % 997}_{i * 7919 % 100_003}", 10.0 + i, 0.5)
    whole = tb.write(tmp_path / "whole.pt.trace.json.gz").read_bytes()
    assert len(whole) * kineto.GZ_RATIO >= kineto.MMAP_WINDOW_BYTES
    cut = tmp_path / "cut.pt.trace.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert not _uses_native_quietly(cut)
    native = _read(cut, True, monkeypatch)
    assert not isinstance(native, Exception), native
    assert native[2]["truncated"] and 0 < native[0].height < 40_000
    assert_same(cut, monkeypatch)


def _uses_native_quietly(path: Path) -> bool:
    try:
        return _uses_native(path)
    except (OSError, EOFError, *kineto._ZLIB_ERRORS):  # a cut gzip stream: what _decode hands back on
        return False


def _gpu_trace(tb: TraceBuilder, steps: int) -> TraceBuilder:
    """Launches, kernels on three streams, CPU ops (some starting together) and NCCL sends, ``steps`` times."""
    for i in range(steps):
        t = 10.0 * i
        tb.launch(t, 1.0, correlation=i + 1)
        tb.kernel(f"k{i % 13}", t + 2.0, 3.0, stream=7 + i % 3, correlation=i + 1)
        tb.cpu_op(f"aten::op{i % 5}", t + (0.0 if i % 7 else 1.0), 0.5 + i % 4)
        if i % 500 == 0:
            tb.nccl_p2p("send", peer=1, ts=t + 4.0, dur=1.0, kernel_ts=t + 5.0, kernel_dur=1.0)
    return tb


def test_a_large_gpu_trace_reads_the_same(tmp_path, monkeypatch):
    # Over 2**17 events in many scanner calls: the scanner's event columns, kept across its calls, outgrow their
    # heap buffers into memory mappings (grown by mremap), and the table is sorted a column at a time (over
    # kineto.SORT_WHOLE_ROWS) with its tracks, devices and streams gathered by each event's track code.
    f = _gpu_trace(TraceBuilder(rank=0, world_size=2), 46_000).write(tmp_path / "t.pt.trace.json")
    monkeypatch.setattr(reading, "NATIVE_CHUNK", 1 << 20)
    batches = kineto._Batches()
    kineto._scan_file(f, batches, None)
    assert batches.rows > 2**17 and batches.tracks is not None and len(batches.x) == 1
    assert_same(f, monkeypatch)


@pytest.mark.parametrize("odd", [False, True])
def test_tracks_read_the_same_both_ways_and_sorted_by_columns(tmp_path, monkeypatch, odd):
    # A GPU event whose stream arg is not an integer (ROCm's "0x0") leaves every event's track to be derived per
    # event; either way, in both of _finish's sorts, the tables are the general decoder's.
    tb = _gpu_trace(TraceBuilder(rank=0, world_size=2), 600)
    if odd:
        tb.kernel("k_odd", 3.0, 1.0)["args"]["stream"] = "0x0"
    f = tb.write(tmp_path / "t.pt.trace.json")
    batches = kineto._Batches()
    kineto._scan_file(f, batches, None)
    assert (batches.tracks is None) == odd
    assert_same(f, monkeypatch)
    monkeypatch.setattr(kineto, "SORT_WHOLE_ROWS", 0)
    assert_same(f, monkeypatch)


# Starts and durations from few values (many ties, in every arrangement), far apart (several radix passes), missing,
# negative or out of range: the scanner's time order against the general decoder's sort of the same events.
_when = st.one_of(st.none(), st.sampled_from([0, 1, 1.5, 2, -3, 2**20, 9.2e12, 1.7e15, 4.6e15]))
_timed = st.fixed_dictionaries({"ph": st.just("X"), "cat": st.sampled_from(["cpu_op", "kernel"]),
                                "name": st.sampled_from(["a", "b"]), "pid": st.just(0), "tid": st.sampled_from([7, 8]),
                                "ts": _when, "dur": st.one_of(st.none(), st.sampled_from([0, 1, 2, 5, -1]))})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(_timed, min_size=1, max_size=40), base=st.sampled_from([None, 1000, 2**61]))
def test_the_scanner_orders_events_as_the_table_is_sorted(tmp_path, monkeypatch, events, base):
    top = {} if base is None else {"baseTimeNanoseconds": base}
    f = tmp_path / "t.json"
    f.write_text(json.dumps({**top, "traceEvents": events}))
    monkeypatch.setattr(kineto, "SORT_WHOLE_ROWS", 0)  # the column-at-a-time path, which takes the scanner's order
    assert _uses_native(f)
    assert_same(f, monkeypatch)


def test_many_events_starting_together_keep_the_table_order(tmp_path, monkeypatch):
    # A run of equal starts longer than the scanner's insertion sort takes (16): merged, stably, longest first.
    events = [dict(X, name=f"op{i}", ts=5.0, dur=float(i % 4)) for i in range(70)]
    f = _write(tmp_path, events + [dict(X, ts=4.0), dict(X, ts=None)])
    monkeypatch.setattr(kineto, "SORT_WHOLE_ROWS", 0)
    assert _uses_native(f)
    assert_same(f, monkeypatch)
