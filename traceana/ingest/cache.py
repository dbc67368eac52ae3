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
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceana import version
from traceana.files import release, sweep_temporaries, temporary_name, write_failure_fix

if TYPE_CHECKING:
    import polars as pl
# polars and the schemas are imported where a key or an entry is made: the names of the cache's folders are read
# before polars is imported (traceana.ingest.reading).

CACHE_DIR = ".traceana"
SUBDIR = "ingest"
INGEST_FORMAT = 4  # bump when ingest produces different tables from the same trace (3: memory.addr; 4: no
# memory file for a trace without allocator samples)


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    from traceana import schema

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
        self._entries: dict[str, list[str]] | None = None  # trace name -> its entries' names, listed once

    def _listed(self) -> dict[str, list[str]]:
        """The folder made (and its dead writers' temporaries swept) and listed once per run, at the first write:
        each write then looks up its own trace's older entries instead of listing the whole folder again (which
        made writing the cache of N ranks take N² — 5,000 small ranks: 131 s against 36 s uncached)."""
        if self._entries is None:
            make_cache_dir(self.dir)
            entries: dict[str, list[str]] = {}
            with os.scandir(self.dir) as it:
                for e in it:
                    m = _ENTRY_NAME.fullmatch(e.name)
                    if m:
                        entries.setdefault(m.group(1), []).append(e.name)
            self._entries = entries
        return self._entries

    def _paths(self, trace: Path, key: str) -> tuple[Path, Path, Path]:
        stem = f"{trace.name}.{key}"
        return (self.dir / f"{stem}.events.parquet", self.dir / f"{stem}.memory.parquet",
                self.dir / f"{stem}.trace.json")

    def load(self, trace: Path, rank: int | None = None) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]] | None:
        if not self.enabled:
            return None
        import polars as pl

        from traceana import schema

        try:
            ev_path, mem_path, row_path = self._paths(trace, cache_key(trace, rank))
            if not (regular_file(ev_path) and regular_file(row_path)):
                return None
            row = json.loads(row_path.read_text())
            no_memory = row.pop("_no_memory", False) is True
            if not no_memory and not regular_file(mem_path):
                return None
            events = schema.check(pl.read_parquet(ev_path), schema.EVENTS, "cached events")
            memory = (schema.empty(schema.MEMORY) if no_memory else
                      schema.check(pl.read_parquet(mem_path), schema.MEMORY, "cached memory"))
        except Exception:  # a damaged or foreign cache entry is a miss, never an error
            return None
        row["path"] = os.fsencode(str(trace)).decode("utf-8", "replace")
        return events, memory, row

    def store(self, trace: Path, events: pl.DataFrame, memory: pl.DataFrame, row: dict[str, Any],
              rank: int | None = None) -> str | None:
        """Write one entry atomically; returns a warning line when that failed (and caching is then off)."""
        if not self.enabled:
            return None
        try:
            key = cache_key(trace, rank)
            for name in self._listed().pop(trace.name, ()):
                # Stale entries of this trace (older file or tool version): only names this cache writes.
                old = self.dir / name
                if _ENTRY.fullmatch(name[len(trace.name) + 1:]).group(1) != key and regular_file(old):
                    old.unlink(missing_ok=True)
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
            return (f"{self.dir}: could not write the ingest cache ({type(e).__name__}: {e}); continuing without "
                    f"it — {write_failure_fix(e, writable='make the run directory writable')}, or pass --no-cache")
        return None


_ENTRY = re.compile(r"([0-9a-f]{20})\.(?:events\.parquet|memory\.parquet|trace\.json)")
_ENTRY_NAME = re.compile(r"(.+)\.[0-9a-f]{20}\.(?:events\.parquet|memory\.parquet|trace\.json)", re.S)


