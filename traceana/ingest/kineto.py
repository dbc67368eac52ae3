"""One Kineto (torch.profiler) JSON trace → the ``events`` and ``memory`` tables plus one ``traces`` row.

The importer owns every quirk of the format; nothing downstream knows JSON exists.

Two decoders produce the same per-batch frames, which ``_finish`` turns into the tables with polars expressions:

- the native scanner (``_scan.c``, an optional C extension built at install time): the file is read through reused
  windows, gunzipped ahead into the next one by a thread of the reader; the scanner parses the ``traceEvents`` array
  straight into Arrow column buffers (times as int64 ns from the digits, strings unescaped and UTF-8 checked)
  without the GIL, so a trace of many GB never exists as Python objects nor whole in memory, and threads can read
  several files at once. Its reading loop is ``traceana.ingest.reading`` (no polars there: the CLI starts it before
  importing polars); here its Arrow tables become frames;
- the general decoder (docs/field-notes.md "Parsing speed": typed msgspec decoding ran ~4.5x faster than orjson), for
  any file the scanner hands back (a type it does not take exactly as this decoder would, bad UTF-8, invalid or
  truncated JSON) or when it was not built:
  1. the file is read (gunzipped when it starts with the gzip magic) in pieces; a JSON of at most
     ``WHOLE_JSON_BYTES`` is held whole, a larger one streams through a window (``_streamed``: at most two chunks
     ahead, or one value of at most ``limits.MAX_VALUE_BYTES``), so no trace is ever whole in memory;
  2. the top level is decoded with msgspec into a small Struct whose ``traceEvents`` is one ``msgspec.Raw``: a
     fast validating pass that builds no per-event objects; the array is then cut between events (``bytes.find``
     of the separator Kineto writes, checked by the decode itself);
  3. events are decoded in chunks of ``CHUNK_BYTES`` into typed Structs that name only the fields we use (``args``
     keeps only the keys we need; the three record_shapes lists stay ``msgspec.Raw`` and are decoded only for the
     few ``c10d::send``/``c10d::recv_``/``gloo:*`` events); each batch becomes a polars frame.
  It also explains what is wrong with a bad file, and recovers the complete events of a truncated one.

Times: Kineto writes ``ts``/``dur`` as float microseconds. Below 2**43 µs (Kineto's base-relative times) a float64
is exact to the nanosecond for 3-decimal values; an absolute µs wall clock (~1.7e15, as older Kineto wrote) is not
(float spacing there is 0.25 µs), so such chunks are decoded again with ``ts`` as ``decimal.Decimal`` (exactly the
digits in the file) and converted to int64 ns from its text. Kineto writes ``ts`` relative to
``baseTimeNanoseconds`` (checked on a torch 2.13 trace: base + ts = wall clock); when the base is present and the
``ts`` values are not already epoch-scale we add it, so ``ts_ns`` is absolute on every rank.
``displayTimeUnit`` is a viewer's display hint, not the data's unit (HTA's ns_resolution_trace says "ns" and holds
µs: docs/field-notes.md), so it is not read; ts in epoch ns is named by its size (``ns_epoch_hint``).

Bad input raises a one-line ``TraceFormatError`` (or ``BadInputError`` for a path that cannot be read). A trace cut
short while being written keeps every complete event, is marked ``truncated`` and says so in a warning.
"""

from __future__ import annotations

import decimal
import json
import math
import re
import threading
import zlib
from functools import partial
from itertools import compress
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable

import msgspec
import polars as pl

from traceana.core import limits, names, schema
from traceana.core.errors import BadInputError, TraceanaError, TraceFormatError, shown
from traceana.core.intervals import ENGINE
from traceana.core.units import MIB, NS_PER_US
from traceana.ingest import reading
from traceana.ingest.process_groups import as_int as _as_int
from traceana.ingest.reading import (GPU_CAT_NAMES as _GPU_CAT_NAMES, GPU_CATS, GZ_RATIO, GZIP_MAGIC,  # noqa: F401
                                     META_KEYS as _META_KEYS, MMAP_WINDOW_BYTES, SHAPES_NAMES as _SHAPES_NAMES,
                                     TRACE_SUFFIXES, ZLIB_ERRORS as _ZLIB_ERRORS, Budget as _Budget,
                                     NotNative as _NotNative, is_trace_name, open_trace as _open,
                                     oversized as _oversized)

# The native scanner (traceana/ingest/_scan.c), or None where it was not built: then (or with this set to None) the
# general decoder does everything.
_scan = reading._scan

# isal (a core dependency) gunzips ~1.6x faster than zlib (docs/field-notes.md).
from isal import isal_zlib as _zlib  # noqa: E402

EPOCH_US = 1e14  # ts above this (µs) is already an epoch wall clock (1e14 µs ≈ 3 years after 1970)

# Element sizes. record_param_comms writes c10::ScalarType names ("Float"); record_shapes "Input type" writes C++
# type names ("float", "c10::Half"). Sources: c10/core/ScalarType.h and the traces in docs/field-notes.md.
SCALAR_TYPE_BYTES = {
    "Byte": 1, "Char": 1, "Short": 2, "Int": 4, "Long": 8, "Half": 2, "Float": 4, "Double": 8,
    "ComplexHalf": 4, "ComplexFloat": 8, "ComplexDouble": 16, "Bool": 1, "BFloat16": 2,
    "Float8_e5m2": 1, "Float8_e4m3fn": 1, "Float8_e5m2fnuz": 1, "Float8_e4m3fnuz": 1, "UInt16": 2, "UInt32": 4,
    "UInt64": 8,
}
CPP_TYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
    "c10::complex<c10::Half>": 4, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fn": 1, "unsigned short": 2,
    "unsigned int": 4, "unsigned long": 8,
}


class NotATraceError(TraceFormatError):
    """Valid JSON, but not a Kineto trace (a config or results file that happens to end in .json)."""


_Num = int | float | str | None  # lenient: a wrong type becomes null in the table instead of losing the event


class _Args(msgspec.Struct, gc=False):
    """The only ``args`` keys ingest reads (Kineto names; see torch/csrc/profiler/util.h for the NCCL ones)."""

    correlation: _Num = None
    external_id: _Num = msgspec.field(default=None, name="External id")
    device: _Num = None
    stream: _Num = None
    total_allocated: _Num = msgspec.field(default=None, name="Total Allocated")
    delta_bytes: _Num = msgspec.field(default=None, name="Bytes")
    device_id: _Num = msgspec.field(default=None, name="Device Id")
    addr: _Num = msgspec.field(default=None, name="Addr")
    collective: _Num = msgspec.field(default=None, name="Collective name")
    in_nelems: _Num = msgspec.field(default=None, name="In msg nelems")
    dtype: _Num = None
    src_rank: _Num = msgspec.field(default=None, name="Src Rank")
    dst_rank: _Num = msgspec.field(default=None, name="Dst Rank")
    pg_name: _Num = msgspec.field(default=None, name="Process Group Name")
    pg_desc: _Num = msgspec.field(default=None, name="Process Group Description")
    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Concrete Inputs")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input type")


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: str | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float | None = None  # exact to the ns below FLOAT_EXACT_US; see _ExactEvent and the module docstring
    dur: float | None = None
    args: _Args = msgspec.field(default_factory=_Args)


class _ExactEvent(_Event):
    """Same fields, ``ts`` kept as the exact decimal digits: for traces whose µs values a float cannot hold."""

    ts: decimal.Decimal | None = None


class _Top(msgspec.Struct):
    """Top level of a Kineto trace; everything but the event list stays raw and is decoded leniently later."""

    traceEvents: msgspec.Raw = msgspec.Raw(b"")  # the whole array, validated but not decoded (one zero-copy view)
    distributedInfo: msgspec.Raw = msgspec.Raw(b"")
    deviceProperties: msgspec.Raw = msgspec.Raw(b"")
    baseTimeNanoseconds: msgspec.Raw = msgspec.Raw(b"")
    traceana: msgspec.Raw = msgspec.Raw(b"")


_TOP = msgspec.json.Decoder(_Top)
_DECODERS = {
    False: (msgspec.json.Decoder(list[_Event]), msgspec.json.Decoder(_Event)),
    True: (msgspec.json.Decoder(list[_ExactEvent]), msgspec.json.Decoder(_ExactEvent)),
}
# Below 2**43 µs (~100 days: Kineto's base-relative ts) a float64's spacing is < 1 ns, so floor + rounded fraction
# gives the exact ns of a 3-decimal µs value. Above it (absolute epoch µs ~1.7e15: spacing 0.25 µs) we decode the
# digits exactly instead.
FLOAT_EXACT_US = 2.0**43
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_STREAM_IN_TID = r"(\d+)\s*$"

_GLOO_PREFIX = names.GLOO_PREFIX  # gloo events carry record_shapes facts too (the scanner's shaped prefixes)


# --- reading bytes (the general decoder) -------------------------------------------------------------------------
WHOLE_JSON_BYTES = 16 * MIB  # a trace whose JSON is at most this is decoded whole (every diagnostic of a bad file)
STREAM_PIECE = MIB  # bytes read, or decompressed, at a time by the general decoder


def _pieces(path: Path, state: dict):
    """The trace's JSON bytes (gunzipped when it starts with the gzip magic) in pieces of at most STREAM_PIECE,
    never more than one piece of the file or its decompressed stream at once. ``state["truncated"]`` is set when
    the gzip stream ended early (a writer killed mid-file: what decompressed is kept)."""
    with _open(path) as fh:
        def read(n: int) -> bytes:
            try:
                data = fh.read(n)
                state["read"] = state.get("read", 0) + len(data)
                return data
            except OSError as e:
                raise BadInputError(f"cannot read the file ({e.strerror or e})", path=shown(path),
                                    fix="check the file and any symlinks to it") from None

        first = read(STREAM_PIECE)
        if not first:
            raise TraceFormatError("empty file (0 bytes)", path=shown(path),
                                   fix="the profiler did not write this trace; re-collect it or remove the file")
        if first[:2] != GZIP_MAGIC:
            while first:
                yield first
                first = read(STREAM_PIECE)
            return
        tail = first
        try:
            while tail[:2] == GZIP_MAGIC:  # concatenated gzip members are one stream
                d = _zlib.decompressobj(16 + zlib.MAX_WBITS)
                while True:
                    if not tail:
                        tail = read(STREAM_PIECE)
                        if not tail:  # the file ended inside a member
                            state["truncated"] = True
                            return
                    piece = d.decompress(tail, STREAM_PIECE)
                    if piece:
                        yield piece
                    tail = d.unconsumed_tail
                    if d.eof:
                        break
                tail = d.unused_data or read(STREAM_PIECE)
        except _ZLIB_ERRORS as e:
            raise TraceFormatError(f"corrupt gzip data ({e})", path=shown(path),
                                   fix="the file is damaged; copy it again from where it was written") from None


class _Window:
    """The JSON behind a window: ``buf`` holds bytes ``base`` .. ``base + len(buf)`` of the stream."""

    def __init__(self, pieces) -> None:
        self.pieces, self.buf, self.base, self.eof = pieces, bytearray(), 0, False

    def fill(self, n: int) -> None:
        """Read until the window holds ``n`` bytes, or the stream ends."""
        while len(self.buf) < n and not self.eof:
            piece = next(self.pieces, None)
            if piece is None:
                self.eof = True
            else:
                self.buf += piece

    def drop(self, k: int) -> None:
        del self.buf[:k]
        self.base += k

    def copy(self, lo: int, hi: int, *, head: bytes = b"[", tail: bytes = b"]") -> bytearray:
        """``head + buf[lo:hi] + tail`` as a fresh buffer (decoded values may point into it; the window moves)."""
        out = bytearray(len(head) + hi - lo + len(tail))
        with memoryview(self.buf) as view:
            out[: len(head)] = head
            out[len(head) : len(head) + hi - lo] = view[lo:hi]
        out[len(head) + hi - lo :] = tail
        return out


_EVENTS_KEY = re.compile(rb'"traceEvents"[ \t\r\n]*:[ \t\r\n]*\[')


def _stream_head(w: _Window, path: Path) -> tuple[_Top, int]:
    """The top level before the traceEvents array, decoded, and where the array's first event may start.

    The key is taken where the head before it closes as a JSON object (so not a "traceEvents" inside a string or a
    nested value); the head may not exceed MAX_VALUE_BYTES."""
    w.fill(limits.MAX_VALUE_BYTES + STREAM_PIECE)
    lead = len(w.buf) - len(w.buf.lstrip(b" \t\r\n"))
    if lead >= limits.MAX_VALUE_BYTES:
        raise _oversized(path, lead)
    _check_start(bytes(w.buf[lead : lead + 64]), path)
    for m in _EVENTS_KEY.finditer(w.buf, lead, lead + limits.MAX_VALUE_BYTES):
        head = bytes(w.buf[lead : m.start()]).rstrip(b" \t\r\n")
        if head != b"{" and not head.endswith(b","):
            continue
        try:
            return _TOP.decode(head.removesuffix(b",") + b"}"), m.end()
        except _DECODE_ERRORS:
            continue
    if len(w.buf) > limits.MAX_VALUE_BYTES:
        raise _oversized(path, limits.MAX_VALUE_BYTES)
    # The whole JSON is in the window and has no traceEvents array: say what it is, as for a small file.
    decoded, _ = _decode_top(bytes(w.buf), path)
    what = "whose traceEvents is not a list" if len(decoded.traceEvents) else "without traceEvents"
    raise NotATraceError(f"JSON object {what}: not a Kineto trace", path=shown(path),
                         fix="pass a trace written by torch.profiler (export_chrome_trace)")


def _streamed(w: _Window, path: Path, problems: list[str], on_progress, size: int, state: dict):
    """Typed events of a large trace read through the window ``w`` (the general decoder's streaming mode); yields
    (events, their ts in ns) per chunk, and returns (top-level raw values, truncated).

    Memory: the window holds at most two chunks (CHUNK_BYTES) of JSON ahead of the current one, or one value of at
    most MAX_VALUE_BYTES (refused beyond it, as the native scanner refuses it). A chunk is cut at a separator
    between events; a cut that was not one (inside a string, or past the array's end) fails to decode as a list,
    and the chunk is retried twice as long. The array's last chunks and the rest of the top level are decoded as
    one small document, which also recovers the complete events of a cut-off file."""
    head, start = _stream_head(w, path)
    top = {k: bytes(getattr(head, k)) for k in _META_KEYS}
    while True:
        w.fill(start + 2 * CHUNK_BYTES + 1)
        if w.eof and len(w.buf) - start <= 2 * CHUNK_BYTES:
            break
        target, chunk = CHUNK_BYTES, None
        while chunk is None:
            m = _ANY_SEPARATOR.search(w.buf, start + target)
            if m is None and not w.eof:
                if len(w.buf) - start > limits.MAX_VALUE_BYTES + 2 * CHUNK_BYTES:
                    raise _oversized(path, w.base + start)
                w.fill(len(w.buf) + STREAM_PIECE)
                continue
            if m is None:  # the stream ended: the rest is the array's end and the top level's
                break
            comma = w.buf.index(b",", m.start())
            try:
                evs, ts, _ = _decode_chunk(w.copy(start, comma), problems)
            except _BadSplit:
                if target > limits.MAX_VALUE_BYTES:
                    raise TraceFormatError(f"not valid JSON (or one event over {limits.MAX_VALUE_BYTES >> 20} MiB) in "
                                           f"the traceEvents array after byte {w.base + start:,} of the JSON",
                                           path=shown(path),
                                           fix="the file is damaged or not a trace; re-collect it") from None
                target *= 2
                w.fill(start + target + 2 * CHUNK_BYTES)
                continue
            chunk = evs
            yield evs, ts
            start = comma + 1
        if chunk is None:
            break
        w.drop(start)
        start = 0
        if on_progress is not None:
            on_progress(min(state.get("read", 0), size), size)
    # The last chunks, the array's end and the rest of the top level: one small document, decoded like a whole file.
    rest = w.copy(start, len(w.buf), head=b'{"traceEvents": [', tail=b"")
    w.drop(len(w.buf))
    try:
        tail, truncated = _decode_top(rest, path)
    except _NothingRecovered:  # cut off right after a chunk: the events so far are all there is
        return top, True
    top.update((k, bytes(getattr(tail, k))) for k in _META_KEYS if len(getattr(tail, k)))
    for evs, ts, _, _ in _decoded_chunks(rest, tail.traceEvents, problems):
        yield evs, ts
    return top, truncated


# --- top level ---------------------------------------------------------------------------------------------------
def _check_start(first: bytes, path: Path) -> None:
    """The JSON must open an object: one line saying what the file is instead."""
    head = first.lstrip()
    if not head:
        raise TraceFormatError("file holds only whitespace", path=shown(path), fix="re-collect the trace")
    if head[:1] != b"{":
        what = "a JSON array" if head[:1] == b"[" else "not JSON"
        cls = NotATraceError if head[:1] == b"[" else TraceFormatError
        raise cls(f"{what}, not a Kineto trace object", path=shown(path),
                  fix="pass the JSON file torch.profiler wrote (export_chrome_trace / tensorboard_trace_handler)")


def _decode_top(buf: bytes, path: Path) -> tuple[_Top, bool]:
    """Decode the top level; on a cut-off file recover every complete event. Returns (top, truncated)."""
    _check_start(bytes(buf[:64]), path)
    try:
        return _TOP.decode(buf), False
    except msgspec.ValidationError as e:
        raise NotATraceError(f"not a Kineto trace ({e})", path=shown(path),
                             fix="pass a torch.profiler trace whose traceEvents is a list") from None
    except RecursionError:
        raise TraceFormatError("JSON nested too deeply to decode (over ~1000 levels)", path=shown(path),
                               fix="this is not a profiler trace as torch writes it; re-collect it") from None
    except msgspec.DecodeError as e:
        msg = str(e)
    # A killed writer leaves a prefix (sometimes followed by NUL padding from the file system).
    body = buf.rstrip(b"\x00 \t\r\n")
    try:
        _TOP.decode(body)
    except msgspec.DecodeError as e:
        if "truncated" not in str(e):
            raise TraceFormatError(f"not valid JSON ({msg})", path=shown(path),
                                   fix="the file is damaged or not a trace; re-collect it") from None
    except (msgspec.ValidationError, RecursionError):
        raise TraceFormatError(f"not valid JSON ({msg})", path=shown(path), fix="re-collect the trace") from None
    else:  # only trailing NULs/whitespace were wrong
        return _TOP.decode(body), True
    return _recover(body, path), True


class _NothingRecovered(TraceFormatError):
    """A cut-off JSON with no complete event after its cut-off point."""


def _recover(body: bytes, path: Path, max_tries: int = 64) -> _Top:
    """Close a cut-off trace after its last complete event: try each '}' from the end, writing ']}' after it."""
    start = body.find(b'"traceEvents"')
    if start < 0:
        raise TraceFormatError("truncated before any trace event was written", path=shown(path),
                               fix="the job was killed while writing; re-collect the trace")
    lb = body.find(b"[", start)
    buf = bytearray(body)
    buf += b"  "  # room to write ']}' in place (must happen before a memoryview pins the size)
    view = memoryview(buf)
    pos = len(body)
    for _ in range(max_tries):
        p = buf.rfind(b"}", lb, pos)
        if p < 0:
            break
        saved = bytes(buf[p + 1 : p + 3])
        buf[p + 1 : p + 3] = b"]}"
        try:
            top = _TOP.decode(view[: p + 3])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            buf[p + 1 : p + 3] = saved
            pos = p
            continue
        # Raw values point into ``buf``; keep it alive with the result.
        return top
    raise _NothingRecovered("truncated and no complete trace event could be recovered", path=shown(path),
                           fix="the job was killed while writing; re-collect the trace")


def _loads(raw: msgspec.Raw | bytes | str | None) -> Any:
    """A raw JSON value decoded, or None when it is absent or does not decode."""
    if raw is None or not len(raw):
        return None
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None


# --- events ------------------------------------------------------------------------------------------------------
CHUNK_BYTES = 4_000_000  # raw JSON decoded into Python objects at a time: bounds transient memory (smaller chunks
# measured less memory and less kernel time in page faults than 16-64 MB, at the same user time)
# Between two events of the traceEvents array: Kineto's pretty printer writes exactly the first; any writer the second.
_KINETO_SEPARATOR = re.compile(re.escape(b"\n  },\n  {"))
_ANY_SEPARATOR = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")


def _array_span(buf: bytes | bytearray, events: msgspec.Raw) -> tuple[int, int] | None:
    """Where the traceEvents array lies in ``buf`` (msgspec.Raw is a view into it, but does not say where)."""
    view = memoryview(events)
    n = view.nbytes
    edge = min(n, 1 << 16)
    head, tail = view[:edge].tobytes(), view[n - edge :].tobytes()
    key = buf.find(b'"traceEvents"')
    while key >= 0:
        lb = buf.find(b"[", key)
        if lb >= 0 and buf[lb : lb + edge] == head and buf[lb + n - edge : lb + n] == tail:
            return lb, lb + n
        key = buf.find(b'"traceEvents"', key + 1)
    return None


class _BadSplit(Exception):
    """A chunk was not cut between two events (its brackets do not balance)."""


def _event_chunks(buf: bytes | bytearray, events: msgspec.Raw):
    """Yield (JSON array of whole events, bytes done, bytes total), about CHUNK_BYTES each.

    The array is cut only at a separator between two events, found by a regex search from the target size (no
    per-event Python objects).
    A cut anywhere else leaves unbalanced brackets, so the chunk fails to decode (the whole array was validated by
    the top-level decode, so nothing else can fail that way) and we fall back to letting msgspec find each event's
    bounds: always correct, a little slower.
    """
    span = _array_span(buf, events)
    if span is None:
        yield from _raw_chunks(events, 0)
        return
    lo, hi = span  # buf[lo] == "[", buf[hi - 1] == "]"
    total = hi - lo
    sep = _KINETO_SEPARATOR if _KINETO_SEPARATOR.search(buf, lo, min(hi, lo + MIB)) else _ANY_SEPARATOR
    start = lo + 1
    view = memoryview(buf)
    # Each chunk is copied as "[" + events + "]" into one reused buffer: a fresh 4 MB allocation per chunk cost
    # more (page faults, zero-filling) than the decode of a tenth of it. Older chunks' msgspec.Raw values may
    # still point into the buffer, so it is never resized, only replaced when a chunk does not fit.
    scratch = bytearray()
    while start < hi - 1:
        m = sep.search(buf, start + CHUNK_BYTES, hi) if hi - start > 2 * CHUNK_BYTES else None
        if m is None:
            end, nxt = hi - 1, hi
        else:
            comma = buf.index(b",", m.start())
            end, nxt = comma, comma + 1
        n = end - start + 2
        if len(scratch) < n:
            scratch = bytearray(max(n, min(2 * CHUNK_BYTES, total + 2)))
        scratch[0] = 0x5B
        scratch[1 : n - 1] = view[start:end]
        scratch[n - 1] = 0x5D
        yield memoryview(scratch)[:n], nxt - lo, total
        start = nxt



def _raw_chunks(events: msgspec.Raw, skip_events: int):
    """The always-correct splitter: msgspec finds each event's bounds (one Raw object per event)."""
    raws = msgspec.json.decode(events, type=list[msgspec.Raw])
    total = memoryview(events).nbytes
    i, done = skip_events, 0
    while i < len(raws):
        j, size = i, 0
        while j < len(raws) and size < CHUNK_BYTES:
            size += memoryview(raws[j]).nbytes + 1
            j += 1
        done = total if j == len(raws) else min(done + size, total)  # sizes ignore whitespace: approximate
        yield b"[" + b",".join(raws[i:j]) + b"]", done, total
        i = j


def _decoded_chunks(buf: bytes | bytearray, events: msgspec.Raw, problems: list[str]):
    """Typed events of the traceEvents array, chunk by chunk: (events, their ts in ns, bytes done, bytes total)."""
    n_events = 0
    for chunk, done, total in _event_chunks(buf, events):
        try:
            evs, ts, n = _decode_chunk(chunk, problems)
        except _BadSplit:
            for chunk2, done2, total2 in _raw_chunks(events, n_events):
                evs, ts, n = _decode_chunk(chunk2, problems)
                yield evs, ts, done2, total2
            return
        n_events += n
        yield evs, ts, done, total


def _decode_chunk(chunk: bytes | bytearray, problems: list[str]) -> tuple[list[_Event], pl.Series, int]:
    """Typed events of one chunk, their ts in ns (exact, see FLOAT_EXACT_US) and how many events the chunk held."""
    batch_problems: list[str] = []
    evs, n = _decode_batch(chunk, batch_problems, exact=False)
    ts = _ts_ns(evs)
    if ts is None:  # some |ts| >= FLOAT_EXACT_US: decode this chunk again with exact ts digits
        batch_problems = []
        evs, n = _decode_batch(chunk, batch_problems, exact=True)
        ts = _ts_ns(evs)
    problems.extend(batch_problems)
    return evs, ts, n


def _decode_batch(chunk: bytes | bytearray, problems: list[str], *, exact: bool) -> tuple[list[_Event], int]:
    many, one = _DECODERS[exact]
    try:
        evs = many.decode(chunk)
        return evs, len(evs)
    except _DECODE_ERRORS:
        pass
    # Some event in this chunk is malformed: decode one by one, keep the good ones, count the rest.
    try:
        raws = msgspec.json.decode(chunk, type=list[msgspec.Raw])
    except msgspec.DecodeError:
        raise _BadSplit from None
    out: list[_Event] = []
    for raw in raws:
        try:
            out.append(one.decode(raw))
            continue
        except msgspec.DecodeError as e:
            if "UTF-8" in str(e):  # a non-UTF-8 name: keep the event, with U+FFFD in place of the bad bytes
                try:
                    out.append(one.decode(bytes(raw).decode("utf-8", "replace").encode()))
                    continue
                except _DECODE_ERRORS as e2:
                    problems.append(str(e2))
                    continue
            problems.append(str(e))
        except (msgspec.ValidationError, RecursionError) as e:
            problems.append(f"{type(e).__name__}: {e}"[:200])
    return out, len(raws)


def _series(name: str, values: list[Any], dtype: pl.DataType) -> pl.Series:
    """A typed column from decoded values; mixed or wrong types (rare) become null instead of failing."""
    try:
        return pl.Series(name, values, dtype=dtype)
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        return pl.Series(name, values, dtype=dtype, strict=False)


def _text_series(name: str, values: list[Any]) -> pl.Series:
    """pid/tid: ints or strings ("Spans", "stream 7") → text."""
    try:  # the usual case, all ints (or missing): no type inference
        return pl.Series(name, values, dtype=pl.Int64).cast(pl.String)
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        pass
    try:
        s = pl.Series(name, values)
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        return pl.Series(name, values, dtype=pl.String, strict=False)
    if s.dtype == pl.String:
        return s
    if s.dtype.is_integer() or s.dtype == pl.Null:
        return s.cast(pl.String)
    return pl.Series(name, values, dtype=pl.String, strict=False)


def _ts_ns(evs: list[_Event]) -> pl.Series | None:
    """Relative ns of each event's ts, null where missing or not a number; None when a float cannot be exact."""
    ts = list(map(attrgetter("ts"), evs))
    if evs and isinstance(evs[0], _ExactEvent):
        text = pl.DataFrame({"t": pl.Series("t", list(map(str, ts)), dtype=pl.String)})
        return text.select(_us_text_to_ns(pl.col("t"))).to_series().alias("ts_rel")
    f = _series("t", ts, pl.Float64)
    hi, lo = f.max(), f.min()
    if hi is not None and max(abs(hi), abs(lo)) >= FLOAT_EXACT_US:  # type: ignore[arg-type]
        return None
    # One select (each eager Series method is a query of its own: ~0.5 ms of fixed cost per call per chunk).
    t = pl.col("t")
    ns = (t.floor().cast(pl.Int64, strict=False) * NS_PER_US
          + ((t - t.floor()) * NS_PER_US).round(0).cast(pl.Int64, strict=False))
    return f.to_frame().select(ns.alias("ts_rel")).to_series()


def _dur_ns(dur_us: pl.Series) -> pl.Series:
    """Float µs → int64 ns (rounded); null where not finite or far out of range (checked again in _finish)."""
    d = pl.col(dur_us.name)
    ns = pl.when(d.is_finite() & (d.abs() < 9.0e15)).then((d * NS_PER_US).round(0)).cast(pl.Int64)
    return dur_us.to_frame().select(ns.alias("dur_ns")).to_series()


def _args_of(evs: list[_Event], fields: tuple[tuple[str, str, pl.DataType], ...], *,
             args: list[_Args] | None = None) -> dict[str, pl.Series]:
    if args is None:
        args = list(map(attrgetter("args"), evs))
    return {col: _series(col, list(map(attrgetter(f), args)), dtype) for col, f, dtype in fields}


_X_ARGS = (
    ("corr_id", "correlation", pl.Int64),
    ("ext_id", "external_id", pl.Int64),
)
# Read only for GPU-stream events (the only ones whose device/stream _finish uses): fewer per-event passes.
_GPU_ARGS = (
    ("arg_device", "device", pl.Int64),
    ("arg_stream", "stream", pl.Int64),
)
_MEM_ARGS = (
    ("allocated_bytes", "total_allocated", pl.Int64),
    ("delta_bytes", "delta_bytes", pl.Int64),
    ("device", "device_id", pl.Int64),
    ("addr", "addr", pl.Int64),
)
_SHAPE_ARGS = ("concrete_inputs", "input_dims", "input_type")  # record_shapes lists, kept raw
_COMM_ARGS = (
    ("coll", "collective", pl.String),
    ("in_nelems", "in_nelems", pl.Int64),
    ("dtype", "dtype", pl.String),
    ("src_rank", "src_rank", pl.Int64),
    ("dst_rank", "dst_rank", pl.Int64),
    ("pg_name", "pg_name", pl.String),
    ("pg_desc", "pg_desc", pl.String),
)


class _Batches:
    """Accumulates per-batch frames: X events, memory instants, and the sparse comm/shape facts (by row)."""

    def __init__(self) -> None:
        self.x: list[pl.DataFrame] = []
        self.mem: list[pl.DataFrame] = []
        self.comm: list[pl.DataFrame] = []
        self.gpu: list[pl.DataFrame] = []  # device/stream args of GPU-stream events
        self.shapes: list[pl.DataFrame] = []
        self.rows = 0  # X events so far
        self.n_mem = 0  # [memory] instants so far
        # The native scanner's X frames hold name, cat, pid and tid as codes into these (each a String Series of the
        # file's distinct values); None: the general decoder's frames hold the text (see _finish).
        self.dicts: tuple[pl.Series, ...] | None = None
        # The native scanner's X frame also holds each event's track as a code into these distinct tracks (is_gpu,
        # arg_device, arg_stream, pid, tid; see _finish); None: derived per event (the general decoder's frames, or
        # a GPU event's device or stream arg of another type).
        self.tracks: pl.DataFrame | None = None
        self._odd_x: list = []  # the scanner's odd X values (rows in the file), put in when its columns are taken
        self.sorted = False  # the X frame is already in the table's order (the native scanner's: _finish)
        self._gpu_raw: list = []  # the scanner's GPU tables (and their odd values), until take_native

    def add(self, evs: list[_Event], ts: pl.Series) -> None:
        ph = pl.Series(list(map(attrgetter("ph"), evs)), dtype=pl.String)
        name = pl.Series(list(map(attrgetter("name"), evs)), dtype=pl.String)
        is_x = ph == "X"
        is_mem = (ph == "i") & (name == "[memory]")
        mem = list(compress(evs, is_mem.to_list()))
        if mem:
            self.mem.append(pl.DataFrame({"ts_rel": ts.filter(is_mem), **_args_of(mem, _MEM_ARGS)}))
            self.n_mem += len(mem)
        xs = list(compress(evs, is_x.to_list()))
        if not xs:
            return
        xname = name.filter(is_x).alias("name")
        cat = _series("cat", list(map(attrgetter("cat"), xs)), pl.String)
        xargs = list(map(attrgetter("args"), xs))
        # Which X events need more than the common columns, found in one query.
        which = pl.DataFrame([xname, cat]).select(
            gpu=pl.col("cat").is_in(_GPU_CAT_NAMES).arg_true().implode(),
            rpc=(pl.col("name") == names.RECORD_PARAM_COMMS).arg_true().implode(),
            shaped=(pl.col("name").is_in(list(_SHAPES_NAMES)) | pl.col("name").str.starts_with(_GLOO_PREFIX))
            .arg_true().implode(),
        )
        gpu, rpc, shaped = (which[c][0] for c in ("gpu", "rpc", "shaped"))
        if len(gpu):
            gpu_args = _args_of([], _GPU_ARGS, args=[xargs[i] for i in gpu.to_list()])
            self.gpu.append(pl.DataFrame({"row": (gpu + self.rows).cast(pl.UInt32), **gpu_args}))
        frame = pl.DataFrame({
            "name": xname,
            "cat": cat,
            "pid": _text_series("pid", list(map(attrgetter("pid"), xs))),
            "tid": _text_series("tid", list(map(attrgetter("tid"), xs))),
            "ts_rel": ts.filter(is_x),
            "dur_ns": _dur_ns(_series("dur_us", list(map(attrgetter("dur"), xs)), pl.Float64)),
            **_args_of(xs, _X_ARGS, args=xargs),
        })
        self.x.append(frame)
        # Sparse facts, decoded only for the few events that carry them.
        if len(rpc):
            sub = [xs[i] for i in rpc.to_list()]
            self.comm.append(pl.DataFrame({"row": (rpc + self.rows).cast(pl.UInt32), **_args_of(sub, _COMM_ARGS)}))
        if len(shaped):
            sub = [xs[i].args for i in shaped.to_list()]
            self.shapes.append(_shape_facts(*(list(map(attrgetter(f), sub)) for f in _SHAPE_ARGS), shaped + self.rows))
        self.rows += frame.height

    def add_columns(self, x_cols, mem_cols, gpu_cols, comm_cols, shape_cols, odd: list) -> None:
        """The scanner's tables of one call (``_scan.c`` "emitting rows"): memory instants and the sparse GPU,
        communication and record_shapes rows, which already hold their X event's row in the file. The X events stay
        in the scanner (``x_cols`` has no columns, only their count) until ``take_native``."""
        mem = _with_odd(_arrow_frame(mem_cols), odd, _ODD_MEM)
        if mem.height:
            self.mem.append(mem)
            self.n_mem += mem.height
        self.rows += len(x_cols)
        self._odd_x.extend(o for o in odd if o[0] == _ODD_X)
        if len(gpu_cols):  # made a frame only if the file's tracks are left to _finish (take_native)
            self._gpu_raw.append((gpu_cols, [o for o in odd if o[0] == _ODD_GPU]))
        comm = _with_odd(_arrow_frame(comm_cols), odd, _ODD_COMM)
        if comm.height:
            self.comm.append(comm.with_columns(pl.col("row").cast(pl.UInt32)))
        shaped = _arrow_frame(shape_cols)
        if shaped.height:
            raws = (shaped[c].to_list() for c in _SHAPE_ARGS)
            self.shapes.append(_shape_facts(*raws, shaped["row"]))

    def take_native(self, scanned: reading.Scanned) -> None:
        """The scanner's X events (one frame, in time order: name, cat, pid and tid as codes into its dictionaries, and
        each event's track as a code into its tracks), its dictionaries and its tracks, once the file is scanned. The
        sparse tables' rows (and the odd values') become rows of that frame, as if the file held the events in it."""
        x, tracks, pos = scanned.taken
        pos = _arrow_frame(pos).to_series()
        self.dicts = tuple(_arrow_frame(d).to_series() for d in scanned.dicts)
        if tracks is None:  # the GPU args, per event (their args are in the tracks otherwise)
            self.gpu = [_with_odd(_arrow_frame(g), odd, _ODD_GPU).with_columns(pl.col("row").cast(pl.UInt32))
                        for g, odd in self._gpu_raw]
        self._gpu_raw = []
        for frames in (self.gpu, self.comm, self.shapes):
            frames[:] = [f.with_columns(pos.gather(f["row"]).cast(pl.UInt32).alias("row")) for f in frames]
        odd_x = [(t, col, pos[row], raw) for t, col, row, raw in self._odd_x]
        self._odd_x = []
        self.sorted = True
        x = _with_odd(pl.concat([_arrow_frame(c) for c in x], how="horizontal"), odd_x, _ODD_X)
        if tracks is None:
            x = x.drop("track")
        else:
            self.tracks = _arrow_frame(tracks)
        if x.height:
            self.x.append(x)


def _us_text_to_ns(text: pl.Expr) -> pl.Expr:
    """Exact µs text ("1712195495519689.047", "12", "1.5E+3") → int64 ns; null when not a usable number.

    Digits below 1 ns are truncated. Exponent forms (rare) go through float64, exact enough for them.
    """
    parts = text.str.extract_groups(r"^(-?)(\d{1,16})(?:\.(\d*))?$")
    sign = pl.when(parts.struct.field("1") == "-").then(-1).otherwise(1)
    whole = parts.struct.field("2").cast(pl.Int64, strict=False)
    whole = pl.when(whole < 9_000_000_000_000_000).then(whole)  # keeps whole * NS_PER_US inside int64
    # (the first 3 digits after the point: NS_PER_US is 1,000)
    frac = parts.struct.field("3").fill_null("").str.slice(0, 3).str.pad_end(3, "0").cast(pl.Int64, strict=False)
    exact = sign * (whole * NS_PER_US + frac)
    as_float = text.cast(pl.Float64, strict=False) * NS_PER_US
    fallback = pl.when(as_float.is_finite() & (as_float.abs() < 9.0e18)).then(as_float.round(0).cast(pl.Int64))
    return pl.when(whole.is_not_null()).then(exact).otherwise(fallback)


def _shape_facts(concrete_inputs: list, input_dims: list, input_types: list, rows: pl.Series) -> pl.DataFrame:
    """peer/tag/nbytes of the few gloo P2P events, from their record_shapes args (decoded only here).

    ``c10d::send``/``c10d::recv_`` carry (tensors, process group, peer, tag) in "Concrete Inputs": the peer is a
    rank of the process group passed (a global rank in the default group). Their "Input type" is "TensorList", so
    the dtype comes from the ``gloo:*`` annotation, whose "Input type" is the element type ("float").
    """
    rows_peer: list[int | None] = []
    rows_tag: list[int | None] = []
    rows_numel: list[int | None] = []
    rows_elem: list[int | None] = []
    for raws in zip(concrete_inputs, input_dims, input_types):  # a handful per step, not per event
        concrete, dims, types = map(_loads, raws)
        peer = tag = numel = elem = None
        if isinstance(concrete, list) and len(concrete) >= 4:
            peer, tag = _as_int(concrete[2]), _as_int(concrete[3])
        if isinstance(dims, list) and dims:
            numel = _numel(dims[0])
        if isinstance(types, list) and types and isinstance(types[0], str):
            elem = CPP_TYPE_BYTES.get(types[0]) or SCALAR_TYPE_BYTES.get(types[0])
        rows_peer.append(peer)
        rows_tag.append(tag)
        rows_numel.append(numel)
        rows_elem.append(elem)
    return pl.DataFrame(
        {"row": rows.cast(pl.UInt32), "shape_peer": rows_peer, "shape_tag": rows_tag, "shape_numel": rows_numel,
         "shape_elem": rows_elem},
        schema={"row": pl.UInt32, "shape_peer": pl.Int64, "shape_tag": pl.Int64, "shape_numel": pl.Int64,
                "shape_elem": pl.Int64},
    )


def _numel(dims: Any) -> int | None:
    """Elements of one argument's shape: [4, 8] → 32; a TensorList [[4, 8], [2]] → 34; a scalar [] → None."""
    if not isinstance(dims, list) or not dims:
        return None
    if all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        n = 1
        for d in dims:
            n *= d
        return n if 0 <= n < 2**62 else None
    if all(isinstance(d, list) for d in dims):
        parts = [_numel(d) for d in dims]
        return sum(parts) if parts and all(p is not None for p in parts) else None  # type: ignore[misc]
    return None


# --- the native scanner's tables -> frames (its reading loop: traceana.ingest.reading) --------------------------------
_ODD_X, _ODD_MEM, _ODD_GPU, _ODD_COMM = range(4)  # the tables of the scanner's odd values (_scan.c T_*)

def _arrow_frame(batch) -> pl.DataFrame:
    """A scanner batch → a frame: polars imports its Arrow columns through the PyCapsule protocol, without a copy
    and without pyarrow (which costs ~0.2 s and ~40 MB to import). Column names and order are the scanner's
    (``_scan.c`` X_NAMES / M_NAMES); callers select columns by name."""
    return pl.DataFrame(batch)


def _with_odd(frame: pl.DataFrame, odd: list, table: int) -> pl.DataFrame:
    """Put in the args values of another type than their column's, converted as the general decoder converts them."""
    by_col: dict[int, tuple[list[int], list[Any]]] = {}
    for t, col, row, raw in odd:  # rare: e.g. a "stream": "0x0" written by ROCm
        if t == table:
            rows, values = by_col.setdefault(col, ([], []))
            rows.append(row)
            values.append(msgspec.json.decode(raw))
    if not by_col:
        return frame
    return frame.with_columns(
        frame[name].scatter(rows, _series(name, values, frame.schema[name]))
        for name, (rows, values) in ((frame.columns[c], v) for c, v in by_col.items())
    )


def native_available() -> bool:
    """Whether the native scanner was built (it needs a C compiler at install time)."""
    return _scan is not None


def _scan_file(path: Path, batches: _Batches, on_progress: Callable[[int, int], None] | None) -> tuple[dict, int]:
    """Decode a trace with the native scanner (``reading.scan``: its read-ahead when the command started one) into
    ``batches``; returns (top-level raw values, JSON bytes)."""
    scanned = reading.scan(path, on_progress)
    calls, scanned.calls = scanned.calls, []
    while calls:  # each call's Arrow buffers move into polars (no copy), and the raw tables go as they are taken
        batches.add_columns(*calls.pop(0))
    batches.take_native(scanned)
    return scanned.top, scanned.n_bytes


# --- whole trace -------------------------------------------------------------------------------------------------
def _meta_json(raw: msgspec.Raw) -> tuple[Any, str | None]:
    obj = _loads(raw)
    return obj, (None if obj is None else json.dumps(obj, sort_keys=True))


def rank_from_filename(path: Path) -> int | None:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _decode(path: Path, on_progress: Callable[[int, int], None] | None
            ) -> tuple[dict[str, Any], _Batches, list[str], bool, int]:
    """(top-level raw values, events in batches, malformed-event messages, truncated, JSON bytes) of one trace.

    The native scanner when it is built and takes the file; else, or when it hands the file back (anything but a
    well-formed trace of the types torch writes), the general decoder, which also explains what is wrong.
    """
    if _scan is not None:
        batches = _Batches()
        try:
            top, n_bytes = _scan_file(path, batches, on_progress)
            return top, batches, [], False, n_bytes
        except reading.HANDED_BACK:
            pass  # e.g. a truncated gzip stream (EOFError): the general decoder recovers what it can
    state: dict[str, bool] = {}
    w = _Window(_pieces(path, state))
    w.fill(WHOLE_JSON_BYTES + 1)
    if bytes(w.buf[:3]) == reading.UTF8_BOM:  # a trace saved by an editor that marks UTF-8: the mark is no JSON
        w.drop(3)
    batches = _Batches()
    problems: list[str] = []
    budget = _Budget(path)
    if w.eof and len(w.buf) <= WHOLE_JSON_BYTES:  # small: decoded whole, with every diagnostic
        buf = bytes(w.buf)
        w.drop(len(w.buf))
        n_bytes = len(buf)
        decoded, json_truncated = _decode_top(buf, path)
        first = bytes(memoryview(decoded.traceEvents)[:1])
        if first != b"[":
            what = "without traceEvents" if not first else "whose traceEvents is not a list"
            raise NotATraceError(f"JSON object {what}: not a Kineto trace", path=shown(path),
                                 fix="pass a trace written by torch.profiler (export_chrome_trace)")
        top = {k: bytes(getattr(decoded, k)) for k in _META_KEYS}
        for evs, ts, done, total in _decoded_chunks(buf, decoded.traceEvents, problems):
            batches.add(evs, ts)
            del evs, ts
            budget.check(batches)
            if on_progress is not None:
                on_progress(done, total)
        return top, batches, problems, state.get("truncated", False) or json_truncated, n_bytes
    size = path.stat().st_size
    events = _streamed(w, path, problems, on_progress, size, state)
    while True:
        try:
            evs, ts = next(events)
        except StopIteration as done:
            top, json_truncated = done.value
            break
        batches.add(evs, ts)
        del evs, ts
        budget.check(batches)
    if on_progress is not None:
        on_progress(size, size)
    return top, batches, problems, state.get("truncated", False) or json_truncated, w.base


# Finishing a rank (building and sorting its table, polars-parallel itself) is its ingest's memory peak: ranks of
# more events than this are finished one at a time, while other threads go on scanning.
FINISH_ALONE_ROWS = 200_000
# A table of fewer events is sorted whole, in one query with its derived columns: the column-at-a-time sort of the
# larger tables (_sorted_by_columns) exists for their memory, and its few dozen operations were most of finishing a
# small rank (docs/performance.md "Fixed cost"). Sorting whole holds the table twice: at 200,000 HTA's 123k- and
# 138k-event traces peaked 3-7 MiB higher in ingest (~50 bytes an event), so the switch stays well below them.
SORT_WHOLE_ROWS = 50_000
_FINISH_LOCK = threading.Lock()


def read_trace(
    path: str | Path,
    *,
    rank: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]]:
    """Read one Kineto trace file: (events per schema.EVENTS, memory per schema.MEMORY, a schema.TRACES row).

    The row also holds ``warnings`` (a list of one-line strings) beyond the TRACES columns. ``rank`` overrides the
    rank found in the trace. ``on_progress(done, total)`` is called after each batch of events.
    """
    return scan_trace(path, rank=rank, on_progress=on_progress)()


def scan_trace(path: str | Path, *, rank: int | None = None,
               on_progress: Callable[[int, int], None] | None = None) -> Callable[[], tuple]:
    """The first half of read_trace: the file read into columns (the native scanner or the general decoder) and its
    metadata; returns the second half (building and sorting the tables: call it for read_trace's result). A caller
    reading many files can finish one while it scans the next (run_dir.load_run). A file read ahead and finished in
    the background (``finish_ahead``) is that result, or raises its error."""
    path = Path(path)
    if rank is None:
        finished = _take_finished(path)
        if finished is not None:
            return lambda: finished
    return _scanned(path, rank, on_progress)


def _scanned(path: Path, rank: int | None, on_progress: Callable[[int, int], None] | None) -> Callable[[], tuple]:
    """scan_trace's work (the file read now, or its read-ahead taken)."""
    top, batches, problems, truncated, n_bytes = _decode(path, on_progress)
    warnings: list[str] = []

    dist = _loads(top.get("distributedInfo"))  # (its JSON text is not kept: only pg_config's, below)
    dist = dist if isinstance(dist, dict) else {}
    devices_obj, devices_json = _meta_json(top.get("deviceProperties"))
    meta, meta_json = _meta_json(top.get("traceana"))
    meta = meta if isinstance(meta, dict) else {}
    base = _loads(top.get("baseTimeNanoseconds"))
    base_ns = base if isinstance(base, int) and not isinstance(base, bool) and 0 <= base < 2**62 else None
    pg_config = dist.get("pg_config")
    pg_json = _pg_text(pg_config)

    # Rank: an explicit override, distributedInfo, our collector's metadata, the file name, else unknown.
    if rank is not None:
        rank_source = "given"
    elif _as_int(dist.get("rank")) is not None:
        rank, rank_source = _as_int(dist.get("rank")), "distributedInfo"
    elif _as_int(meta.get("rank")) is not None:
        rank, rank_source = _as_int(meta.get("rank")), "traceana_meta"
    elif rank_from_filename(path) is not None:
        rank, rank_source = rank_from_filename(path), "filename"
    else:
        rank, rank_source = 0, "single"
    world_size = _as_int(dist.get("world_size"))
    if world_size is None:
        world_size = _as_int(meta.get("world_size"))

    if truncated:
        warnings.append(f"{shown(path)}: trace is truncated (the writer stopped mid-file); kept its "
                        f"{batches.rows + batches.n_mem} complete events — re-collect it for a full analysis")
    if problems:
        warnings.append(f"{shown(path)}: skipped {len(problems)} malformed trace events (first: {problems[0]}) — "
                        "the rest of the trace is used")

    return _Scan(path, batches, rank, base_ns, pg_config, warnings, {
        "rank": rank, "path": shown(path), "world_size": world_size,
        "backend": dist.get("backend") if isinstance(dist.get("backend"), str) else None,
        "base_time_ns": base_ns, "n_events": None, "n_bytes": n_bytes, "truncated": truncated,
        "stage": _as_int(meta.get("stage")), "rank_source": rank_source,
        "devices": devices_json if devices_obj else None, "pg_config": pg_json, "meta": meta_json,
        "warnings": None,
    })


class _Scan:
    """A scanned file waiting to be finished: call it for read_trace's result, or finish many small ones at once
    (``finish_together``)."""

    def __init__(self, path: Path, batches: _Batches, rank: int, base_ns: int | None, pg_config: Any,
                 warnings: list[str], row: dict[str, Any]) -> None:
        self.path, self.batches, self.rank, self.base_ns, self.pg_config = path, batches, rank, base_ns, pg_config
        self.warnings, self.row = warnings, row

    def __call__(self) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]]:
        held, self.batches = self.batches, None  # finishing frees the scanned columns as it goes: no second reference
        if held.rows >= FINISH_ALONE_ROWS:  # two threads finishing two large ranks at once hold both peaks at once
            with _FINISH_LOCK:
                events, memory, dropped = _finish(held, rank=self.rank, base_ns=self.base_ns, pg_config=self.pg_config)
        else:
            events, memory, dropped = _finish(held, rank=self.rank, base_ns=self.base_ns, pg_config=self.pg_config)
        del held
        return self.complete(events, memory, dropped)

    def complete(self, events: pl.DataFrame, memory: pl.DataFrame, dropped: int) -> tuple:
        """The file's (events, memory, row), its tables finished."""
        if dropped:
            ns = ns_epoch_hint(self.path)
            self.warnings.append(f"{shown(self.path)}: dropped {dropped} events with a missing, negative, non-numeric "
                                 "or out-of-range ts/dur — the rest of the trace is used" + (f" ({ns})" if ns else ""))
        return events, memory, {**self.row, "n_events": events.height, "warnings": self.warnings}



_NS_TS = re.compile(rb'"ts"\s*:\s*(1[0-9]{18}|[2-9][0-9]{17})\b')  # 1e17..2e19 "µs": 1973..2600 in ns since the epoch
NS_NOTE = "nanoseconds"


def ns_epoch_hint(path: Path, head_bytes: int = MIB) -> str | None:
    """Why a trace's events have no usable time when its exporter wrote ns, not the format's µs: a ``ts`` like
    1700000000000000000 is 2023 in ns since the epoch, and the year 55,000 in µs (beyond what a time in ns can
    hold). Looked for in the file's first MiB only when events were dropped; None when no ts looks like that."""
    import gzip

    try:
        with reading.open_trace(path) as fh:
            raw = fh.read(2)
            fh.seek(0)
            head = gzip.GzipFile(fileobj=fh).read(head_bytes) if raw == reading.GZIP_MAGIC else fh.read(head_bytes)
    except (OSError, EOFError, TraceanaError):
        return None
    m = _NS_TS.search(head)
    if m is None:
        return None
    return (f"its ts values, like {m.group(1).decode()}, are {NS_NOTE} since the epoch, not the µs Kineto and Chrome "
            f"traces hold: {NS_FIX}")


NS_FIX = "convert ts and dur to µs (÷ 1000), or export the trace in µs"


# --- the read-ahead, finished in the background -------------------------------------------------------------------
_FINISHED: dict[str, tuple[tuple[int, ...] | None, threading.Thread, dict]] = {}
_FINISHED_LOCK = threading.Lock()


def finish_ahead() -> None:
    """Build the tables of each trace read ahead (``reading.read_ahead``, started by the CLI before polars was
    imported) in a thread of its own, as ``read_trace`` builds them: right after polars is imported, so that its
    finishing (polars, mostly without the GIL) runs while the command imports the analysis. ``scan_trace`` of that
    file (no rank given: as load_run reads it) takes the result, or raises its error; a file changed meanwhile is
    read again."""
    for path in reading.ahead_files():
        out: dict = {}

        def finish(path: Path = path, out: dict = out) -> None:
            try:
                out["result"] = _scanned(path, None, None)()
            except BaseException as e:  # raised where the file is asked for, as read_trace there would raise it
                out["error"] = e

        thread = threading.Thread(target=finish, name="traceana-finish-ahead", daemon=True)
        with _FINISHED_LOCK:
            _FINISHED[reading.key(path)] = (reading.file_identity(path), thread, out)
        thread.start()


def _take_finished(path: Path) -> tuple | None:
    with _FINISHED_LOCK:
        entry = _FINISHED.pop(reading.key(path), None)
    if entry is None:
        return None
    identity, thread, out = entry
    thread.join()
    if identity is None or reading.file_identity(path) != identity:
        return None  # changed since: read again
    if "error" in out:
        raise out.pop("error")
    return out["result"]


def drop_finished() -> None:
    """Forget the tables finished in the background and not asked for (a command that ended before reading them,
    or was interrupted). Not waited for: a large file's thread may still be reading it (its thread is a daemon, and
    the traceana program ends without waiting for it)."""
    with _FINISHED_LOCK:
        _FINISHED.clear()


_PG_TEXT: dict[bytes, str] = {}  # pg_config (as msgspec writes it) → _pg_text, for the next rank


def _pg_text(pg_config: Any) -> str | None:
    """pg_config as JSON text (keys sorted), from which its process groups are read (traceana.ingest.process_groups).
    Every rank of a job writes the same pg_config, whose default group lists every rank: made once, not once per
    rank (at 4,096 ranks json.dumps of its 4,096 ranks took ~2 ms a file)."""
    if pg_config is None:
        return None
    try:
        key = msgspec.json.encode(pg_config, order="sorted")
    except (TypeError, ValueError, OverflowError):  # not msgspec's to write: made each time
        return json.dumps(pg_config, sort_keys=True)
    text = _PG_TEXT.get(key)
    if text is None:
        if len(_PG_TEXT) >= 16:
            _PG_TEXT.clear()
        text = _PG_TEXT[key] = json.dumps(pg_config, sort_keys=True)
    return text


_X_SCHEMA = {"name": pl.String, "cat": pl.String, "pid": pl.String, "tid": pl.String, "ts_rel": pl.Int64,
             "dur_ns": pl.Int64, **{c: t for c, _, t in _X_ARGS}}
_GPU_SCHEMA = {"row": pl.UInt32, **{c: t for c, _, t in _GPU_ARGS}}
_MEM_SCHEMA = {"ts_rel": pl.Int64, **{c: t for c, _, t in _MEM_ARGS}}


def _absolute(ts_rel: pl.Expr, base_ns: int | None, median: float | None) -> pl.Expr:
    """Kineto writes ts relative to baseTimeNanoseconds; synthetic or old traces may already hold epoch µs
    (``median``: of the trace's ts_rel, nulls aside; None if it has none)."""
    if base_ns is not None and median is not None and median < EPOCH_US * NS_PER_US:
        ts_rel = ts_rel + base_ns
    return pl.when(ts_rel.is_between(0, 2**62)).then(ts_rel)


_TEXT = ("name", "cat", "pid", "tid")  # the X columns the native scanner gives as codes into the file's dictionaries


def _codes(x: pl.DataFrame) -> tuple[pl.DataFrame, tuple[pl.Series, ...]]:
    """The general decoder's text columns as codes into their distinct values, as the native scanner gives them."""
    dicts = tuple(x[c].drop_nulls().unique(maintain_order=True).alias("value") for c in _TEXT)
    return x.with_columns(x[c].cast(pl.Enum(d)).to_physical().alias(c) for c, d in zip(_TEXT, dicts)), dicts


def _finish(batches: _Batches, *, rank: int, base_ns: int | None, pg_config: Any) -> tuple[pl.DataFrame, pl.DataFrame, int]:
    """Per-batch columns → EVENTS and MEMORY tables (whole-column polars expressions only).

    name, cat, pid and tid stay codes into the file's distinct values until the table is sorted: what is derived
    from them (GPU or not, device and stream numbers, the track's text) is computed once per distinct value, and
    the sorted table's text columns are gathered from the distinct values at the end (as categorical codes). The native scanner also gives each event's track as a code
    into the file's distinct tracks: is_gpu, device, stream and the track's text are then computed once per track
    and gathered by that code after the sort, like the text."""
    if len(batches.x) == 1:  # the native scanner's one frame: nothing to concatenate
        x = batches.x[0]
    else:
        x = pl.concat(batches.x, how="vertical", rechunk=True) if batches.x else pl.DataFrame(schema=_X_SCHEMA)
    batches.x.clear()
    if _scan is not None and x.height >= FINISH_ALONE_ROWS:  # the scanner's buffers (C malloc) were just freed
        _scan.release_memory()
    if batches.dicts is None or not x.height:
        x, dicts = _codes(x.cast({c: pl.String for c in _TEXT}) if not x.height else x)
    else:
        dicts = batches.dicts
    name_d, cat_d, pid_d, tid_d = dicts
    # Older Kineto (torch 1.8/1.9) capitalised its categories (Kernel, Runtime, Operator, Memcpy): one spelling for
    # every rule downstream, on the file's few distinct categories.
    cat_d = cat_d.cast(pl.String).str.to_lowercase()
    tracks = batches.tracks if "track" in x.columns else None
    mem = pl.concat(batches.mem, how="vertical") if batches.mem else pl.DataFrame(schema=_MEM_SCHEMA)
    median = (x if x.height else mem)["ts_rel"].median() if base_ns is not None else None  # (once: ~4 ms a rank)
    rank_lit = pl.lit(rank, dtype=pl.Int32)

    memory = schema.conform(
        mem.with_columns(ts_ns=_absolute(pl.col("ts_rel"), base_ns, median), rank=rank_lit)
        .filter(pl.col("ts_ns").is_not_null() & pl.col("allocated_bytes").is_not_null())
        .with_columns(pl.when(pl.col("device").is_between(-(2**31), 2**31 - 1)).then(pl.col("device")).alias("device"))
        .sort("ts_ns", maintain_order=True),
        schema.MEMORY,
    )

    # A null pid or tid is "" in the table: code len(d).
    pid_text, tid_text = (pl.concat([d, pl.Series("value", [""])]) for d in (pid_d, tid_d))
    pid_code = pl.col("pid").fill_null(len(pid_d))
    tid_code = pl.col("tid").fill_null(len(tid_d))
    times = dict(ts_ns=_absolute(pl.col("ts_rel"), base_ns, median),
                 dur_ns=pl.when(pl.col("dur_ns").is_between(0, 2**62 - 1)).then(pl.col("dur_ns")), pid=pid_code,
                 tid=tid_code)
    keep = pl.col("ts_ns").is_not_null() & pl.col("dur_ns").is_not_null() \
        & ((pl.col("ts_ns") + pl.col("dur_ns")) < 2**62)
    if tracks is None:  # derived per event: the GPU args scattered into place by row first
        gpu = pl.concat(batches.gpu, how="vertical") if batches.gpu else pl.DataFrame(schema=_GPU_SCHEMA)
        x = x.with_columns(pl.repeat(None, x.height, dtype=pl.Int64, eager=True).scatter(gpu["row"], gpu[c]).alias(c)
                           for c, _, _ in _GPU_ARGS)
        del gpu
        x = _derived(x.lazy().with_columns(**times, is_gpu=pl.lit(cat_d.is_in(_GPU_CAT_NAMES)).gather(pl.col("cat"))
                                           .fill_null(False)).with_columns(keep=keep),
                     pid_text, tid_text).collect(engine=ENGINE)
        per_track = None
    else:  # once per track, gathered by its code after the sort
        x = x.lazy().with_columns(**times).with_columns(keep=keep).collect(engine=ENGINE)
        per_track = _derived(tracks.lazy().select(is_gpu=pl.col("is_gpu").cast(pl.Boolean), pid=pid_code,
                                                   tid=tid_code, arg_device="arg_device", arg_stream="arg_stream"),
                             pid_text, tid_text).collect(engine=ENGINE)
    batches.gpu.clear()
    facts = _comms(x, batches, pg_config, name_d, per_track)
    n_read = x.height
    dropped = n_read - x["keep"].sum()
    text = {"name": name_d.cast(schema.EVENTS["name"]), "cat": cat_d.cast(schema.EVENTS["cat"]), "pid": pid_text.cast(schema.EVENTS["pid"]),
            "tid": tid_text.cast(schema.EVENTS["tid"])}
    by_track = ("is_gpu", "device", "stream", "track")
    if n_read < SORT_WHOLE_ROWS:  # small: one query (a few dozen eager operations cost more than the work here)
        derived = [] if per_track is None else [pl.lit(per_track[c]).gather(pl.col("track")).alias(c) for c in by_track]
        return schema.check(_small_events(x, facts, text, rank, derived), schema.EVENTS, "events"), \
            schema.check(memory, schema.MEMORY, "memory"), dropped
    # Each fact's row in the table: its index into facts, sorted with the columns (the facts themselves are sparse
    # and put in after the sort, the rank, constant, too).
    if facts.height:
        x = x.with_columns(pl.repeat(None, n_read, dtype=pl.UInt32, eager=True)
                           .scatter(facts["row"], pl.int_range(facts.height, dtype=pl.UInt32, eager=True))
                           .alias("fact"))
    if dropped:  # copying the table only when some event has no usable time
        x = x.filter("keep")
    # Deterministic order: by time, enclosing spans before the spans they contain, then file order (a stable sort of
    # the table in file order; helper columns are dropped first, so only the table's own columns are copied). The
    # native scanner's events come in that order already (_scan.c "the time order"): dropping events keeps it.
    body = {c: t for c, t in schema.EVENTS.items()
            if c not in (*_TEXT, *_FACTS, "rank", *(by_track if per_track is not None else ()))}
    columns = [*x.select(*_TEXT, *(["track"] if per_track is not None else []), *(["fact"] if facts.height else []))
               .get_columns(), *schema.conform(x, body).get_columns()]
    del x  # the list holds the only reference to each column now (helper columns are freed here)
    events = pl.DataFrame(columns) if batches.sorted else _sorted_by_columns(columns)
    n = events.height
    events = events.with_columns(
        *(pl.lit(d).gather(c).alias(c) for c, d in text.items()),
        *((pl.lit(per_track[c]).gather(pl.col("track")) if per_track[c].null_count() < per_track.height
           else pl.lit(schema.nulls(c, n, schema.EVENTS[c]))).alias(c)
          for c in by_track if per_track is not None),
        # (a column null on every event, e.g. an NCCL run's tag, is not written: schema.nulls)
        *((facts[c].gather(events["fact"]) if facts[c].null_count() < facts.height else schema.nulls(c, n, t))
          .alias(c) for c, t in _FACTS.items()),
        rank=pl.repeat(rank, n, dtype=pl.Int32, eager=True),
    ).select(list(schema.EVENTS))
    return schema.check(events, schema.EVENTS, "events"), schema.check(memory, schema.MEMORY, "memory"), dropped


# Small files finished together (finish_together): at most this many X events in one set of queries. Each query
# on a small file costs about as much as its work (4,096 files of ~700 events: ~6 ms of polars each), so files that
# _small_events would finish one by one are joined into one frame, a file index beside each row, and split after.
TOGETHER_ROWS = 50_000


def can_finish_together(scan: Any) -> bool:
    """Whether a scanned file can be finished with others (_finish_many): the native scanner's one frame of codes and
    tracks, small enough for _small_events, no record_shapes facts (gloo's op ↔ annotation pairing is per file)."""
    b = getattr(scan, "batches", None)
    return (isinstance(scan, _Scan) and b is not None and b.dicts is not None and b.tracks is not None
            and len(b.x) == 1 and 0 < b.x[0].height < SORT_WHOLE_ROWS and "track" in b.x[0].columns
            and not b.shapes)


def finish_together(scans: list) -> list[tuple]:
    """read_trace's result for each of ``scans`` (scan_trace's), in order: the small native-scanned ones in one set
    of queries per TOGETHER_ROWS events (_finish_many: the same tables, rows and order as one by one), the others
    one by one. A file whose finishing raises a TraceanaError has that error in its place (the others are kept)."""
    out: list[tuple | TraceanaError | None] = [None] * len(scans)

    def alone(scan: _Scan) -> tuple | TraceanaError:
        try:
            return scan()
        except TraceanaError as e:
            return e

    group: list[int] = []

    def flush() -> None:
        if len(group) == 1:
            out[group[0]] = alone(scans[group[0]])
        elif group:
            try:
                finished = _finish_many([scans[i] for i in group])
            except (pl.exceptions.PolarsError, schema.SchemaError):  # e.g. columns of other types: one by one
                finished = None
            for i, one in zip(group, finished or [None] * len(group)):
                if one is None:
                    out[i] = alone(scans[i])
                    continue
                events, memory, dropped = one
                scans[i].batches = None
                out[i] = scans[i].complete(events, memory, dropped)
        group.clear()

    rows = 0
    for i, scan in enumerate(scans):
        if not can_finish_together(scan) or (group and _key(scan) != _key(scans[group[0]])):
            flush()
            rows = 0
        if not can_finish_together(scan):
            out[i] = alone(scan)
            continue
        if rows + scan.batches.rows > TOGETHER_ROWS:
            flush()
            rows = 0
        group.append(i)
        rows += scan.batches.rows
    flush()
    return out  # type: ignore[return-value]


def _key(scan: _Scan) -> tuple:
    """Files whose frames can be joined as they are: the same column types."""
    b = scan.batches
    return tuple(b.x[0].schema.items()), tuple(b.tracks.schema.items()), tuple(d.dtype for d in b.dicts)


def _file_index(counts: list[int]) -> pl.Series:
    """0 repeated counts[0] times, 1 counts[1] times, ...: each joined row's file."""
    return pl.DataFrame({"f": list(range(len(counts))), "k": counts}, schema={"f": pl.Int32, "k": pl.Int64}) \
        .filter(pl.col("k") > 0).select(pl.col("f").repeat_by("k").explode()).to_series()


def _starts(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:  # one per file
        out.append(total)
        total += c
    return out


def _finish_many(scans: list[_Scan]) -> list[tuple[pl.DataFrame, pl.DataFrame, int]]:
    """_finish of several small native-scanned files (can_finish_together) in one set of queries: their frames joined with a
    file index ``f`` beside each row, codes shifted into the joined dictionaries (a file's null pid/tid code is its
    own "", as in _finish), each file's time base its own, a stable sort by (file, ts_ns, dur_ns descending), and the
    result cut back into each file's rows. The scans' columns are left in place (the caller drops them)."""
    bs = [s.batches for s in scans]
    xs = [b.x[0] for b in bs]
    heights = [x.height for x in xs]
    n_dicts = [[len(d) for d in b.dicts] for b in bs]
    f_x = _file_index(heights)
    per_file = lambda values, dtype=pl.Int64: pl.lit(pl.Series(values, dtype=dtype))  # noqa: E731
    name_d = pl.concat([b.dicts[0] for b in bs])
    cat_d = pl.concat([b.dicts[1] for b in bs]).cast(pl.String).str.to_lowercase()
    empty = pl.Series("value", [""])
    pid_text = pl.concat([s for b in bs for s in (b.dicts[2], empty)])
    tid_text = pl.concat([s for b in bs for s in (b.dicts[3], empty)])
    off = {c: _starts([n[i] + (1 if c in ("pid", "tid") else 0) for n in n_dicts]) for i, c in enumerate(_TEXT)}
    null = {c: [n[i] for n in n_dicts] for i, c in enumerate(_TEXT) if c in ("pid", "tid")}

    def shifted(c: str, f: pl.Expr) -> pl.Expr:
        code = pl.col(c).cast(pl.Int64)
        if c in null:
            code = code.fill_null(per_file(null[c]).gather(f))
        return code + per_file(off[c]).gather(f)

    # Each file's time base, as _absolute decides it (the median of its ts_rel: one query for all files).
    bases = [s.base_ns for s in scans]
    shift = [0] * len(scans)
    if any(b is not None for b in bases):
        medians = pl.DataFrame([f_x, pl.concat([x["ts_rel"] for x in xs])]).group_by("f").agg(
            pl.col("ts_rel").median())
        median = dict(zip(medians["f"].to_list(), medians["ts_rel"].to_list()))
        shift = [b if b is not None and median.get(i) is not None and median[i] < EPOCH_US * NS_PER_US else 0
                 for i, b in enumerate(bases)]
    f = pl.col("f")
    absolute = lambda: pl.when((pl.col("ts_rel") + per_file(shift).gather(f)).is_between(0, 2**62)) \
        .then(pl.col("ts_rel") + per_file(shift).gather(f))  # noqa: E731
    ranks = per_file([s.rank for s in scans], pl.Int32)

    mems = [pl.concat(b.mem, how="vertical") if b.mem else pl.DataFrame(schema=_MEM_SCHEMA) for b in bs]
    mem_n = [m.height for m in mems]
    memory = schema.conform(
        pl.concat([m for m in mems if m.height] or mems[:1], how="vertical").with_columns(_file_index(mem_n)).lazy()
        .with_columns(ts_ns=absolute(), rank=ranks.gather(f))
        .filter(pl.col("ts_ns").is_not_null() & pl.col("allocated_bytes").is_not_null())
        .with_columns(pl.when(pl.col("device").is_between(-(2**31), 2**31 - 1)).then(pl.col("device")).alias("device"))
        .sort("f", "ts_ns", maintain_order=True).collect(engine=ENGINE),
        {**schema.MEMORY, "f": pl.Int32},
    )

    track_n = [b.tracks.height for b in bs]
    tracks = pl.concat([b.tracks for b in bs], how="vertical").with_columns(_file_index(track_n))
    per_track = _derived(tracks.lazy().select(is_gpu=pl.col("is_gpu").cast(pl.Boolean), pid=shifted("pid", f),
                                              tid=shifted("tid", f), arg_device="arg_device",
                                              arg_stream="arg_stream"),
                         pid_text, tid_text).collect(engine=ENGINE)
    track_off = per_file(_starts(track_n))
    keep = pl.col("ts_ns").is_not_null() & pl.col("dur_ns").is_not_null() \
        & ((pl.col("ts_ns") + pl.col("dur_ns")) < 2**62)
    x = pl.concat(xs, how="vertical").with_columns(f_x).lazy().with_columns(
        ts_ns=absolute(), dur_ns=pl.when(pl.col("dur_ns").is_between(0, 2**62 - 1)).then(pl.col("dur_ns")),
        **{c: shifted(c, f) for c in _TEXT}, track=pl.col("track").cast(pl.Int64) + track_off.gather(f),
    ).with_columns(keep=keep).collect(engine=ENGINE)

    row_off = _starts(heights)
    comm_n = [sum(c.height for c in b.comm) for b in bs]
    comm = pl.concat([c for b in bs for c in b.comm], how="vertical") if any(comm_n) else \
        pl.DataFrame(schema=_COMM_SCHEMA)
    pg_keys: dict[str, int] = {}
    pgk = [pg_keys.setdefault(s.row["pg_config"], len(pg_keys)) for s in scans]  # (pg_config's JSON text)
    f_c = _file_index(comm_n)
    comm = comm.with_columns(f_c).with_columns(
        row=(pl.col("row").cast(pl.Int64) + per_file(row_off).gather(f)).cast(pl.UInt32),
        pgk=per_file(pgk).gather(f)).drop("f")
    tables = []
    for config, k in pg_keys.items():  # one per distinct pg_config among the files: few
        table = None if config is None else _pg_table(json.loads(config))
        if table is not None:
            tables.append(table.with_columns(pgk=pl.lit(k, dtype=pl.Int64)))
    to_global = None if not tables else partial(_to_global, table=pl.concat(tables), on=["pgk", "pg_name", "peer"])
    facts = _comms(x, None, None, name_d, per_track, comm=comm, to_global=to_global)

    text = {"name": name_d.cast(schema.EVENTS["name"]), "cat": cat_d.cast(schema.EVENTS["cat"]),
            "pid": pid_text.cast(schema.EVENTS["pid"]), "tid": tid_text.cast(schema.EVENTS["tid"])}
    derived = [pl.lit(per_track[c]).gather(pl.col("track")).alias(c) for c in ("is_gpu", "device", "stream", "track")]
    kept = x.group_by("f").agg(pl.col("keep").sum())
    kept = dict(zip(kept["f"].to_list(), kept["keep"].to_list()))
    events = _small_events(x, facts, text, ranks.gather(f), derived, by_file=True)
    del x
    n_events = [kept.get(i, 0) for i in range(len(scans))]
    counts = memory["f"].value_counts()
    counts = dict(zip(counts["f"].to_list(), counts["count"].to_list()))
    mem_kept = [counts.get(i, 0) for i in range(len(scans))]
    ev_off, mem_off = _starts(n_events), _starts(mem_kept)
    memory = memory.drop("f")
    return [(schema.check(events.slice(ev_off[i], n_events[i]), schema.EVENTS, "events"),
             schema.check(memory.slice(mem_off[i], mem_kept[i]), schema.MEMORY, "memory"), heights[i] - n_events[i])
            for i in range(len(scans))]


def _derived(x: pl.LazyFrame, pid_text: pl.Series, tid_text: pl.Series) -> pl.LazyFrame:
    """is_gpu, arg_device, arg_stream, pid and tid (codes into pid_text and tid_text) → device, stream (in their
    schema type's range) and the track: per event, or once per distinct track (_finish).

    Kineto writes a GPU's device as pid and its stream as tid, the stream sometimes as text ("stream 7"): where the
    args do not say, the device and stream are the pid's and tid's numbers (computed once per distinct value)."""
    per_value = pl.DataFrame({"t": tid_text}).select(
        pl.coalesce(pl.col("t").cast(pl.Int64, strict=False),
                    pl.col("t").str.extract(_STREAM_IN_TID).cast(pl.Int64, strict=False))).to_series()
    x = x.with_columns(
        device=pl.when("is_gpu").then(pl.coalesce(pl.col("arg_device"),
                                                  pl.lit(pid_text.cast(pl.Int64, strict=False)).gather("pid"))),
        stream=pl.when("is_gpu").then(pl.coalesce(pl.col("arg_stream"), pl.lit(per_value).gather("tid"))),
    ).collect(engine=ENGINE)
    return x.lazy().with_columns(*(_in_range(pl.col(c), c).cast(schema.EVENTS[c]).alias(c)
                                   for c in ("device", "stream")), track=_tracks(x, pid_text, tid_text))


def _small_events(x: pl.DataFrame, facts: pl.DataFrame, text: dict[str, pl.Series], rank: int | pl.Expr,
                  derived: list[pl.Expr], *, by_file: bool = False) -> pl.DataFrame:
    """The events table of a table under SORT_WHOLE_ROWS rows, in one query: the same rows and order as the
    column-at-a-time path below it in _finish (a stable sort by ts_ns, then dur_ns descending, of the kept events in
    file order; the facts joined by file position; text gathered from the distinct values; ``derived``: columns
    gathered by track code, put in first). ``by_file``: x holds several files (_finish_many), each file's rows
    sorted apart, in file order (``rank`` an expression of the file index ``f``)."""
    have = [*x.columns, *(e.meta.output_name() for e in derived)]
    body = [(pl.col(c).cast(t) if c in have else pl.lit(None, dtype=t)).alias(c)
            for c, t in schema.EVENTS.items() if c not in (*_TEXT, *_FACTS, "rank")]
    return (
        x.lazy().with_columns(derived).with_row_index("row").filter("keep")
        .join(facts.lazy(), on="row", how="left", maintain_order="left")
        .sort(["f", "ts_ns", "dur_ns"] if by_file else ["ts_ns", "dur_ns"],
              descending=[False, False, True] if by_file else [False, True], maintain_order=True)
        .select(*(pl.lit(d).gather(pl.col(c)).alias(c) for c, d in text.items()), *body,
                *(pl.col(c) for c in _FACTS),
                rank=rank if isinstance(rank, pl.Expr) else pl.lit(rank, dtype=pl.Int32))
        .select(list(schema.EVENTS))
        .collect(engine=ENGINE)
    )


def _tracks(x: pl.DataFrame, pid_text: pl.Series, tid_text: pl.Series) -> pl.Series:
    """Each event's track, "gpu:{device}:{stream}" or "cpu:{pid}:{tid}" (device and stream are null off the GPU;
    pid and tid are codes into pid_text and tid_text), formatted once per distinct track.

    The five parts are numbered densely (device and stream values by their sorted distinct values) and packed into
    one int64 per event, whose few distinct values are formatted and looked up by binary search: a join on the five
    columns took ~15% of finishing a rank. A run whose parts have too many distinct values to pack is joined."""
    keys = ["is_gpu", "device", "stream", "pid", "tid"]
    text = (pl.format("{}:{}:{}", pl.when("is_gpu").then(pl.lit("gpu")).otherwise(pl.lit("cpu")),
                         pl.coalesce(pl.col("device").cast(pl.String), pl.lit(pid_text).gather("pid")),
                         pl.coalesce(pl.col("stream").cast(pl.String), pl.lit(tid_text).gather("tid")))
            .cast(schema.EVENTS["track"]))
    values = {c: v[0] for c, v in x.select(pl.col(c).drop_nulls().unique().sort().implode()
                                          for c in ("device", "stream")).to_dict().items()}
    sizes = [2, len(values["device"]) + 1, len(values["stream"]) + 1, len(pid_text), len(tid_text)]
    if math.prod(sizes) >= 2**62:
        tracks = x.select(keys).unique().with_columns(track=text)
        return x.select(keys).join(tracks, on=keys, how="left", nulls_equal=True, maintain_order="left")["track"]
    dense = {c: pl.when(pl.col(c).is_null()).then(len(v)).otherwise(pl.lit(v).search_sorted(pl.col(c))
                                                                       .cast(pl.Int64)) for c, v in values.items()}
    parts = [pl.col("is_gpu").cast(pl.Int64), dense["device"], dense["stream"], pl.col("pid").cast(pl.Int64),
             pl.col("tid").cast(pl.Int64)]
    packed = parts[0]
    for part, size in zip(parts[1:], sizes[1:]):
        packed = packed * size + part
    key = x.select(packed.alias("key")).to_series()
    rest, unpacked = pl.col("key"), {}
    for c, size in zip(reversed(keys), reversed(sizes)):
        unpacked[c], rest = rest % size, rest // size
    distinct = key.to_frame().lazy().select(pl.col("key").unique().sort()).select(
        "key",
        is_gpu=unpacked["is_gpu"].cast(pl.Boolean),
        device=pl.lit(values["device"]).append(pl.lit(None, dtype=values["device"].dtype)).gather(unpacked["device"]),
        stream=pl.lit(values["stream"]).append(pl.lit(None, dtype=values["stream"].dtype)).gather(unpacked["stream"]),
        pid=unpacked["pid"], tid=unpacked["tid"]).select("key", track=text).collect(engine=ENGINE)
    return pl.select(pl.lit(distinct["track"]).gather(pl.lit(distinct["key"]).search_sorted(pl.lit(key))))\
        .to_series().alias("track")


def _sorted_by_columns(columns: list[pl.Series]) -> pl.DataFrame:
    """The columns stably sorted by ts_ns, then longest first — one column at a time, each unsorted column freed
    (popped from ``columns``, which must hold the only reference) once its sorted copy exists: sorting the frame at
    once held the whole table twice, the peak of ingesting a rank."""
    by = {c.name: c for c in columns if c.name in ("ts_ns", "dur_ns")}
    order = _time_order(pl.DataFrame([by["ts_ns"], by["dur_ns"]]))
    del by
    out = []
    while columns:
        # One chunk first: polars' gather from a string column of several chunks (the batches, each with its own
        # dictionary buffer) writes every value out in full (~120 bytes per event here) instead of 16-byte views.
        out.append(columns.pop(0).rechunk().gather(order))
    return pl.DataFrame(out)


def _time_order(times: pl.DataFrame) -> pl.Series:
    """The stable order by ts_ns, then dur_ns descending, of ``times`` (no nulls): a stable sort by ts_ns alone, then
    the few runs of equal ts_ns sorted by duration in place (a sort on two keys took ~1.5x as long as on one; under
    1% of a generated or real trace's events share a start)."""
    order = times.select(pl.arg_sort_by("ts_ns", maintain_order=True)).to_series()
    ts = times["ts_ns"].gather(order)
    tied = pl.select((ts == ts.shift(1)) | (ts == ts.shift(-1))).to_series().fill_null(False).arg_true()
    if not len(tied):
        return order
    rows = order.gather(tied)
    sub = times[rows].with_columns(pl.int_range(pl.len(), dtype=pl.UInt32).alias("i"))
    within = sub.sort(["ts_ns", "dur_ns"], descending=[False, True], maintain_order=True)["i"]
    return order.scatter(tied, rows.gather(within))


_COMM_SCHEMA = {"row": pl.UInt32, **{c: t for c, _, t in _COMM_ARGS}}


_FACTS = {c: schema.EVENTS[c] for c in ("peer", "tag", "nbytes", "coll", "pg")}  # communication events' only


def _in_range(value: pl.Expr, column: str) -> pl.Expr:
    """Null where an int32 column of schema.EVENTS cannot hold the value."""
    if schema.EVENTS[column] != pl.Int32:
        return value
    return pl.when(value.is_between(-(2**31), 2**31 - 1)).then(value)


def _comms(x: pl.DataFrame, batches: _Batches, pg_config: Any, name_d: pl.Series,
           per_track: pl.DataFrame | None, *, comm: pl.DataFrame | None = None,
           to_global: Callable[[pl.LazyFrame], pl.LazyFrame] | None = None) -> pl.DataFrame:
    """``row`` and its peer, tag, nbytes, coll and pg, for communication events (from the sparse per-batch facts).
    ``row`` is the event's position in ``x`` (in file order), whose name is a code into name_d and whose track is
    the track's text, or a code into per_track's tracks (_finish).

    NCCL: ``record_param_comms`` gives "Collective name", "In msg nelems" × "dtype", and for P2P "Dst Rank"/"Src
    Rank" (a rank within its process group; mapped to a global rank through distributedInfo.pg_config by
    "Process Group Name" when the trace has it).
    gloo: ``c10d::send``/``c10d::recv_`` carry peer and tag; the ``gloo:send``/``gloo:recv`` annotation that starts
    inside them on the same thread carries the element type. Each side gets the other's facts, so both the op and
    the annotation (which spans post → wait return) have peer, tag and nbytes.

    Several files finished together (``_finish_many``) give their ``comm`` rows (rows into their joined ``x``, a
    ``pgk`` column naming each file's pg_config) and ``to_global``, the group → global mapping of those configs.
    """
    if comm is None:
        comm = pl.concat(batches.comm) if batches.comm else pl.DataFrame(schema=_COMM_SCHEMA)
        to_global = partial(_group_to_global, pg_config=pg_config)
    elem = pl.col("dtype").replace_strict(SCALAR_TYPE_BYTES, default=None, return_dtype=pl.Int64)
    # one lazy query from here to the end (a few eager operations each cost as much here)
    facts = comm.lazy().select("row", "coll", "pg_name", *(["pgk"] if "pgk" in comm.columns else []),
                               nbytes=pl.col("in_nelems") * elem,
                               peer=pl.coalesce(pl.col("dst_rank"), pl.col("src_rank")),
                               pg=pl.coalesce(pl.col("pg_desc"), pl.col("pg_name")))
    comm = (to_global(facts) if comm.height and to_global is not None else facts).drop("pg_name", "pgk", strict=False)
    shapes = pl.concat(batches.shapes) if batches is not None and batches.shapes else None
    if shapes is not None and shapes.height:
        track = pl.col("track") if per_track is None else pl.lit(per_track["track"]).gather(pl.col("track"))
        ev = x[shapes["row"]].select(pl.lit(shapes["row"]).alias("row"), "ts_ns", "dur_ns",
                                     name=pl.lit(name_d).gather("name"), track=track.cast(pl.String))
        shaped = pl.concat([ev, shapes.drop("row")], how="horizontal").filter(
            pl.col("ts_ns").is_not_null() & pl.col("dur_ns").is_not_null())
        comm = pl.concat([comm, _gloo_pairs(shaped).lazy()], how="diagonal_relaxed")
    # Each event has at most one row of facts: its "row" is the event's position in x (see _finish).
    columns = comm.collect_schema().names()
    return comm.select("row", *[_in_range(pl.col(c) if c in columns else pl.lit(None), c).cast(t).alias(c)
                                for c, t in _FACTS.items()]).collect(engine=ENGINE)


def _gloo_pairs(shaped: pl.DataFrame) -> pl.DataFrame:
    """Facts of gloo events: own record_shapes facts, plus those of the c10d op ↔ gloo annotation pair.

    A ``gloo:send``/``gloo:recv`` annotation starts inside its ``c10d::send``/``c10d::recv_`` op on the same thread
    (op.ts <= ann.ts <= op end): the op knows peer and tag, the annotation knows the element type.
    """
    direction = (
        pl.when(pl.col("name").is_in([names.C10D_SEND, names.GLOO_SEND])).then(pl.lit("send"))
        .when(pl.col("name").is_in([names.C10D_RECV, names.GLOO_RECV])).then(pl.lit("recv"))
    )
    # Two lazy queries (the pieces, then the pairs) instead of ~16 eager operations per gloo trace: on a small run
    # their fixed cost was most of this (docs/performance.md "Fixed cost").
    own = shaped.lazy().with_columns(
        direction=direction,
        peer=pl.col("shape_peer"),
        tag=pl.col("shape_tag"),
        nbytes=pl.col("shape_numel") * pl.col("shape_elem"),
    )
    ops = (
        own.filter(pl.col("name").is_in([names.C10D_SEND, names.C10D_RECV]))
        .select("track", "direction", op_ts=pl.col("ts_ns"), op_end=pl.col("ts_ns") + pl.col("dur_ns"),
                op_row=pl.col("row"), op_peer=pl.col("peer"), op_tag=pl.col("tag"))
        .sort("op_ts")
    )
    anns = (
        own.filter(pl.col("name").is_in([names.GLOO_SEND, names.GLOO_RECV]))
        .select("track", "direction", "ts_ns", ann_row=pl.col("row"), ann_nbytes=pl.col("nbytes"))
        .sort("ts_ns")
    )
    ops, anns, out = pl.collect_all([ops, anns, own.select("row", "peer", "tag", "nbytes")], engine=ENGINE)
    if ops.height == 0 or anns.height == 0:
        return out
    pairs = (
        anns.lazy().join_asof(ops.lazy(), left_on="ts_ns", right_on="op_ts", by=["track", "direction"],
                              strategy="backward", check_sortedness=False)
        .filter(pl.col("op_row").is_not_null() & (pl.col("ts_ns") <= pl.col("op_end")))
    )
    to_ann = pairs.select(row=pl.col("ann_row"), p_peer=pl.col("op_peer"), p_tag=pl.col("op_tag"))
    to_op = pairs.group_by("op_row").agg(p_nbytes=pl.col("ann_nbytes").sort_by("ts_ns").first()).rename(
        {"op_row": "row"})
    return (
        out.lazy().join(to_ann, on="row", how="left")
        .join(to_op, on="row", how="left")
        .select("row", peer=pl.coalesce("peer", "p_peer"), tag=pl.coalesce("tag", "p_tag"),
                nbytes=pl.coalesce("nbytes", "p_nbytes"))
        .collect(engine=ENGINE)
    )


def _group_to_global(comm: pl.LazyFrame, pg_config: Any) -> pl.LazyFrame:
    """Map record_param_comms P2P peers from group ranks to global ranks using distributedInfo.pg_config."""
    table = _pg_table(pg_config)
    return comm if table is None else _to_global(comm, table, ["pg_name", "peer"])


_PG_SCHEMA = {"pg_name": pl.String, "peer": pl.Int64, "global_peer": pl.Int64}


def _pg_table(pg_config: Any) -> pl.LazyFrame | None:
    """pg_config's (pg_name, group rank → global rank), the first entry of a repeated pair; None if it has none."""
    if not isinstance(pg_config, list):
        return None
    rows = []
    for pg in pg_config:  # one entry per process group: tiny
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            for group_rank, global_rank in enumerate(pg["ranks"]):
                if isinstance(global_rank, int) and not isinstance(global_rank, bool):
                    rows.append((str(pg.get("pg_name")), group_rank, global_rank))
    if not rows:
        return None
    return pl.LazyFrame(rows, schema=_PG_SCHEMA, orient="row").unique(["pg_name", "peer"], keep="first",
                                                                       maintain_order=True)


def _to_global(comm: pl.LazyFrame, table: pl.LazyFrame, on: list[str]) -> pl.LazyFrame:
    return (
        comm.join(table, on=on, how="left")
        .with_columns(peer=pl.coalesce("global_peer", "peer"))
        .drop("global_peer")
    )
