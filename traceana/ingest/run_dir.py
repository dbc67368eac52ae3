"""A run directory (or one trace file) → a ``Run``: every rank parsed, checked against the others and run.json.

    run = load_run("runs/1f1b_pp4")            # parallel over ranks, Parquet cache under runs/1f1b_pp4/.traceana
    run.events, run.memory, run.traces, run.manifest, run.warnings

Ranks are parsed in parallel (all cores; serially when there is one file to parse): in threads when the native
scanner is built (it runs without the GIL), else in separate processes. The result does not depend on how: every
rank's table is sorted the same way and ranks are concatenated in rank order.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing
import os
import sys
import warnings as pywarnings
from functools import partial
from pathlib import Path
from typing import Any, Callable

import polars as pl

from traceana.core import names, schema
from traceana.core.errors import BadInputError, RunDirError, TraceFormatError, TraceanaError
from traceana.core.intervals import ENGINE
from traceana.core.limits import check_ranks
from traceana.core.manifest import MANIFEST_NAME, Manifest
from traceana.core.units import NS_PER_MS, NS_PER_S
from traceana.ingest import Run
from traceana.ingest import kineto, reading
from traceana.ingest.cache import CACHE_DIR, TraceCache
from traceana.ingest.kineto import NotATraceError, rank_from_filename, read_trace, shown
from traceana.ingest.reading import (MERGED_PRODUCER, find_traces, is_merged_trace,  # noqa: F401 (polars-free: the CLI)
                                     trace_subfolders, SCANNER_STALE)

Parsed = tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]]


class IngestWarning(UserWarning):
    """A usable but incomplete input (truncated trace, missing ranks, no cache): also listed in ``Run.warnings``.

    Commands that print ``Run.warnings`` themselves can silence these with
    ``warnings.simplefilter("ignore", IngestWarning)``.
    """


class IngestNote(IngestWarning):
    """A fact about the input that is normal practice, not a fault: a job profiled on some of its ranks (2 of
    128 is usual). Listed in ``Run.warnings`` like the others, shown as a note, not a warning (``category_of``)."""


SAMPLED_RANKS = " ranks have no trace ("  # (the words of the one note ``_check_ranks`` gives)


def category_of(message: str) -> type[IngestWarning]:
    """The warning class of one of ``Run.warnings``: ``IngestNote`` for a sample of the ranks, else
    ``IngestWarning`` (a cached run's warnings are text, so the class is told from the words)."""
    return IngestNote if SAMPLED_RANKS in message else IngestWarning


def input_files(path: str | Path) -> list[Path]:
    """The files an analysis of ``path`` reads (its traces and run.json, or the one trace file): outputs are
    checked against these (``traceana.core.files.refuse_inputs``) so that none is ever written over."""
    path = Path(path)
    try:
        if not path.is_dir():
            return [path]
        return [*find_traces(path), path / MANIFEST_NAME]
    except (TraceanaError, OSError):
        return [path]


def load_run(path: str | Path, *, workers: int | None = None, cache: bool = True, progress: bool = False) -> Run:
    """Load a run directory or a single trace file into one ``Run`` (see the module docstring).

    ``workers``: processes parsing ranks in parallel (None: all cores when the traces are big enough to pay for
    starting them, else 1). ``cache``: read and write the Parquet cache under RUN_DIR/.traceana. ``progress``: a
    progress bar on stderr.
    """
    path = Path(path)
    try:
        exists = path.exists() or path.is_symlink()
    except OSError:
        exists = False
    if not exists:
        raise BadInputError("no such file or directory", path=shown(path),
                            fix="pass a run directory or a Kineto trace file")
    manifest: Manifest | None = None
    early_notes: list[str] = []
    if path.is_dir():
        run_dir = path
        files = find_traces(path)
        merged = [f for f in files if is_merged_trace(f)]
        if merged:
            files = [f for f in files if f not in merged]
            early_notes = [f"{shown(f)}: skipped — it is traceana's own merged trace (traceana merge), not a rank's "
                           "trace; keep merged traces outside run folders" for f in merged]
        if not files:
            subs = trace_subfolders(path)
            fix = ("point at the directory the profiler wrote rank*.pt.trace.json.gz into" if not subs else
                   f"its subfolder{'s' if len(subs) > 1 else ''} {', '.join(s.name + '/' for s in subs)} "
                   f"hold{'' if len(subs) > 1 else 's'} traces: pass one of them (e.g. {shown(subs[0])})")
            raise RunDirError("no Kineto traces (*.json, *.json.gz) in this directory", path=shown(path), fix=fix)
        if (path / MANIFEST_NAME).exists():
            manifest = Manifest.read(path / MANIFEST_NAME)
    else:
        if is_merged_trace(path):
            raise BadInputError("this is traceana's own merged trace (traceana merge output), not a profiler trace",
                                path=shown(path), fix="analyse the run folder it was merged from")
        run_dir = path.parent
        files = [path]

    trace_cache = TraceCache(run_dir, enabled=cache)
    warnings: list[str] = list(early_notes)
    if SCANNER_STALE:
        warnings.append(SCANNER_STALE)
    if trace_cache.note:
        warnings.append(trace_cache.note)
    parsed: dict[Path, Parsed] = {}
    marks: dict[Path, Marks] = {}  # each parsed rank's step spans and annotations (_rank_marks), found as it was read
    misses = []
    hit = result = None
    for f in files:
        hit = trace_cache.load(f)
        if hit is not None:
            parsed[f] = hit
        else:
            misses.append(f)
    with reading.keep_windows():  # one rank's reading windows reused for the next
        outcomes = _parse_all(misses, workers=workers, progress=progress)
    outcomes.reverse()  # popped in file order: from here ``parsed`` holds the only reference to each rank's table
    for f in misses:
        result = outcomes.pop()
        if result[0] == "error":
            cls, what = result[1][0], result[1][1]
            if path.is_dir() and _users_file(f, cls):  # e.g. a config, notes, or `analyze --json > RUN/analysis.json`
                warnings.append(f"{shown(f)}: ignored, not a trace ({what}); a file of yours in the run folder?")
                continue
            _raise(result[1])
        parsed[f], marks[f] = result[1][:3], result[1][3]
    # (written together: many small ranks' events go into a few batch files, not one Parquet file each)
    note = trace_cache.store_all([(f, *parsed[f]) for f in misses if f in parsed])
    if note:
        warnings.append(note)
    files = [f for f in files if f in parsed]
    if not files:
        raise RunDirError("no Kineto traces in this directory (only other JSON files)", path=shown(path),
                          fix="point at the directory the profiler wrote rank*.pt.trace.json.gz into")

    results = [parsed[f] for f in files]
    found = [marks.get(f) for f in files]
    warnings.extend(w for _, _, row in results for w in row.get("warnings", []))
    if all(r[0].height == 0 for r in results):
        one = len(results) == 1
        ns = next((w[w.index("(its ts values") + 1:-1] for _, _, row in results for w in row.get("warnings", [])
                   if "(its ts values" in w), None)
        raise RunDirError(
            ("the trace holds no" if one else f"none of the {len(results)} traces holds a") + " usable event"
            + (f": {ns.removesuffix(': ' + kineto.NS_FIX)}" if ns else
               " (traceEvents empty, or every event dropped as malformed or with an unusable ts/dur)"),
            path=shown(files[0] if one else path),
            fix=kineto.NS_FIX if ns else "re-collect with the profiler active for at least one step",
        )
    warnings.extend(f"{shown(r[2]['path'])}: rank {r[2]['rank']} has no usable event; it is analysed as empty"
                    for r in results if r[0].height == 0)
    warnings.extend(_check_ranks(results, manifest, run_dir))
    warnings.extend(_one_collection(results, run_dir))
    warnings.extend(_contradictions(results, manifest, run_dir, found))
    del found
    marks.clear()
    results.sort(key=lambda r: r[2]["rank"])
    # (only the ranks with memory instants: concatenating thousands of empty frames took ~1 s at 4,096 ranks)
    memory = pl.concat([r[1] for r in results if r[1].height] or [schema.empty(schema.MEMORY)], how="vertical")
    traces = _traces_table([r[2] for r in results])
    frames = [r[0] for r in results]
    del results, hit, result  # from here ``frames`` holds the only reference to each rank's table
    parsed.clear()
    events = _one_table(frames) if frames else schema.empty(schema.EVENTS)
    for w in warnings:
        pywarnings.warn(w, category_of(w), stacklevel=2)
    return Run(path=path, events=schema.check(events, schema.EVENTS, "events"),
               memory=schema.check(memory, schema.MEMORY, "memory"), traces=traces, manifest=manifest,
               warnings=tuple(warnings))


def _traces_table(rows: list[dict]) -> pl.DataFrame:
    """The TRACES table of the ranks' rows. pg_config's JSON text (at 4,096 ranks each rank's default group lists
    4,096 ranks: 23 kB of text a rank, 92 MB for the run as 4,096 strings) is converted once per distinct object
    (the ranks of a job share one: kineto._pg_text) and gathered, not once per rank (a gathered string column
    shares its bytes: the text is held once); its process groups are read from it (traceana.ingest.process_groups)."""
    shared = ("pg_config",)
    distinct: dict[str, list] = {c: [] for c in shared}
    index: dict[str, list[int]] = {c: [] for c in shared}
    for c in shared:
        seen: dict[int, int] = {}
        for r in rows:  # one per rank
            value = r.get(c)
            i = seen.get(id(value))
            if i is None:
                i = seen[id(value)] = len(distinct[c])
                distinct[c].append(value)
            index[c].append(i)
    plain = pl.DataFrame([{k: v for k, v in r.items() if k in schema.TRACES and k not in shared} for r in rows],
                         schema={c: t for c, t in schema.TRACES.items() if c not in shared})
    columns = [pl.Series(c, distinct[c], dtype=schema.TRACES[c]).gather(pl.Series(index[c], dtype=pl.UInt32))
               for c in shared]
    return schema.conform(plain.with_columns(columns), schema.TRACES)


def _one_table(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The ranks' tables as one contiguous table (the analysis needs one), joined a few columns at a time, each rank's
    copy of a column dropped as soon as the joined column exists: ``pl.concat(rechunk=True)`` held the whole run's
    table twice. ``frames`` must hold the only references to the tables; it is emptied."""
    names = frames[0].columns
    if sum(f.height for f in frames) < kineto.SORT_WHOLE_ROWS:  # small: at once (the column rounds cost ~4 ms a run)
        out = pl.concat(frames, rechunk=True)
        frames.clear()
        return out
    # polars copies without the GIL: a few columns at a time in threads (on 2 cores the end of a parallel ingest
    # took half as long), each round's copies dropped before the next.
    k = min(len(names), os.cpu_count() or 1) if sum(f.height for f in frames) >= kineto.FINISH_ALONE_ROWS else 1
    if len(frames) > JOIN_FRAMES:  # thousands of small ranks: first side by side in a few frames (no copy: their
        # chunks are only listed together), so that each round below is a few dozen calls, not thousands
        n = -(-len(frames) // JOIN_FRAMES)
        frames[:] = [pl.concat(frames[i:i + n], how="vertical", rechunk=False) for i in range(0, len(frames), n)]
    columns: list[pl.Series] = []
    with cf.ThreadPoolExecutor(max_workers=k) as pool:
        for i in range(0, len(names), k):
            group = names[i:i + k]
            columns.extend(pool.map(_joined, [[f[c] for f in frames] for c in group]))
            frames[:] = [f.drop(group) for f in frames]
    frames.clear()
    return pl.DataFrame(columns)


JOIN_FRAMES = 64


def _joined(parts: list[pl.Series]) -> pl.Series:
    """One rank's column after another, as one chunk; null on every event stays unwritten (schema.nulls)."""
    if all(p.null_count() == len(p) for p in parts):
        return schema.nulls(parts[0].name, sum(len(p) for p in parts), parts[0].dtype)
    return pl.concat(parts, rechunk=True)


# --- parsing, serial or parallel -----------------------------------------------------------------------------------
def _parse_one(path: Path) -> tuple[str, Any]:
    """Worker entry point: ("ok", parsed + marks) or ("error", (class name, what, path, fix)) — errors cross
    processes."""
    return _caught(_marked, read_trace, path)


def _marked(fn: Callable[..., Parsed], *args: Any, **kw: Any) -> tuple[Any, ...]:
    """``fn``'s (events, memory, row) and the events' marks (``_rank_marks``), found in the thread that read them."""
    result = fn(*args, **kw)
    return (*result, _rank_marks(result[0]))


def _worker_init() -> None:
    """A worker leaves Ctrl-C to the parent (which prints the one line): the signal's default action ends it at
    once, without a traceback (and without an exit call in the library)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _raise(payload: tuple[type, str, str | None, str | None]) -> None:
    cls = payload[0] if isinstance(payload[0], type) and issubclass(payload[0], TraceanaError) else TraceanaError
    raise cls(payload[1], path=payload[2], fix=payload[3])


def _parse_all(files: list[Path], *, workers: int | None, progress: bool) -> list[tuple[str, Any]]:
    if not files:
        return []
    threads = kineto.native_available()
    if workers is None:
        # Threads cost nothing to start. A worker process costs ~1 s (a fresh interpreter importing polars):
        # worth it only for big traces.
        big = threads or _raw_size_estimate(files) >= PARALLEL_MIN_BYTES
        workers = (os.cpu_count() or 1) if big else 1
    n_workers = min(max(workers, 1), len(files))
    with _Progress(progress, files) as bar:
        if n_workers <= 1 and threads and len(files) > 1:
            return _parse_pipelined(files, bar)
        if n_workers <= 1:
            out = []
            for f in files:
                result = _parse_serial(f, bar.per_event(f))
                if result[0] == "error" and not _users_file(f, result[1][0]):
                    _raise(result[1])  # no point reading the other ranks
                out.append(result)
                bar.file_done()
            return out
        results: dict[Path, Any] = {}
        if threads:
            # The native scanner, gunzip and polars run without the GIL: threads use every core with no worker to
            # start and no tables to send between processes.
            # Small files go to a thread a chunk at a time, their tables finished together (_parse_chunk).
            with cf.ThreadPoolExecutor(max_workers=n_workers) as pool:
                futures = {pool.submit(_parse_chunk, chunk): chunk for chunk in _chunks(files)}
                for fut in cf.as_completed(futures):
                    for f, result in zip(futures[fut], fut.result()):
                        results[f] = result
                        bar.file_done()
        elif _can_start_workers():
            try:
                # forkserver, not fork: polars' thread pool does not survive a fork of a process that used it.
                ctx = multiprocessing.get_context("forkserver")
                # The server imports ingest (polars, msgspec) once; each worker forks from it ready to parse.
                ctx.set_forkserver_preload(["traceana.ingest.run_dir"])
                with cf.ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx, initializer=_worker_init) as pool:
                    futures = {pool.submit(_parse_one, f): f for f in files}
                    for fut in cf.as_completed(futures):
                        results[futures[fut]] = fut.result()
                        bar.file_done()
            except (cf.process.BrokenProcessPool, OSError, RuntimeError):
                results.clear()  # workers could not start here (see _can_start_workers): parse serially
        for f in files:
            if f not in results:
                results[f] = _parse_serial(f, None)
                bar.file_done()
        return [results[f] for f in files]


PARALLEL_MIN_BYTES = 64_000_000  # raw JSON bytes (estimated) of all files to parse before workers pay off


def _raw_size_estimate(files: list[Path]) -> int:
    total = 0
    for f in files:
        try:
            size = f.stat().st_size
        except OSError:
            continue
        total += size * (10 if f.name.endswith(".gz") else 1)  # Kineto JSON gzips about 10:1
    return total


def _can_start_workers() -> bool:
    """Worker processes re-import the main module by path; a main read from stdin or ``-c`` has none to import."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is None or Path(main_file).exists()


def _parse_serial(path: Path, on_progress: Callable[[int, int], None] | None) -> tuple[str, Any]:
    return _caught(_marked, read_trace, path, on_progress=on_progress)


CHUNK_BYTES = 32_000_000  # raw JSON bytes (estimated) of the small files one thread reads as one task
CHUNK_FILES = 256


def _chunks(files: list[Path]) -> list[list[Path]]:
    """The files in consecutive chunks of about CHUNK_BYTES (raw, estimated) or CHUNK_FILES: a big file is a chunk of
    its own (threads share big files one by one, as before), thousands of small ones come in a few dozen tasks."""
    out: list[list[Path]] = []
    size = 0
    for f in files:
        one = _raw_size_estimate([f])
        if not out or size + one > CHUNK_BYTES or len(out[-1]) >= CHUNK_FILES:
            out.append([])
            size = 0
        out[-1].append(f)
        size += one
    return out


def _parse_chunk(files: list[Path]) -> list[tuple[str, Any]]:
    """A thread's files, read one after another, the small ones' tables finished together (kineto.finish_together,
    up to kineto.TOGETHER_ROWS events at once): one result per file, in order. Each file is gunzipped in the thread
    itself: with every core scanning a rank, gunzipping ahead in one more thread per rank only adds switches and a
    second window (on 8 x 100 MB with two workers, best of 4 under load: 1.79 against 2.00 CPU-s, peak 291 against
    319 MiB)."""
    out: list[tuple[str, Any]] = []
    group: list[Any] = []
    rows = 0

    def hand_over() -> None:
        nonlocal rows
        if group:
            out.extend(_finish_group(group[:]))
            group.clear()
            rows = 0

    with reading.gunzip_inline():
        for f in files:
            scanned = _caught(kineto.scan_trace, f)
            if scanned[0] == "ok" and kineto.can_finish_together(scanned[1]):
                group.append(scanned[1])
                rows += scanned[1].batches.rows
                del scanned
                if rows >= kineto.TOGETHER_ROWS:
                    hand_over()
                continue
            hand_over()
            out.append(scanned if scanned[0] == "error" else _caught(_marked, scanned[1]))
            del scanned
    hand_over()
    return out


def _caught(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[str, Any]:
    """("ok", fn(...)) or ("error", (class, what, path, fix)) for a TraceanaError (errors cross threads and processes
    as values)."""
    try:
        return "ok", fn(*args, **kw)
    except TraceanaError as e:
        return "error", (type(e), e.what, e.path, e.fix)


def _parse_pipelined(files: list[Path], bar: _Progress) -> list[tuple[str, Any]]:
    """One rank scanned at a time, as workers=1 asks, but each rank's finishing (building and sorting its table,
    polars' own threads) runs in a second thread while the next rank is scanned: on 4 ranks of 200 MB finishing was
    a third of ingest's CPU time, spent with the scanner idle. At most one rank waits to be finished (its columns
    are what the overlap adds to memory); results, errors and progress come in file order, as serially."""
    out: list[tuple[str, Any]] = []

    def take(result: tuple[str, Any], f: Path) -> None:
        if result[0] == "error" and not _users_file(f, result[1][0]):
            _raise(result[1])  # no point reading the other ranks
        out.append(result)
        bar.file_done()

    # Small ranks wait to be finished together (kineto.finish_together: one set of queries for up to
    # kineto.TOGETHER_ROWS events, where one rank's queries cost more than its work): a group is handed to the
    # finisher when it is full, or before a rank that is finished alone.
    group: list[tuple[Any, Path]] = []
    rows = 0
    with cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="traceana-finish") as finisher:
        pending: tuple[cf.Future, list[Path]] | None = None

        def submit(job: Callable[[], list[tuple[str, Any]]], paths: list[Path]) -> None:
            nonlocal pending
            if pending is not None:
                for result, p in zip(pending[0].result(), pending[1]):
                    take(result, p)
            pending = (finisher.submit(job), paths) if paths else None

        def hand_over() -> None:
            nonlocal rows
            if group:
                scans, paths = [s for s, _ in group], [p for _, p in group]
                group.clear()
                rows = 0
                submit(partial(_finish_group, scans), paths)

        for f in files:
            scanned = _caught(kineto.scan_trace, f, on_progress=bar.per_event(f))
            if scanned[0] == "ok" and kineto.can_finish_together(scanned[1]):
                group.append((scanned[1], f))
                rows += scanned[1].batches.rows
                del scanned
                if rows >= kineto.TOGETHER_ROWS:
                    hand_over()
                continue
            hand_over()
            if scanned[0] == "error":
                submit(list, [])
                take(scanned, f)
            else:
                submit(partial(lambda s: [_caught(_marked, s)], scanned[1]), [f])
                del scanned
        hand_over()
        submit(list, [])
    return out


def _finish_group(scans: list) -> list[tuple[str, Any]]:
    """_caught(_marked, scan) of each of ``scans``, finished together (kineto.finish_together)."""
    out = []
    for r in kineto.finish_together(scans):
        out.append(("error", (type(r), r.what, r.path, r.fix)) if isinstance(r, TraceanaError)
                   else ("ok", (*r, _rank_marks(r[0]))))
    return out


def _users_file(f: Path, error: type) -> bool:
    """A file found in a run folder that is not a trace and is not named like one (a config, notes, an empty
    ``analysis.json`` the shell created for ``analyze --json > RUN/analysis.json``): skipped with a warning. A file
    named like a trace that cannot be read stays an error."""
    return isinstance(error, type) and issubclass(error, TraceFormatError) and not _named_like_a_trace(f)


def _named_like_a_trace(f: Path) -> bool:
    """Profiler output names: *.pt.trace.json[.gz], rank-numbered files, or anything gzipped."""
    return ".pt.trace." in f.name or f.name.endswith(".gz") or rank_from_filename(f) is not None


class _Progress:
    """A rich progress bar on stderr (files, and events of the file being read when parsing serially)."""

    def __init__(self, enabled: bool, files: list[Path]) -> None:
        self.enabled = enabled
        self.files = files
        self.bar = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from traceana.core.tables import progress_bar

            self.bar = progress_bar()
            self.bar.start()
            self.task = self.bar.add_task("reading traces", total=len(self.files))
            self.event_task = None
        return self

    def per_event(self, path: Path) -> Callable[[int, int], None] | None:
        if self.bar is None:
            return None
        if self.event_task is not None:
            self.bar.remove_task(self.event_task)
        self.event_task = self.bar.add_task(f"  {path.name}: events", total=None)

        def update(done: int, total: int) -> None:
            self.bar.update(self.event_task, completed=done, total=total)

        return update

    def file_done(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


# --- consistency -------------------------------------------------------------------------------------------------
def _check_ranks(results: list[Parsed], manifest: Manifest | None, run_dir: Path) -> list[str]:
    """Raise RunDirError for contradictions; return warnings for what is merely incomplete."""
    notes: list[str] = []
    rows = [r[2] for r in results]
    if len(rows) == 1 and rows[0]["rank_source"] == "single":
        notes.append(f"{shown(rows[0]['path'])}: the trace does not say its rank (no distributedInfo.rank, traceana "
                     "metadata or rankN in the file name); assuming rank 0")
    unnamed = [r for r in rows if r["rank_source"] == "single"]
    if len(rows) > 1 and unnamed:
        raise RunDirError(
            f"{len(unnamed)} of {len(rows)} traces do not say their rank (e.g. {shown(unnamed[0]['path'])})",
            path=shown(run_dir), fix="name the files rank{R}.pt.trace.json.gz or collect with torch.distributed initialised",
        )
    by_rank: dict[int, str] = {}
    for r in rows:
        if r["rank"] in by_rank:
            raise RunDirError(
                f"two traces claim rank {r['rank']}: {shown(by_rank[r['rank']])} and {shown(r['path'])}",
                path=shown(run_dir), fix="keep one trace per rank (traces of different runs mixed up?)",
            )
        by_rank[r["rank"]] = r["path"]
    sizes: dict[int, str] = {}
    for r in rows:
        if r["world_size"] is not None:
            check_ranks(r["world_size"], "distributedInfo.world_size", r["path"])
            sizes.setdefault(r["world_size"], r["path"])
    if len(sizes) > 1:
        (w1, p1), (w2, p2) = list(sizes.items())[:2]
        raise RunDirError(
            f"traces from runs of different world sizes: {shown(p1)} has {w1}, {shown(p2)} has {w2}",
            path=shown(run_dir), fix="put each run's traces in its own directory",
        )
    world = next(iter(sizes), None)
    if manifest is not None:
        if world is not None and world != manifest.world_size:
            raise RunDirError(
                f"run.json says world_size {manifest.world_size} but the traces say {world}",
                path=shown(run_dir / MANIFEST_NAME), fix="fix or delete run.json (it belongs to another run?)",
            )
        world = manifest.world_size
    if world is not None:
        outside = sorted(r for r in by_rank if not 0 <= r < world)
        if outside:
            raise RunDirError(f"rank {outside[0]} is outside world size {world}", path=shown(by_rank[outside[0]]),
                              fix="the trace belongs to another run; move it out of this directory")
        n_missing = world - len(by_rank)  # (by_rank is inside range(world) here: counted, never listed whole)
        if n_missing:
            first = list(itertools.islice((r for r in range(world) if r not in by_rank), 10))
            listed = ", ".join(map(str, first)) + (" …" if n_missing > 10 else "")
            # (a note, not a fault: profiling a sample of the ranks is usual; the figures are the traced ranks')
            notes.append(f"{shown(run_dir)}: {n_missing:,} of {world:,}{SAMPLED_RANKS}{listed}); analysing "
                         f"the {len(by_rank)} present (a sample of the job's ranks: every figure is theirs)")
    if manifest is not None and manifest.ranks_written is not None:
        unwritten = sorted(set(by_rank) - set(manifest.ranks_written))
        if unwritten:
            notes.append(f"{shown(run_dir / MANIFEST_NAME)}: ranks {unwritten} did not finish writing their trace "
                         "according to run.json; their data may be partial")
    return notes


# Ranks of one collection profile the same steps at the same time: their traces' time spans overlap, up to the
# hosts' clock skew (milliseconds under NTP). Spans further apart than this, and than MIXED_SPANS times the longest
# span, come from different collections (run one after the other into one folder); closer, a note names them.
MIXED_GAP_S = 10.0
MIXED_NOTE_S = 1.0
MIXED_SPANS = 10
# What traceana's collectors record of a collection's configuration in every rank's trace ("traceana" metadata):
# one collection's ranks agree on each.
COLLECTION_KEYS = ("pp", "world_size", "schedule", "bpipe", "profiler", "torch", "microbatches", "microbatch_size",
                   "preset", "attention", "recompute", "collector")


def _one_collection(results: list[Parsed], run_dir: Path) -> list[str]:
    """RunDirError when the traces in one folder come from different collections, as the traces themselves show it:
    traceana's metadata naming another configuration (pp, schedule, BPipe pairs, profiler schedule, torch), or
    ranks whose events lie far apart in time (a rank's trace from a later collection of the same configuration);
    a note when ranks' spans are apart by more than MIXED_NOTE_S but less than the refusal's gap."""
    import json

    if len(results) < 2:
        return []
    metas = []
    for _, _, row in results:
        try:
            meta = json.loads(row["meta"]) if row.get("meta") else None
        except (TypeError, ValueError):
            meta = None
        metas.append(meta if isinstance(meta, dict) else None)
    for key in COLLECTION_KEYS:
        seen = {}
        for meta, (_, _, row) in zip(metas, results):
            if meta is not None and key in meta:
                seen.setdefault(json.dumps(meta[key], sort_keys=True, default=str), row)
        if len(seen) > 1:
            (v1, r1), (v2, r2) = list(seen.items())[:2]
            raise RunDirError(f"traces from different collections: rank {r1['rank']} was collected with {key} {v1}, "
                              f"rank {r2['rank']} with {key} {v2} (their traceana metadata)", path=shown(run_dir),
                              fix="keep each collection's traces in its own folder")
    spans = []
    for ev, _, row in results:
        if ev.height:
            lo, hi = ev.select(lo=pl.col("ts_ns").min(), hi=(pl.col("ts_ns") + pl.col("dur_ns")).max()).row(0)
            if lo is not None and hi is not None:
                spans.append((lo, hi, row["rank"]))
    if len(spans) < 2:
        return []
    spans.sort()
    longest = max(hi - lo for lo, hi, _ in spans)
    groups, end = [[spans[0]]], spans[0][1]
    gaps = []
    for span in spans[1:]:
        if span[0] - end > MIXED_NOTE_S * NS_PER_S:
            gaps.append(span[0] - end)
            groups.append([])
        groups[-1].append(span)
        end = max(end, span[1])
    if len(groups) == 1:
        return []
    gap = max(gaps)

    def ranks(group) -> str:
        rs = sorted(r for _, _, r in group)
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs[:8])) + (" …" if len(rs) > 8 else "")

    where = "; ".join(f"{ranks(g)} from {(g[0][0] - spans[0][0]) / NS_PER_S:,.1f} s to "
                      f"{(max(h for _, h, _ in g) - spans[0][0]) / NS_PER_S:,.1f} s" for g in groups[:4])
    what = (f"the ranks' traces do not overlap in time ({where}, from the first event; the ranks of one collection "
            f"profile the same steps together)")
    if gap > MIXED_GAP_S * NS_PER_S and gap > MIXED_SPANS * longest:
        raise RunDirError(f"traces from different collections: {what}", path=shown(run_dir),
                          fix="keep each collection's traces in its own folder (if the hosts' clocks really were "
                              "that far apart, synchronise them: NTP)")
    return [f"{shown(run_dir)}: traces from different collections? {what}; P2P and bubble figures across them "
            "mean nothing"]


def _contradictions(results: list[Parsed], manifest: Manifest | None, run_dir: Path,
                    marks: list[Marks | None] | None = None) -> list[str]:
    """Notes for what is readable but contradicts itself: a trace's rank against its file name, run.json's stage
    map against the traces' own stage metadata, overlapping or duplicated ProfilerStep spans and annotations,
    events that all last zero. Only step spans and annotations are compared (a few rows per rank). ``marks``: each
    trace's ``_rank_marks`` where the reading thread found them already (None: found here)."""
    notes: list[str] = []
    found = _marks_found(results, marks)
    for i, (ev, _, row) in enumerate(results):
        name = Path(row["path"])
        file_rank = rank_from_filename(name)
        if row["rank_source"] == "distributedInfo" and file_rank is not None and file_rank != row["rank"]:
            notes.append(f"{shown(row['path'])}: distributedInfo says rank {row['rank']} but the file name says "
                         f"rank {file_rank}; using {row['rank']} (renamed or mixed-up files?)")
        if manifest is not None and manifest.stage_of_rank is not None and row["stage"] is not None \
                and 0 <= row["rank"] < len(manifest.stage_of_rank) and manifest.stage_of_rank[row["rank"]] != row["stage"]:
            notes.append(f"{shown(run_dir / MANIFEST_NAME)}: stage_of_rank gives rank {row['rank']} stage "
                         f"{manifest.stage_of_rank[row['rank']]} but its trace says stage {row['stage']}; "
                         "run.json wins — fix whichever is wrong")
        if not ev.height:
            continue
        dups, steps, zero = found[i]
        if dups:
            notes.append(f"{shown(row['path'])}: {dups} step spans or annotations are copies of another (same name, "
                         "thread, start and duration): the trace holds duplicated events, and counts from it are "
                         "inflated — re-export it")
        if steps.height:
            first = steps.row(0, named=True)
            notes.append(f"{shown(row['path'])}: {steps.height} ProfilerStep spans overlap the previous step (first: "
                         f"{first['name']} starts {(first['prev_end'] - first['ts_ns']) / NS_PER_MS:.3f} ms before "
                         f"{first['prev']} ends); the overlap is counted in both steps")
        if zero:
            notes.append(f"{shown(row['path'])}: every one of its {ev.height:,} events lasts 0 ns: no time can be "
                         "attributed on rank " + str(row["rank"]))
    return notes


Marks = tuple[pl.DataFrame, bool]  # a trace's step spans and annotations (track, name, ts_ns, dur_ns); all 0 ns?


def _rank_marks(ev: pl.DataFrame) -> Marks:
    """The rows of one trace's events that the contradiction checks compare (its CPU step spans and annotations:
    a few per step) and whether every event lasts 0 ns. Found in the thread that read the trace, right after it,
    these passes over every event overlap the reading of the next trace instead of following the last one (on
    4 × 200 MB ~0.05 s at the end of ingest)."""
    if not ev.height:
        return ev.select("track", "name", "ts_ns", "dur_ns").clear(), False
    marks, zero = pl.collect_all([_marks_of(ev.lazy()), ev.lazy().select(zero=(pl.col("dur_ns") == 0).all())],
                                 engine=ENGINE)
    return marks, bool(zero["zero"][0])


def _marks_of(ev: pl.LazyFrame) -> pl.LazyFrame:
    """The CPU step spans and annotations among ``ev`` (track, name, ts_ns, dur_ns)."""
    return ev.filter(~pl.col("is_gpu") & names.name_test(pl.col("name"), lambda t: t.str.contains(names.STEP_PATTERN)
                                                         | t.str.starts_with(names.PP_PREFIX))
                     ).select("track", "name", "ts_ns", "dur_ns")


def _marks_found(results: list[Parsed], found: list[Marks | None] | None = None
                 ) -> dict[int, tuple[int, pl.DataFrame, bool]]:
    """Per trace with events (by its index in ``results``): how many step spans or annotations copy another, the
    ProfilerStep spans that overlap their thread's previous step, and whether every event lasts 0 ns. One query for
    all the traces, each trace's rows marked by its index: a few operations on a few rows per trace, whose fixed cost
    was most of this check on a small run (docs/performance.md "Fixed cost")."""
    present = [(i, ev) for i, (ev, _, _) in enumerate(results) if ev.height]
    if not present:
        return {}
    f = pl.lit(0, dtype=pl.UInt32)
    given = {i: m for i, m in enumerate(found or ()) if m is not None}
    rest = [(i, ev) for i, ev in present if i not in given]  # e.g. cache hits: the same query over all of them
    marks = pl.concat([
        *(given[i][0].lazy().with_columns(f=f + i) for i, _ in present if i in given),
        *(_marks_of(ev.lazy()).with_columns(f=f + i) for i, ev in rest)])
    steps = (marks.filter(names.text(pl.col("name")).str.contains(names.STEP_PATTERN)).unique(["f", "track", "ts_ns", "name"])
             .sort("f", "track", "ts_ns")
             .with_columns(prev_end=(pl.col("ts_ns") + pl.col("dur_ns")).shift(1).over("f", "track"),
                           prev=pl.col("name").shift(1).over("f", "track"))
             .filter(pl.col("ts_ns") < pl.col("prev_end")))
    zero = [ev.lazy().select(f=f + i, zero=(pl.col("dur_ns") == 0).all()) for i, ev in rest]
    n_keys, n_unique, steps, *zero = pl.collect_all(
        [marks.group_by("f").len(), marks.unique().group_by("f").len(), steps, *([pl.concat(zero)] if zero else [])],
        engine=ENGINE)
    keys, distinct = (dict(zip(t["f"].to_list(), t["len"].to_list())) for t in (n_keys, n_unique))
    zeros = {i: m[1] for i, m in given.items()}
    if zero:
        zeros.update(zip(zero[0]["f"].to_list(), zero[0]["zero"].to_list()))
    by_file = steps.partition_by("f", as_dict=True, include_key=False)
    empty = steps.clear().drop("f")
    return {i: (keys.get(i, 0) - distinct.get(i, 0), by_file.get((i,), empty), zeros[i]) for i, _ in present}


# --- per-rank summary ----------------------------------------------------------------------------------------------
__all__ = ["load_run", "read_trace", "find_traces", "IngestWarning", "IngestNote", "CACHE_DIR"]
