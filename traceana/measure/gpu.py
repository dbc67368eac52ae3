"""What runs at once on a GPU: each phase's own GPU time next to the per-instant partition, time per stream, and
the kernels nothing explains that run beside compute (issue 26).

The attribution (traceana.measure.attribution) gives every instant one category, by priority: where a forward and a
backward kernel run at the same instant on two streams, the instant is the backward's (COMPUTE_ORDER), and where
communication runs under compute, compute's. That partition sums to the step; it does not say how much GPU time
each phase took. This module says it, per (rank, step):

- ``phase_time``: each compute phase's own GPU time — the union of the kernels launched inside its windows (the
  annotation whose CPU range holds the kernel's launch, found by correlation id: ``attribution.label_busy``) — and
  the part of it during which another phase's kernels ran too (overlapped), next to the partition's share;
- ``stream_time``: per GPU stream, the union of its compute, communication and memory-copy work, its idle time and
  the part of its busy time during which another stream was busy;
- ``concurrent_notes``: a note per stream whose compute kernels ran beside compute on another stream for a large
  share of the step: no rule called them communication, so they count as compute (DeepEP-like kernels under a name
  no rule knows would look so).

Only GPU ranks (their busy timeline is the GPU's); a CPU rank's thread runs one thing at a time.
"""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.names import PASS_PHASES
from traceana.core.units import NS_PER_MS

# (``shared_ns``: the step's time during which two or more phases ran, the same on every row of a (rank, step).)
PHASE_TIME = {"rank": pl.Int32, "step": pl.Int32, "phase": pl.String, "own_ns": pl.Int64, "overlapped_ns": pl.Int64,
              "shared_ns": pl.Int64}
STREAM_TIME = {"rank": pl.Int32, "step": pl.Int32, "stream": pl.Int32, "compute_ns": pl.Int64,
               "communication_ns": pl.Int64, "memcpy_ns": pl.Int64, "busy_ns": pl.Int64, "idle_ns": pl.Int64,
               "overlapped_ns": pl.Int64}
# What a GPU event's kind makes it in the per-stream breakdown.
COMMUNICATION_KINDS = ("collective", "p2p_send", "p2p_recv", "p2p_call", "bpipe_transfer")
MEMORY_KINDS = ("memcpy", "memset")
# A stream whose compute kernels ran beside compute on another stream for at least this share of the rank's step
# time is noted (concurrent_notes): below it, side streams' small kernels (a copy, a reduction) are ordinary.
CONCURRENT_NOTED_ABOVE = 0.05
# The share of a GPU rank's step during which two phases' kernels ran at once above which the overlap is shown
# (analyze's table): below it the partition is each phase's time to within that share.
OVERLAP_SHOWN_ABOVE = 0.01


def _in_steps(frame: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """``frame``'s intervals (``rank, start, end`` and others) cut to the steps, with ``step``."""
    windows = steps.select("rank", "step", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))
    return iv.clip(frame, windows, on="rank", window_keys="step", keep_order=False)


def phase_time(labelled: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """PHASE_TIME per (rank, step, phase) of GPU ranks, from ``attribution.label_busy``'s intervals."""
    gpu = labelled.filter(pl.col("is_gpu")).select("rank", "start", "end", pl.col("phase").cast(pl.String))
    if gpu.height == 0:
        return pl.DataFrame(schema=PHASE_TIME)
    per_phase, per_step = iv.coverage(_in_steps(gpu, steps), ["rank", "step"], "phase")
    return (per_phase.join(per_step.select("rank", "step", pl.col("overlapped_ns").alias("shared_ns")),
                           on=["rank", "step"])
            .cast(PHASE_TIME).select(list(PHASE_TIME)))


def gpu_work(events: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """GPU work (kernels, copies, memsets) cut to the steps: ``rank, stream, what, start, end, name, step``."""
    what = (pl.when(pl.col("kind").is_in(list(COMMUNICATION_KINDS))).then(pl.lit("communication"))
            .when(pl.col("kind").is_in(list(MEMORY_KINDS))).then(pl.lit("memcpy"))
            .when(pl.col("kind") == "compute").then(pl.lit("compute")))
    work = (events.lazy().filter(pl.col("is_gpu") & (pl.col("dur_ns") > 0))
            .select("rank", pl.col("stream").fill_null(-1), what.alias("what"), pl.col("ts_ns").alias("start"),
                    (pl.col("ts_ns") + pl.col("dur_ns")).alias("end"), "name")
            .filter(pl.col("what").is_not_null()).collect(**iv.COLLECT))
    return _in_steps(work, steps) if work.height else work.with_columns(pl.lit(None, pl.Int32).alias("step"))


def stream_time(events: pl.DataFrame, steps: pl.DataFrame, *, work: pl.DataFrame | None = None) -> pl.DataFrame:
    """STREAM_TIME per (rank, step, stream) of ranks with GPU work (``events``: classified, with ``stream``;
    ``work``: ``gpu_work(events, steps)``, if the caller has it)."""
    work = gpu_work(events, steps) if work is None else work
    if work.height == 0:
        return pl.DataFrame(schema=STREAM_TIME)
    work = work.drop("name")
    length = pl.col("end") - pl.col("start")
    by_what = (iv.merge(work, ["rank", "step", "stream", "what"])
               .group_by("rank", "step", "stream").agg(
                   *(length.filter(pl.col("what") == w).sum().alias(f"{w}_ns")
                     for w in ("compute", "communication", "memcpy"))))
    busy, _ = iv.coverage(work, ["rank", "step"], "stream")
    return (by_what.join(busy.rename({"own_ns": "busy_ns"}), on=["rank", "step", "stream"])
            .join(steps.select("rank", "step", "dur_ns"), on=["rank", "step"])
            .with_columns((pl.col("dur_ns") - pl.col("busy_ns")).alias("idle_ns"))
            .cast({k: v for k, v in STREAM_TIME.items()}).select(list(STREAM_TIME)).sort("rank", "step", "stream"))


def concurrent_notes(events: pl.DataFrame, steps: pl.DataFrame, *, work: pl.DataFrame | None = None) -> list[str]:
    """One note per (rank, stream) whose compute kernels ran beside compute on another of the rank's streams for
    at least ``CONCURRENT_NOTED_ABOVE`` of its step time (over all its steps): they count as compute, and if they
    are communication a name rule should say so (docs/naming.md)."""
    work = (gpu_work(events, steps) if work is None else work).filter(pl.col("what") == "compute")
    if work.height == 0 or work["stream"].n_unique() < 2:
        return []
    cut = work.drop("what", "name")
    per_stream, _ = iv.coverage(cut, ["rank"], "stream")
    # the rank's main compute stream (most compute time) is compute's own: the note is about the others
    main = per_stream.sort("own_ns", descending=True).unique("rank", keep="first").select("rank", pl.col("stream")
                                                                                         .alias("_main"))
    total = steps.group_by("rank").agg(pl.col("dur_ns").sum().alias("_steps"))
    hit = (per_stream.join(main, on="rank").join(total, on="rank")
           .filter((pl.col("stream") != pl.col("_main"))
                   & (pl.col("overlapped_ns") >= CONCURRENT_NOTED_ABOVE * pl.col("_steps")))
           .sort("rank", "overlapped_ns", descending=[False, True]))
    notes = []
    # one note per stream, over the ranks where it happened (a job of many ranks repeats itself)
    per = (hit.with_columns((pl.col("overlapped_ns") / pl.col("_steps")).alias("_share"))
           .group_by("stream").agg(pl.col("rank").sort(), pl.col("overlapped_ns").max(), pl.col("_share").min()
                                   .alias("_lo"), pl.col("_share").max().alias("_hi"))
           .sort("overlapped_ns", descending=True))
    for stream, ranks, ns, lo, hi in per.rows():  # one row per noted stream
        top = (work.filter(pl.col("rank").is_in(ranks) & (pl.col("stream") == stream))
               .group_by("name").agg((pl.col("end") - pl.col("start")).sum().alias("ns"))
               .sort("ns", descending=True).head(2))  # a few rows: one stream's distinct kernel names
        named = "; ".join(f"{str(n)[:60]}" for n in top["name"].to_list())
        share = f"{hi:.0%}" if f"{lo:.0%}" == f"{hi:.0%}" else f"{lo:.0%}–{hi:.0%}"
        who = (f"rank {ranks[0]}: {ns / NS_PER_MS:,.1f} ms" if len(ranks) == 1 else
               f"ranks {', '.join(map(str, ranks[:8]))}{' …' if len(ranks) > 8 else ''} ({len(ranks)} ranks): up to "
               f"{ns / NS_PER_MS:,.1f} ms a rank")
        notes.append(f"{who} of kernels on stream {stream} ({share} of {'its' if len(ranks) == 1 else 'their'} step "
                     f"time) overlap compute on another stream and were counted as compute (mostly {named}): add a "
                     "name rule (docs/naming.md) if they are communication")
    return notes


def batched_p2p_notes(events: pl.DataFrame) -> list[str]:
    """A note per rank whose send/receive kernels name no launching send or receive while its CPU posted P2P
    messages: batched P2P (``batch_isend_irecv``) launches one kernel per batch at ``ncclGroupEnd``, after the
    per-op scopes closed (pytorch/pytorch#194693), so those kernels cannot be paired; they count as collective."""
    kernels = events.lazy().filter(pl.col("is_gpu") & (pl.col("kind") == "collective") & pl.col("comm_dir").is_null()
                                   & names.name_test(pl.col("name"), lambda t: t.str.contains(r"(?i)send_?recv")))
    posting = events.lazy().filter(~pl.col("is_gpu") & pl.col("kind").is_in(["p2p_send", "p2p_recv"])).select(
        "rank").unique()
    hit = (kernels.join(posting, on="rank").group_by("rank").agg(pl.len().alias("n"), pl.col("dur_ns").sum())
           .sort("rank").collect(**iv.COLLECT))
    return [f"rank {r}: {n} send/receive kernels ({ns / NS_PER_MS:,.3f} ms) name no launching send or receive although "
            "the rank posted P2P messages (batched P2P, batch_isend_irecv, launches one kernel per batch after the "
            "per-op scopes closed): they count as collective, unpaired, with no wait/transfer split (docs/gpu.md)"
            for r, n, ns in hit.rows()]


# What every surface says of a run that is no pipeline (analyze's line, --json's summary.no_pipeline, the report).
NO_PIPELINE = ("no pipeline found: no rank has a stage (no run.json, no PP:/framework annotations, no P2P messages "
               "chaining ranks), so no bubble, stage, schedule or data-parallel replica figure applies")


def pipeline_found(stages: pl.DataFrame, schedule: pl.DataFrame, p2p: pl.DataFrame) -> bool:
    """Is this a pipeline at all: a rank with a known stage, a forward/backward in the schedule, or a matched P2P
    message? (Else no bubble, stage or schedule figure means anything: the summary gives none (``NO_PIPELINE``).)"""
    staged = "stage" in stages.columns and stages["stage"].drop_nulls().len() > 0
    passes = schedule.filter(pl.col("phase").is_in(list(PASS_PHASES))).height if schedule.height else 0
    return bool(staged or passes or p2p.height)


def _measured(frame: pl.DataFrame, steps: list[int] | tuple[int, ...]) -> pl.DataFrame:
    kept = frame.filter(pl.col("step").is_in(list(steps)))
    return kept if kept.height or not frame.height else frame


def phase_means(phase_time: pl.DataFrame, attribution: pl.DataFrame,
                steps: list[int] | tuple[int, ...]) -> pl.DataFrame:
    """Per (rank, phase), means per step over ``steps`` (the measured steps; all where none of them is there):
    ``own_ms`` (the phase's GPU time), ``overlapped_ms`` (of it, with another phase's kernels running), ``partition_ms``
    (what the per-instant attribution gave the phase) and ``shared_fraction``: the share of the rank's step during
    which two or more phases ran."""
    pt = _measured(phase_time, steps)
    if pt.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "phase": pl.String, "own_ms": pl.Float64,
                                    "overlapped_ms": pl.Float64, "partition_ms": pl.Float64,
                                    "shared_fraction": pl.Float64})
    att = attribution.select("rank", "step", pl.col("category").cast(pl.String).alias("phase"), "ns")
    shared = (pt.group_by("rank", "step").agg(pl.col("shared_ns").first())
              .join(att.group_by("rank", "step").agg(pl.col("ns").sum().alias("_step")), on=["rank", "step"])
              .group_by("rank").agg((pl.col("shared_ns").sum() / pl.col("_step").sum()).alias("shared_fraction")))
    n = pt.group_by("rank").agg(pl.col("step").n_unique().alias("_n"))
    return (pt.join(att, on=["rank", "step", "phase"], how="left")
            .group_by("rank", "phase").agg(pl.col("own_ns").sum(), pl.col("overlapped_ns").sum(),
                                           pl.col("ns").fill_null(0).sum())
            .join(n, on="rank").join(shared, on="rank")
            .select("rank", "phase", *((pl.col(c) / pl.col("_n") / NS_PER_MS).alias(m) for c, m in
                                       (("own_ns", "own_ms"), ("overlapped_ns", "overlapped_ms"),
                                        ("ns", "partition_ms"))), "shared_fraction")
            .sort("rank", "phase"))


def stream_means(stream_time: pl.DataFrame, steps: list[int] | tuple[int, ...]) -> pl.DataFrame:
    """Per (rank, stream), STREAM_TIME's figures in ms, means per step over ``steps`` (as ``phase_means``)."""
    st = _measured(stream_time, steps)
    cols = [c for c in STREAM_TIME if c.endswith("_ns") and c != "idle_ns"]
    # (a stream idle for a whole step has no row in it: the rank's steps are counted from all its rows)
    per_rank = (st.group_by("rank", "step").agg((pl.col("busy_ns") + pl.col("idle_ns")).first().alias("_dur"))
                .group_by("rank").agg(pl.len().alias("_n"), pl.col("_dur").mean().alias("_dur")))
    return (st.group_by("rank", "stream").agg(pl.col(c).sum() for c in cols).join(per_rank, on="rank")
            .with_columns(pl.col(c) / pl.col("_n") for c in cols)
            .with_columns((pl.col("_dur") - pl.col("busy_ns")).alias("idle_ns"))
            .select("rank", "stream", *((pl.col(c) / NS_PER_MS).alias(c.replace("_ns", "_ms")) for c in STREAM_TIME
                                        if c.endswith("_ns")))
            .sort("rank", "stream"))


# --- HTA's GPU views, pipeline-aware (issue 36 Build 3) -------------------------------------------------------------
# HolisticTraceAnalysis (HTA 0.5.0, hta/analyzers/breakdown_analysis.py and communication_analysis.py) reads a GPU
# trace as: kernel types (communication: NCCL kernels; memory: copies and memsets; computation: the rest), the share
# of communication time during which computation ran (get_comm_comp_overlap), and each stream's idle time between
# consecutive kernels split by why (get_idle_time_breakdown): "host wait" where the next kernel's launch call began
# only after the previous kernel ended (the CPU was late), "kernel wait" where the launch came earlier and the gap is
# under KERNEL_WAIT_BELOW_NS (back-to-back launch overhead), "other" for the rest (waiting on an event, another
# stream). The same figures here, from the classified events (a kernel's type is its kind: classify's rules, so a
# name rule's communication kernels count as communication), per rank, per stream and per stage, and the top
# kernels of each pipeline phase (the phase whose schedule window holds the kernel's launch).
KERNEL_TYPES = {"computation": ("compute",), "communication": COMMUNICATION_KINDS, "memory": MEMORY_KINDS}
KERNEL_WAIT_BELOW_NS = 30_000  # HTA's consecutive_kernel_delay default, 30 in the trace's unit (µs in Kineto's JSON)
TOP_KERNELS = 5  # kernels listed per (rank, phase)


def gpu_kernels(events: pl.DataFrame, steps: pl.DataFrame | None = None) -> pl.DataFrame:
    """Every kernel, copy and memset: ``rank, stream, type, name, start, end, launch_ns`` (the start of the runtime
    call that launched it, null if none is in the trace), cut to ``steps`` when given (with ``step``)."""
    type_of = pl.lit(None, pl.String)
    for t, kinds in reversed(KERNEL_TYPES.items()):
        type_of = pl.when(pl.col("kind").is_in(list(kinds))).then(pl.lit(t)).otherwise(type_of)
    k = (events.lazy().filter(pl.col("is_gpu") & (pl.col("dur_ns") > 0))
         .select("rank", pl.col("stream").fill_null(-1), type_of.alias("type"), pl.col("name").cast(pl.String),
                 pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end"),
                 pl.when(pl.col("launch_ns") != pl.col("ts_ns")).then(pl.col("launch_ns")).alias("launch_ns"))
         .filter(pl.col("type").is_not_null()).collect(**iv.COLLECT))
    return _in_steps(k, steps) if steps is not None and k.height else k


def kernel_type_breakdown(kernels: pl.DataFrame) -> pl.DataFrame:
    """``rank, type, ns, fraction``: each type's summed kernel time and its share of the rank's (HTA's kernel type
    breakdown: durations summed, so kernels running at once on two streams both count)."""
    d = kernels.group_by("rank", "type").agg((pl.col("end") - pl.col("start")).sum().alias("ns"))
    return (d.with_columns((pl.col("ns") / pl.col("ns").sum().over("rank")).alias("fraction"))
            .sort("rank", "ns", descending=[False, True]))


def comm_comp_overlap(kernels: pl.DataFrame, by: list[str] | None = None) -> pl.DataFrame:
    """``by + [communication_ns, overlapped_ns, overlap_pct]``: the union of communication kernels' time and the
    part of it during which a computation kernel ran on any stream of the rank, in percent (HTA's
    comp_comm_overlap_pctg); ``by`` ["rank"] (default) or ["rank", "stream"] (the communication of one stream)."""
    by = by or ["rank"]
    comm = kernels.filter(pl.col("type") == "communication")
    comp = iv.merge(kernels.filter(pl.col("type") == "computation"), "rank")
    comm_u = iv.merge(comm, by)
    both = iv.intersect(comm_u, comp, "rank") if len(by) == 1 else iv.intersect(
        comm_u, comp.join(comm_u.select("rank", "stream").unique(), on="rank"), by)
    length = (pl.col("end") - pl.col("start")).sum()
    total = comm_u.group_by(by).agg(length.alias("communication_ns"))
    over = both.group_by(by).agg(length.alias("overlapped_ns"))
    return (total.join(over, on=by, how="left").with_columns(pl.col("overlapped_ns").fill_null(0))
            .with_columns((100 * pl.col("overlapped_ns") / pl.col("communication_ns")).alias("overlap_pct"))
            .sort(by))


def idle_breakdown(kernels: pl.DataFrame) -> pl.DataFrame:
    """``rank, stream, host_wait_ns, kernel_wait_ns, other_ns, idle_ns``: each stream's gaps between consecutive
    kernels (copies and memsets count as kernels), split as HTA's get_idle_time_breakdown does (module comment)."""
    k = kernels.sort("rank", "stream", "start").with_columns(
        pl.col("end").shift(1).over("rank", "stream").alias("_prev_end"))
    k = k.filter(pl.col("_prev_end").is_not_null()).with_columns((pl.col("start") - pl.col("_prev_end")).alias("_gap"))
    host = pl.col("launch_ns").is_not_null() & (pl.col("launch_ns") > pl.col("_prev_end"))
    kernel = ~host & (pl.col("_gap") < KERNEL_WAIT_BELOW_NS)
    gap = pl.col("_gap").clip(lower_bound=0)
    return (k.group_by("rank", "stream").agg(gap.filter(host).sum().alias("host_wait_ns"),
                                              gap.filter(kernel).sum().alias("kernel_wait_ns"),
                                              gap.filter(~host & ~kernel).sum().alias("other_ns"),
                                              gap.sum().alias("idle_ns"))
            .sort("rank", "stream"))


def top_kernels(kernels: pl.DataFrame, schedule: pl.DataFrame, *, n: int = TOP_KERNELS) -> pl.DataFrame:
    """``rank, phase, name, ns, count, fraction``: the ``n`` kernels taking the most time in each phase of each rank
    (``fraction`` of the phase's kernel time). A kernel's phase is the schedule window (forward, backward, W, …,
    optimizer) holding its launch on its rank; communication kernels are "communication", kernels launched outside
    every window "other"."""
    k = kernels.with_columns(pl.coalesce("launch_ns", "start").alias("_at"))
    windows = (schedule.select("rank", "phase", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))
               .filter(pl.col("end") > pl.col("start")))
    if windows.height:
        phase = iv.containing(k, "_at", windows.sort("rank", "start"), by="rank", columns=["phase"])["phase"]
    else:
        phase = pl.repeat(None, k.height, dtype=pl.String, eager=True)
    k = k.with_columns(pl.when(pl.col("type") == "communication").then(pl.lit("communication"))
                       .otherwise(pl.lit(phase).fill_null("other")).alias("phase"))
    per = (k.group_by("rank", "phase", "name").agg((pl.col("end") - pl.col("start")).sum().alias("ns"),
                                                   pl.len().alias("count"))
           .with_columns((pl.col("ns") / pl.col("ns").sum().over("rank", "phase")).alias("fraction")))
    return (per.sort("rank", "phase", "ns", descending=[False, False, True])
            .group_by("rank", "phase", maintain_order=True).head(n))


def gpu_views(analysis) -> dict:
    """HTA's views of a run's GPU ranks over its measured steps (module comment), times in ms per step and shares as
    fractions (JSON's units): ``kernel_types``, ``overlap`` (per rank, with its stage: ``overlap_fraction`` is HTA's
    comp_comm_overlap_pctg / 100), ``overlap_by_stream``, ``overlap_by_stage`` (the stage's ranks together), ``idle``
    (per rank and stream) and ``top_kernels`` per phase; empty for a run with no GPU work or no events."""
    if analysis.events is None:
        return {}
    steps = analysis.steps.filter(pl.col("step").is_in(list(analysis.summary.steps)))
    k = gpu_kernels(analysis.events, steps if steps.height else None)
    if k.height == 0:
        return {}
    n = steps.group_by("rank").agg(pl.len().alias("_n")) if steps.height else \
        k.select("rank").unique().with_columns(pl.lit(1).alias("_n"))
    stage = analysis.stages.select(pl.col("rank").cast(pl.Int32), "stage", "stages")
    def per_step(f: pl.DataFrame, cols: list[str]) -> pl.DataFrame:  # ms per step; percentages as fractions (JSON)
        f = f.join(n, on="rank").with_columns(
            *((pl.col(c) / pl.col("_n") / NS_PER_MS).alias(c.replace("_ns", "_ms")) for c in cols)).drop(*cols, "_n")
        return fraction(f)

    def fraction(f: pl.DataFrame) -> pl.DataFrame:
        return (f.with_columns((pl.col("overlap_pct") / 100).alias("overlap_fraction")).drop("overlap_pct")
                if "overlap_pct" in f.columns else f)

    ov = comm_comp_overlap(k)
    by_stage = (ov.join(stage, on="rank", how="left").group_by("stage")
                .agg(pl.col("communication_ns", "overlapped_ns").sum(), pl.col("rank").sort().alias("ranks"))
                .with_columns((100 * pl.col("overlapped_ns") / pl.col("communication_ns")).alias("overlap_pct"))
                .sort("stage", nulls_last=True))
    return {
        "kernel_types": per_step(kernel_type_breakdown(k), ["ns"]).to_dicts(),
        "overlap": per_step(ov.join(stage, on="rank", how="left"), ["communication_ns", "overlapped_ns"]).to_dicts(),
        "overlap_by_stream": per_step(comm_comp_overlap(k, ["rank", "stream"]),
                                      ["communication_ns", "overlapped_ns"]).to_dicts(),
        "overlap_by_stage": fraction(by_stage.with_columns(pl.col("ranks").cast(pl.List(pl.Int64))).drop(
            "communication_ns", "overlapped_ns")).to_dicts(),
        "idle": per_step(idle_breakdown(k), ["host_wait_ns", "kernel_wait_ns", "other_ns", "idle_ns"]).to_dicts(),
        "top_kernels": per_step(top_kernels(k, analysis.schedule), ["ns"]).to_dicts(),
    }
