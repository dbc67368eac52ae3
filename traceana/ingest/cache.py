"""Parquet cache of parsed traces under ``RUN_DIR/.traceana/ingest/`` (safe to delete at any time).

One entry per trace file, keyed by the file's name, size and mtime (ns), the traceana version and a hash of the
table schemas: a changed trace or a new tool version simply misses. Writing is best effort — a read-only run
directory (for example ../shared) is never written to, and a failed write is a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import polars as pl

import traceana
from traceana import schema

CACHE_DIR = ".traceana"
SUBDIR = "ingest"
INGEST_FORMAT = 1  # bump when ingest produces different tables from the same trace


def schema_hash() -> str:
    text = repr([sorted((k, str(v)) for k, v in s.items()) for s in (schema.EVENTS, schema.MEMORY, schema.TRACES)])
    return hashlib.sha1(f"{text}|{traceana.__version__}|{INGEST_FORMAT}".encode()).hexdigest()[:12]


def cache_key(path: Path, rank: int | None = None) -> str:
    st = path.stat()
    text = f"{path.name}|{st.st_size}|{st.st_mtime_ns}|{rank}|{schema_hash()}"
    return hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def _writable(directory: Path) -> bool:
    """True when we may create files here. Root ignores permission bits, but a directory with no write bit for
    anyone (like the read-only ../shared) is treated as read-only all the same: we never touch the user's files."""
    try:
        mode = directory.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(directory, os.W_OK)


class TraceCache:
    """Cached (events, memory, traces row) per trace file of one run directory."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        self.dir = run_dir / CACHE_DIR / SUBDIR
        self.enabled = enabled and _writable(run_dir) and (
            not (run_dir / CACHE_DIR).exists() or _writable(run_dir / CACHE_DIR)
        )

    def _paths(self, trace: Path, key: str) -> tuple[Path, Path, Path]:
        stem = f"{trace.name}.{key}"
        return (self.dir / f"{stem}.events.parquet", self.dir / f"{stem}.memory.parquet",
                self.dir / f"{stem}.trace.json")

    def load(self, trace: Path, rank: int | None = None) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]] | None:
        if not self.enabled:
            return None
        try:
            ev_path, mem_path, row_path = self._paths(trace, cache_key(trace, rank))
            if not (ev_path.exists() and mem_path.exists() and row_path.exists()):
                return None
            row = json.loads(row_path.read_text())
            events = schema.check(pl.read_parquet(ev_path), schema.EVENTS, "cached events")
            memory = schema.check(pl.read_parquet(mem_path), schema.MEMORY, "cached memory")
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
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.dir.glob(f"{_glob_escape(trace.name)}.*"):
                if key not in old.name:  # stale entries of this trace (older file or tool version)
                    old.unlink(missing_ok=True)
            targets = self._paths(trace, key)
            tmp = [t.with_name(f".{t.name}.{os.getpid()}.tmp") for t in targets]
            events.write_parquet(tmp[0], compression="lz4", statistics=False)
            memory.write_parquet(tmp[1], compression="lz4", statistics=False)
            tmp[2].write_text(json.dumps(row))
            for t, final in zip(tmp, targets):
                os.replace(t, final)
        except Exception as e:  # read-only file system, disk full, ...: analysis goes on without a cache
            self.enabled = False
            return (f"{self.dir}: could not write the ingest cache ({type(e).__name__}: {e}); continuing without "
                    "it — make the run directory writable or pass cache=False / --no-cache")
        return None


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)
