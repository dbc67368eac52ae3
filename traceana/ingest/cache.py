"""Parquet cache of parsed traces under ``RUN_DIR/.traceana/ingest/`` (safe to delete at any time).

One entry per trace file, keyed by the file's name, size, mtime, inode and ctime (``fingerprint``), the traceana version and a hash of the
table schemas: a changed trace or a new tool version simply misses. Writing is best effort — a read-only run
directory (a read-only share, say) is never written to, and a failed write is a warning, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceana import version
from traceana.core.files import (STALE_AFTER_S, failure_reason, os_error_of, release, short_name, sweep_temporaries,
                                 temporary_name, write_failure_fix)

if TYPE_CHECKING:
    import polars as pl
# polars and the schemas are imported where a key or an entry is made: the names of the cache's folders are read
# before polars is imported (traceana.ingest.reading).

CACHE_DIR = ".traceana"
SUBDIR = "ingest"
INGEST_FORMAT = 5  # bump when ingest produces different tables from the same trace (3: memory.addr; 4: no
# memory file for a trace without allocator samples; 5: small traces' events batched, see TraceCache.store_all)
BATCH_MIN = 64  # traces: a run writing at least this many small entries at once batches their events
SMALL_ROWS = 20_000  # events: a trace at most this large (and without allocator samples) may be batched
BATCH_ROWS = 500_000  # events in one batch file at most


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    from traceana.core import schema

    return repr([sorted((k, str(v)) for k, v in s.items()) for s in (schema.EVENTS, schema.MEMORY, schema.TRACES)])


def schema_hash() -> str:
    return hashlib.sha1(f"{_schema_text()}|{version.__version__}|{INGEST_FORMAT}".encode()).hexdigest()[:12]


def fingerprint(path: Path) -> str:
    """What identifies a file's content without reading it: size, mtime, inode and ctime (ns). The inode and ctime
    catch an in-place edit that restores the mtime (``touch -r``) or keeps the size; a copy simply misses."""
    st = path.stat()
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def cache_key(path: Path, rank: int | None = None) -> str:
    text = f"{path.name}|{fingerprint(path)}|{rank}|{schema_hash()}"
    return hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def _writable(directory: Path) -> bool:
    """True when we may create files here. Root ignores permission bits, but a directory with no write bit for
    anyone (a read-only share) is treated as read-only all the same: we never touch the user's files."""
    try:
        mode = directory.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(directory, os.W_OK)


TAG_NAME = "CACHEDIR.TAG"  # https://bford.info/cachedir/: marks RUN_DIR/.traceana as ours (and tells backups to skip it)
TAG = b"Signature: 8a477f597d28d172789f06886806bc55\n# traceana's derived caches: safe to delete.\n"
_OURS = {TAG_NAME, SUBDIR, "analysis"}


def _real_dir(path: Path) -> bool | None:
    """True: a directory (not a symlink to one); None: nothing there; False: anything else."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError:
        return False


def cache_dir(run_dir: Path, sub: str, *, enabled: bool = True) -> tuple[Path | None, str | None]:
    """``RUN_DIR/.traceana/<sub>`` when traceana may use it, else None, and a warning line when the reason is
    worth telling (a symlinked or foreign ``.traceana``). Nothing is created here.

    Rules (docs/reliability.md "Files traceana reads and writes"): the run directory must be writable (see ``_writable``);
    ``.traceana`` and ``.traceana/<sub>`` must be real directories, never symlinks (a cache written through a link
    lands in, and cleans up, someone else's folder); an existing ``.traceana`` must carry traceana's CACHEDIR.TAG
    or hold nothing but traceana's own folders."""
    if not enabled or not _writable(run_dir):
        return None, None
    root = run_dir / CACHE_DIR
    kind = _real_dir(root)
    if kind is False:
        return None, (f"{root}: is a symlink or not a directory; the cache is not used (traceana writes only into "
                      f"a {CACHE_DIR} folder it made) — remove it to let traceana cache again, or pass --no-cache")
    if kind:
        if not _writable(root):
            return None, None
        try:
            names = set(os.listdir(root))
        except OSError:
            return None, None
        if TAG_NAME not in names and not names <= _OURS:
            return None, (f"{root}: holds files traceana did not write ({sorted(names - _OURS)[0]}, …); the cache "
                          "is not used — move them, or pass --no-cache")
    if _real_dir(root / sub) is False and (root / sub).is_symlink():
        return None, (f"{root / sub}: is a symlink; the cache is not used (traceana never writes through a link) — "
                      "remove it, or pass --no-cache")
    return root / sub, None


def make_cache_dir(directory: Path) -> None:
    """Create ``RUN_DIR/.traceana/<sub>`` (tagging ``.traceana``), refusing symlinks met on the way."""
    root = directory.parent
    if _real_dir(root) is None:
        root.mkdir(exist_ok=True)
    if _real_dir(root) is not True:
        raise OSError(f"{root} is not a directory traceana made")
    if not (root / TAG_NAME).exists():
        try:
            fd = os.open(root / TAG_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(TAG)
    if _real_dir(directory) is None:
        directory.mkdir(exist_ok=True)
    if _real_dir(directory) is not True:
        raise OSError(f"{directory} is not a directory traceana made")
    sweep_temporaries(directory)


def _current(run_dir: Path, name: Any, key: str) -> bool:
    """Whether trace ``name`` of ``run_dir`` still has cache key ``key`` (unchanged since its entry was written)."""
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        return False
    try:
        return os.path.isfile(run_dir / name) and cache_key(run_dir / name) == key
    except OSError:
        return False


def regular_file(path: Path) -> bool:
    """A regular file itself (no symlink, FIFO or device): the only kind of cache entry traceana reads or removes."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class TraceCache:
    """Cached (events, memory, traces row) per trace file of one run directory."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        directory, self.note = cache_dir(run_dir, SUBDIR, enabled=enabled)
        self.dir = directory if directory is not None else run_dir / CACHE_DIR / SUBDIR
        self.enabled = directory is not None
        self._entries: dict[str, list[str]] | None = None  # trace's short_name -> its entries' names, listed once
        self._batches: dict[str, pl.DataFrame] = {}  # batch files read by ``load``, each read once
        self._index: dict[str, tuple[str, dict[str, Any]]] | None = None  # key -> (batch file, entry)
        self._bad: set[str] = set()  # batch files that could not be read
        self._swept = False  # the folder's dead writers' temporaries removed (once per run, at the first look-up)

    def _batched(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """The batched entries (``store_all``) by key: the folder listed and each batch's rows file read once."""
        if self._index is None:
            self._index = {}
            if _real_dir(self.dir.parent) and _real_dir(self.dir):
                with os.scandir(self.dir) as it:
                    found = [(e.stat(follow_symlinks=False).st_mtime_ns, e.name) for e in it
                             if _BATCH_ROWS.fullmatch(e.name)]
                for _, name in sorted(found):  # oldest first: a trace written again (its batch damaged) takes the newer

                    path = self.dir / name
                    try:
                        if not regular_file(path):
                            continue
                        entries = json.loads(path.read_text())
                    except Exception:  # damaged: its traces miss
                        continue
                    if isinstance(entries, dict):
                        events = name.replace(".rows.json", ".events.parquet")
                        self._index.update((k, (events, v)) for k, v in entries.items() if isinstance(v, dict))
        return self._index

    def _listed(self) -> dict[str, list[str]]:
        """The folder made (and its dead writers' temporaries swept) and listed once per run, at the first write:
        each write then looks up its own trace's older entries instead of listing the whole folder again (which
        made writing the cache of N ranks take N² — 5,000 small ranks: 131 s against 36 s uncached)."""
        if self._entries is None:
            make_cache_dir(self.dir)
            entries: dict[str, list[str]] = {}
            batches = []
            with os.scandir(self.dir) as it:
                for e in it:
                    m = _ENTRY_NAME.fullmatch(e.name)
                    if m:
                        entries.setdefault(m.group(1), []).append(e.name)
                    elif _BATCH.fullmatch(e.name) or _BATCH_ROWS.fullmatch(e.name):
                        batches.append(e.name)
            self._entries = entries
            if batches:
                self._sweep_batches(batches)
        return self._entries

    def _sweep_batches(self, batches: list[str]) -> None:
        """Remove batches none of whose traces is current any more (each trace gone, or changed: another key), and
        events files without their rows file once older than STALE_AFTER_S (younger: a concurrent writer's whose
        rows file is not yet renamed into place)."""
        run_dir, now = self.dir.parent.parent, time.time()
        present = set(batches)
        for name in batches:
            path = self.dir / name
            if name.endswith(".rows.json"):
                try:
                    entries = json.loads(path.read_text())
                    live = any(_current(run_dir, e.get("name"), k) for k, e in entries.items())
                except Exception:
                    live = False
                if not live and regular_file(path):
                    path.unlink(missing_ok=True)
                    events = self.dir / name.replace(".rows.json", ".events.parquet")
                    if regular_file(events):
                        events.unlink(missing_ok=True)
            elif name.replace(".events.parquet", ".rows.json") not in present:
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_AFTER_S:
                    path.unlink(missing_ok=True)

    def _paths(self, trace: Path, key: str) -> tuple[Path, Path, Path]:
        stem = f"{short_name(trace.name)}.{key}"  # (a long name cut and hashed: within NAME_MAX whatever its length)
        return (self.dir / f"{stem}.events.parquet", self.dir / f"{stem}.memory.parquet",
                self.dir / f"{stem}.trace.json")

    def load(self, trace: Path, rank: int | None = None) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]] | None:
        if not self.enabled:
            return None
        if not self._swept:  # a killed writer's temporaries go at the first look-up too: a run whose entries all
            self._swept = True  # hit never writes again (and ``_listed`` sweeps only at the first write)
            if _real_dir(self.dir.parent) and _real_dir(self.dir):
                sweep_temporaries(self.dir)
        import polars as pl

        from traceana.core import schema

        try:
            key = cache_key(trace, rank)
            ev_path, mem_path, row_path = self._paths(trace, key)
            batch = self._batched().get(key)
            if batch is not None:  # a small trace's events: rows at..at+n of a batch file (store_all)
                batch, entry = batch
                row, at = dict(entry["row"]), entry["at"]
                no_memory = True
                if not (isinstance(row, dict) and isinstance(at, list) and len(at) == 2
                        and all(type(x) is int and x >= 0 for x in at)):
                    return None
            else:
                if not regular_file(row_path):
                    return None
                row = json.loads(row_path.read_text())
                no_memory = row.pop("_no_memory", False) is True
                if not no_memory and not regular_file(mem_path):
                    return None
            if batch is not None:
                if entry.get("name") != trace.name or batch in self._bad:
                    return None
                table = self._batches.get(batch)
                if table is None:
                    self._bad.add(batch)  # (until read whole: a damaged batch is tried once, not once per rank)
                    if not regular_file(self.dir / batch):
                        return None
                    table = schema.check(pl.read_parquet(self.dir / batch), schema.EVENTS, "cached events")
                    self._batches[batch] = table
                    self._bad.discard(batch)
                if at[0] + at[1] > table.height:
                    return None
                events = table.slice(at[0], at[1])
            elif not regular_file(ev_path):
                return None
            else:
                events = schema.check(pl.read_parquet(ev_path), schema.EVENTS, "cached events")
            memory = (schema.empty(schema.MEMORY) if no_memory else
                      schema.check(pl.read_parquet(mem_path), schema.MEMORY, "cached memory"))
        except Exception:  # a damaged or foreign cache entry is a miss, never an error
            return None
        row["path"] = os.fsencode(str(trace)).decode("utf-8", "replace")
        return events, memory, row

    def store_all(self, items: list[tuple[Path, pl.DataFrame, pl.DataFrame, dict[str, Any]]]) -> str | None:
        """Write the entries of many traces; returns a warning line when that failed (caching is then off).

        Each Parquet write costs ~1–2.5 ms whatever its size, so a run of many small traces (at least BATCH_MIN of
        at most SMALL_ROWS events and no allocator samples) writes their events in batch files of up to
        BATCH_ROWS events, each trace's row (its own key, as ever) pointing at its slice. Atomicity holds per file:
        a batch is renamed into place before any row that points at it, so a reader sees a whole entry or a miss."""
        small = [it for it in items if it[2].height == 0 and it[1].height <= SMALL_ROWS]
        if len(small) < BATCH_MIN:
            small = []
        chosen = {id(it) for it in small}
        for it in items:
            if id(it) not in chosen:
                note = self.store(*it)
                if note:
                    return note
        while small and self.enabled:
            n = rows = 0
            while n < len(small) and (n == 0 or rows + small[n][1].height <= BATCH_ROWS):
                rows += small[n][1].height
                n += 1
            note = self._store_batch(small[:n])
            small = small[n:]
            if note:
                return note
        return None

    def _store_batch(self, items: list[tuple[Path, pl.DataFrame, pl.DataFrame, dict[str, Any]]]) -> str | None:
        if not self.enabled:
            return None
        import polars as pl

        from traceana.core import schema

        try:
            listed = self._listed()
            name = f"batch-{secrets.token_hex(10)}.events.parquet"
            final = self.dir / name
            tmp = temporary_name(final)
            try:
                pl.concat([schema.check(ev, schema.EVENTS, "events") for _, ev, _, _ in items],
                          how="vertical").write_parquet(tmp, compression="lz4", statistics=False)
                os.replace(tmp, final)
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                release(tmp)
            at, entries = 0, {}
            for trace, events, _, row in items:
                key = cache_key(trace, None)
                self._drop_stale(trace, key, listed)
                entries[key] = {"name": trace.name, "row": row, "at": [at, events.height]}
                at += events.height
            rows = final.with_name(name.replace(".events.parquet", ".rows.json"))
            t = temporary_name(rows)
            try:  # renamed after its events: a rows file is never without them
                t.write_text(json.dumps(entries))
                os.replace(t, rows)
            finally:
                try:
                    os.unlink(t)
                except OSError:
                    pass
                release(t)
        except Exception as e:
            self.enabled = False
            e = os_error_of(e, self.dir, sum(ev.estimated_size() for _, ev, _, _ in items))  # (a full disk: named)
            return (f"{self.dir}: could not write the ingest cache ({failure_reason(e)}); continuing without "
                    f"it — {write_failure_fix(e, writable='make the run directory writable')}, or pass --no-cache")
        return None

    def _drop_stale(self, trace: Path, key: str, listed: dict[str, list[str]]) -> None:
        """Remove this trace's stale entries (older file or tool version): only names this cache writes."""
        stem = short_name(trace.name)
        for name in listed.pop(stem, ()):
            old = self.dir / name
            if _ENTRY.fullmatch(name[len(stem) + 1:]).group(1) != key and regular_file(old):
                old.unlink(missing_ok=True)

    def store(self, trace: Path, events: pl.DataFrame, memory: pl.DataFrame, row: dict[str, Any],
              rank: int | None = None) -> str | None:
        """Write one entry atomically; returns a warning line when that failed (and caching is then off)."""
        if not self.enabled:
            return None
        try:
            key = cache_key(trace, rank)
            self._drop_stale(trace, key, self._listed())
            targets = self._paths(trace, key)
            tmp = [temporary_name(t) for t in targets]
            try:
                # (each write_parquet costs ~2.5 ms whatever the size: a trace without allocator samples, most
                # small ranks', writes no memory file — the entry's row says so)
                events.write_parquet(tmp[0], compression="lz4", statistics=False)
                if memory.height:
                    memory.write_parquet(tmp[1], compression="lz4", statistics=False)
                tmp[2].write_text(json.dumps(row if memory.height else {**row, "_no_memory": True}))
                for t, final in zip(tmp, targets):
                    if t != tmp[1] or memory.height:
                        os.replace(t, final)
            finally:  # failed, or interrupted (Ctrl-C, SIGTERM): no temporary is left behind
                for t in tmp:
                    try:
                        os.unlink(t)
                    except OSError:
                        pass
                release(*tmp)
        except Exception as e:  # read-only file system, disk full, ...: analysis goes on without a cache
            self.enabled = False
            e = os_error_of(e, self.dir, events.estimated_size() + memory.estimated_size())  # (a full disk: named)
            return (f"{self.dir}: could not write the ingest cache ({failure_reason(e)}); continuing without "
                    f"it — {write_failure_fix(e, writable='make the run directory writable')}, or pass --no-cache")
        return None


_ENTRY = re.compile(r"([0-9a-f]{20})\.(?:events\.parquet|memory\.parquet|trace\.json)")
_BATCH = re.compile(r"batch-[0-9a-f]{20}\.events\.parquet")  # (no "." before the hex: never an _ENTRY_NAME)
_BATCH_ROWS = re.compile(r"batch-[0-9a-f]{20}\.rows\.json")
_ENTRY_NAME = re.compile(r"(.+)\.[0-9a-f]{20}\.(?:events\.parquet|memory\.parquet|trace\.json)", re.S)


