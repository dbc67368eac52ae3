"""Memory per stage from the allocator's ``[memory]`` instants (docs/architecture.md, "Memory").

Per rank and step: the baseline (allocated bytes when the step starts: the last sample before it, else the first
sample in it minus its own delta), the peak within the step and the activation peak (peak − baseline; weights,
gradients and optimizer state are in the baseline). A rank with GPU samples is measured on its GPU (the device
with most samples); a CPU-only rank on the CPU allocator (device −1). Balance across stages is max/min of the
per-stage peak: BPipe's claim is that it moves towards 1.
"""

from __future__ import annotations

import polars as pl

from traceana.intervals import COLLECT
from traceana.schema import STAGE_MEMORY, conform


def device_samples(memory: pl.DataFrame) -> pl.DataFrame:
    """Samples of the device that carries each rank's model: its GPU if it has one, else the CPU (a LazyFrame gives
    a LazyFrame)."""
    counts = memory.group_by("rank", "device").agg(pl.len().alias("n"))
    chosen = (
        counts.with_columns((pl.col("device") >= 0).alias("gpu"))
        .sort("rank", "gpu", "n", descending=[False, True, True])
        .unique("rank", keep="first")
        .select("rank", "device")
    )
    return memory.join(chosen, on=["rank", "device"])


def stage_memory(memory: pl.DataFrame, steps: pl.DataFrame, stages: pl.DataFrame) -> pl.DataFrame:
    """schema.STAGE_MEMORY: one row per (rank, step) that has allocator samples or a baseline before it."""
    if memory.height == 0:
        return conform(pl.DataFrame(), STAGE_MEMORY).clear()
    samples = device_samples(memory.lazy()).sort("ts_ns")  # one query (docs/performance.md "Fixed cost")
    w = steps.lazy().select("rank", "step", "start_ns", "end_ns").sort("start_ns")
    before = (
        w.join_asof(samples.select("rank", "ts_ns", "allocated_bytes"), left_on="start_ns", right_on="ts_ns",
                    by="rank", strategy="backward", allow_exact_matches=False, check_sortedness=False)
        .select("rank", "step", pl.col("allocated_bytes").alias("_before"))
    )
    inside = (
        samples.join_asof(w, left_on="ts_ns", right_on="start_ns", by="rank", strategy="backward",
                          check_sortedness=False)
        .filter(pl.col("end_ns").is_not_null() & (pl.col("ts_ns") < pl.col("end_ns")))
        .group_by("rank", "step", maintain_order=True)
        .agg(pl.col("allocated_bytes").max().alias("_peak"),
             (pl.col("allocated_bytes") - pl.col("delta_bytes")).first().alias("_first_before"))
    )
    out = (
        before.join(inside, on=["rank", "step"], how="full", coalesce=True)
        .with_columns(pl.coalesce("_before", "_first_before").alias("baseline_bytes"))
        .filter(pl.col("baseline_bytes").is_not_null())
        .with_columns(pl.max_horizontal("_peak", "baseline_bytes").alias("peak_bytes"))
        .with_columns((pl.col("peak_bytes") - pl.col("baseline_bytes")).alias("activation_peak_bytes"))
        .join(stages.lazy().select("rank", "stage"), on="rank", how="left")
    )
    return conform(out, STAGE_MEMORY).sort("rank", "step").collect(**COLLECT)
