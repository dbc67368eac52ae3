"""Ingest runs of thousands of ranks: one Parquet partition per rank, fanned out by any executor's ``map``.

traceana does not schedule anything itself. ``ingest_to_parquet`` turns a run directory into one task per trace file
and hands them to the ``map`` you give it — the builtin ``map`` (one process), ``ProcessPoolExecutor().map`` (one
machine), or a distributed engine you already run (Dask, Ray; see docs/performance.md for the two-line adapters).
Each task reads one file with the public ingest API (``read_trace``) and writes its tables as hive-style
partitions, so the output is a plain partitioned Parquet dataset any engine can read:

    OUT/events/rank=R/<trace file name>.parquet     schema.EVENTS without ``rank`` (the folder holds it)
    OUT/memory/rank=R/<trace file name>.parquet     schema.MEMORY
    OUT/traces/rank=R/<trace file name>.parquet     schema.TRACES
    OUT/ingest.json                                 what was ingested: rank, file, events, warnings per task
    OUT/run.json                                    the run's manifest, copied when present

``scan_tables(OUT)`` gives lazy polars frames over the partitions (``scan_parquet`` with hive partitioning, so a
filter on ``rank`` reads only those folders); ``load_parquet(OUT, ranks=…)`` collects them back into a ``Run`` for
``traceana.measure.analysis.analyze``. Tasks are idempotent (write to a temporary name, then rename), so an engine may
retry them; the output is written under the name of the trace file, so two files claiming one rank are both kept
and reported instead of one silently replacing the other.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from traceana.core import schema
from traceana.core.errors import BadInputError, RunDirError
from traceana.core.manifest import MANIFEST_NAME, Manifest
from traceana.ingest import Run

TABLES: dict[str, dict[str, pl.DataType]] = {"events": schema.EVENTS, "memory": schema.MEMORY, "traces": schema.TRACES}
INGEST_SUMMARY = "ingest.json"
PARTITION_KEY = "rank"

Map = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


@dataclass(frozen=True)
class RankTask:
    """One unit of work: ingest ``trace`` and write its partitions under ``out_dir`` (plain strings: picklable)."""

    trace: str
    out_dir: str


def trace_files(run_dir: str | Path) -> list[Path]:
    """The trace files of a run directory, found by the same rule as ``load_run`` (run.json and hidden files out)."""
    from traceana.ingest.run_dir import find_traces

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInputError("not a directory", path=run_dir, fix="pass a run directory holding rank*.pt.trace.json.gz")
    files = find_traces(run_dir)
    if not files:
        raise RunDirError("no trace files (*.json, *.json.gz)", path=run_dir,
                          fix="pass the folder torch.profiler wrote its traces into")
    return files


def ingest_rank(task: RankTask) -> dict[str, Any]:
    """Ingest one trace file and write its events, memory and traces rows as ``rank=R`` partitions.

    Runs inside the executor's workers: it imports the ingest lazily and returns only a small dict. It reads the
    file with ``read_trace`` (one rank, no run-level checks: those need every rank and run in the driver).
    """
    return ingest_rank_events(task)[0]


def ingest_rank_events(task: RankTask) -> tuple[dict[str, Any], pl.DataFrame, pl.DataFrame]:
    """``ingest_rank``'s summary, and the rank's events and its traces row (for a caller that derives more from them
    in the worker)."""
    from traceana.ingest.kineto import read_trace

    events, memory, row = read_trace(task.trace)
    rank = int(row[PARTITION_KEY])
    traces = schema.conform(pl.DataFrame([{k: row.get(k) for k in schema.TRACES}], schema=schema.TRACES),
                            schema.TRACES)
    name = Path(task.trace).name
    for table, frame in (("events", events), ("memory", memory), ("traces", traces)):
        _write_partition(frame.drop(PARTITION_KEY), Path(task.out_dir) / table / f"{PARTITION_KEY}={rank}", name)
    return {"rank": rank, "trace": task.trace, "rank_source": row.get("rank_source"),
            "world_size": row.get("world_size"), "events": events.height, "memory": memory.height,
            "warnings": list(row.get("warnings", ()))}, events, traces


def _write_partition(frame: pl.DataFrame, folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{name}.parquet"
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    frame.write_parquet(tmp, compression="zstd", statistics=True)
    os.replace(tmp, final)  # atomic: a retried or concurrent task never leaves a half-written partition


def ingest_to_parquet(run_dir: str | Path, out_dir: str | Path, *, map: Map = map) -> list[dict[str, Any]]:
    """Ingest every trace of ``run_dir`` into partitioned Parquet under ``out_dir``, one task per file via ``map``.

    ``map(fn, tasks)`` is any executor's map: builtin ``map``, ``concurrent.futures.Executor.map``, or an adapter
    for Dask or Ray (docs/performance.md). Returns one summary dict per file (also written to out_dir/ingest.json).
    Raises RunDirError when two files claim the same rank.
    """
    files = trace_files(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = sorted(map(ingest_rank, [RankTask(str(f), str(out)) for f in files]), key=lambda r: (r["rank"], r["trace"]))
    finish_dataset(run_dir, out, results)
    return results


def finish_dataset(run_dir: str | Path, out: Path, results: list[dict[str, Any]]) -> None:
    """The driver's part once every rank is written: run-level checks, stale partitions out, run.json and
    ingest.json in (``results``: the tasks' summaries, sorted by rank)."""
    _check_ranks(results, run_dir)
    _remove_stale(out, results)
    manifest = Path(run_dir) / MANIFEST_NAME
    if manifest.is_file():
        shutil.copyfile(manifest, out / MANIFEST_NAME)
    (out / INGEST_SUMMARY).write_text(json.dumps(results, indent=1))


def _remove_stale(out: Path, results: list[dict[str, Any]]) -> None:
    """Drop partition files an earlier ingest into ``out`` left behind (a renamed or removed trace, another run)."""
    keep = {f"{PARTITION_KEY}={r['rank']}/{Path(r['trace']).name}.parquet" for r in results}
    for table in TABLES:
        for part in (out / table).glob("*/*.parquet"):
            if f"{part.parent.name}/{part.name}" not in keep:
                part.unlink()
        for folder in (out / table).iterdir():
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _check_ranks(results: list[dict[str, Any]], run_dir: str | Path) -> None:
    """The run-level checks of ``load_run`` that matter for a dataset: one file per rank, ranks that say who they are."""
    if len(results) > 1:
        unnamed = [r["trace"] for r in results if r["rank_source"] == "single"]
        if unnamed:
            raise RunDirError(f"{len(unnamed)} of {len(results)} traces do not say their rank (e.g. {unnamed[0]})",
                              path=run_dir, fix="name the files rank{R}.pt.trace.json.gz or give each a "
                              "distributedInfo.rank")
    seen: dict[int, str] = {}
    for r in results:
        if r["rank"] in seen:
            raise RunDirError(f"{seen[r['rank']]} and {r['trace']} are both rank {r['rank']}", path=run_dir,
                              fix="keep one trace per rank (traces of different runs mixed up?)")
        seen[r["rank"]] = r["trace"]
    sizes = {r["world_size"] for r in results if r["world_size"] is not None}
    if len(sizes) > 1:
        raise RunDirError(f"traces from runs of different world sizes {sorted(sizes)}", path=run_dir,
                          fix="put each run's traces in its own directory")


def scan_tables(out_dir: str | Path) -> dict[str, pl.LazyFrame]:
    """Lazy frames over the partitioned tables, with the declared schemas; filters on ``rank`` prune partitions."""
    out = Path(out_dir)
    frames = {}
    for table, table_schema in TABLES.items():
        if not (out / table).is_dir():
            raise BadInputError(f"no {table}/ partitions here", path=out,
                                fix="pass a folder written by traceana.ingest.scale.ingest_to_parquet")
        lazy = pl.scan_parquet(
            out / table / "**" / "*.parquet",
            hive_partitioning=True,
            hive_schema={PARTITION_KEY: table_schema[PARTITION_KEY]},
            schema={c: t for c, t in table_schema.items() if c != PARTITION_KEY},
            missing_columns="insert",  # a dataset written before a column was added (memory.addr): null there
        )
        frames[table] = lazy.select(list(table_schema))
    return frames


def _rank_files(out: Path, table: str, ranks: list[int]) -> list[Path]:
    """The partition files of ``ranks`` (listing only their folders: a task of a 1,024-rank run reads a few)."""
    return [f for r in ranks for f in sorted((out / table / f"{PARTITION_KEY}={r}").glob("*.parquet"))]


def _scan_ranks(out: Path, ranks: list[int]) -> dict[str, pl.LazyFrame]:
    frames = {}
    for table, table_schema in TABLES.items():
        files = _rank_files(out, table, ranks)
        if not files:  # no partition of these ranks: an empty frame of the declared schema
            frames[table] = pl.LazyFrame(schema=table_schema)
            continue
        frames[table] = pl.scan_parquet(
            files, hive_partitioning=True, hive_schema={PARTITION_KEY: table_schema[PARTITION_KEY]},
            schema={c: t for c, t in table_schema.items() if c != PARTITION_KEY}, missing_columns="insert",
        ).select(list(table_schema))
    return frames


def load_traces(out_dir: str | Path) -> pl.DataFrame:
    """The ``traces`` table of a partitioned dataset (one row per rank), ordered by rank."""
    frame = scan_tables(out_dir)["traces"].collect().sort(PARTITION_KEY, maintain_order=True)
    return schema.check(frame, schema.TRACES, f"{out_dir}/traces")


def load_parquet(out_dir: str | Path, *, ranks: Iterable[int] | None = None) -> Run:
    """The ``Run`` of a partitioned dataset (all ranks, or only ``ranks``: only their partitions are read)."""
    out = Path(out_dir)
    wanted = None if ranks is None else sorted(set(ranks))
    tables = {}
    lazies = scan_tables(out) if wanted is None else _scan_ranks(out, wanted)
    for table, lazy in lazies.items():
        # Partitions are listed by path (rank=10 before rank=2): order by rank, keeping each rank's own order.
        frame = lazy.collect().sort(PARTITION_KEY, maintain_order=True)
        tables[table] = schema.check(frame, TABLES[table], f"{out}/{table}")
    summary_path = out / INGEST_SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else []
    warnings = tuple(w for r in summary if wanted is None or r["rank"] in wanted for w in r.get("warnings", ()))
    manifest = Manifest.read(out / MANIFEST_NAME) if (out / MANIFEST_NAME).is_file() else None
    return Run(path=out, events=tables["events"], memory=tables["memory"], traces=tables["traces"],
               manifest=manifest, warnings=warnings)

