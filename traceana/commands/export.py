"""Write an Analysis out: every table as Parquet/CSV for notebooks, a JSON summary for scripts, and one merged
Chrome/Perfetto trace of all ranks with added schedule, micro-batch and bubble tracks.

The merged trace is built column-wise: polars writes the events as JSON lines (in Rust), a chunk of rows at a time,
and each chunk's text is written (gzipped) before the next is built, so no per-event Python dict is ever made and
the whole trace's text is never in memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl
from isal import igzip

from traceana.core import names
from traceana.core.errors import BadInputError, shown
from traceana.core.files import (TABLE_FORMATS, atomic_path, descriptor_of, os_error_of, output_stream, refuse_inputs,
                                 write_bytes, write_failure_fix)
from traceana.core.schema import CATEGORIES
from traceana.core.units import NS_PER_MS, NS_PER_US
from traceana.ingest.reading import MERGED_PRODUCER  # ingest recognises (and skips) the merged trace by it
from traceana.measure import gpu
from traceana.measure.summary import without_bubble

FORMATS = TABLE_FORMATS


def input_files(analysis) -> list[Path]:
    """The files the analysis read (traces and run.json): no output may be written over one of them."""
    from traceana.ingest.run_dir import input_files as of_path  # (cost: the decoder only when called: a cache hit loads none)

    return of_path(analysis.run.path)


def export_paths(directory: str | Path, names: list[str], fmt: str) -> list[Path]:
    out = Path(directory)
    return [out / f"{name}.{fmt}" for name in names] + [out / "notes.txt"]


def write_tables(analysis, directory: str | Path, *, fmt: str = "parquet") -> list[Path]:
    """One file per table (``steps.parquet``, ``attribution.parquet``, …) plus ``notes.txt``, each written under a
    temporary name and renamed into place (a failed export leaves no partial file and keeps older ones)."""
    if fmt not in FORMATS:
        raise BadInputError(f"unknown export format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    out = Path(directory)
    tables = analysis.tables()
    targets = export_paths(out, list(tables), fmt)
    inputs = input_files(analysis)
    for t in targets:
        refuse_inputs(t, inputs, flag="--export")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInputError(f"cannot create the export folder ({e.strerror})", path=shown(out),
                            fix="choose a writable folder") from None
    for i, (path, (name, table)) in enumerate(zip(targets, tables.items())):
        try:
            with atomic_path(path) as tmp:
                if fmt == "parquet":
                    table.write_parquet(tmp)
                else:  # CSV has no enum or nested types: write them as text
                    table.with_columns(pl.col(pl.Enum, pl.Categorical).cast(pl.String)).write_csv(tmp)
        except BadInputError:
            raise
        except Exception as e:  # disk full, permissions (polars raises its own types, a full disk even as thrift's)
            e = os_error_of(e, path.parent, table.estimated_size())
            raise _write_error(path, e, "the table", targets[:i], len(targets)) from None
    try:
        write_bytes(targets[-1], "".join(f"{n}\n" for n in analysis.notes).encode())
    except OSError as e:
        raise _write_error(targets[-1], e, "the notes", targets[:-1], len(targets)) from None
    return targets


def _write_error(path: Path, e: BaseException, what: str, done: list[Path] = (), total: int = 1) -> BadInputError:
    """What a failed write left: the file it failed on is as it was (no partial file), and the files written before
    it are complete — said so, since an export is then a mix of new and older (or missing) tables."""
    reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:200] or type(e).__name__
    left = (f"; the {len(done)} file(s) before it ({', '.join(p.name for p in done[:3])}{', …' if len(done) > 3 else ''})"
            f" were written complete, the other {total - len(done)} not" if done else "")
    return BadInputError(f"cannot write {what} ({reason}); nothing partial was left of it{left}",
                         path=shown(path), fix=write_failure_fix(e))


# Shares in the JSON the commands print: every one is a fraction (0..1) and its key says so. These fields are
# fractions under a bare name in the tables; ``*_pct`` columns are percents (0..100).
FRACTION_FIELDS = frozenset({"mfu", "hfu", "efficiency", "error", "step_error", "sampled_error", "replay_error",
                             "last_step_error", "blocked_error", "memory_error", "median_abs_memory_error",
                             "noise_floor"})


def json_fractions(value: Any) -> Any:
    """``value`` (dicts and lists, nested) with every share as ``<name>_fraction`` in 0..1: a field of
    ``FRACTION_FIELDS`` is renamed, a ``<name>_pct`` percent becomes ``<name>_fraction`` divided by 100."""
    if isinstance(value, list):
        return [json_fractions(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if isinstance(k, str) and k.endswith("_pct"):
            out[f"{k.removesuffix('_pct')}_fraction"] = None if v is None else v / 100
        elif k in FRACTION_FIELDS:
            out[f"{k}_fraction"] = v
        else:
            out[k] = json_fractions(v)
    return out


def summary(analysis, *, per_step: bool = False) -> dict[str, Any]:
    """A JSON-ready summary: the run's headline figures (traceana.measure.summary), per-rank table, notes, clocks (and
    per-step attribution), with every share a ``*_fraction`` in 0..1 (``json_fractions``)."""
    out: dict[str, Any] = {
        "run": str(analysis.run.path),
        "summary": analysis.summary.as_dict(),
        "config": analysis.config.as_dict(),
        # (a run that is no pipeline has no bubble: null, as in its summary)
        "stages": (analysis.stages if analysis.summary.pipeline_found
                   else without_bubble(analysis.stages)).to_dicts(),
        "clock_offsets": analysis.clock_offsets.to_dicts(),
        "notes": list(analysis.notes),
    }
    if per_step:
        out["per_step"] = per_step_table(analysis).to_dicts()
    out["gpu"] = gpu_summary(analysis)
    return json_fractions(_finite(out))


def gpu_summary(analysis) -> dict[str, Any]:
    """``pipeline_found`` (the summary's), and on GPU ranks, means per measured step: each phase's
    own GPU time beside what the partition gave it (``phases``) and the time per stream (``streams``)."""
    steps = analysis.summary.steps
    out: dict[str, Any] = {"pipeline_found": analysis.summary.pipeline_found}
    if analysis.phase_time is not None:
        out["phases"] = gpu.phase_means(analysis.phase_time, analysis.attribution, steps).to_dicts()
    if analysis.stream_time is not None:
        out["streams"] = gpu.stream_means(analysis.stream_time, steps).to_dicts()
    views = gpu.gpu_views(analysis)  # HTA's views (kernel types, overlap, idle split, top kernels): issue 36
    if views:
        out["views"] = views
    return out


def _finite(value: Any) -> Any:
    """NaN and ±inf (a 0/0 somewhere) become null: JSON has no such numbers, and ``--json`` must always parse.
    Stage- and step-sized data only."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def per_step_table(analysis) -> pl.DataFrame:
    """One row per (rank, step) (``Analysis.per_rank_step`` in ms): stage, step_ms, every category's
    ``<category>_ms`` (0 where the step has none), bubble_ms (warm-up + stall + cool-down), blocked_ms (bubble +
    exposed P2P)."""
    ms = lambda c: (pl.col(f"{c}_ns") / NS_PER_MS).alias(f"{c}_ms")  # noqa: E731
    return (
        analysis.per_rank_step
        .select("rank", "stage", "step", ms("step"), *(ms(c) for c in CATEGORIES), ms("bubble"), ms("blocked"))
        .sort("stage", "rank", "step", nulls_last=True)
    )


# --- merged Perfetto trace -----------------------------------------------------------------------------------
def _tids(frame: pl.DataFrame) -> pl.DataFrame:
    """Integer thread ids per (rank, track), stable and dense."""
    return (
        frame.select("rank", "track").unique().sort("rank", "track")
        .with_columns((pl.int_range(pl.len()).over("rank") + 1).alias("tid"))
    )


MERGE_CHUNK_ROWS = 250_000  # events turned into JSON text at a time: bounds the merged trace's memory (the text
# of one chunk, ~40 MB), whatever the run's size (docs/reliability.md "Bounded memory")
_MERGED_COLS = ["ph", "name", "cat", "pid", "tid", "ts", "dur"]


def _merged_parts(analysis, *, chunk_rows: int = MERGE_CHUNK_ROWS):
    """The merged trace's complete events, as frames of at most ``chunk_rows`` rows with columns ph, name, cat,
    pid, tid, ts, dur (µs, from the run's first instant) and args (JSON text): the ranks' own events chunk by
    chunk, then the phase, micro-batch and attribution lanes (step- and micro-batch-sized)."""
    ev = analysis.events
    if ev is None:
        raise BadInputError("this analysis kept no events", fix="run analyze() again")
    origin = int(ev["ts_ns"].min() or 0)
    tids = _tids(ev)
    us = lambda c: ((pl.col(c) - origin) / NS_PER_US)  # noqa: E731 — one conversion, used for every table

    def done(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.select(*_MERGED_COLS, pl.col("args").struct.json_encode())

    for lo in range(0, ev.height, chunk_rows):
        yield done(
            ev.slice(lo, chunk_rows).drop("tid").join(tids, on=["rank", "track"], how="left", maintain_order="left")
            .select(pl.lit("X").alias("ph"), names.text(pl.col("name")), pl.col("cat").fill_null(""),
                    pl.col("rank").alias("pid"),
                    "tid", us("ts_ns").alias("ts"), (pl.col("dur_ns") / NS_PER_US).alias("dur"),
                    pl.struct(pl.col("kind").cast(pl.String), "step", "peer").alias("args"))
        )
    first_extra = int(tids["tid"].max() or 0) + 1
    sched = analysis.schedule.filter(pl.col("end_ns") > pl.col("start_ns"))
    phase_track = sched.select(
        pl.lit("X").alias("ph"),
        # "forward 3"; a phase of no micro-batch (the optimizer) is its name alone, no trailing space
        pl.concat_str(pl.col("phase"), pl.lit(" ") + pl.col("microbatch").cast(pl.String), ignore_nulls=True)
        .alias("name"),
        pl.lit("traceana.phase").alias("cat"), pl.col("rank").alias("pid"), pl.lit(first_extra).alias("tid"),
        us("start_ns").alias("ts"), ((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_US).alias("dur"),
        pl.struct("stage", "microbatch", "step", "source").alias("args"),
    )
    mb = (
        sched.filter(pl.col("microbatch").is_not_null())
        .group_by("rank", "step", "stage", "microbatch")
        .agg(pl.col("start_ns").min(), pl.col("end_ns").max())
        .sort("rank", "start_ns")
    )
    # Micro-batches overlap in time (1F1B keeps several in flight): give each its own lane, as Perfetto wants
    # complete events on one thread to nest.
    mb_track = mb.select(
        pl.lit("X").alias("ph"), pl.concat_str(pl.lit("mb "), pl.col("microbatch").cast(pl.String)).alias("name"),
        pl.lit("traceana.microbatch").alias("cat"), pl.col("rank").alias("pid"),
        (first_extra + 2 + pl.col("microbatch")).alias("tid"),  # after the phase and attribution lanes
        us("start_ns").alias("ts"), ((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_US).alias("dur"),
        pl.struct("stage", "microbatch", "step").alias("args"),
    )
    # The attribution lane is the full partition of every step (compute included), so P2P flow arrows always
    # find a slice to bind to.
    segs = analysis.segments if analysis.segments is not None else pl.DataFrame()
    bubble_track = segs.select(
        pl.lit("X").alias("ph"), pl.col("category").cast(pl.String).alias("name"),
        pl.lit("traceana.attribution").alias("cat"), pl.col("rank").alias("pid"),
        pl.lit(first_extra + 1).alias("tid"), us("start_ns").alias("ts"),
        ((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_US).alias("dur"), pl.struct("step").alias("args"),
    )
    for frame in (phase_track, mb_track, bubble_track):
        for lo in range(0, frame.height, chunk_rows):
            yield done(frame.slice(lo, chunk_rows))


def merged_trace_events(analysis) -> pl.DataFrame:
    """Columns ph, name, cat, pid, tid, ts, dur (µs, from the run's first instant), args (JSON text): all ranks,
    as one frame (``write_merged_trace`` writes the same rows chunk by chunk instead)."""
    return pl.concat(list(_merged_parts(analysis)), how="vertical_relaxed")


def flow_events(analysis, *, origin: int, tid: int) -> pl.DataFrame:
    """Perfetto flow arrows from each P2P/BPipe send (when it started) to its receive (when it completed), bound to
    the attribution lanes of the two ranks. Columns ph, id, name, cat, pid, tid, ts, bp."""
    p = analysis.p2p.with_row_index("id", offset=1)
    us = lambda c: ((c - origin) / NS_PER_US)  # noqa: E731
    common = [pl.col("channel").alias("name"), pl.lit("traceana.p2p").alias("cat")]
    starts = p.select(pl.lit("s").alias("ph"), "id", *common, pl.col("src").alias("pid"), pl.lit(tid).alias("tid"),
                      us(pl.col("send_start_ns")).alias("ts"), pl.lit(None, pl.String).alias("bp"))
    # Bind the arrow's head inside the slice that ends when the receive completed.
    ends = p.select(pl.lit("f").alias("ph"), "id", *common, pl.col("dst").alias("pid"), pl.lit(tid).alias("tid"),
                    us(pl.max_horizontal(pl.col("recv_end_ns") - 1, pl.col("recv_post_ns"))).alias("ts"),
                    pl.lit("e").alias("bp"))
    return pl.concat([starts, ends])


PATH_TID = 9_999  # the merged trace's critical-path lane of each rank (after every track, phase and micro-batch lane)


def critical_path_events(analysis, *, origin: int) -> pl.DataFrame:
    """The replayed steps' critical paths (the summary's ``path``: traceana.causal.critical_path of every measured
    step, as analyze and the report show it) in the merged trace: each piece of time on the path as a slice of its
    rank's "critical path" lane (name: its kind), and flow arrows from each piece to the next along the path, across
    ranks where the path goes through a message. Columns ph, id, name, cat, pid, tid, ts, dur, bp; empty where the
    summary has no what-if (no schedule, or a run too large for it: the summary's diagnosis says why)."""
    empty = pl.DataFrame(schema={"ph": pl.String, "id": pl.Int64, "name": pl.String, "cat": pl.String,
                                 "pid": pl.Int32, "tid": pl.Int64, "ts": pl.Float64, "dur": pl.Float64,
                                 "bp": pl.String})
    path = analysis.summary.path
    if path is None or path.height == 0:
        return empty
    pieces = (path.filter(pl.col("end_ns") > pl.col("start_ns")).sort("step", "start_ns")
              .with_row_index("id", offset=1_000_000_000))  # ids apart from the P2P arrows' (1, 2, …)
    us = lambda c: ((pl.col(c) - origin) / NS_PER_US)  # noqa: E731
    slices = pieces.select(pl.lit("X").alias("ph"), pl.lit(None, pl.Int64).alias("id"), pl.col("kind").alias("name"),
                           pl.lit("traceana.critical_path").alias("cat"), pl.col("rank").alias("pid"),
                           pl.lit(PATH_TID, pl.Int64).alias("tid"), us("start_ns").alias("ts"),
                           ((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_US).alias("dur"),
                           pl.lit(None, pl.String).alias("bp"))
    nxt = pieces.with_columns(pl.col("rank", "start_ns", "step").shift(-1).name.suffix("_next")).filter(
        pl.col("step_next") == pl.col("step"))
    arrow = [pl.lit("critical path").alias("name"), pl.lit("traceana.critical_path").alias("cat"),
             pl.lit(PATH_TID, pl.Int64).alias("tid"), pl.lit(None, pl.Float64).alias("dur")]
    starts = nxt.select(pl.lit("s").alias("ph"), "id", *arrow[:2], pl.col("rank").alias("pid"), arrow[2],
                        ((pl.col("end_ns") - 1 - origin) / NS_PER_US).alias("ts"), arrow[3],
                        pl.lit(None, pl.String).alias("bp"))
    ends = nxt.select(pl.lit("f").alias("ph"), "id", *arrow[:2], pl.col("rank_next").alias("pid"), arrow[2],
                      ((pl.col("start_ns_next") + 1 - origin) / NS_PER_US).alias("ts"), arrow[3],
                      pl.lit("e").alias("bp"))
    return pl.concat([slices.cast(empty.schema), starts.cast(empty.schema), ends.cast(empty.schema)])


def _metadata(analysis, tids: pl.DataFrame, first_extra: int, stages: dict[int, Any]) -> list[dict[str, Any]]:
    """Process and thread names: one small dict per rank and track (rank-sized, not event-sized)."""
    meta: list[dict[str, Any]] = []
    for rank in sorted(tids["rank"].unique().to_list()):
        stage = stages.get(rank)
        label = f"rank {rank}" + ("" if stage is None else
                                  f" (stage{'s' if ',' in stage else ''} {stage.replace(',', '+')})")
        meta.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for name, tid in ((" pipeline phases", first_extra), (" attribution", first_extra + 1),
                          ("critical path", PATH_TID)):
            meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name.strip()}})
    for rank, track, tid in tids.rows():
        meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
    return meta


def write_merged_trace(analysis, path: str | Path, *, chunk_rows: int = MERGE_CHUNK_ROWS) -> Path:
    """Write all ranks into one Chrome/Perfetto JSON trace (gzip when the name ends in .gz), under a temporary name
    renamed into place; never over one of the analysis' own input files.

    Streamed: the events are turned into JSON text ``chunk_rows`` at a time and written (compressed) as they come,
    so the text of the whole trace is never in memory (docs/reliability.md "Bounded memory")."""
    fd = descriptor_of(path)  # ``-o -``, /dev/stdout, a symlink to /proc/self/fd/N: that stream
    to_stdout = fd is not None
    stream = output_stream(fd, shown=str(path)) if to_stdout else None
    path = Path(path)
    if not to_stdout:
        refuse_inputs(path, input_files(analysis))
    if analysis.events is None:
        raise BadInputError("this analysis kept no events", fix="run analyze() again")
    tids = _tids(analysis.events)
    first_extra = int(tids["tid"].max() or 0) + 1
    # every virtual stage a rank holds ("0,3" -> "stages 0+3"), else its one stage
    stages = {r: (v or (None if s is None else str(s)))
              for r, s, v in analysis.stages.select("rank", "stage", "stages").rows()}
    meta = _metadata(analysis, tids, first_extra, stages)
    mb_lanes = (  # sorted: the merged trace is the same bytes on every run (unique() has no order)
        analysis.schedule.filter((pl.col("end_ns") > pl.col("start_ns")) & pl.col("microbatch").is_not_null())
        .select(pl.col("rank").alias("pid"), (first_extra + 2 + pl.col("microbatch")).alias("tid"), "microbatch")
        .unique().sort("pid", "tid")
    )
    meta += [{"ph": "M", "name": "thread_name", "pid": p, "tid": t, "args": {"name": f"micro-batch {m}"}}
             for p, t, m in mb_lanes.rows()]
    header = {"displayTimeUnit": "ns", "otherData": {"producer": MERGED_PRODUCER, "run": str(analysis.run.path),
                                                     "clock_offsets": analysis.clock_offsets.to_dicts(),
                                                     "notes": list(analysis.notes)}}
    origin = int(analysis.events["ts_ns"].min() or 0)

    def texts():
        """The trace's text in pieces: header and metadata, then each chunk of events as JSON lines."""
        yield json.dumps(header)[:-1] + ', "traceEvents": [' + ",\n".join(json.dumps(m) for m in meta)
        first = not meta
        for part in _merged_parts(analysis, chunk_rows=chunk_rows):
            if part.height:  # one JSON object per event, built as strings by polars; args is already JSON text
                yield ("" if first else ",\n") + part.select(
                    pl.concat_str(pl.struct(_MERGED_COLS).struct.json_encode().str.head(-1), pl.lit(',"args":'),
                                  pl.col("args").fill_null("{}"), pl.lit("}")).str.join(",\n"))[0, 0]
                first = False
        flows = flow_events(analysis, origin=origin, tid=first_extra + 1)
        for lo in range(0, flows.height, chunk_rows):
            yield ("" if first else ",\n") + flows.slice(lo, chunk_rows).select(
                pl.when(pl.col("bp").is_null()).then(pl.struct(pl.all().exclude("bp")).struct.json_encode())
                .otherwise(pl.struct(pl.all()).struct.json_encode()).str.join(",\n"))[0, 0]
            first = False
        path = critical_path_events(analysis, origin=origin)
        if path.height:  # each row's JSON without the fields that do not apply to it (nulls)
            yield ("" if first else ",\n") + path.select(
                pl.when(pl.col("ph") == "X").then(pl.struct("ph", "name", "cat", "pid", "tid", "ts", "dur")
                                                  .struct.json_encode())
                .when(pl.col("ph") == "s").then(pl.struct("ph", "id", "name", "cat", "pid", "tid", "ts")
                                                .struct.json_encode())
                .otherwise(pl.struct("ph", "id", "name", "cat", "pid", "tid", "ts", "bp").struct.json_encode())
                .str.join(",\n"))[0, 0]
            first = False
        yield "]}"

    if to_stdout:  # ``-o -``: plain JSON text as it is built (a stream: a reader that stops early ends it)
        out = stream
        for text in texts():
            out.write(text.encode())
        out.flush()
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInputError(f"cannot create the folder for the merged trace ({e.strerror or e})",
                            path=shown(path.parent), fix="choose a folder you can write to") from None
    try:
        with atomic_path(path) as tmp, open(tmp, "xb") as raw:
            out = igzip.IGzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) if path.suffix == ".gz" else raw
            try:
                for text in texts():
                    out.write(text.encode())
            finally:
                if out is not raw:
                    out.close()
    except OSError as e:
        raise BadInputError(f"cannot write the merged trace ({e.strerror or e}); nothing partial was left",
                            path=shown(path), fix=write_failure_fix(e)) from None
    return path
