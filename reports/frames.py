"""Shape traceana's analysis tables into the small frames the figures draw. Polars in, polars out; no plotting.

Everything here reads the tables of ``traceana.measure.analysis.Analysis`` (schemas in ``traceana/core/schema.py``) and
never the trace events, so a report's cost does not grow with the number of kernels: the timeline is drawn from the
schedule table (one row per rank, step, phase and micro-batch) plus the gaps between its spans.
"""

from __future__ import annotations

import polars as pl

from traceana.core import schema
from traceana.core.units import MIB, NS_PER_MS
from traceana.measure.analysis import Analysis
from traceana.measure.timeline import shift

BUBBLE_KINDS = schema.BUBBLE_CATEGORIES


def origin_ns(a: Analysis) -> int:
    """The report's time zero for one run: the first step's start (or the first scheduled span)."""
    starts = [f["start_ns"].min() for f in (a.steps, a.schedule) if f.height and f["start_ns"].null_count() < f.height]
    return int(min(starts)) if starts else 0


def _ms(col: str, origin: int) -> pl.Expr:
    return ((pl.col(col) - origin) / NS_PER_MS).alias(col.replace("_ns", "_ms"))


def bubble_segments(a: Analysis) -> pl.DataFrame:
    """The attribution's bubble segments (rank, step, kind, start_ns, end_ns): what the analysis labelled warm-up,
    stall or cool-down (pipeline_rules.bubble_windows), drawn as they are."""
    empty = pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int32, "kind": pl.String,
                                 "start_ns": pl.Int64, "end_ns": pl.Int64})
    if a.segments is None:
        return empty
    return (a.segments.with_columns(pl.col("category").cast(pl.String))
            .filter(pl.col("category").is_in(BUBBLE_KINDS))
            .select("rank", "step", pl.col("category").alias("kind"), "start_ns", "end_ns"))


def rank_stage(a: Analysis) -> pl.DataFrame:
    """(rank, stage) for every rank the analysis knows, stage null where it could not be determined."""
    frames = [
        f.select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32))
        for f in (a.schedule, a.attribution, a.stage_memory)
        if {"rank", "stage"} <= set(f.columns)
    ]
    known = pl.concat(frames).drop_nulls().unique("rank", keep="first") if frames else None
    ranks = a.run.traces.select(pl.col("rank").cast(pl.Int32))
    if known is None:
        return ranks.with_columns(stage=pl.lit(None, pl.Int32))
    return pl.concat([ranks, known.select("rank")]).unique().join(known, on="rank", how="left").sort("rank")


def timeline_blocks(a: Analysis) -> pl.DataFrame:
    """One row per drawn block: rank, stage, step, kind (phase or bubble kind), microbatch, start/end/dur in ms."""
    origin = origin_ns(a)
    work = a.schedule.filter(pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null()).select(
        "rank", "step", "stage", pl.col("phase").alias("kind"), "microbatch", "start_ns", "end_ns"
    )
    gaps = bubble_segments(a).with_columns(microbatch=pl.lit(None, pl.Int32), stage=pl.lit(None, pl.Int32))
    return (
        pl.concat([work, gaps.select(work.columns)])
        # a span keeps its own stage (interleaved schedules run several stages per rank); gaps take the rank's
        .join(rank_stage(a), on="rank", how="left", suffix="_of_rank")
        .with_columns(stage=pl.coalesce("stage", "stage_of_rank"))
        .with_columns(
            _ms("start_ns", origin),
            _ms("end_ns", origin),
            dur_ms=(pl.col("end_ns") - pl.col("start_ns")) / NS_PER_MS,
        )
        .select("rank", "stage", "step", "kind", "microbatch", "start_ms", "end_ms", "dur_ms")
        .sort("rank", "start_ms")
    )


def attribution_strip(a: Analysis, *, bins: int = 3000) -> pl.DataFrame:
    """What every instant of each rank was spent on (the attribution's segments), at most ``bins`` blocks per rank.

    ``Analysis.segments`` partitions every step into categories; on a real trace that is one segment per kernel or
    operator gap, far more than a browser should draw. The run's time range is cut into ``bins`` equal bins; each bin
    takes the category that covers most of it, and runs of equal bins merge into one block (Perfetto's "summary
    track" idea). Without segments, the schedule's phases stand in.
    """
    origin = origin_ns(a)
    if a.segments is not None and a.segments.height:
        segs = a.segments.select("rank", "step", pl.col("category").cast(pl.String), "start_ns", "end_ns")
    else:
        work = a.schedule.filter(pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null()).select(
            "rank", "step", pl.col("phase").alias("category"), "start_ns", "end_ns"
        )
        segs = work
    segs = segs.filter(pl.col("end_ns") > pl.col("start_ns"))
    empty = {"rank": pl.Int32, "category": pl.String, "start_ms": pl.Float64, "end_ms": pl.Float64,
             "dur_ms": pl.Float64, "share": pl.Float64}
    if segs.height == 0:
        return pl.DataFrame(schema=empty)
    lo, hi = int(segs["start_ns"].min()), int(segs["end_ns"].max())
    width = max(-(-(hi - lo) // bins), 1)
    per_bin = (
        segs.with_columns(
            b0=(pl.col("start_ns") - lo) // width, b1=(pl.col("end_ns") - 1 - lo) // width
        )
        .with_columns(bin=pl.int_ranges("b0", pl.col("b1") + 1))
        .explode("bin")
        .with_columns(
            ns=pl.min_horizontal("end_ns", lo + (pl.col("bin") + 1) * width)
            - pl.max_horizontal("start_ns", lo + pl.col("bin") * width)
        )
        .group_by("rank", "bin", "category")
        .agg(pl.col("ns").sum())
        .sort("rank", "bin", "ns", "category", descending=[False, False, True, False])
        .group_by("rank", "bin", maintain_order=True)
        .agg(pl.col("category").first(), pl.col("ns").first(), covered=pl.col("ns").sum())
        .sort("rank", "bin")
    )
    runs = per_bin.with_columns(
        run=(
            (pl.col("category") != pl.col("category").shift(1)) | (pl.col("bin") != pl.col("bin").shift(1) + 1)
        ).fill_null(True).cum_sum().over("rank")
    )
    return (
        runs.group_by("rank", "run")
        .agg(
            pl.col("category").first(),
            b0=pl.col("bin").min(), b1=pl.col("bin").max(), ns=pl.col("ns").sum(), covered=pl.col("covered").sum()
        )
        .select(
            "rank",
            "category",
            start_ms=(lo + pl.col("b0") * width - origin) / NS_PER_MS,
            end_ms=(lo + (pl.col("b1") + 1) * width - origin) / NS_PER_MS,
            dur_ms=pl.col("ns") / NS_PER_MS,
            share=100 * pl.col("ns") / pl.col("covered"),
        )
        .sort("rank", "start_ms")
    )


def critical_path(a: Analysis) -> pl.DataFrame:
    """The replayed steps' critical path (traceana.measure.summary's ``path``, from traceana.causal.graph): rank, kind,
    start_ms, end_ms, dur_ms; empty where the what-if could not run."""
    path = a.summary.path
    if path is None or path.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "kind": pl.String, "start_ms": pl.Float64,
                                    "end_ms": pl.Float64, "dur_ms": pl.Float64})
    origin = origin_ns(a)
    return path.select("rank", "kind", _ms("start_ns", origin), _ms("end_ns", origin),
                       (pl.col("ms")).alias("dur_ms")).sort("start_ms")


def timeline_transfers(a: Analysis) -> pl.DataFrame:
    """Matched P2P / BPipe messages on the receiving rank: the transfer (data ready → received), the wait before it."""
    origin = origin_ns(a)
    p2p = a.p2p.filter(pl.col("data_ready_ns").is_not_null() & pl.col("recv_end_ns").is_not_null())
    return p2p.select(
        pl.col("dst").alias("rank"),
        pl.col("src").alias("peer"),
        "step",
        pl.when(pl.col("channel") == "bpipe").then(pl.lit("bpipe")).otherwise(pl.lit("p2p")).alias("kind"),
        pl.col("nbytes"),
        ((pl.col("data_ready_ns") - origin) / NS_PER_MS).alias("start_ms"),
        ((pl.col("recv_end_ns") - origin) / NS_PER_MS).alias("end_ms"),
        (pl.col("transfer_ns") / NS_PER_MS).alias("transfer_ms"),
        (pl.col("wait_ns") / NS_PER_MS).alias("wait_ms"),
    ).sort("rank", "start_ms")


def stage_label() -> pl.Expr:
    """A bar's stage as text; ranks whose stage is not known are "no stage" (a null label would be drawn "nan")."""
    return pl.format("stage {}", pl.col("stage")).fill_null("no stage")


def stage_attribution(a: Analysis) -> pl.DataFrame:
    """The summary's per-stage table in long form: stage, category, ms (mean per measured step), percent."""
    per = a.summary.per_stage
    long = per.select("stage", *(f"{c}_ms" for c in schema.CATEGORIES), "step_ms").unpivot(
        index=["stage", "step_ms"], variable_name="category", value_name="ms")
    return (
        long.with_columns(pl.col("category").str.strip_suffix("_ms"))
        .with_columns(percent=pl.when(pl.col("step_ms") > 0).then(100 * pl.col("ms") / pl.col("step_ms")))
        .drop("step_ms")
    )


def bubble_breakdown(a: Analysis) -> pl.DataFrame:
    """Per stage: warm-up, stall and cool-down bubble in ms per measured step."""
    return stage_attribution(a).filter(pl.col("category").is_in(BUBBLE_KINDS))


def memory_curves(a: Analysis, *, bins: int = 400) -> pl.DataFrame:
    """Allocated memory over time per rank, downsampled to at most ``bins`` points per rank (max in each bin).

    Taking the bin's maximum keeps every peak visible, which is what a memory plot is for. For each rank the
    accelerator (highest device id) is shown when the trace has one, otherwise the CPU allocator (device -1).
    """
    # on the analysis' corrected clock, as its steps and schedule (traceana.measure.timeline.shift)
    mem = shift(a.run.memory, a.clock_offsets, ["ts_ns"]).filter(pl.col("allocated_bytes").is_not_null())
    if mem.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "stage": pl.Int32, "t_ms": pl.Float64, "mib": pl.Float64})
    origin = origin_ns(a) or int(mem["ts_ns"].min())
    lo, hi = int(mem["ts_ns"].min()), int(mem["ts_ns"].max())
    width = max((hi - lo) // bins + 1, 1)
    return (
        mem.filter(pl.col("device") == pl.col("device").max().over("rank"))
        .with_columns(bin=(pl.col("ts_ns") - lo) // width)
        .group_by("rank", "bin")
        .agg(ts_ns=pl.col("ts_ns").min(), mib=pl.col("allocated_bytes").max() / MIB)
        .join(rank_stage(a), on="rank", how="left")
        .select("rank", "stage", ((pl.col("ts_ns") - origin) / NS_PER_MS).alias("t_ms"), "mib")
        .sort("rank", "t_ms")
    )


_UNITS = {"_ms": ("ms", 1.0), "_bytes": ("MiB", 1 / MIB)}


def validation_items(per_stage: pl.DataFrame, summary: dict) -> pl.DataFrame:
    """``traceana.validation``'s per-stage table (measured_X next to simulated_X or estimated_X) in long form:
    item, unit, measured, estimated, error_pct — plus the whole pipeline's step time from its summary."""
    parts = []
    measured_step, simulated_step = summary.get("measured_step_ms"), summary.get("simulated_step_ms")
    if measured_step is not None and simulated_step is not None:
        parts.append(pl.DataFrame({"order": [0], "item": ["step time, whole pipeline"], "unit": ["ms"],
                                   "measured": [float(measured_step)], "estimated": [float(simulated_step)]}))
    for k, col in enumerate(c for c in per_stage.columns if c.startswith("measured_")):
        rest = col.removeprefix("measured_")
        est = next((f"{p}_{rest}" for p in ("simulated", "estimated") if f"{p}_{rest}" in per_stage.columns), None)
        unit = next((u for suffix, u in _UNITS.items() if rest.endswith(suffix)), None)
        if est is None or unit is None:
            continue
        what = rest.removesuffix("_ms").removesuffix("_bytes")
        what = {"step": "step time", "activation": "activation peak",
                "blocked": "blocked (bubble + exposed P2P)"}.get(what, what.replace("_", " "))
        parts.append(
            per_stage.select(
                order=pl.lit(k + 1) * 1000 + pl.col("stage"),
                item=pl.format("stage {} · {}", pl.col("stage"), pl.lit(what)),
                unit=pl.lit(unit[0]),
                measured=pl.col(col).cast(pl.Float64) * unit[1],
                estimated=pl.col(est).cast(pl.Float64) * unit[1],
            )
        )
    if not parts:
        return pl.DataFrame(schema={"item": pl.String, "unit": pl.String, "measured": pl.Float64,
                                    "estimated": pl.Float64, "error_pct": pl.Float64})
    return (
        pl.concat(parts, how="vertical_relaxed")
        .sort("order")
        .drop("order")
        .with_columns(
            error_pct=pl.when(pl.col("measured") != 0)
            .then(100 * (pl.col("estimated") - pl.col("measured")) / pl.col("measured"))
            .otherwise(None)
        )
    )
