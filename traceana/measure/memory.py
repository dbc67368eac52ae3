"""Memory per stage from the allocator's ``[memory]`` instants (docs/architecture.md, "Memory").

Per rank and step: the baseline (allocated bytes when the step starts: the last sample before it, else the first
sample in it minus its own delta), the peak within the step, and the activation peak. A rank with GPU samples is
measured on its GPU (the device with most samples); a CPU-only rank on the CPU allocator (device −1). Balance across
stages is max/min of the per-stage peak: BPipe's claim is that it moves towards 1.

The activation peak is what activations are: memory allocated during the step and freed during the same step
(*transient*), at its most alive at once. Each allocation is paired with the next event at its address on the same
rank and device, which must be its free (the same bytes); a pair whose allocation and free both fall inside one
step window is that step's transient memory, and the peak is the maximum over the step of the running sum of +bytes
at allocations and −bytes at frees, in the trace's order. What outlives the step (new gradients, optimizer state, an
allocation whose free is not in the trace) or existed before it (the previous step's gradients that
``zero_grad(set_to_none=True)`` frees inside the step, blocks allocated before profiling began) is not an
activation, wherever the peak falls. BPipe's buffers are transient on both sides: evicted activations are freed on
the evictor, accepted ones allocated and freed on the acceptor, within the step.

A rank whose samples carry no block address (Kineto's "Addr": older torch, hand-written traces) keeps the older rule,
peak − baseline, which reads low by up to the gradients freed inside the step when the peak comes before backward
allocates new ones, and high by the new gradients when it comes after; ``ranks_without_addresses`` names them for the
analysis' note.
"""

from __future__ import annotations

import polars as pl

from traceana.core.intervals import COLLECT
from traceana.core.schema import STAGE_MEMORY, conform

_BLOCK = ("rank", "device", "addr")  # one allocator block: its address on one rank's device


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
    return memory.join(chosen, on=["rank", "device"], maintain_order="left")


def _addressed(samples: pl.LazyFrame) -> pl.LazyFrame:
    """``rank, _addressed``: whether every sample of the rank's measured device carries its block's address."""
    return samples.group_by("rank").agg(pl.col("addr").is_not_null().all().alias("_addressed"))


def ranks_without_addresses(memory: pl.DataFrame) -> list[int]:
    """The ranks whose activation peak is peak − baseline: samples without block addresses on the measured device."""
    if memory.height == 0:
        return []
    got = _addressed(device_samples(memory.lazy())).filter(~pl.col("_addressed")).collect(**COLLECT)
    return sorted(got["rank"].to_list())


def transient_peak(stepped: pl.LazyFrame) -> pl.LazyFrame:
    """``rank, step, _transient``: per step window, the most bytes alive at once among the allocations made in it
    and freed in it. ``stepped``: the samples of one device per rank, ``_i`` numbering the trace's order rank by
    rank, with the step window each falls in (``step`` null outside every window)."""
    # each block's events in order: by address, then _i (rank by rank, in time); the next row is the block's next
    # event where it has the same rank, device and address (a sort and a shift: a window over a million addresses
    # is 20x slower)
    same = pl.all_horizontal(pl.col(c).shift(-1) == pl.col(c) for c in _BLOCK)
    nxt = {c: pl.when(same).then(pl.col(c).shift(-1)) for c in ("delta_bytes", "step", "_i")}
    pairs = (
        stepped.select(*_BLOCK, "_i", "delta_bytes", "step").filter(pl.col("addr").is_not_null())
        .sort("addr", "_i")
        .with_columns(_free_delta=nxt["delta_bytes"], _free_step=nxt["step"], _free_i=nxt["_i"])
        # an allocation whose next event at its address is its own free (else its free is not in the trace),
        # both in one step window
        .filter((pl.col("delta_bytes") > 0) & (pl.col("_free_delta") == -pl.col("delta_bytes"))
                & (pl.col("_free_step") == pl.col("step")))
    )
    moves = pl.concat([
        pairs.select("rank", "step", "_i", pl.col("delta_bytes").alias("_d")),
        pairs.select("rank", "step", pl.col("_free_i").alias("_i"), (-pl.col("delta_bytes")).alias("_d")),
    ])
    # In the trace's order a (rank, step)'s moves are contiguous (_i runs rank by rank, in time; steps are disjoint
    # windows) and sum to zero (each allocation with its free): one running sum is every step's live bytes.
    return (
        moves.sort("_i")
        .with_columns(pl.col("_d").cum_sum().alias("_live"))
        .group_by("rank", "step")
        .agg(pl.col("_live").max().alias("_transient"))
    )


def stage_memory(memory: pl.DataFrame, steps: pl.DataFrame, stages: pl.DataFrame) -> pl.DataFrame:
    """schema.STAGE_MEMORY: one row per (rank, step) that has allocator samples or a baseline before it."""
    if memory.height == 0:
        return conform(pl.DataFrame(), STAGE_MEMORY).clear()
    # _i: the trace's order, rank by rank (ingest sorts each rank stably by time: an allocation and its free at one
    # timestamp stay in the file's order; a table that is not so is sorted so, stably). Every sample with the step
    # window it falls in (step null outside), in time: made once (the lean optimizer does not share a subplan between
    # the queries below that read it).
    r, t = pl.col("rank").diff(), pl.col("ts_ns").diff()
    if not memory.select(((r > 0) | ((r == 0) & (t >= 0))).all()).item():
        memory = memory.sort("rank", "ts_ns", maintain_order=True)
    w = steps.lazy().select("rank", "step", "start_ns", "end_ns").sort("start_ns")
    stepped = (
        device_samples(memory.lazy().with_row_index("_i")).sort("ts_ns", maintain_order=True)
        .join_asof(w, left_on="ts_ns", right_on="start_ns", by="rank", strategy="backward", check_sortedness=False)
        .with_columns(pl.when(pl.col("ts_ns") < pl.col("end_ns")).then(pl.col("step")).alias("step"))
        .collect(**COLLECT).lazy()
    )
    before = (
        w.join_asof(stepped.select("rank", "ts_ns", "allocated_bytes"), left_on="start_ns", right_on="ts_ns",
                    by="rank", strategy="backward", allow_exact_matches=False, check_sortedness=False)
        .select("rank", "step", pl.col("allocated_bytes").alias("_before"))
    )
    inside = (
        stepped.filter(pl.col("step").is_not_null())
        .group_by("rank", "step", maintain_order=True)
        .agg(pl.col("allocated_bytes").max().alias("_peak"),
             (pl.col("allocated_bytes") - pl.col("delta_bytes")).first().alias("_first_before"))
    )
    out = (
        before.join(inside, on=["rank", "step"], how="full", coalesce=True)
        .with_columns(pl.coalesce("_before", "_first_before").alias("baseline_bytes"))
        .filter(pl.col("baseline_bytes").is_not_null())
        .with_columns(pl.max_horizontal("_peak", "baseline_bytes").alias("peak_bytes"))
        .join(transient_peak(stepped), on=["rank", "step"], how="left")
        .join(_addressed(stepped), on="rank", how="left")
        .with_columns(
            pl.when(pl.col("_addressed")).then(pl.col("_transient").fill_null(0))
            .otherwise(pl.col("peak_bytes") - pl.col("baseline_bytes")).alias("activation_peak_bytes"))
        .join(stages.lazy().select("rank", "stage"), on="rank", how="left")
    )
    return conform(out, STAGE_MEMORY).sort("rank", "step").collect(**COLLECT)
