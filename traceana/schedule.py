"""The schedule: (rank, step, stage, micro-batch, phase) rows from the annotations (``PP:{stage}{ACTION}{mb}``,
PyTorch's ``Forward {i}`` / ``Backward {i}``, overlapped F/B spans), or, for ranks without any, inferred from P2P order
(``infer_schedule``). A rank whose stage or micro-batches cannot be determined gets no rows and a note says why."""

from __future__ import annotations

import polars as pl

from traceana import intervals as iv
from traceana import names
from traceana.classify import inside
from traceana.schema import SCHEDULE, conform
from traceana.timeline import training_tracks


def annotated_schedule(events: pl.DataFrame, stages: pl.DataFrame, *,
                       overlapped: pl.DataFrame | None = None) -> pl.DataFrame:
    """schema.SCHEDULE rows from PP: compute annotations, PyTorch's GPipe names and torch.optim's step ranges;
    an overlapped ``PP:(…;…)OVERLAP_F_B`` span gives one row per sub-action (see ``overlap_rows``; ``overlapped``:
    its rows, if the caller has them already)."""
    # Three queries instead of ~14 eager operations (docs/performance.md "Fixed cost").
    pp = events.lazy().filter(pl.col("pp_action").is_in(list(names.PHASE_OF_ACTION)) & pl.col("step").is_not_null())
    opt = events.lazy().filter(~pl.col("is_gpu") & (pl.col("cat") == "user_annotation")
                               & names.name_test(pl.col("name"),
                                                 lambda t: t.str.starts_with(names.OPTIMIZER_STEP_PREFIX))
                               & pl.col("step").is_not_null())
    rows = pl.concat([
        pp.select("rank", "step", "pp_stage", "pp_microbatch",
                  pl.col("pp_action").cast(pl.String).replace_strict(names.PHASE_OF_ACTION, return_dtype=pl.String)
                  .alias("phase"),
                  "ts_ns", "dur_ns"),
        opt.select("rank", "step", pl.lit(None, pl.Int32).alias("pp_stage"),
                   pl.lit(None, pl.Int32).alias("pp_microbatch"), pl.lit("optimizer").alias("phase"),
                   "ts_ns", "dur_ns"),
        (overlap_rows(events) if overlapped is None else overlapped).lazy(),
    ]).collect(**iv.COLLECT)
    # A rank annotated both ways (our PP: names and PyTorch's GPipe names) keeps the PP: rows, which carry a stage.
    has_pp = rows.filter(pl.col("pp_stage").is_not_null() & (pl.col("phase") != "optimizer")).select("rank").unique()
    gpipe_dup = (pl.col("pp_stage").is_null() & (pl.col("phase") != "optimizer")
                 & pl.col("rank").is_in(has_pp["rank"].implode()))
    rows = rows.lazy().filter(~gpipe_dup)
    return conform(
        rows.join(stages.lazy().select("rank", "stage"), on="rank", how="left").select(
            "rank", "step", pl.coalesce("pp_stage", "stage").alias("stage"),
            pl.col("pp_microbatch").alias("microbatch"), "phase", pl.col("ts_ns").alias("start_ns"),
            (pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"), pl.lit("annotated").alias("source"),
        ),
        SCHEDULE,
    ).collect(**iv.COLLECT)


def overlap_spans(events: pl.DataFrame) -> pl.DataFrame:
    """Every ``OVERLAP_F_B`` span with its sub-actions and the backward work (autograd's ops, any CPU thread of the
    rank) inside it: ``_bwd_start`` (first backward op start) and ``_bwd_end`` (last backward op end), null if none."""
    end = pl.col("ts_ns") + pl.col("dur_ns")
    spans = (
        events.lazy()
        .filter((pl.col("pp_action") == names.OVERLAP_F_B) & pl.col("step").is_not_null() & ~pl.col("is_gpu"))
        .select("rank", "step", "ts_ns", end.alias("_end"), **names.overlap_columns(names.text(pl.col("name"))))
        .collect(**iv.COLLECT)
    )
    if spans.height == 0:
        return spans.with_columns(pl.lit(None, pl.Int64).alias("_bwd_start"), pl.lit(None, pl.Int64).alias("_bwd_end"))
    bwd = events.filter(~pl.col("is_gpu") & (pl.col("kind") == "compute") & names.backward_like(pl.col("name"))).select(
        "rank", pl.col("ts_ns").alias("_bwd_start"), end.alias("_bwd_end"))
    return (
        spans.sort("ts_ns")
        .join_asof(bwd.select("rank", "_bwd_start").sort("_bwd_start"), left_on="ts_ns", right_on="_bwd_start",
                   by="rank", strategy="forward", check_sortedness=False)
        .sort("_end")
        .join_asof(bwd.select("rank", "_bwd_end").sort("_bwd_end"), left_on="_end", right_on="_bwd_end",
                   by="rank", strategy="backward", check_sortedness=False)
        .with_columns(pl.when(pl.col("_bwd_start") < pl.col("_end")).then("_bwd_start").alias("_bwd_start"),
                      pl.when(pl.col("_bwd_end") > pl.col("ts_ns")).then("_bwd_end").alias("_bwd_end"))
    )


def overlap_rows(events: pl.DataFrame, *, spans: pl.DataFrame | None = None) -> pl.DataFrame:
    """Two rows (``rank, step, pp_stage, pp_microbatch, phase, ts_ns, dur_ns``) per overlapped F/B span: torch runs
    the sub-actions one after the other in the order its name lists them (schedules.py, ``OVERLAP_F_B``), so the
    span splits where the backward's work begins (F first) or ends (B first). A span with no backward op inside
    cannot be split and gives no rows (``overlap_notes`` says so). ``spans``: ``overlap_spans(events)``, if the
    caller has them already."""
    # one query (docs/performance.md)
    sp = (overlap_spans(events) if spans is None else spans).lazy().filter(pl.col("_bwd_start").is_not_null())
    f_first = pl.col("first_action") == names.FORWARD
    split = pl.when(f_first).then(pl.col("_bwd_start")).otherwise(pl.col("_bwd_end"))
    out = []
    for which, lo, hi in (("first", pl.col("ts_ns"), split), ("second", split, pl.col("_end"))):
        out.append(sp.select(
            "rank", "step", pl.col(f"{which}_stage").alias("pp_stage"), pl.col(f"{which}_mb").alias("pp_microbatch"),
            pl.col(f"{which}_action").replace_strict(names.PHASE_OF_ACTION, return_dtype=pl.String).alias("phase"),
            lo.alias("ts_ns"), (hi - lo).alias("dur_ns")))
    return (pl.concat(out).filter(pl.col("dur_ns") > 0).with_columns(pl.col("pp_stage", "pp_microbatch").cast(pl.Int32))
            .collect(**iv.COLLECT))


def overlap_notes(events: pl.DataFrame, *, spans: pl.DataFrame | None = None) -> list[str]:
    """What ``overlap_rows`` could not split (``spans``: ``overlap_spans(events)``, if the caller has them)."""
    sp = overlap_spans(events) if spans is None else spans
    unsplit = sp.filter(pl.col("_bwd_start").is_null())
    notes = []
    if sp.height:
        notes.append(f"{sp.height} overlapped forward+backward spans (OVERLAP_F_B) split into their forward and "
                     "backward at the first/last autograd op inside each")
    if unsplit.height:
        notes.append(f"{unsplit.height} OVERLAP_F_B spans (ranks {', '.join(map(str, unsplit['rank'].unique().sort()))})"
                     " hold no autograd backward op, so where the forward ends cannot be told: they are left "
                     "out of the schedule (their time counts as other compute)")
    return notes


def infer_schedule(
    events: pl.DataFrame, msgs: pl.DataFrame, stages: pl.DataFrame, *, ranks: list[int]
) -> tuple[pl.DataFrame, list[str]]:
    """Schedule rows for ``ranks`` from P2P order, for runs without forward/backward annotations.

    A message to/from a lower stage is upstream traffic (recv = activation in, send = gradient out), to/from a higher
    stage downstream (send = activation out, recv = gradient in). The k-th message of a role in a step belongs to
    micro-batch k. Compute is split into forward-like and backward-like work by the ops autograd records for every
    backward node (``autograd::engine::evaluate_function: …``); then (the rules of docs/architecture.md):
    forward work is micro-batch k's if it precedes the k-th activation sent downstream, or — on the last stage —
    follows the k-th activation received and precedes the k-th gradient sent; backward work is micro-batch k's if it
    precedes the k-th gradient sent upstream, or — on the first stage — follows the k-th gradient received.
    """
    notes: list[str] = []
    st = stages.filter(pl.col("rank").is_in(ranks) & pl.col("stage").is_not_null())
    if st.height == 0:
        return conform(pl.DataFrame(), SCHEDULE).clear(), notes
    stage_of = stages.select(pl.col("rank").alias("peer"), pl.col("stage").alias("peer_stage"))
    # A message without a peer (torch.profiler's defaults: record_shapes off, so c10d writes none) on the first or
    # the last stage has one neighbouring stage to go to: that one. On a middle stage it could be either: unknown.
    first, last = stages["stage"].min(), stages["stage"].max()
    roles = (
        msgs.filter((pl.col("channel") == "p2p") & (pl.col("peer").is_not_null() | (first != last)))
        .join(st.select("rank", "stage"), on="rank").join(stage_of, on="peer", how="left")
        .with_columns(pl.when(pl.col("peer").is_not_null()).then(pl.col("peer_stage"))
                      .when(pl.col("stage") == first).then(pl.col("stage") + 1)
                      .when(pl.col("stage") == last).then(pl.col("stage") - 1).alias("peer_stage"))
        .filter(pl.col("peer_stage").is_not_null() & (pl.col("peer_stage") != pl.col("stage")))
        .with_columns(
            pl.when(pl.col("peer_stage") < pl.col("stage"))
            .then(pl.when(pl.col("dir") == "recv").then(pl.lit("recv_act")).otherwise(pl.lit("send_grad")))
            .otherwise(pl.when(pl.col("dir") == "send").then(pl.lit("send_act")).otherwise(pl.lit("recv_grad")))
            .alias("role"))
        # Compute is matched on the CPU timeline: on a GPU rank the CPU issues a transfer and moves on (stream
        # order does the waiting), so its launch is both when the data is "in" and when it is "out".
        .with_columns(
            pl.when(pl.col("on_gpu")).then(pl.col("launch_ns")).otherwise(pl.col("post_ns")).alias("post_ns"),
            pl.when(pl.col("on_gpu")).then(pl.col("launch_ns")).otherwise(pl.col("end_ns")).alias("end_ns"))
        .sort("post_ns")
        .with_columns(pl.int_range(pl.len()).over("rank", "step", "role").cast(pl.Int32).alias("mb"))
    )
    # Pipeline traffic goes to the neighbouring stages. Traffic between others means virtual stages (interleaved
    # schedules wrap around from the last rank to the first) or an unidentified side channel: micro-batches and
    # phases cannot then be told from P2P order, and we say so rather than guess.
    far = roles.filter((pl.col("peer_stage") - pl.col("stage")).abs() != 1)
    if far.height:
        pairs_ = sorted({(min(a, b), max(a, b)) for a, b in far.select("rank", "peer").rows()})
        notes.append("P2P between non-neighbouring stages (ranks " + ", ".join(f"{a}↔{b}" for a, b in pairs_)
                     + "), as in interleaved schedules: the schedule of un-annotated ranks is not inferred")
        return conform(pl.DataFrame(), SCHEDULE).clear(), notes
    has = roles.group_by("rank").agg(
        (pl.col("role") == "send_act").any().alias("has_down"), (pl.col("role") == "recv_act").any().alias("has_up"))
    lonely = sorted(set(st["rank"].to_list()) - set(has.filter(pl.col("has_down") | pl.col("has_up"))["rank"]
                                                   .to_list()))
    if lonely:
        notes.append(f"ranks {', '.join(map(str, lonely))} have no P2P traffic with other stages: their forward and "
                     "backward micro-batches cannot be inferred")
    # Top-level compute ops, each tagged forward- or backward-like by its outermost op: on a CPU rank those of the
    # training thread; on a GPU rank those of every CPU thread (autograd runs backward on its own device thread).
    tracks = training_tracks(events)
    gpu = events.select(pl.col("rank").filter(pl.col("is_gpu") & (pl.col("kind") == "compute")).unique())
    cpu_ops = events.select("rank", "track", "name", "ts_ns", "dur_ns", "step", "is_gpu", "kind").filter(
        ~pl.col("is_gpu") & (pl.col("kind") == "compute") & pl.col("step").is_not_null() & pl.col("rank").is_in(ranks))
    cpu = pl.concat([cpu_ops.join(gpu, on="rank", how="anti").join(tracks, on=["rank", "track"]),
                     cpu_ops.join(gpu, on="rank")])
    ops = (
        cpu.sort("rank", "track", "ts_ns")
        .with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end"), names.backward_like(pl.col("name")).alias("_bwd"))
        .with_columns(pl.col("end").cum_max().shift(1).over("rank", "track").alias("_reach"))
        .with_columns((pl.col("_reach").is_null() | (pl.col("ts_ns") >= pl.col("_reach"))).cum_sum()
                      .over("rank", "track").alias("_top"))
        .group_by("rank", "track", "_top")
        .agg(pl.col("step").first(), pl.col("ts_ns").min().alias("start"), pl.col("end").max(),
             pl.col("_bwd").any().alias("is_bwd"))
        .join(has, on="rank")
        .sort("start")
    )
    # Optimizer work is not a micro-batch's: drop ops inside torch.optim's step ranges.
    opt = iv.merge(events.filter(names.name_test(pl.col("name"),
                                                 lambda t: t.str.starts_with(names.OPTIMIZER_STEP_PREFIX))).select(
        "rank", pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")), "rank")
    ops = ops.filter(~inside(ops, "start", opt))

    def role(name: str, at: str) -> pl.DataFrame:
        return roles.filter(pl.col("role") == name).select(
            "rank", "step", pl.col(at).alias(f"{name}_at"), pl.col("mb").alias(f"{name}_mb")).sort(f"{name}_at")

    fwd, bwd = ops.filter(~pl.col("is_bwd")), ops.filter(pl.col("is_bwd"))
    send_grad_post = roles.filter(pl.col("role") == "send_grad").select(
        "rank", "step", pl.col("mb").alias("recv_act_mb"), pl.col("post_ns").alias("_grad_out"))
    # Forward work sent downstream must not have backward work between it and the send: what runs before a
    # backward (autograd's setup, the next input being made) is not that micro-batch's forward.
    next_bwd = bwd.select("rank", "step", pl.col("start").alias("_next_bwd")).sort("_next_bwd")
    prev_bwd = bwd.select("rank", "step", pl.col("end").alias("_prev_bwd")).sort("_prev_bwd")
    fwd = (
        fwd.join_asof(next_bwd, left_on="end", right_on="_next_bwd", by=["rank", "step"], strategy="forward",
                      check_sortedness=False)
        .join_asof(role("send_act", "post_ns"), left_on="end", right_on="send_act_at", by=["rank", "step"],
                   strategy="forward", check_sortedness=False)
        .with_columns(pl.when(pl.col("_next_bwd") < pl.col("send_act_at")).then(None)
                      .otherwise(pl.col("send_act_mb")).alias("send_act_mb"))
        .join_asof(role("recv_act", "end_ns"), left_on="start", right_on="recv_act_at", by=["rank", "step"],
                   strategy="backward", check_sortedness=False)
        .join(send_grad_post, on=["rank", "step", "recv_act_mb"], how="left")
        # On the last stage, forward work after backward work began (grad accumulation, bookkeeping) is not F.
        .join_asof(prev_bwd, left_on="start", right_on="_prev_bwd", by=["rank", "step"], strategy="backward",
                   check_sortedness=False)
        .with_columns(
            # A middle stage's forward of micro-batch k runs after its activation k arrived.
            pl.when(pl.col("has_down") & pl.col("has_up"))
            .then(pl.when(pl.col("recv_act_mb") == pl.col("send_act_mb")).then(pl.col("send_act_mb")))
            .when(pl.col("has_down")).then(pl.col("send_act_mb"))
            .when(pl.col("has_up") & (pl.col("_grad_out").is_null() | (pl.col("end") <= pl.col("_grad_out")))
                  & (pl.col("_prev_bwd").is_null() | (pl.col("_prev_bwd") <= pl.col("recv_act_at"))))
            .then(pl.col("recv_act_mb")).alias("microbatch"),
            pl.lit("forward").alias("phase"))
    )
    bwd = (
        bwd.join_asof(role("send_grad", "post_ns"), left_on="end", right_on="send_grad_at", by=["rank", "step"],
                      strategy="forward", check_sortedness=False)
        .join_asof(role("recv_grad", "end_ns"), left_on="start", right_on="recv_grad_at", by=["rank", "step"],
                   strategy="backward", check_sortedness=False)
        .with_columns(
            pl.when(pl.col("has_up")).then(pl.col("send_grad_mb"))
            .when(pl.col("has_down")).then(pl.col("recv_grad_mb")).alias("microbatch"),
            pl.lit("backward").alias("phase"))
    )
    cols = ["rank", "step", "microbatch", "phase", "start", "end"]
    labelled = pl.concat([fwd.select(cols), bwd.select(cols)]).filter(pl.col("microbatch").is_not_null())
    rows = (
        labelled.group_by("rank", "step", "microbatch", "phase")
        .agg(pl.col("start").min().alias("start_ns"), pl.col("end").max().alias("end_ns"))
        .join(st.select("rank", "stage"), on="rank")
        .with_columns(pl.lit("inferred").alias("source"))
    )
    no_bwd = sorted(set(ranks) - set(bwd["rank"].to_list()) - set(lonely))
    if no_bwd:
        notes.append(f"ranks {', '.join(map(str, no_bwd))}: no autograd backward ops found on the CPU, so forward "
                     "and backward work could not be told apart there")
    return conform(rows, SCHEDULE).sort("rank", "step", "start_ns"), notes



def dropped_annotation_notes(events: pl.DataFrame) -> list[str]:
    """A ``PP:`` name of the annotation form whose stage or micro-batch does not fit a number (``PP:1F9999…``)
    is not taken as an annotation: say so, naming the first (a few rows: only names of that form are looked at)."""
    from traceana.errors import printable

    # The regular expression runs only on names with the contract's prefix (a cheap test on every event).
    bad = (events.filter(~pl.col("is_gpu") & pl.col("pp_action").is_null()
                         & names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.PP_PREFIX)))
           .filter(names.text(pl.col("name")).str.contains(names.PP_PATTERN)))
    if not bad.height:
        return []
    first = bad.sort("rank", "ts_ns").row(0, named=True)
    return [f"{bad.height} PP: annotations ignored (first: {printable(first['name'][:60])!r} on rank {first['rank']}): "
            "their stage or micro-batch number is too large to be one, so their time counts as other compute"]

