"""Cached analysis: ``load_and_analyze(path)`` = ``analyze(load_run(path))``, with the result kept as Parquet under
``RUN_DIR/.traceana/analysis/`` so that analysing the same run again reads a few small tables instead of
re-parsing and re-attributing every event (safe to delete at any time).

An entry is keyed by everything the result depends on: the path as given (it is shown in ``run.path``, the traces
table and warnings), the ingest cache key of every trace file (``traceana.ingest.cache.cache_key``: name, size,
inode, ctime, ingest schema and tool version), run.json's ``fingerprint``, ``peak_flops``, the traceana version, a hash of the
analysis table schemas and a hash of traceana's own source (so an edited analysis never reads a stale result).
A changed input simply misses. An entry is a folder written under a temporary name and renamed into place, with
``meta.json`` written last: a half-written or damaged entry is a miss, never an error. A run directory that is not
writable (a read-only share) is never written to; a failed write is a warning, never an error.

What a hit holds: every ``Analysis`` table (``tables()``), the run's ``traces`` and ``memory`` tables, the per-rank
summary, the notes, warnings and memory balance. The two big event tables are not stored: ``run.events`` is read
back through ``load_run`` (its own Parquet cache) and ``Analysis.events`` (classified, aligned events) recomputed,
both only when something first reads them (the merged Perfetto trace does; the tables, reports and validation
do not).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings as pywarnings
from collections.abc import Callable
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import polars as pl

import traceana
from traceana import version
from traceana.core import names, schema
from traceana.core import names as _names  # (load_and_analyze's keyword ``names`` hides the module there)
from traceana.core.files import (failure_reason, os_error_of, release, short_name, sweep_temporaries, temporary_name,
                                 write_failure_fix)
from traceana.core.manifest import MANIFEST_NAME, Manifest, check_peak_flops
from traceana.core.names import NameRules
from traceana.ingest import Run
from traceana.ingest.cache import CACHE_DIR, cache_dir, cache_key, fingerprint, make_cache_dir, regular_file
from traceana.measure.analysis import Analysis, analyze
from traceana.measure.classify import name_table, rank_summary
from traceana.measure.summary import RunSummary

SUBDIR = "analysis"
_KEY = re.compile(r"[0-9a-f]{20}")  # entry folders are named "<target>.<key>"
ANALYSIS_FORMAT = 8  # bump when what an entry holds changes (2: the summary; 3: memory.addr, the transient peak;
#                     4: the what-if's straggler, diagnosis and bottleneck; 5: phase and stream time,
#                     traceana.measure.gpu; 6: the summary's step_times_ms, the noise interval's samples; 7: the P2P
#                     waiting note per rank and step;
#                     8: the summary's ``diagnosed``, the diagnosis only where asked)
_TABLES = ("steps", "p2p", "schedule", "attribution", "stage_memory", "stages", "clock_offsets", "segments",
           "rank_summary", "phase_time", "stream_time")
_RUN_TABLES = ("traces", "memory")
# The summary (traceana.measure.summary.RunSummary) is kept too: a hit then reads two small tables instead of
# recomputing it (~15 ms of the repeated analyze of a tiny run, docs/performance.md "Fixed cost").
_SUMMARY_TABLES = ("per_stage", "replicas", "critical_path", "path")


class AnalysisCacheWarning(UserWarning):
    """The analysis cache could not be written (the analysis itself is complete)."""


# --- lazily filled fields of a cached result ------------------------------------------------------------------
class _Lazy:
    """A dataclass field computed on first read, then kept; assignable like a plain field (dataclass __init__)."""

    def __init__(self, compute) -> None:
        self.compute = compute

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_lazy_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        d = obj.__dict__
        if self.slot not in d:
            d[self.slot] = self.compute(obj)
        return d[self.slot]

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


def _load_events(run: "CachedRun") -> pl.DataFrame:
    from traceana.ingest.run_dir import load_run  # (cost: a hit's events are read again only when asked for)

    with pywarnings.catch_warnings():  # the warnings were already given with the cached result
        pywarnings.simplefilter("ignore")
        return load_run(run.path, workers=run.__dict__.get("_workers"), cache=True).events


class CachedRun(Run):
    """A ``Run`` from the analysis cache: ``events`` is read (through the ingest cache) on first use."""

    events = _Lazy(_load_events)


def _classified_events(a: "CachedAnalysis") -> pl.DataFrame | None:
    return analyze(a.run, peak_flops=a.__dict__.get("_peak_flops")).events


class CachedAnalysis(Analysis):
    """An ``Analysis`` from the cache: ``events`` (classified, on the aligned clock) is recomputed on first use."""

    events = _Lazy(_classified_events)


def _build(cls, values: dict[str, Any], extra: dict[str, Any]):
    obj = object.__new__(cls)
    for f in fields(cls):
        if f.name in values:
            object.__setattr__(obj, f.name, values[f.name])
    obj.__dict__.update(extra)
    return obj


# --- keys --------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def code_hash() -> str:
    """traceana's version, the analysis table schemas and its own source: any change makes every entry miss."""
    h = hashlib.sha1(f"{version.__version__}|{ANALYSIS_FORMAT}".encode())
    for s in (schema.STEPS, schema.P2P, schema.SCHEDULE, schema.ATTRIBUTION, schema.STAGE_MEMORY, schema.TRACES,
              schema.MEMORY, schema.EVENTS):
        h.update(repr(sorted((k, str(v)) for k, v in s.items())).encode())
    root = Path(traceana.__file__).parent
    for p in sorted(root.rglob("*.py")):
        try:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:16]


def _target(path: Path) -> tuple[Path, list[Path], str]:
    """(run directory, trace files load_run would read, entry name prefix)."""
    if path.is_dir():
        from traceana.ingest.reading import find_traces  # (run_dir's, from its polars-free home: a hit loads no decoder)

        return path, find_traces(path), "run"
    return path.parent, [path], short_name(path.name)  # (cut and hashed when long: the entry stays within NAME_MAX)


def entry_key(path: Path, files: list[Path], run_dir: Path, peak_flops: float | None,
              rules_key: str = names.DEFAULT_RULES.key()) -> str:
    parts = [str(path), repr(peak_flops), code_hash(), rules_key]
    parts += [f"{f.name}:{cache_key(f)}" for f in files]
    manifest = run_dir / MANIFEST_NAME
    if path.is_dir() and manifest.exists():
        parts.append(f"{MANIFEST_NAME}:{fingerprint(manifest)}")
    return hashlib.sha1("|".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:20]


# --- the cache ---------------------------------------------------------------------------------------------------
class AnalysisCache:
    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        # A symlinked or foreign .traceana is not used (the ingest cache's warning says so).
        directory, _ = cache_dir(run_dir, SUBDIR, enabled=enabled)
        self.dir = directory if directory is not None else run_dir / CACHE_DIR / SUBDIR
        self.enabled = directory is not None

    def load(self, prefix: str, key: str, path: Path, *, peak_flops: float | None,
             workers: int | None) -> Analysis | None:
        if not self.enabled:
            return None
        # Temporaries a killed writer left (``kill -9`` during a store: a folder of tables) go at every look-up,
        # not only at the next store: an unchanged run hits its entry and would never store again.
        sweep_temporaries(self.dir)
        entry = self.dir / f"{prefix}.{key}"
        try:
            if entry.is_symlink() or not regular_file(entry / "meta.json"):
                return None
            meta = json.loads((entry / "meta.json").read_text())
            if meta.get("key") != key:
                return None
            wanted = [n for n in (*_TABLES, *_RUN_TABLES) if n not in meta["none"]]
            if not all(regular_file(entry / f"{n}.parquet") for n in wanted):
                return None
            tables = {name: None if name in meta["none"] else pl.read_parquet(entry / f"{name}.parquet")
                      for name in (*_TABLES, *_RUN_TABLES)}
            traces = schema.check(tables.pop("traces"), schema.TRACES, "cached traces")
            memory = schema.check(tables.pop("memory"), schema.MEMORY, "cached memory")
            summary = _read_summary(entry, meta["summary"])
        except Exception:  # a damaged, partial or foreign entry is a miss, never an error
            return None
        manifest = Manifest.read(path / MANIFEST_NAME) if path.is_dir() and (path / MANIFEST_NAME).exists() else None
        run = _build(CachedRun, dict(path=path, memory=memory, traces=traces, manifest=manifest,
                                     warnings=tuple(meta["warnings"])), {"_workers": workers})
        for w in run.warnings:  # as load_run gives them, so a hit reads like a miss
            pywarnings.warn(w, _ingest_warning(w), stacklevel=3)
        return _build(CachedAnalysis, dict(run=run, notes=tuple(meta["notes"]), peak_flops=peak_flops,
                                           **tables),
                      {"_peak_flops": peak_flops, "summary": summary})  # Analysis.summary's cached value

    def store(self, prefix: str, key: str, analysis: Analysis) -> None:
        if not self.enabled:
            return
        entry = self.dir / f"{prefix}.{key}"
        tmp = temporary_name(entry)
        needed = 0  # (the tables' size: a failure with less free than that is a full disk, whatever polars says)
        try:
            make_cache_dir(self.dir)
            tmp.mkdir()
            tables = {name: getattr(analysis, name) for name in _TABLES}
            tables |= {"traces": analysis.run.traces, "memory": analysis.run.memory}
            needed = sum(t.estimated_size() for t in tables.values() if t is not None)
            for name, table in tables.items():
                if table is not None:
                    table.write_parquet(tmp / f"{name}.parquet", compression="lz4", statistics=False)
            meta = {"key": key, "none": [n for n, t in tables.items() if t is None], "notes": list(analysis.notes),
                    "warnings": list(analysis.run.warnings), "summary": _write_summary(tmp, analysis.summary)}
            (tmp / "meta.json").write_text(json.dumps(meta))  # last: an entry without it is a miss
            # Stale entries of the same target go, and so does a damaged entry under this key (it just missed).
            for old in self.dir.glob(f"{_glob_escape(prefix)}.*"):
                # Only entry folders this cache wrote: not hidden temporaries, not another file's, not a symlink.
                if _KEY.fullmatch(old.name[len(prefix) + 1:]) and old.is_dir() and not old.is_symlink():
                    trash = temporary_name(old)
                    os.rename(old, trash)  # atomic: a concurrent reader sees the entry or nothing
                    shutil.rmtree(trash, ignore_errors=True)
                    release(trash)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process stored the same entry meanwhile: theirs is as good
                if not (entry / "meta.json").exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            release(tmp)
        except BaseException as e:  # disk full, permissions, ...: the analysis goes on without a cache
            shutil.rmtree(tmp, ignore_errors=True)
            release(tmp)
            if not isinstance(e, Exception):  # Ctrl-C, SIGTERM: cleaned up, and on its way out
                raise
            self.enabled = False
            e = os_error_of(e, self.dir, needed)  # (a full disk, even as polars' "Invalid thrift": named)
            fix = write_failure_fix(e, writable="make the run directory writable")
            pywarnings.warn(f"{self.dir}: could not write the analysis cache ({failure_reason(e)}); continuing "
                            f"without it — {fix}, or pass --no-cache",
                            AnalysisCacheWarning, stacklevel=3)


def _write_summary(entry: Path, summary) -> dict:
    """The summary's tables as Parquet in ``entry``; returns its other fields (for meta.json)."""
    fields_ = {f.name: getattr(summary, f.name) for f in fields(summary)}
    for name in _SUMMARY_TABLES:
        table = fields_.pop(name)
        if table is not None:
            table.write_parquet(entry / f"summary_{name}.parquet", compression="lz4", statistics=False)
    return fields_ | {"steps": list(summary.steps), "none": [n for n in _SUMMARY_TABLES if getattr(summary, n) is None]}


def _read_summary(entry: Path, meta: dict):
    values = {k: v for k, v in meta.items() if k != "none"} | {"steps": tuple(meta["steps"]),
                                                               "step_times_ms": tuple(meta.get("step_times_ms", ()))}
    for name in _SUMMARY_TABLES:
        path = entry / f"summary_{name}.parquet"
        if name not in meta["none"] and not regular_file(path):
            raise FileNotFoundError(path)
        values[name] = None if name in meta["none"] else pl.read_parquet(path)
    return RunSummary(**values)


def _ingest_warning(message: str):
    from traceana.ingest.run_dir import category_of  # (cost: run_dir only when a hit replays a warning)

    return category_of(message)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def input_files(path: str | Path) -> list[Path]:
    """The files an analysis of ``path`` reads (``traceana.ingest.run_dir.input_files``), for commands above ingest
    that check their outputs against them."""
    from traceana.ingest.run_dir import input_files as of_path  # (cost: run_dir, the decoder, only when called)

    return of_path(path)


def run_name_rules(path: str | Path, given: str | Path | names.NameRules | None = None) -> names.NameRules:
    """The name rules for analysing ``path``: ``given`` (a rules file, ``"none"``, or NameRules), else run.json's
    ``"names"``, else the built-ins (``names.rules_for_run``). A bad rules file is one BadInputError line, raised
    before any trace is read."""
    path = Path(path)
    spec = None
    if given is None and path.is_dir() and (path / MANIFEST_NAME).exists():
        spec = Manifest.read(path / MANIFEST_NAME).names
    return names.rules_for_run(path, spec, given)


def load_and_analyze(path: str | Path, *, peak_flops: float | None = None, cache: bool = True,
                     workers: int | None = None, progress: bool = False,
                     names: str | Path | NameRules | None = None,
                     diagnose: Callable[[Analysis], object] | None = None, **old_keywords) -> Analysis:
    """``analyze(load_run(path), peak_flops=..., names=...)`` with ``Analysis.rank_summary`` filled, read from /
    written to the analysis cache unless ``cache`` is False (which also turns off the ingest cache, as ``load_run``
    does). ``names``, as the command line's ``--names``: a name rules file (docs/naming.md), ``"none"``, or
    NameRules; default: run.json's ``"names"``, else the built-ins (``names_from=`` is an old spelling).
    ``diagnose``: a layer above's completion of the summary, run on a fresh analysis before it is stored (the CLI
    passes traceana.causal.diagnosis.diagnose where it shows the diagnosis), so that a hit holds it too; entries
    with and without it are kept apart."""
    path = Path(path)
    peak_flops = check_peak_flops(peak_flops)  # NaN, inf or 1e-300 would make MFU meaningless (and not JSON)
    rules = run_name_rules(path, _names.names_keyword(names, old_keywords, "load_and_analyze"))
    store = None
    if cache:
        try:
            run_dir, files, prefix = _target(path)
            key = entry_key(path, files, run_dir, peak_flops, rules.key() + ("|diagnosed" if diagnose else ""))
            store = AnalysisCache(run_dir)
        except Exception:  # unreadable path etc.: load_run below reports it properly
            store = None
        if store is not None:
            hit = store.load(prefix, key, path, peak_flops=peak_flops, workers=workers)
            if hit is not None:
                return hit
    from traceana.ingest.run_dir import load_run  # (cost: the run's reader and decoder only on a miss)

    run = load_run(path, workers=workers, cache=cache, progress=progress)
    # (The per-rank counts before the analysis: their few frames then come on top of the ingested events alone,
    # not on top of everything the analysis holds at its end.)
    by_name = name_table(run.events, rules)  # (the distinct names, found once for both)
    ranks = rank_summary(run, by_name=by_name)
    if progress:
        from rich.console import Console

        with Console(stderr=True).status("attributing step time"):
            result = analyze(run, peak_flops=peak_flops, names=rules, by_name=by_name)
    else:
        result = analyze(run, peak_flops=peak_flops, names=rules, by_name=by_name)
    result = replace(result, rank_summary=ranks)
    if diagnose is not None:
        diagnose(result)
    if store is not None:
        store.store(prefix, key, result)
    return result
