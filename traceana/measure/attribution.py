"""Where each (rank, step)'s wall time goes: schema.CATEGORIES, disjoint, summing exactly to the step.

Every instant of a step gets the first category (in this priority order) whose intervals cover it
(docs/architecture.md: compute > collective > bpipe > p2p > idle):

1. compute — the rank is busy (timeline.busy_events); split by the schedule window the work was launched in:
   ``recompute`` (inside B) > ``optimizer`` > ``backward`` / ``backward_input`` / ``backward_weight`` >
   ``forward`` > ``other_compute`` (no window);
2. ``collective`` — a collective op, span or kernel of the rank is running;
3. ``bpipe`` — inside an EVICT/LOAD/ACCEPT/RETURN span or a BPipe op (or, on ranks without those annotations, while
   a BPipe message — either side classified as BPipe — is in flight);
4. ``p2p`` — a P2P message is moving bytes (after ``data_ready_ns``: the peer's send had started and the receiver
   had posted, moved by traceana.measure.p2p's floor and, between CPU ranks, its ceiling: bytes over the slowest
   plausible link plus a message's latency — a gloo receive returning later than that waited on its peer's process), or
   a CPU rank is inside a P2P post call for its message's own cost (docs/schedules.md "Waiting or transfer");
5. waiting on a peer — before ``data_ready_ns`` of a message (or anywhere in an unmatched one), including a post
   call blocked there beyond its message's cost: a bubble by the
   pipeline rules' windows (``pipeline_rules.bubble_windows``): ``bubble_warmup`` before the stage's first forward
   of the step, ``bubble_cooldown`` after its last forward (the drain: only backward work is left, so waits are the
   pipeline emptying), ``bubble_stall`` in between;
6. on a CPU rank, the rest of a framework's P2P helper (a span a name rule calls ``p2p_call``: Megatron's
   ``send_forward``, DeepSpeed's ``SendActivation``, …): ``p2p`` — the helper's own Python (building the ops,
   allocating receive buffers) is the cost of its transfers; then the rest of an annotated compute action's window
   (PP: span, GPipe's ``Forward {i}``, the optimizer step): that action's phase — see "Blocked or computing" below;
7. ``host`` — idle that no dependency explains (Python, data loading, launch overhead).

Blocked or computing (asynchronous P2P): a message's span runs from its post to the return of its ``wait()``, and
schedules post receives (and sends) ahead and wait on them later, so most of that span the thread is doing other
work. The rule (docs/schedules.md, measured there against wall-clock timers): a CPU rank is blocked while inside a
P2P call (the post op, e.g. ``c10d::send``, which under gloo can itself take milliseconds: transfer or waiting as
item 4/5 say), and on a message only
from the last moment its training thread was seen active (the start or end of any op, annotation or post of it, or
another wait returning) before the message's wait returned — a thread blocked in ``wait()`` records nothing — to
that return, never before the post; a mark less than ``WAIT_RETURN_TOLERANCE_NS`` before the return is not taken
for activity (the next op's start a few µs early, on timelines converted from other tools, would otherwise make the
wait a few µs long and the time before it host). Before that the message is in flight in the background and the
thread is computing, or running the Python of the action it is inside: inside a compute action's window, time no op
covers and no wait explains counts as that action (its own interpreter and dispatch cost, which a wall-clock timer
around the action also counts). GPU ranks keep the GPU's view: a transfer overlapping no kernel is exposed, whatever the
CPU was doing.

Cool-down starts after the stage's last *forward*, not its last backward: in 1F1B the first stage finishes the pipeline's very last backward, so "after its last backward" would
leave it no cooldown at all, while its waits between the final p−1 backwards are exactly the drain bubble
(Narayanan et al. 2021, §2.2, Fig. 4).
"""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names, pipeline_rules
from traceana.core.pipeline_rules import bubble_windows
from traceana.core.schema import ATTRIBUTION, CATEGORIES, Category, conform
from traceana.measure.timeline import training_tracks

# Compute phases in the order they win where windows nest (recompute runs inside a backward).
COMPUTE_ORDER = ("recompute", "optimizer", "backward", "backward_input", "backward_weight", "forward", "other_compute")

SEGMENTS = {"rank": pl.Int32, "step": pl.Int32, "category": Category, "start_ns": pl.Int64, "end_ns": pl.Int64}
# A busy interval's phase: one byte, not a text column, and its code is the phase's place in COMPUTE_ORDER (the
# compute layers' priority in segments).
Phase = pl.Enum(list(COMPUTE_ORDER))


def _by(frame: pl.DataFrame, column: str, values) -> dict[str, pl.DataFrame]:
    """The rows of ``frame`` (without ``column``) for each of ``values`` of ``column``, in their order; empty where
    none: one pass instead of a filter per value (docs/performance.md "Fixed cost")."""
    parts = frame.partition_by(column, as_dict=True, include_key=False)
    empty = pl.DataFrame(schema={c: t for c, t in frame.schema.items() if c != column})
    return {v: parts.get((v,), empty) for v in values}


def _span(frame: pl.DataFrame, start: str = "ts_ns", end: pl.Expr | None = None) -> pl.DataFrame:
    e = (pl.col("ts_ns") + pl.col("dur_ns")) if end is None else end
    return frame.select("rank", pl.col(start).alias("start"), e.alias("end"))


def label_busy(busy: pl.DataFrame, schedule: pl.DataFrame) -> pl.DataFrame:
    """Busy events' ``rank, is_gpu, start, end`` with ``phase`` (``Phase``): the schedule window (same rank)
    containing the launch time, recompute winning over the backward it is nested in; ``other_compute`` when none
    contains it. ``window_start`` says which window (its ``start_ns``), so that GPU work can be traced back to the
    schedule row that launched it. (Only the columns later steps read: the busy kernels of a large run are hundreds
    of thousands.)"""
    def containing(windows: pl.DataFrame) -> pl.DataFrame:
        return iv.containing(busy, "launch_ns", windows, by="rank", columns=["phase", "start_ns"], start="start_ns",
                             end="end_ns").rename({"start_ns": "window_start"})

    w = schedule.select("rank", "start_ns", "end_ns", pl.col("phase").cast(Phase))
    outer = containing(w.filter(pl.col("phase") != "recompute"))
    inner = containing(w.filter(pl.col("phase") == "recompute"))
    return busy.select(
        "rank", "is_gpu", "start", "end",
        pl.coalesce(inner["phase"], outer["phase"], pl.lit("other_compute", Phase)).alias("phase"),
        pl.coalesce(inner["window_start"], outer["window_start"]).alias("window_start"),
    )


def gpu_schedule_extents(schedule: pl.DataFrame, labelled: pl.DataFrame) -> pl.DataFrame:
    """Schedule rows of GPU ranks span the GPU work they launched (first kernel start to last kernel end), not the
    CPU range that launched it; rows that launched no GPU work keep their CPU times."""
    gpu = (labelled.lazy().select("rank", "is_gpu", "window_start", "start", "end")
           .filter(pl.col("is_gpu") & pl.col("window_start").is_not_null()).collect(**iv.COLLECT))
    if gpu.height == 0:
        return schedule
    ext = (gpu.lazy().group_by("rank", "window_start")
           .agg(pl.col("start").min().alias("_s"), pl.col("end").max().alias("_e")))
    return (  # one query (docs/performance.md "Fixed cost")
        schedule.lazy().join(ext, left_on=["rank", "start_ns"], right_on=["rank", "window_start"], how="left")
        .with_columns(pl.coalesce("_s", "start_ns").alias("start_ns"), pl.coalesce("_e", "end_ns").alias("end_ns"))
        .drop("_s", "_e")
        .sort("rank", "step", "start_ns")
        .collect(**iv.COLLECT)
    )


def _last_mark(frame: pl.DataFrame, rank: str, at: str, marks: pl.DataFrame) -> pl.Series:
    """Per row of ``frame``: the last activity mark of rank ``frame[rank]`` strictly before ``frame[at]`` (null if
    none, or on a rank without marks)."""
    if frame.height == 0 or marks.height == 0:
        return pl.repeat(None, frame.height, dtype=pl.Int64, eager=True).alias("_mark")
    left = frame.select(pl.col(rank).alias("rank"), pl.col(at).alias("_at")).with_row_index("_row")
    hit = (
        left.filter(pl.col("_at").is_not_null()).sort("_at")
        .join_asof(marks, left_on="_at", right_on="_mark", by="rank", strategy="backward",
                   allow_exact_matches=False, check_sortedness=False)
    )
    return (pl.repeat(None, frame.height, dtype=pl.Int64, eager=True)
            .scatter(hit["_row"], hit["_mark"].cast(pl.Int64)).alias("_mark"))


def activity_marks(events: pl.DataFrame, gpu_ranks: pl.DataFrame) -> pl.DataFrame:
    """``rank, _mark``: every instant a CPU rank's training thread is seen doing something — the start and end of
    each of its ops, annotations, P2P posts and returns from a wait. A thread blocked in ``wait()`` records nothing,
    so it began to block after the last such mark."""
    cpu = events.select("rank", "track", "is_gpu", "kind", "ts_ns", "dur_ns", "step").filter(  # (the columns first)
        ~pl.col("is_gpu") & pl.col("step").is_not_null() & ~pl.col("rank").is_in(gpu_ranks["rank"].implode()))
    cpu = cpu.join(training_tracks(cpu), on=["rank", "track"])
    return pl.concat([cpu.select("rank", pl.col("ts_ns").alias("_mark")),
                      cpu.select("rank", (pl.col("ts_ns") + pl.col("dur_ns")).alias("_mark"))]).sort("_mark")


# A thread blocked in wait() records nothing, but on timelines converted from GPU streams (or with a few µs of
# timestamp noise) the next op often starts a few µs *before* the wait returns. Counting from that op's start, the
# wait would look a few µs long and the whole time before it host (issue 26: up to 27 % of a step, 97 of 288 waits
# of one job). Marks this close before the return are not taken as the thread having been busy.
WAIT_RETURN_TOLERANCE_NS = 20_000


def p2p_intervals(pairs: pl.DataFrame, unmatched: pl.DataFrame, marks: pl.DataFrame | None = None,
                  posts: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(transfer, wait) intervals per rank for the P2P channel, from both ends of every pair.

    With ``marks`` (``activity_marks`` of CPU ranks) each message counts only where its rank is blocked on it:
    from the rank's last activity mark before the message's wait returned (module doc). ``posts`` (``rank, start,
    end``): CPU ranks' P2P post calls, where the rank is blocked too: a post call is transfer after the split (its
    side's end of waiting) and, from its start, for what the message's ceiling (``max_transfer_ns``) leaves after
    that; waiting on the peer in between; a post of no paired message, or of one without a ceiling, is transfer."""
    p = pairs.filter(pl.col("channel") == "p2p")
    um = unmatched.filter(pl.col("channel") == "p2p")
    if marks is not None:
        cpu = marks["rank"].unique().implode()

        def block(frame: pl.DataFrame, rank: str, end: str, post: str) -> pl.Expr:
            """On a CPU rank, where the rank began to block (its post, if nothing was seen since); null elsewhere."""
            before = frame.with_columns((pl.col(end) - WAIT_RETURN_TOLERANCE_NS).alias("_returned"))
            return (pl.when(pl.col(rank).is_in(cpu))
                    .then(pl.max_horizontal(pl.lit(_last_mark(before, rank, "_returned", marks)), post)))

        p = p.with_columns(block(p, "dst", "recv_end_ns", "recv_post_ns").alias("_recv_block"),
                           block(p, "src", "send_end_ns", "send_start_ns").alias("_send_block"))
        um = um.with_columns(block(um, "rank", "end", "start").alias("_block"))
    else:
        p = p.with_columns(pl.lit(None, pl.Int64).alias("_recv_block"), pl.lit(None, pl.Int64).alias("_send_block"))
        um = um.with_columns(pl.lit(None, pl.Int64).alias("_block"))

    def blocked(rank: str, start: pl.Expr, end: pl.Expr, block: str) -> pl.Expr:
        return [pl.col(rank).alias("rank"), pl.max_horizontal(start, block).alias("start"), end.alias("end")]

    # Sender: waiting until the receiver posted, then moving bytes until the receiver had them (or its own wait()
    # returned, if earlier): an asynchronous send waited on much later would otherwise count its whole span. Where
    # the blocked part is known (CPU ranks), the sender is in wait() until it returns, however late that is.
    measured_ready = pl.min_horizontal(pl.max_horizontal("send_start_ns", "recv_post_ns"), "send_end_ns")
    send_done = (pl.when(pl.col("_send_block").is_not_null()).then(pl.col("send_end_ns"))
                 .otherwise(pl.max_horizontal(measured_ready, pl.min_horizontal("send_end_ns", "recv_end_ns"))))
    # (no shorter a transfer than its bytes take on the link, and on a CPU rank, between CPU ranks, no longer than
    # its bytes on the slowest link plus a message's latency: traceana.measure.p2p's floor and ceiling, as on the
    # receiving side; the rest of the sender's blocked time waited on the receiver's process)
    floor = pl.col("min_transfer_ns").fill_null(0) if "min_transfer_ns" in p.columns else pl.lit(0)
    top = (pl.when(pl.col("_send_block").is_not_null()).then(send_done - pl.col("max_transfer_ns"))
           if "max_transfer_ns" in p.columns else pl.lit(None, pl.Int64))
    send_ready = pl.max_horizontal(pl.min_horizontal(pl.max_horizontal(measured_ready, top), send_done - floor),
                                   "send_start_ns")
    p = p.with_columns(send_ready.alias("_send_ready"), send_done.alias("_send_done"))
    has_ceiling = "max_transfer_ns" in p.columns
    p, um = p.lazy(), um.lazy()  # both sets are one collect_all (docs/performance.md "Fixed cost")
    transfer = [
        p.select(blocked("dst", pl.col("data_ready_ns"), pl.col("recv_end_ns"), "_recv_block")),
        p.select(blocked("src", pl.col("_send_ready"), pl.col("_send_done"), "_send_block")),
    ]
    wait = [
        p.select(blocked("dst", pl.col("recv_post_ns"), pl.col("data_ready_ns"), "_recv_block")),
        p.select(blocked("src", pl.col("send_start_ns"), pl.col("_send_ready"), "_send_block")),
        um.select(blocked("rank", pl.col("start"), pl.col("end"), "_block")),
    ]
    if posts is not None:
        # Each post call is its own message's (same rank, same start): split where that message's waiting ends.
        # A message costs its rank at most its ceiling in all: the transfer at its end (after the split) first,
        # then the call's own time from its start (building the message, gloo's enqueue) up to what is left; past
        # that, until the split, the call is blocked on the peer (a gloo post can block for milliseconds). No
        # ceiling (GPU, or no paired message): all transfer.
        ceil = pl.col("max_transfer_ns") if has_ceiling else pl.lit(None, pl.Int64)
        split = pl.concat([
            p.select(pl.col("dst").alias("rank"), pl.col("recv_post_ns").alias("start"),
                     pl.col("data_ready_ns").alias("_split"),
                     (ceil - (pl.col("recv_end_ns") - pl.col("data_ready_ns"))).alias("_left")),
            p.select(pl.col("src").alias("rank"), pl.col("send_start_ns").alias("start"),
                     pl.col("_send_ready").alias("_split"),
                     (ceil - (pl.col("_send_done") - pl.col("_send_ready"))).alias("_left")),
        ]).unique(["rank", "start"], keep="first")
        own = pl.min_horizontal(pl.col("end"), pl.col("start") + pl.col("_left").clip(lower_bound=0)
                                .fill_null(pl.col("end") - pl.col("start")))
        cut = (posts.lazy().select("rank", "start", "end").join(split, on=["rank", "start"], how="left")
               .with_columns(own.alias("_a"))
               .with_columns(pl.max_horizontal("_a", pl.min_horizontal("end", pl.col("_split").fill_null(pl.col("_a"))))
                             .alias("_b")))
        transfer.append(cut.select("rank", "start", pl.col("_a").alias("end")))
        transfer.append(cut.select("rank", pl.col("_b").alias("start"), "end"))
        wait.append(cut.select("rank", pl.col("_a").alias("start"), pl.col("_b").alias("end")))
    transfer, wait = pl.collect_all([pl.concat(transfer), pl.concat(wait)], **iv.COLLECT)
    return transfer, wait


def _gpu_ranks(labelled: pl.DataFrame) -> pl.DataFrame:
    """``rank``: the ranks of ``label_busy``'s intervals that are GPU work."""
    return labelled.select("rank", "is_gpu").filter("is_gpu").select("rank").unique()


def action_windows(schedule: pl.DataFrame, labelled: pl.DataFrame) -> dict[str, pl.DataFrame]:
    """Per compute phase, the schedule windows (``rank, start, end``) of CPU-only ranks: the time inside a compute
    action that no op covers and no wait explains is that action's (module doc)."""
    gpu = _gpu_ranks(labelled).lazy()
    # Only windows the trace itself drew (annotations), or a pass told from torch.profiler's default events
    # (source "autograd": one pass's own ops, from its first to its last, with no communication call or other pass
    # between, so the Python between them is that pass's, as a wall-clock timer around it counts it): a window
    # inferred from P2P order is traceana's reconstruction from ops that may belong elsewhere, and the time between
    # them is not claimed for an action nobody named.
    w = (schedule.lazy().filter(pl.col("source").is_in(["annotated", "autograd"])).join(gpu, on="rank", how="anti")
         .select("rank", "phase", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))
         .collect(**iv.COLLECT))
    return _by(w, "phase", [ph for ph in COMPUTE_ORDER if ph != "other_compute"])


def segments(
    *,
    events: pl.DataFrame,
    steps: pl.DataFrame,
    labelled: pl.DataFrame,
    pairs: pl.DataFrame,
    unmatched: pl.DataFrame,
    schedule: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """The partition of every step into category segments (SEGMENTS columns); ``labelled`` is ``label_busy``'s,
    ``schedule`` the windows it was labelled with (their idle, unblocked time is the action's on CPU ranks)."""
    windows = steps.select("rank", "step", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))

    def clip(frame: pl.DataFrame) -> pl.DataFrame:
        return iv.clip(frame.select("rank", "start", "end"), windows, on="rank", window_keys="step")

    # Big layers stay keyed by rank and are cut into steps once, inside partition; the busy intervals are every
    # compute layer at once, each in its phase's (iv.partition's multi-layer frame: no copy per phase).
    compute = labelled.select("rank", "start", "end", pl.col("phase").to_physical().alias(iv.LAYER))
    forward = labelled.select("rank", "start", "end", "phase").filter(pl.col("phase") == "forward").drop("phase")
    gpu = _gpu_ranks(labelled)
    # The event subsets each layer reads are one collect_all (docs/performance.md "Fixed cost").
    ev = events.lazy()
    collective, annotated, bp, bp_unmatched, bp_ops, posts, explicit_wait, p2p_calls, gpu_p2p_work = pl.collect_all([
        _span(ev.filter(pl.col("kind") == "collective")),
        ev.filter(pl.col("pp_action").is_in(list(names.BPIPE_ACTIONS))).select("rank", "ts_ns", "dur_ns"),
        pairs.lazy().filter(pl.col("channel") == "bpipe"),
        unmatched.lazy().filter(pl.col("channel") == "bpipe"),
        _span(ev.filter((pl.col("kind") == "bpipe_transfer") & (pl.col("cat") != "user_annotation"))),
        # A CPU rank inside a P2P call (gloo's post can itself block) is in communication.
        _span(ev.filter(pl.col("kind").is_in(["p2p_send", "p2p_recv"]) & (pl.col("channel") == "p2p")
                        & ~pl.col("is_gpu") & (pl.col("cat") != "user_annotation"))
              .join(gpu.lazy(), on="rank", how="anti")),
        _span(ev.filter(pl.col("pp_action").is_in([names.WAIT_F, names.WAIT_B]))),
        # A framework's P2P helper (name rules' p2p_call: Megatron's send_forward, DeepSpeed's SendActivation):
        # on a CPU rank, its time no op covers and no wait explains is the helper's own Python, P2P's.
        _span(ev.filter((pl.col("kind") == "p2p_call") & ~pl.col("is_gpu")).join(gpu.lazy(), on="rank", how="anti")),
        # GPU work launched inside a P2P call (classify: its packing copies, a library's own kernels) moves bytes.
        _span(ev.filter((pl.col("kind") == "p2p_call") & pl.col("is_gpu"))),
    ], **iv.COLLECT)
    # BPipe time: its annotated spans (the rank is blocked evicting/loading) and its ops. The spans of its
    # asynchronous messages count only on ranks without such annotations (traffic known from the process group
    # alone): where annotations exist, a message posted early and waited on inside LOAD/ACCEPT would otherwise
    # claim all the idle time in between, which is the pipeline's bubble, not BPipe's cost.
    # A run without BPipe (no BPipe span, op or message) skips the joins (docs/performance.md "Fixed cost").
    if annotated.height or bp.height or bp_unmatched.height or bp_ops.height:
        bp_msgs = pl.concat([
            bp.select(pl.col("src").alias("rank"), pl.col("send_start_ns").alias("start"),
                      pl.col("send_end_ns").alias("end")),
            bp.select(pl.col("dst").alias("rank"), pl.col("recv_post_ns").alias("start"),
                      pl.col("recv_end_ns").alias("end")),
            bp_unmatched.select("rank", "start", "end"),
        ]).join(annotated.select("rank").unique(), on="rank", how="anti")
        bpipe = pl.concat([bp_ops, _span(annotated), bp_msgs])
    else:
        bpipe = bp_ops
    # The marks are read only for P2P messages on CPU ranks: a run without any skips the join over its CPU events
    # (where every rank with events is a GPU rank the marks would be empty: the same as none).
    has_p2p = ((pairs["channel"] == "p2p").any() or (unmatched["channel"] == "p2p").any()) and (
        gpu.height < events["rank"].n_unique())
    transfer, wait = p2p_intervals(pairs, unmatched, activity_marks(events, gpu) if has_p2p else None, posts)
    fill = action_windows(schedule, labelled) if schedule is not None else {}
    transfer = pl.concat([transfer, gpu_p2p_work])
    wait = clip(pl.concat([wait, explicit_wait]))
    # Waits are bubbles by the pipeline rules' windows: warm-up before the stage's first forward *work* (on a GPU,
    # kernels run later than the CPU annotation says), cool-down after its last, a stall in between.
    bubbles = iv.clip(wait, bubble_windows(windows, clip(forward)), on=["rank", "step"],
                      window_keys="category", keep_order=False)
    del forward  # (a copy of the forward busy intervals: not held while the segments are built)
    layers = [
        (COMPUTE_ORDER, compute),
        ("collective", collective), ("bpipe", bpipe), ("p2p", transfer),
        *_by(bubbles, "category", (pipeline_rules.BUBBLE_WARMUP, pipeline_rules.BUBBLE_COOLDOWN,
                                   pipeline_rules.BUBBLE_STALL)).items(),
        ("p2p", p2p_calls),
        *fill.items(),
    ]
    segs = iv.partition(windows, layers, by=["rank", "step"], on="rank", default="host", label="category",
                        label_dtype=Category)
    segs = conform(segs.rename({"start": "start_ns", "end": "end_ns"}), SEGMENTS)
    return _helpers_python(segs, schedule) if schedule is not None else segs


# What waiting or moving a message is, next to which idle time is a P2P helper's own Python (_helpers_python).
_IN_A_CALL = ("p2p", pipeline_rules.BUBBLE_WARMUP, pipeline_rules.BUBBLE_STALL, pipeline_rules.BUBBLE_COOLDOWN)


def _helpers_python(segs: pl.DataFrame, schedule: pl.DataFrame) -> pl.DataFrame:
    """On CPU ranks whose passes were told from torch.profiler's default events (schedule source "autograd": no
    Python frames, so no framework helper span), host time touching a P2P call's time (its transfer or its wait)
    is the helper that made the call (Megatron's ``send_forward…``, DeepSpeed's ``SendActivation``: building its
    ops and buffers before the post, taking the result after the wait) and counts as P2P, as the helper's span
    would have made it (item 6 of the module doc; issue 36: without it the blocked share read 0.05–0.10 low)."""
    ranks = schedule.filter(pl.col("source") == "autograd")["rank"].unique()
    if ranks.len() == 0:
        return segs
    mine = pl.col("rank").is_in(ranks.implode())
    seg = segs.with_row_index("_i").sort("rank", "step", "start_ns")
    cat = pl.col("category").cast(pl.String)
    near = (seg.with_columns(cat.shift(1).over("rank", "step").alias("_prev"),
                             cat.shift(-1).over("rank", "step").alias("_next"),
                             pl.col("end_ns").shift(1).over("rank", "step").alias("_prev_end"),
                             pl.col("start_ns").shift(-1).over("rank", "step").alias("_next_start"))
            .filter(mine & (cat == "host")
                    & ((pl.col("_prev").is_in(list(_IN_A_CALL)) & (pl.col("_prev_end") == pl.col("start_ns")))
                       | (pl.col("_next").is_in(list(_IN_A_CALL)) & (pl.col("_next_start") == pl.col("end_ns"))))))
    if near.height == 0:
        return segs
    relabel = pl.repeat(False, segs.height, dtype=pl.Boolean, eager=True).scatter(near["_i"], True)
    return segs.with_columns(pl.when(pl.lit(relabel)).then(pl.lit("p2p", dtype=segs.schema["category"]))
                             .otherwise(pl.col("category")).alias("category"))


def attribute(segs: pl.DataFrame, steps: pl.DataFrame, stages: pl.DataFrame) -> pl.DataFrame:
    """schema.ATTRIBUTION: nanoseconds per (rank, step, category), every category present (zero when absent)."""
    # polars' streaming engine groups a large frame in about half the CPU time of the in-memory one (and starts
    # slower: small frames stay in memory).
    sums = (segs.lazy().group_by("rank", "step", "category")
            .agg((pl.col("end_ns") - pl.col("start_ns")).sum().alias("ns")))
    if segs.height > 50_000:
        sums = sums.collect(engine="streaming").lazy()
    # (The rest is one query, docs/performance.md "Fixed cost".)
    grid = steps.lazy().select("rank", "step", "dur_ns").join(
        pl.LazyFrame({"category": list(CATEGORIES)}, schema={"category": Category}), how="cross")
    out = (
        grid.join(sums, on=["rank", "step", "category"], how="left")
        .join(stages.lazy().select("rank", "stage"), on="rank", how="left")
        .with_columns(pl.col("ns").fill_null(0))
        .with_columns(pl.when(pl.col("dur_ns") > 0).then(pl.col("ns") / pl.col("dur_ns")).otherwise(0.0)
                      .alias("fraction"))
    )
    return conform(out, ATTRIBUTION).sort("rank", "step", "category").collect(**iv.COLLECT)
