"""Per-rank time structure: steps, the training thread, the busy timeline and clock alignment.

- Steps are ``ProfilerStep#N`` spans on the CPU (the profiler's own step markers). A rank without any gets the whole
  trace as one step ``-1``, and a note says so.
- Busy: on a rank with GPU work, kernels/memcpy/memset on the GPU (NCCL kernels are communication, not busy);
  on a CPU-only rank, the training thread's compute cpu_ops (communication posts and blocking waits excluded —
  gloo's wait() records no cpu_op, so the gap it leaves is idle and is explained later by the P2P spans).
- Clocks: ranks on one host share the wall clock (docs/field-notes.md), so offsets are zero. Across hosts a per-rank
  offset is estimated from matched P2P pairs: a receive cannot complete before its send started, i.e.
  ``send_start_ns + o[src] <= recv_end_ns + o[dst]``; the smallest corrections satisfying all pairs are the shortest
  paths of that difference-constraint system (Bellman–Ford over ranks, not events), and where messages in both
  directions bound a rank, its offset is taken from the interval they allow (``_mid_offsets``): a round one where
  the interval holds one far rounder than its width (0, a whole number of seconds: ``_offset_in``), else the middle.
"""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.errors import BadInputError
from traceana.core.schema import STEPS, conform
from traceana.core.units import NS_PER_MS
from traceana.measure.p2p import pipeline_groups

WHOLE_TRACE_STEP = -1


def steps(events: pl.DataFrame) -> tuple[pl.DataFrame, list[str]]:
    """schema.STEPS from ProfilerStep spans, with a whole-trace fallback per rank that has none."""
    notes: list[str] = []
    marked = (  # (a few queries, docs/performance.md "Fixed cost")
        events.lazy().filter((pl.col("kind") == "step") & ~pl.col("is_gpu"))
        .with_columns(_n=names.text(pl.col("name")).str.extract(names.STEP_PATTERN, 1))
        .with_columns(step=pl.col("_n").cast(pl.Int32, strict=False))
        .group_by("rank", "step")
        .agg(pl.col("ts_ns").min().alias("start_ns"), (pl.col("ts_ns") + pl.col("dur_ns")).max().alias("end_ns"),
             _beyond=(pl.col("_n").is_not_null() & pl.col("step").is_null()).any())
        .collect(**iv.COLLECT)
    )
    if marked["_beyond"].any():  # a number beyond Int32 (ProfilerStep#99999999999999999999): no profiler's
        bad = marked.filter(pl.col("_beyond")).row(0, named=True)
        raise BadInputError(f"rank {bad['rank']} has a ProfilerStep span numbered beyond {2**31 - 1:,} (the profiler "
                            "counts steps from 0): not a profiler's step marker", fix="re-export the trace, or "
                            "rename the span (the names of steps must be ProfilerStep#N, N a step count)")
    marked = marked.drop("_beyond")
    missing = (events.lazy().select("rank").unique().join(marked.lazy().select("rank").unique(), on="rank", how="anti")
               .collect(**iv.COLLECT))
    if missing.height:
        extent = (
            events.join(missing, on="rank")
            .group_by("rank")
            .agg(pl.col("ts_ns").min().alias("start_ns"), (pl.col("ts_ns") + pl.col("dur_ns")).max().alias("end_ns"))
            .with_columns(pl.lit(WHOLE_TRACE_STEP, pl.Int32).alias("step"))
        )
        ranks = ", ".join(str(r) for r in sorted(missing["rank"].to_list()))
        if marked.height:
            notes.append(f"ranks {ranks} have no ProfilerStep spans while others do: each is analysed as one "
                         f"step {WHOLE_TRACE_STEP} covering its whole trace, not comparable step by step")
        else:
            notes.append(f"no ProfilerStep spans in any trace: each rank's whole trace is analysed as one step "
                         f"{WHOLE_TRACE_STEP} (profile with torch.profiler.schedule and prof.step() for per-step "
                         "results)")
        marked = pl.concat([marked, extent.select(marked.columns)], how="vertical_relaxed")
    out = conform(marked.lazy().with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("dur_ns")), STEPS)
    out, per_rank = pl.collect_all([
        out.sort("rank", "step"),
        out.filter(pl.col("step") != WHOLE_TRACE_STEP).group_by("rank").agg(pl.col("step").sort().alias("s")),
    ], **iv.COLLECT)
    if per_rank.height and per_rank["s"].n_unique() > 1:
        out, n = _renumber_by_time(out)
        notes += n
        per_rank = (out.filter(pl.col("step") != WHOLE_TRACE_STEP).group_by("rank")
                    .agg(pl.col("step").sort().alias("s")))
        if per_rank["s"].n_unique() > 1:
            notes.append("ranks recorded different ProfilerStep numbers; steps are compared only where numbers match")
    return out, notes


def _renumber_by_time(table: pl.DataFrame) -> tuple[pl.DataFrame, list[str]]:
    """Ranks whose profilers numbered the same steps apart (rank 1's ProfilerStep#3 running while rank 0's #2 does:
    one called prof.step() once more, or started profiling a step later) get the lowest rank's numbers, where that
    is unambiguous: every step of the rank that overlaps one of the reference rank's (by more than half the shorter
    of the two) overlaps exactly one, all at the same distance in numbers. Steps are paired by number everywhere
    else (P2P messages, the measured steps), so numbers apart pair one step's sends with another's receives."""
    real = table.filter(pl.col("step") != WHOLE_TRACE_STEP)
    ref_rank = real["rank"].min()
    ref = real.filter(pl.col("rank") == ref_rank).select(
        pl.col("step").alias("_ref"), pl.col("start_ns").alias("_rs"), pl.col("end_ns").alias("_re"))
    hits = (
        real.filter(pl.col("rank") != ref_rank).join(ref, how="cross")
        .filter(pl.min_horizontal("end_ns", "_re") - pl.max_horizontal("start_ns", "_rs")
                > 0.5 * pl.min_horizontal(pl.col("end_ns") - pl.col("start_ns"), pl.col("_re") - pl.col("_rs")))
        .with_columns((pl.col("_ref") - pl.col("step")).alias("_by"))
    )
    per_step = hits.group_by("rank", "step").agg(pl.len().alias("n"))
    per_rank = (hits.group_by("rank").agg(pl.col("_by").unique().alias("by"))
                .join(per_step.group_by("rank").agg((pl.col("n") > 1).any().alias("twice")), on="rank")
                .filter((pl.col("by").list.len() == 1) & ~pl.col("twice"))
                .select("rank", pl.col("by").list.first().alias("_by")).filter(pl.col("_by") != 0).sort("rank"))
    if per_rank.height == 0:
        return table, []
    out = (table.join(per_rank, on="rank", how="left")
           .with_columns(pl.when(pl.col("step") != WHOLE_TRACE_STEP).then(pl.col("step") + pl.col("_by").fill_null(0))
                         .otherwise(pl.col("step")).cast(pl.Int32).alias("step"))
           .drop("_by").sort("rank", "step"))
    moved = "; ".join(f"rank {r} {abs(b)} {'higher' if b < 0 else 'lower'}" for r, b in per_rank.rows())
    return out, [f"ranks numbered the same ProfilerSteps apart (by the times they ran: {moved} than rank {ref_rank}): "
                 f"their steps are renumbered to rank {ref_rank}'s, so that each step is compared and its P2P "
                 "messages paired across ranks"]


def assign_steps(events: pl.DataFrame, step_table: pl.DataFrame) -> pl.DataFrame:
    """Add ``step``: the step window (of the same rank) containing the event's start; null outside all steps."""
    hit = iv.containing(events, "ts_ns", step_table, by="rank", columns=["step"], start="start_ns", end="end_ns")
    return events.with_columns(hit["step"].cast(pl.Int32))


def training_tracks(events: pl.DataFrame) -> pl.DataFrame:
    """``rank, track``: the CPU thread driving training — the one holding ProfilerStep spans, else the busiest
    (``events`` may be a LazyFrame: one query either way)."""
    cpu = events.lazy().select("rank", "track", "kind", "dur_ns", "is_gpu").filter(~pl.col("is_gpu"))
    by_steps = (
        cpu.filter(pl.col("kind") == "step").group_by("rank", "track").agg(pl.len().alias("n"))
        .sort("rank", "n", "track", descending=[False, True, False]).unique("rank", keep="first")
        .select("rank", "track")
    )
    busiest = (
        cpu.filter(pl.col("kind") == "compute").group_by("rank", "track").agg(pl.col("dur_ns").sum().alias("n"))
        .sort("rank", "n", "track", descending=[False, True, False]).unique("rank", keep="first")
        .select("rank", "track")
    )
    return (pl.concat([by_steps, busiest.join(by_steps, on="rank", how="anti")]).sort("rank")
            .collect(**iv.COLLECT))


_GPU_BUSY = pl.col("is_gpu") & pl.col("kind").is_in(["compute", "memcpy", "memset"])


def gpu_ranks(events: pl.DataFrame) -> pl.DataFrame:
    """``rank``s whose traces hold GPU kernels: their busy timeline is the GPU's."""
    return events.select(pl.col("rank").filter(_GPU_BUSY).unique().sort())


def busy_events(events: pl.DataFrame) -> pl.DataFrame:
    """The events that make a rank busy (see module doc): ``rank, track, is_gpu, kind, launch_ns, start, end``."""
    # The columns first, then the filters: a filter of the events copies every column of the rows it keeps.
    # (Three queries, docs/performance.md "Fixed cost".)
    busy = events.lazy().select("rank", "track", "is_gpu", "kind", "launch_ns", "ts_ns", "dur_ns")
    cols = ["rank", "track", "is_gpu", "kind", "launch_ns", pl.col("ts_ns").alias("start"),
            (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")]
    on_gpu_rank = pl.col("rank").is_in(gpu_ranks(events)["rank"].implode())
    on_gpu = busy.filter(on_gpu_rank & _GPU_BUSY).select(cols)
    tracks = training_tracks(busy.select("rank", "track", "kind", "dur_ns", "is_gpu").filter(~on_gpu_rank))
    on_cpu = busy.filter(~on_gpu_rank & (pl.col("kind") == "compute")).select(cols).join(
        tracks.lazy(), on=["rank", "track"], maintain_order="left")
    return pl.concat([on_gpu, on_cpu]).collect(**iv.COLLECT)


def shift(frame: pl.DataFrame, offsets: pl.DataFrame, columns: list[str], *, rank: str = "rank") -> pl.DataFrame:
    """Add each rank's clock offset to the given time columns."""
    if offsets.height == 0 or offsets["offset_ns"].abs().max() == 0:
        return frame
    o = offsets.select(pl.col("rank").alias(rank), "offset_ns")
    return (
        frame.join(o, on=rank, how="left")
        .with_columns(pl.col(c) + pl.col("offset_ns").fill_null(0) for c in columns)
        .drop("offset_ns")
    )


def clock_offsets(pairs: pl.DataFrame, ranks: list[int], *, same_host: bool | None) -> tuple[pl.DataFrame, list[str]]:
    """``rank, offset_ns, source`` from matched P2P pairs (schema.P2P) — see module doc."""
    schema = {"rank": pl.Int32, "offset_ns": pl.Int64, "source": pl.String}
    zero = pl.DataFrame({"rank": ranks, "offset_ns": [0] * len(ranks)}, schema={"rank": pl.Int32,
                                                                                 "offset_ns": pl.Int64})
    if same_host:
        return zero.with_columns(pl.lit("same host").alias("source")), []
    if pairs.height == 0:
        return zero.with_columns(pl.lit("none (no matched P2P pairs)").alias("source")), []
    # Tightest constraint per directed rank pair: o[src] - o[dst] <= min(recv_end_ns - send_start_ns).
    edges = pairs.group_by("src", "dst").agg((pl.col("recv_end_ns") - pl.col("send_start_ns")).min().alias("c"))
    if edges["c"].min() >= 0:
        return zero.with_columns(pl.lit("consistent (no correction needed)").alias("source")), []
    rows = edges.rows()
    dist = _relaxed(rows, {r: 0 for r in ranks})
    if dist is None:
        return zero.with_columns(pl.lit("inconsistent (left uncorrected)").alias("source")), [
            "P2P timings contradict each other across ranks (a cycle of impossible orderings): clocks left as recorded"]
    base = dist[min(ranks)]
    offset = _mid_offsets(rows, ranks, {r: dist[r] - base for r in ranks})
    out = pl.DataFrame({"rank": ranks, "offset_ns": [offset[r] for r in ranks]},
                       schema={"rank": pl.Int32, "offset_ns": pl.Int64})
    worst = int(out["offset_ns"].abs().max())
    return out.with_columns(pl.lit("p2p constraints").alias("source")).select(list(schema)), [
        f"clocks differ across ranks: corrected by up to {worst / NS_PER_MS:.3f} ms from P2P ordering constraints"]


# GPU work that ends this long after its step's ProfilerStep span (as a share of the step) is reported: the CPU
# ran ahead of the GPU (no synchronisation in the step), so the CPU windows the steps are cut by hold other steps'
# GPU work, and the last step's overrun lies outside every window.
GPU_LAG_NOTED_ABOVE = 0.05


def gpu_lag_notes(busy: pl.DataFrame, step_table: pl.DataFrame) -> list[str]:
    """A note per GPU rank whose work launched inside a step ran past that step's end (``busy``: ``busy_events``).
    Steps are the CPU's ProfilerStep spans; the GPU's view of a step (its kernels) is cut by them."""
    gpu = busy.filter(pl.col("is_gpu"))
    if gpu.height == 0:
        return []
    windows = step_table.filter(pl.col("step") != WHOLE_TRACE_STEP)
    hit = iv.containing(gpu, "launch_ns", windows, by="rank", columns=["step", "end_ns", "dur_ns"],
                        start="start_ns", end="end_ns")
    late = (
        pl.concat([gpu.select("rank", "end"), hit], how="horizontal")
        .filter(pl.col("step").is_not_null() & (pl.col("dur_ns") > 0))
        .group_by("rank", "step").agg((pl.col("end") - pl.col("end_ns")).max().alias("over"), pl.col("dur_ns").first())
        .filter(pl.col("over") > GPU_LAG_NOTED_ABOVE * pl.col("dur_ns"))
        .sort("rank", "over", descending=[False, True]).unique("rank", keep="first").sort("rank")
    )
    last = windows.group_by("rank").agg(pl.col("end_ns").max().alias("_last"))
    tail = (gpu.join(last, on="rank").filter(pl.col("end") > pl.col("_last"))
            .group_by("rank").agg((pl.col("end") - pl.max_horizontal("start", "_last")).sum().alias("tail")))
    tails = dict(tail.rows())
    return [f"rank {r}: GPU work launched in step {s} ran until {over / NS_PER_MS:.3f} ms after its ProfilerStep span ended "
            f"({over / dur:.0%} of the step; the CPU ran ahead of the GPU): steps are cut by the CPU's spans, so each "
            "step's figures hold part of earlier steps' GPU work, and the step time is the CPU's"
            + (f"; {tails[r] / NS_PER_MS:.3f} ms of GPU work after the last step is in no step" if tails.get(r) else "")
            for r, s, over, dur in late.rows()]


def _relaxed(edges: list[tuple[int, int, int]], start: dict[int, float]) -> dict[int, float] | None:
    """The largest values, at most ``start``, with ``v[a] ≤ v[b] + c`` for every edge ``(a, b, c)`` among start's
    ranks: Bellman–Ford over ranks, not events (len(start) rounds); None where the edges hold a cycle of negative
    total (no such values: impossible orderings)."""
    v = dict(start)
    for _ in range(len(v)):
        changed = False
        for a, b, c in edges:
            if a in v and b in v and v[b] + c < v[a]:
                v[a], changed = v[b] + c, True
        if not changed:
            return v
    return None


def _mid_offsets(edges: list[tuple[int, int, int]], ranks: list[int], smallest: dict[int, int]) -> dict[int, int]:
    """Each rank's offset from its group's first rank's clock: the middle of the interval the pairs allow it, where
    messages in both directions bound it (``edges``: ``src, dst, c`` with ``o[src] − o[dst] ≤ c``). The smallest
    correction (``smallest``: the shortest paths) sits at an end of that interval, where the tightest message in one
    direction took no time at all and its waiting and transfer are split as if it had; the middle is at most half
    the interval from the truth (the estimate NTP makes from a round trip). A rank bounded on one side only, or
    middles that together break a pair, keep ``smallest``."""
    # per group of ranks joined by messages, from its first rank (as the group's analysis alone has it)
    peers: dict[int, list[int]] = {r: [] for r in ranks}
    for src, dst, _ in edges:
        if src in peers:
            peers[src].append(dst)
    inf = float("inf")
    start = {r: (0 if r == g[0] else inf) for g in pipeline_groups(peers) for r in g}
    hi = _relaxed(edges, start)  # the most each offset may be: o[src] ≤ o[dst] + c
    below = _relaxed([(dst, src, c) for src, dst, c in edges], start)  # −(the least): o[dst] ≥ o[src] − c
    if hi is None or below is None:
        return smallest
    mid = {r: (_offset_in(int(-below[r]), int(hi[r])) if below[r] < inf and hi[r] < inf else smallest[r])
           for r in ranks}
    if all(mid[s] - mid[d] <= c for s, d, c in edges if s in mid and d in mid):
        return mid
    return smallest


# A round offset is taken from the interval the messages allow only when its unit is this many times the interval's
# width: a clock offset that is not round (hosts never synchronised) falls on such a multiple by chance with
# probability width / unit, under 1 %, and then is still within the interval (off by at most its width).
ROUND_UNIT_OVER_WIDTH = 100


def _offset_in(lo: int, hi: int) -> int:
    """The offset taken from ``[lo, hi]``, the interval the messages allow (ns): a round one where there is one —
    a multiple of a power of ten at least ROUND_UNIT_OVER_WIDTH times the interval's width (0 when the clocks agree,
    a whole number of seconds when a clock was set or a copy shifted by hand) — else the middle. Round offsets are
    what clocks set by hand, time zones, leap seconds and shifted copies differ by; the middle would take a copy
    shifted by exactly 10 s back by 10 s less half the messages' asymmetry (1.4 ms on a reference-trainer run), so
    the copy's figures were not its original's."""
    unit = 10 ** 18
    while unit >= ROUND_UNIT_OVER_WIDTH * max(hi - lo, 1):
        k = -(-lo // unit) * unit  # the first multiple at or above lo (unit > the width: at most one fits)
        if k <= hi:
            return k
        unit //= 10
    return (lo + hi) // 2
