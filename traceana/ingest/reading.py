"""Reading trace files without polars: which files a run holds, their bytes through one window, the native
scanner's loop, and the first trace of a run read ahead while the command still imports polars.

Everything here imports only the standard library, isal, msgspec-free helpers and the native scanner
(``_scan.c``), so that ``traceana.cli`` can start reading a run's first trace right after parsing its arguments:
the scanner and isal's gunzip run without the GIL, so on a second core they read the file while the main thread
imports polars and the analysis (docs/performance.md "Fixed cost"). ``traceana.ingest.kineto`` turns what the
scanner hands back (Arrow tables, the few values of another type, the top level's raw values) into polars frames;
it is the only caller of ``scan``, and the one place a read-ahead is taken (``scan`` does both).

Read-ahead is bounded: one file (the first trace load_run would read), at most ``AHEAD_BYTES`` of JSON or
``AHEAD_EVENTS`` events scanned in the background, after which the thread stops; whoever takes it goes on from
there in its own thread under the memory rule (``Budget``). A read-ahead is used only for the same file unchanged (device, inode, size, mtime and
ctime as when it was opened), its errors are raised where the file is taken, exactly as a scan there would raise
them, and one never taken costs only its thread's work.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

from traceana.core import limits, names
from traceana.core.errors import BadInputError, TraceanaError, TraceFormatError, shown
from traceana.core.files import open_regular
from traceana.core.manifest import MANIFEST_NAME
from traceana.core.units import MIB

try:  # the optional native scanner (traceana/ingest/_scan.c); without it the general decoder does everything
    from traceana.ingest import _scan
except ImportError:  # pragma: no cover - built without a C compiler
    _scan = None  # type: ignore[assignment]


def stale_scanner(scan, source: Path = Path(__file__).with_name("_scan.c")) -> str | None:
    """Why a built scanner cannot be used, or None: built from another ``_scan.c`` than the one beside it (an
    editable install not rebuilt after the source changed; setup.py builds the source's CRC-32 into the module).
    Without the source (a wheel) there is nothing to compare, and the build is taken as it is."""
    if scan is None:
        return None
    try:
        crc = zlib.crc32(source.read_bytes())
    except OSError:
        return None
    if getattr(scan, "SOURCE_CRC", None) == crc:
        return None
    return ("the native trace scanner was built from another version of traceana/ingest/_scan.c: traces are read "
            "by the pure-Python decoder, 3-4x slower — rebuild it (pip install -e . , or python setup.py build_ext "
            "--inplace)")


SCANNER_STALE = stale_scanner(_scan)  # one line for the user (run_dir's notes, --version), or None
if SCANNER_STALE:
    _scan = None  # a stale build's calls would fail or, worse, disagree with the Python around them

# isal (a core dependency) gunzips ~1.6x faster than zlib (docs/field-notes.md).
from isal import igzip
from isal import isal_zlib as _zlib

ZLIB_ERRORS: tuple[type[BaseException], ...] = (_zlib.error, zlib.error)
GZIP_MAGIC = b"\x1f\x8b"
TRACE_SUFFIXES = (".json", ".json.gz")

# Kineto categories of events that run on a GPU stream (newer Kineto writes lower case, older "Kernel", "Memcpy").
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "memcpy", "memset")
GPU_CAT_NAMES = [*GPU_CATS, *(c.capitalize() for c in GPU_CATS)]
# Events whose record_shapes args ingest decodes (few per step): peers, tags and message sizes of gloo P2P.
SHAPES_NAMES = (names.C10D_SEND, names.C10D_RECV)
META_KEYS = ("distributedInfo", "deviceProperties", "baseTimeNanoseconds", "traceana")


# --- which files ---------------------------------------------------------------------------------------------------
UTF8_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors write first: accepted before the JSON


def is_trace_name(path: Path) -> bool:
    return path.name.endswith(TRACE_SUFFIXES)


def find_traces(directory: Path) -> list[Path]:
    """Kineto trace files directly in ``directory`` (``*.json``, ``*.json.gz``; run.json and hidden files excluded)."""
    try:
        entries = sorted(directory.iterdir())
    except PermissionError:
        raise BadInputError("permission denied listing the directory", path=shown(directory),
                            fix="make it readable (chmod +rx)") from None
    except OSError as e:
        raise BadInputError(f"cannot list the directory ({e.strerror or e})", path=shown(directory),
                            fix="check the path") from None
    return [p for p in entries
            if is_trace_name(p) and p.name != MANIFEST_NAME and not p.name.startswith(".")
            and not (p.is_dir() and not p.is_symlink())]


def trace_subfolders(directory: Path, limit: int = 4) -> list[Path]:
    """The first ``limit`` subfolders of ``directory`` (by name) that hold traces directly: where a directory holds
    none itself, they are what the user likely meant (two runs side by side, a run per configuration)."""
    try:
        subs = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    found = []
    for sub in subs:  # one listing per subfolder, only on the way to an error
        try:
            if find_traces(sub):
                found.append(sub)
        except BadInputError:
            continue
        if len(found) == limit:
            break
    return found


MERGED_PRODUCER = "traceana merge"  # otherData.producer in the header of the trace ``traceana merge`` writes
_MERGED_MARK = re.compile(rb'^\s*\{\s*"displayTimeUnit"\s*:\s*"ns"\s*,\s*"otherData"\s*:\s*\{\s*"producer"\s*:\s*"'
                          + re.escape(MERGED_PRODUCER.encode()) + rb'"')


def is_merged_trace(path: Path) -> bool:
    """Whether ``path`` is traceana's own merged trace (its header, written first, names the producer): a run
    folder holding one must still analyse as the ranks' traces alone. Reads at most the first 64 KiB."""
    try:
        with open_regular(path) as fh:
            head = fh.read(1 << 16)
        if head[:2] == GZIP_MAGIC:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 4096)
    except (TraceanaError, OSError, zlib.error, EOFError):
        return False  # unreadable: the parse says why
    return bool(_MERGED_MARK.match(head))


# --- reading bytes -------------------------------------------------------------------------------------------------
def open_trace(path: Path):
    """The trace file opened for reading when it is a regular file, or a one-line BadInputError saying why not."""
    if path.is_dir():
        raise BadInputError("is a directory, not a trace file", path=shown(path), fix="pass a trace file or use load_run")
    return open_regular(path, shown=shown(path))


def oversized(path: Path, offset: int) -> TraceFormatError:
    return TraceFormatError(
        f"one JSON value (an event, or the top level before traceEvents) exceeds "
        f"{limits.MAX_VALUE_BYTES >> 20} MiB at about byte {offset:,} of the JSON; no profiler event is that large",
        path=shown(path), fix="the file is damaged or not a profiler trace; re-collect it")


class Budget:
    """The bounded-memory rule (``traceana.core.limits``): after each batch, the memory still free must be at least
    twice what reading this trace has taken so far (building its tables takes about as much again). ``batches``
    is anything counting its X events (``rows``) and memory instants (``n_mem``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.start = path, limits.usage()

    def check(self, batches) -> None:
        short = limits.short_of_room(self.start, limits.usage())
        if short is not None:
            taken, free = short
            raise TraceFormatError(
                f"after {batches.rows + batches.n_mem:,} events, reading it has taken {limits.gib(taken)} and only "
                f"{limits.gib(free)} of memory is left: its tables would not fit",
                path=shown(self.path), fix=limits.how_to_raise())


# --- the native scanner ------------------------------------------------------------------------------------------
NATIVE_CHUNK = 16 * MIB  # bytes of JSON scanned per call (one set of column buffers)
READ_PIECE = 16 * MIB  # bytes read, or gunzipped, at a time: the whole file is never in memory at once
MIN_PIECE = 1 << 16  # the window of a small file: what a file cannot fill is not allocated (nor zero-filled)
GZ_RATIO = 32  # raw bytes per gzipped byte assumed to size the window (Kineto JSON gzips ~10-14:1)
THREADED_GUNZIP_BYTES = MIB  # smaller gzip files are gunzipped inline: a thread and a second window cost more


# Which X events the scanner gives GPU, communication and record_shapes rows (the same names as the general decoder's).
_GPU_CAT_BYTES = tuple(c.encode() for c in GPU_CAT_NAMES)
_COMM_NAME_BYTES = (names.RECORD_PARAM_COMMS.encode(),)
_SHAPES_NAME_BYTES = tuple(n.encode() for n in SHAPES_NAMES)
_SHAPES_PREFIX_BYTES = (names.GLOO_PREFIX.encode(),)


class NotNative(Exception):
    """A file the native scanner leaves to the general decoder (which also says what is wrong with it, if anything)."""


# What the native scanner raises for a file it hands back to the general decoder (a truncated gzip stream is an
# EOFError: the general decoder recovers what it can).
HANDED_BACK: tuple[type[BaseException], ...] = (NotNative, OSError, EOFError, *ZLIB_ERRORS,
                                                *((_scan.Unsupported,) if _scan is not None else ()))

MMAP_WINDOW_BYTES = 1 << 21  # a window at least this large is an anonymous mapping, not a bytearray


def _new_window(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``size`` bytes for the reading window. A large one is an anonymous mapping: its pages are
    zero-filled by the kernel when first written (a bytearray is zeroed by a pass of its own, ~20 ms for 16 MB, then
    written again), in huge pages where the kernel allows (2 MB faults instead of 4 KB), and go back to the OS when
    it is closed (a freed 16 MB bytearray stayed in glibc's heap, and raised its mmap threshold for everything
    after it)."""
    if size < MMAP_WINDOW_BYTES:
        return bytearray(size)
    window = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            window.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return window


def _free_window(window: bytearray | mmap.mmap, *, keep: bool = False) -> None:
    """Unmap ``window``; with ``keep``, while ``keep_windows`` is on, keep it for the next file instead."""
    if keep and len(window):
        with _POOL_LOCK:
            if _POOL_USERS and len(_POOL) < POOL_MAX:
                _POOL.append(window)
                return
    if isinstance(window, mmap.mmap):
        try:
            window.close()
        except BufferError:  # a view of it is still alive (an error while reading): unmapped when it is collected
            pass


def _gunzip_inline(fh, read_bytes: int | None = None):
    """isal's gzip reader itself (the one its gunzip thread and ``igzip.open`` wrap): its ``readinto`` inflates
    straight into the window, the GIL released. ``igzip.open``'s file object reads a bytes object and copies it:
    on a 54 MB trace a copy of every byte and ~11 MB more memory kept (the freed 16 MB blocks). ``read_bytes``:
    compressed bytes it reads from the file at a time (each read takes the GIL)."""
    reader = getattr(igzip, "_IGzipReader", None)
    return reader(fh, read_bytes or igzip.READ_BUFFER_SIZE) if reader is not None else igzip.open(fh, "rb")


# Gunzipped ahead (Reader): the window's first HEAD bytes are room for the bytes kept from the window before (an
# event cut by its end), so that only they are copied when the windows swap.
HEAD = MIN_PIECE
AHEAD_READ_BYTES = 2 * MIB  # compressed bytes the fill thread reads at a time (~20-30 MB of JSON): few GIL takes
_INLINE = threading.local()  # ``on``: Readers opened in this thread gunzip inline (see gunzip_inline)


class gunzip_inline:
    """``with gunzip_inline():`` Readers opened in this thread gunzip in it, not ahead in a thread of their own:
    for threads that each scan a file while others do the same (load_run's workers), where a core is no longer
    free for the gunzip and the fill threads only add switches."""

    def __enter__(self) -> None:
        self.before = getattr(_INLINE, "on", False)
        _INLINE.on = True

    def __exit__(self, *exc: object) -> None:
        _INLINE.on = self.before


# Windows kept for the next file (``keep_windows``): a fresh 16 MB window is 4,096 page faults as it is first
# written, ~10 ms of a 200 MB rank's 0.3 s.
_POOL: list[bytearray | mmap.mmap] = []
_POOL_LOCK = threading.Lock()
_POOL_USERS = 0
POOL_MAX = 4


class keep_windows:
    """``with keep_windows():`` the windows of files read meanwhile (in any thread) are kept for the next file, at
    most POOL_MAX of them, and freed when the last such block ends (load_run reads its ranks in one)."""

    def __enter__(self) -> None:
        global _POOL_USERS
        with _POOL_LOCK:
            _POOL_USERS += 1

    def __exit__(self, *exc: object) -> None:
        global _POOL_USERS
        with _POOL_LOCK:
            _POOL_USERS -= 1
            left = _POOL[:] if not _POOL_USERS else []
            if left:
                _POOL.clear()
        for w in left:
            _free_window(w)


def _window(size: int) -> bytearray | mmap.mmap:
    """A window of ``size`` bytes, one kept from an earlier file when there is one."""
    with _POOL_LOCK:
        for i, w in enumerate(_POOL):
            if len(w) == size:
                return _POOL.pop(i)
    return _new_window(size)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_identity(path: Path) -> tuple[int, ...] | None:
    """The file's device, inode, size, mtime and ctime (None when it cannot be stat'ed): the same file unchanged."""
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


class Reader:
    """A trace file's bytes behind a sliding window of about READ_PIECE, gunzipped on the fly.

    ``buf`` is a view of the window; ``extend(keep_from)`` keeps the bytes from ``keep_from`` on (at most one event
    cut by the window's end) and puts the next bytes of the stream after them. The whole file is never in memory,
    and no fresh memory is touched per piece.

    A gzip file of ``threads_from`` bytes or more is gunzipped ahead: while the caller scans one window, a thread
    of this Reader inflates the next piece straight into a second window (isal's inflate releases the GIL), and
    ``extend`` swaps the two, copying only the kept bytes (isal's own gunzip thread handed over each MB as a new
    bytes object, copied into the window under the GIL: ~0.04 s of the reading thread per 200 MB). A smaller
    file, or one opened under ``gunzip_inline``, is gunzipped inline, in the thread that reads.
    """

    def __init__(self, path: Path, *, threads_from: int | None = None) -> None:
        """``threads_from``: a gzip file of at least this many bytes (default THREADED_GUNZIP_BYTES) is gunzipped
        ahead in a thread of its own, a smaller one inline (in the thread that reads, the GIL released while it
        inflates)."""
        self.path = path
        self.fh = open_trace(path)
        st = os.fstat(self.fh.fileno())
        self.identity = _identity(st)  # the file as opened: a read-ahead is used only for the same file unchanged
        self.size = st.st_size
        gz = self.fh.read(2) == GZIP_MAGIC
        self.fh.seek(0)
        ahead = gz and self.size >= (THREADED_GUNZIP_BYTES if threads_from is None else threads_from) \
            and getattr(_INLINE, "on", False) is False
        self.src = _gunzip_inline(self.fh, AHEAD_READ_BYTES if ahead else None) if gz else self.fh
        # The window fits the file (grown in extend() should one event not fit): a 16 MB window for a 6 KB trace
        # was most of the memory a small analysis used.
        expect = self.size * (GZ_RATIO if gz else 1) + 1
        # Bytes read at a time; gunzipped ahead, half as many in each of the two windows: the same memory as one.
        self.piece = min(READ_PIECE // 2 if ahead else READ_PIECE, max(MIN_PIECE, expect))
        self.length = 0
        self.base = 0  # where buf starts in the window
        self.n_bytes = 0  # decompressed bytes so far
        self.final = False  # the window reaches the end of the stream
        self._fill: threading.Thread | None = None
        self.wsize = HEAD + self.piece if ahead else self.piece  # a window's size, unless one event needs more
        if ahead:  # the window being scanned and the one being filled
            self.window: bytearray | mmap.mmap = bytearray(0)
            self.spare: bytearray | mmap.mmap | None = _window(self.wsize)
            self._start_fill()
        else:
            self.window, self.spare = _window(self.wsize), None
        self.buf = memoryview(self.window)[:0]

    # --- gunzipped ahead ----------------------------------------------------------------------------------------
    def _start_fill(self) -> None:
        self._got, self._eof, self._error = 0, False, None
        self._fill = threading.Thread(target=self._fill_spare, name="traceana-gunzip", daemon=True)
        self._fill.start()

    def _fill_spare(self) -> None:
        """The fill thread: the spare window after its HEAD, as full as the stream allows."""
        try:
            with memoryview(self.spare) as view:
                end = len(view)
                at = HEAD
                while at < end:
                    with view[at:] as rest:
                        n = self.src.readinto(rest)
                    if not n:
                        self._eof = True
                        break
                    at += n
                self._got = at - HEAD
        except BaseException as e:  # raised by extend, in the reading thread, as an inline read would raise it
            self._error = e

    def _wait(self) -> None:
        if self._fill is not None:
            self._fill.join()
            self._fill = None

    def _extend_ahead(self, keep_from: int) -> None:
        kept = self.length - keep_from
        self._wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        got, spare, old = self._got, self.spare, self.window
        start = self.base + keep_from
        if kept >= limits.MAX_VALUE_BYTES:
            raise oversized(self.path, self.n_bytes - kept)
        if kept <= HEAD:  # the usual case: the kept bytes go right before what was read
            spare[HEAD - kept:HEAD] = old[start:start + kept]
            self.window, self.base = spare, HEAD - kept
            spare = old if len(old) == self.wsize else None
            if spare is None:
                _free_window(old)
        else:  # one event longer than HEAD (rare): a window of its own for it and what was read after it
            big = _new_window(kept + max(got, 1))
            big[:kept] = old[start:start + kept]
            big[kept:kept + got] = spare[HEAD:HEAD + got]
            self.window, self.base = big, 0
            _free_window(old)  # the spare, its bytes copied, is filled next
        self.n_bytes += got
        self.final = self._eof or got == 0
        self.length = kept + got
        if self.final:
            if spare is not None:
                _free_window(spare, keep=True)
            self.spare = None
        else:
            self.spare = spare if spare is not None else _window(self.wsize)
            self._start_fill()

    # ------------------------------------------------------------------------------------------------------------
    def extend(self, keep_from: int) -> int:
        """Keep the window from ``keep_from`` on and read more after it; returns where ``keep_from`` now is (0)."""
        self.buf.release()
        if self.spare is not None or self._fill is not None:
            self._extend_ahead(keep_from)
            self.buf = memoryview(self.window)[self.base:self.base + self.length]
            return 0
        kept = self.length - keep_from
        old = self.window
        if kept >= len(old) // 2:  # one event larger than half the window: make room
            if kept >= limits.MAX_VALUE_BYTES:
                raise oversized(self.path, self.n_bytes - kept)
            # Doubled, but never past the rule's size (plus a read's worth): a longer value reaches it and is refused.
            grow = min(len(old), limits.MAX_VALUE_BYTES + MIN_PIECE - len(old))
            if grow > 0:
                self.window = _new_window(len(old) + grow)
        self.window[:kept] = old[keep_from:self.length]
        if self.window is not old:
            _free_window(old)
        with memoryview(self.window) as view, view[kept:] as rest:
            n = self.src.readinto(rest)
        self.n_bytes += n
        self.final = n == 0
        self.length = kept + n
        self.buf = memoryview(self.window)[: self.length]
        return 0

    def done(self) -> int:
        return self.fh.tell()

    def close(self) -> None:
        """Close the file and free the windows (again: nothing)."""
        if self.fh.closed:
            return
        self.buf.release()
        try:
            self._wait()  # the fill thread writes into the spare window and reads the file
        finally:
            for w in (self.window, self.spare):
                if w is not None:
                    _free_window(w, keep=self.final and len(w) == self.wsize)
            self.spare = None
            if self.src is not self.fh:
                self.src.close()
            self.fh.close()


class Scanned:
    """What the native scanner read of one trace, before polars: per scanner call the X, memory, GPU,
    communication and record_shapes tables (Arrow arrays, ``_scan.c`` "emitting rows"; the X table only counts the
    call's events, which the scanner keeps) and the values of another type than their column's (``odd``); at the
    end the X events in the table's order, their tracks and where each went (``taken``), the file's four
    dictionaries, the top level's raw values and the JSON's size. ``rows``/``n_mem`` count X events and memory instants (the memory rule's ``Budget``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[tuple[Any, ...]] = []  # (x, memory, gpu, comm, shapes, odd) per call, in file order
        self.rows = self.n_mem = 0
        self.top: dict[str, bytes] = {}
        self.dicts: tuple[Any, ...] | None = None
        self.taken: tuple[Any, ...] | None = None  # Scanner.take()'s tables, at the end
        self.n_bytes = 0
        self.size = 0

    def steps(self, reader: Reader | None = None):
        """The scan, one scanner call at a time: a generator yielding the Reader after each call (so a caller can
        check the memory rule, report progress, or stop and hand the rest to another thread); when it ends, the
        scan is complete. Raises what the scanner raises for a file it hands back (HANDED_BACK) or a
        TraceanaError; the file (``reader``, else opened at the first step) is closed when it ends or fails, or
        when the generator is closed."""
        r = Reader(self.path) if reader is None else reader
        self.size = r.size
        try:
            r.extend(0)
            if not r.buf:
                raise NotNative("empty file")
            start = len(UTF8_BOM) if bytes(r.buf[:3]) == UTF8_BOM else 0  # (an editor's UTF-8 mark: skipped)
            while True:  # the top level up to the traceEvents array (kept whole in the window until found)
                status, pos, keys = _scan.top(r.buf, start, True, r.final)
                if status != _scan.NEED:
                    break
                r.extend(0)  # grow the window: nothing is dropped before the array starts
            if status != _scan.EVENTS:
                raise NotNative("no traceEvents array")
            self.top = {k: bytes(r.buf[a:b]) for k, a, b in keys}
            first = True
            scanner = _scan.Scanner(_GPU_CAT_BYTES, _COMM_NAME_BYTES, _SHAPES_NAME_BYTES, _SHAPES_PREFIX_BYTES)
            while True:
                status, pos, first, *tables, odd, _ = _scan.events(r.buf, pos, first, NATIVE_CHUNK, r.final, scanner)
                self.calls.append((*tables, odd))
                self.rows += len(tables[0])
                self.n_mem += len(tables[1])
                del tables
                yield r
                if status == _scan.END:
                    break
                if status == _scan.NEED:
                    pos = r.extend(pos)
            while True:  # the rest of the top level
                status, end, keys = _scan.top(r.buf, pos, False, r.final)
                if status != _scan.NEED:
                    break
                pos = r.extend(pos)
            if status != _scan.END or any(k == "traceEvents" for k, _, _ in keys):
                raise NotNative("a second traceEvents")
            self.top.update((k, bytes(r.buf[a:b])) for k, a, b in keys)
            self.taken = scanner.take()  # the X events (kept by the scanner across its calls) sorted, tracks, pos
            self.dicts = scanner.dictionaries()
            while True:  # only whitespace may follow
                if bytes(r.buf[end:]).strip(b" \t\r\n"):
                    raise NotNative("data after the trace object")
                if r.final:
                    break
                end = r.extend(len(r.buf))
            self.n_bytes = r.n_bytes
        finally:
            r.close()


def _run(scanned: Scanned, steps, on_progress: Callable[[int, int], None] | None) -> Scanned:
    """The rest of a scan, in this thread, under the memory rule, with progress after each call and at the end."""
    budget = Budget(scanned.path)
    for r in steps:
        budget.check(scanned)
        if on_progress is not None:
            on_progress(r.done(), r.size)
    if on_progress is not None:
        on_progress(scanned.size, scanned.size)
    return scanned


def scan(path: Path, on_progress: Callable[[int, int], None] | None = None) -> Scanned:
    """A trace read by the native scanner (it must be built): the read-ahead of this file when one was started
    (``read_ahead``) and the file is unchanged, finished here; else the file scanned here. Raises HANDED_BACK for a
    file the general decoder must read, a TraceanaError for one nobody can (exactly as either way)."""
    ahead = _take(path)
    if ahead is not None:
        return _run(ahead.scanned, ahead.steps, on_progress)
    scanned = Scanned(path)
    return _run(scanned, scanned.steps(), on_progress)


# --- reading ahead ---------------------------------------------------------------------------------------------
# A read-ahead stops (and waits to be taken) after this much JSON or this many events: HTA's public traces (54 and
# 87 MB, 123k and 138k events) are read whole. The memory rule (Budget) runs where the read is taken and counts from
# there: what the read-ahead holds by then (its tables: ~60 bytes an event, so at most ~30 MB with the last call's
# overshoot of a 16 MB chunk) is not in its count — nor is polars' import, which ran meanwhile.
AHEAD_BYTES = 128 * MIB
AHEAD_EVENTS = 250_000
# A read-ahead gunzips inline what it can read whole: a gunzip thread takes the GIL for each read of the file and
# each window it hands over, and while the main thread imports (running Python code itself) each take waits for it
# (isal's own gunzip thread, handing over each 1 MB, made a 54 MB trace's read take longer than the import); inline,
# the reading thread takes the GIL only between its ~16 MB reads and scanner calls.
AHEAD_THREADS_FROM = max(THREADED_GUNZIP_BYTES, AHEAD_BYTES // GZ_RATIO)
_AHEAD: dict[str, "_Ahead"] = {}
_AHEAD_LOCK = threading.Lock()


class _Ahead:
    """One file scanned in a background thread until AHEAD_BYTES of its JSON or AHEAD_EVENTS events, the end, an
    error, or ``stop``."""

    def __init__(self, path: Path) -> None:
        self.scanned = Scanned(path)
        # Opened here: a file that cannot be opened is not read ahead.
        self.reader = Reader(path, threads_from=AHEAD_THREADS_FROM)
        self.steps = self.scanned.steps(self.reader)
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._scan, name="traceana-read-ahead", daemon=True)

    def _scan(self) -> None:
        try:
            for r in self.steps:
                if (self.stopping.is_set() or r.n_bytes >= AHEAD_BYTES
                        or self.scanned.rows + self.scanned.n_mem >= AHEAD_EVENTS):
                    return  # the rest is read by whoever takes it (under the memory rule), or never
        except BaseException as e:  # raised where the file is taken, as a scan there would raise it
            self.error = e

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def close(self) -> None:
        self.steps.close()
        self.reader.close()


def key(path: Path | str) -> str:
    """What a read-ahead is found by: the file's absolute path as given (its identity is checked where it is taken)."""
    return os.path.abspath(os.fspath(path))


def ahead_files() -> list[Path]:
    """The files being read ahead, not taken yet."""
    with _AHEAD_LOCK:
        return [a.scanned.path for a in _AHEAD.values()]


def _take(path: Path) -> _Ahead | None:
    """The read-ahead of ``path``, stopped (what it has not read yet is read by the caller): None when there is
    none, or the file is no longer the file it opened. Raises the read-ahead's error."""
    with _AHEAD_LOCK:
        ahead = _AHEAD.pop(key(path), None)
    if ahead is None:
        return None
    ahead.stop()
    if file_identity(path) != ahead.reader.identity:  # changed or replaced: read it again as if nothing had been read ahead
        ahead.close()
        return None
    if ahead.error is not None:
        error, ahead.error = ahead.error, None
        raise error
    return ahead


# A run whose traces hold at most this much JSON (gzipped files counted at GZ_RATIO) is analysed by the traceana
# program with one polars thread and one jemalloc arena (traceana.cli sets them before polars is imported: a library
# sets no environment variable in its host process): a few thousand events give polars' threads nothing to share,
# and each thread, arena and background thread they bring is memory of its own. The tiny two-rank run (4 KB of
# JSON): 10 threads → 6, peak RSS −1.7 MiB (docs/performance.md "Fixed cost"). Anything larger keeps polars'
# defaults (one thread a core).
SMALL_RUN_BYTES = MIB


def run_files(path: str | Path) -> tuple[Path, list[Path]] | None:
    """The run folder and the trace files ``load_run(path)`` would read (a folder, or one file): None when ``path``
    is neither, or cannot be listed (load_run says why)."""
    try:
        path = Path(path)
        if path.is_dir():
            return path, find_traces(path)
        if path.is_file():
            return path.parent, [path]
    except (TraceanaError, OSError, ValueError):
        pass
    return None


def raw_sizes(path: str | Path) -> list[int] | None:
    """The bytes of JSON in each trace ``load_run(path)`` would read (a gzipped file's size times GZ_RATIO), from
    the files' sizes alone: None when there is none or one cannot be read (load_run says why)."""
    found = run_files(path)
    if not found or not found[1]:
        return None
    try:
        return [f.stat().st_size * (GZ_RATIO if f.name.endswith(".gz") else 1) for f in found[1]]
    except OSError:
        return None


def is_small_run(path: str | Path, sizes: list[int] | None = None) -> bool:
    """Whether the traces ``load_run(path)`` would read hold at most ``SMALL_RUN_BYTES`` of JSON (``sizes``: their
    ``raw_sizes``, when the caller has them)."""
    sizes = raw_sizes(path) if sizes is None else sizes
    return sizes is not None and sum(sizes) <= SMALL_RUN_BYTES


def read_ahead(path: str | Path, *, cache: bool = True) -> Path | None:
    """Start reading the first trace that ``load_run(path)`` would read, in a background thread (native scanner
    only); returns that file, or None when nothing was started: no scanner, nothing readable (load_run says
    why), or, with ``cache``, an entry of the run's cache for that file (a cache hit must not pay a scan)."""
    if _scan is None:
        return None
    found = run_files(path)
    if found is None:
        return None
    run_dir, files = found
    try:
        first = next((f for f in files if not is_merged_trace(f)), None)
        if first is None or (cache and _cached(run_dir, first)):
            return None
        ahead = _Ahead(first)
        with _AHEAD_LOCK:
            if key(first) in _AHEAD:
                return None
            _AHEAD[key(first)] = ahead
        ahead.thread.start()
        return first
    except (TraceanaError, OSError, ValueError):
        return None


def _cached(run_dir: Path, trace: Path) -> bool:
    """Whether the run's ingest cache holds an entry for ``trace``: its key needs polars' schemas, so any entry of
    that file counts (a stale one only costs this read-ahead). An analysis cache hit implies one: load_run wrote
    it in the same folder when the analysis was stored."""
    from traceana.ingest.cache import CACHE_DIR, SUBDIR

    try:
        return any(n.startswith(f"{trace.name}.") for n in os.listdir(run_dir / CACHE_DIR / SUBDIR))
    except OSError:
        return False


def drop_ahead() -> None:
    """Stop and forget every read-ahead not taken (a command that ended before reading it, or failed)."""
    with _AHEAD_LOCK:
        left = list(_AHEAD.values())
        _AHEAD.clear()
    for ahead in left:
        ahead.stop()
        ahead.close()
