"""Analyse a run of thousands of ranks on a cluster: one task per rank to ingest, one task per pipeline to analyse.

The step-time attribution of a rank needs the ranks it exchanges P2P messages with (pairs, waits, clock offsets,
the stage chain) and nothing of any other rank: data-parallel replicas of a pipeline meet only in collectives,
whose exposed time each rank's own trace already shows. So a run splits into **pipeline groups** — the connected
components of the "sends to / receives from" graph (BPipe's evictor↔acceptor transfers included) — and
``analyze`` of each group alone gives that group's rows of the whole-run analysis (docs/performance.md
"Analysis across machines" says what is and is not the same).

Two rounds of tasks, both handed to any executor's ``map`` (builtin ``map``, ``Executor.map``, or ``dask_map`` for
a ``dask.distributed`` cluster), so a worker's memory is bounded by one rank, then by one pipeline group:

1. ``ingest_rank``: read one trace (``traceana.ingest.scale.ingest_rank``: a ``rank=R`` Parquet partition under
   ``out_dir``) and return its summary plus the ranks it has P2P events with;
2. ``analyze_group``: load one group's partitions (``scale.load_parquet(..., ranks=group)``), ``analyze`` it and
   return its tables (steps, P2P pairs, schedule, attribution, stage memory, stages, clock offsets, rank summary).

The driver only finds the components (a graph of a few thousand nodes) and concatenates the results: it never holds
an event. Every worker must see ``run_dir`` and ``out_dir`` at the same path (a shared file system), as for
``traceana.ingest.scale``.
"""

from __future__ import annotations

import warnings as pywarnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import polars as pl

from traceana.core import names
from traceana.core import names as _names  # (analyze_partitioned's keyword ``names`` hides the module there)
from traceana.core.errors import BadInputError
from traceana.core.manifest import MANIFEST_NAME, Manifest
from traceana.core.names import NameRules
from traceana.ingest import scale
from traceana.ingest import Run
from traceana.measure.classify import rank_summary
from traceana.measure.p2p import pipeline_groups
from traceana.measure.schedule import pipeline_process_groups
from traceana.measure.reconcile import run_config, run_facts

# The Analysis tables a group task returns, and how the whole-run tables are ordered (as ``analyze`` orders them
# where it does; by their keys otherwise).
TABLE_ORDER: dict[str, tuple[str, ...]] = {
    "steps": ("rank", "step"),
    "p2p": ("step", "src", "dst", "tag", "seq"),
    "schedule": ("rank", "step", "start_ns"),
    "attribution": ("rank", "step"),
    "stage_memory": ("rank", "step"),
    "clock_offsets": ("rank",),
    "rank_summary": ("rank",),
    "segments": ("rank", "step"),
    "phase_time": ("rank", "step"),
    "stream_time": ("rank", "step"),
}
PARTITIONS_DIR = "partitions"  # under RUN_DIR/.traceana: where the CLI's --dask writes the per-rank Parquet


@dataclass(frozen=True)
class GroupTask:
    """Analyse the ranks of one pipeline group from the dataset at ``out_dir`` (plain values: picklable)."""

    out_dir: str
    ranks: tuple[int, ...]
    peak_flops: float | None = None
    name_rules: names.NameRules = names.DEFAULT_RULES
    # what else the worker makes of the group's Analysis, with its events (a module-level function, picklable;
    # causal.group_graph's part of the step's graph): its result comes back as the group's ``extra``
    extra: Callable[[Any], Any] | None = None


def p2p_peers(events: pl.DataFrame) -> list[int]:
    """The ranks an EVENTS frame names as a peer (ingest fills ``peer`` for P2P sends and receives).

    Any event with a peer counts, not only those classify calls P2P (a third of the cost of ingesting a small
    rank): an edge too many only merges two groups, and a union of groups is analysed as correctly as the whole
    run is — it costs parallelism, never a wrong number.
    """
    return sorted(int(p) for p in events["peer"].drop_nulls().unique().to_list())


def pipeline_peers(traces: pl.DataFrame, rank: int) -> list[int]:
    """The other ranks of ``rank``'s pipeline where its trace's process groups name one
    (``schedule.pipeline_process_groups``: megatron-core's): its P2P partners even where its messages name no peer
    (torch.profiler's defaults)."""
    return sorted({int(r) for ranks in pipeline_process_groups(traces) if rank in ranks for r in ranks} - {rank})


def ingest_rank(task: scale.RankTask) -> dict[str, Any]:
    """Round 1 in a worker: ``scale.ingest_rank`` (one rank's partitions), plus ``peers``: the ranks its events
    name as P2P peers, and those of its pipeline process group (``pipeline_peers``)."""
    summary, events, traces = scale.ingest_rank_events(task)
    return {**summary, "peers": sorted(set(p2p_peers(events)) | set(pipeline_peers(traces, summary["rank"])))}


def analyze_group(task: GroupTask) -> dict[str, Any]:
    """Round 2 in a worker: the Analysis tables of one pipeline group (its classified events stay in the worker;
    the segments, a few rows per step, come back: ``traceana merge`` and the report draw them)."""
    from traceana.measure.analysis import analyze

    run = scale.load_parquet(task.out_dir, ranks=task.ranks)
    result = analyze(run, peak_flops=task.peak_flops, names=task.name_rules)
    tables = {name: getattr(result, name) for name in TABLE_ORDER if name != "rank_summary"}
    tables["stages"] = result.stages
    tables["rank_summary"] = rank_summary(run)
    tables["segments"] = result.segments
    extra = task.extra(result) if task.extra is not None else None
    return {"ranks": task.ranks, "tables": tables, "notes": list(result.notes), "extra": extra}


def analyze_partitioned(run_dir: str | Path, out_dir: str | Path, *, map: scale.Map = map,
                        peak_flops: float | None = None, names: str | Path | NameRules | None = None,
                        **old_keywords):
    """The ``Analysis`` of ``run_dir``, computed one rank, then one pipeline group, per task through ``map``.
    ``names``: the name rules, as ``analyze``'s (``name_rules=`` is an old spelling).

    Its tables equal ``analyze(load_run(run_dir))``'s up to row order and the caveats in docs/performance.md;
    ``events`` is None (the classified events stay in the workers) and ``run`` holds the traces table only.
    """
    return analyze_partitioned_with(run_dir, out_dir, map=map, peak_flops=peak_flops, names=names,
                                    **old_keywords)[0]


def analyze_partitioned_with(run_dir: str | Path, out_dir: str | Path, *, extra: Callable[[Any], Any] | None = None,
                             map: scale.Map = map, peak_flops: float | None = None,
                             names: str | Path | NameRules | None = None, **old_keywords) -> tuple[Any, list]:
    """``analyze_partitioned``, and per pipeline group (in the groups' order) what ``extra`` made of the group's
    Analysis in its worker, while the events were there (``GroupTask.extra``; None without ``extra``)."""
    from traceana.measure.analysis import Analysis, _mfu, stage_table
    from traceana.ingest.run_dir import IngestWarning
    from traceana.measure.analysis_cache import run_name_rules
    from traceana.measure.summary import measured_steps, rank_steps

    rules = run_name_rules(run_dir, _names.names_keyword(names, old_keywords, "analyze_partitioned"))
    run_dir = Path(run_dir)
    files = scale.trace_files(run_dir)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInputError(f"cannot write the per-rank Parquet dataset here ({e.strerror or e})", path=out,
                            fix="make the run directory writable, or copy the run somewhere writable") from None
    summaries = sorted(map(ingest_rank, [scale.RankTask(str(f), str(out)) for f in files]),
                       key=lambda r: (r["rank"], r["trace"]))
    scale.finish_dataset(run_dir, out, summaries)
    groups = pipeline_groups({r["rank"]: r["peers"] for r in summaries})
    results = list(map(analyze_group, [GroupTask(str(out), g, peak_flops, rules, extra) for g in groups]))

    tables = {}
    for name in (*TABLE_ORDER, "stages"):
        parts = [r["tables"][name] for r in results]
        frame = pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame()
        tables[name] = frame.sort(TABLE_ORDER[name], maintain_order=True) if name in TABLE_ORDER and frame.height \
            else frame
    notes = list(dict.fromkeys(n for r in results for n in r["notes"]))  # the same note from many groups: once
    if len(groups) > 1:
        notes.append(f"analysed as {len(groups)} pipeline groups of "
                     f"{', '.join(sorted({str(len(g)) for g in groups}, key=int))} ranks (one task each)")
    ingest_warnings = tuple(w for r in summaries for w in r.get("warnings", ()))
    for w in ingest_warnings:  # as load_run reports them (the CLI prints each on one line)
        pywarnings.warn(w, IngestWarning, stacklevel=2)
    manifest = Manifest.read(run_dir / MANIFEST_NAME) if (run_dir / MANIFEST_NAME).is_file() else None
    traces = scale.load_traces(out)
    empty = {t: pl.DataFrame(schema=scale.TABLES[t]) for t in ("events", "memory")}
    run = Run(path=run_dir, events=empty["events"], memory=empty["memory"], traces=traces, manifest=manifest,
              warnings=ingest_warnings)
    # The per-rank means are over the run's measured steps (traceana.measure.summary), which depend on every rank: the
    # groups' tables are recomputed here over the whole run's, exactly as analyze computes them.
    att, stage_mem = tables["attribution"], tables["stage_memory"]
    measured = measured_steps(att, tables["schedule"])
    # the stage map's columns (placement.stage_map: rank, stage, …) are those stage_table puts before its means
    stage_map = tables["stages"].select(tables["stages"].columns[: tables["stages"].columns.index("steps")])
    config = run_config(run_facts(manifest, traces, peak_flops=peak_flops), tables["schedule"], stage_map)
    mfu, _ = _mfu(config, stage_map, tables["steps"].filter(pl.col("step").is_in(measured)))
    per_rank_step = rank_steps(att)
    stages = stage_table(per_rank_step.filter(pl.col("step").is_in(measured)), stage_map,
                         stage_mem.filter(pl.col("step").is_in(measured)), mfu)
    out = Analysis(
        run=run, steps=tables["steps"], p2p=tables["p2p"], schedule=tables["schedule"], attribution=att,
        stage_memory=stage_mem, stages=stages, clock_offsets=tables["clock_offsets"], notes=tuple(notes),
        rank_summary=tables["rank_summary"], segments=tables["segments"], phase_time=tables["phase_time"],
        stream_time=tables["stream_time"], peak_flops=peak_flops,
    )
    out.__dict__.update(config=config, per_rank_step=per_rank_step)  # (the ones MFU and the stage table used)
    return out, [r["extra"] for r in results]


def dask_map(client) -> scale.Map:
    """``map(fn, tasks)`` over a ``dask.distributed.Client``: one future per task, results in task order."""

    def run(fn, tasks):
        futures = client.map(fn, list(tasks), pure=False)  # tasks are idempotent: a retried one rewrites its files
        return client.gather(futures)

    return run


def connect(address: str, *, timeout: float = 10.0):
    """A ``dask.distributed.Client`` of the scheduler at ``address``, or a one-line BadInputError saying why not."""
    try:
        from distributed import Client
    except ImportError:
        raise BadInputError("--dask needs dask.distributed, which is not installed",
                            fix="pip install 'traceana[scale]' (or: pip install dask distributed)") from None
    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as e:
        raise BadInputError(f"cannot reach the Dask scheduler at {address} ({type(e).__name__}: {e})".rstrip(),
                            fix="start one (dask scheduler; dask worker ADDRESS) or check the address") from None
