"""The schedule: (rank, step, stage, micro-batch, phase) rows from the annotations (``PP:{stage}{ACTION}{mb}``,
PyTorch's ``Forward {i}`` / ``Backward {i}``, overlapped F/B spans), or, for ranks without any, inferred from P2P order
(``infer_schedule``). A rank whose stage or micro-batches cannot be determined gets no rows and a note says why."""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.errors import printable
from traceana.core.pipeline_rules import device_order
from traceana.core.schema import SCHEDULE, conform
from traceana.ingest.process_groups import process_groups
from traceana.measure.classify import inside
from traceana.measure.timeline import training_tracks


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
    # The regular expression runs only on names with the contract's prefix (a cheap test on every event).
    bad = (events.filter(~pl.col("is_gpu") & pl.col("pp_action").is_null()
                         & names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.PP_PREFIX)))
           .filter(names.text(pl.col("name")).str.contains(names.PP_PATTERN)))
    if not bad.height:
        return []
    first = bad.sort("rank", "ts_ns").row(0, named=True)
    return [f"{bad.height} PP: annotations ignored (first: {printable(first['name'][:60])!r} on rank {first['rank']}): "
            "their stage or micro-batch number is too large to be one, so their time counts as other compute"]



# --- torch.profiler's defaults: no annotations, no Python frames, no P2P peers (issue 36) ---------------------------
# What such a trace still holds: autograd's per-node ops (``autograd::engine::evaluate_function: …Backward0``) mark
# every backward pass, the c10d/gloo/nccl send and recv calls (their direction, not their peer) separate one
# micro-batch's pass from the next, ``Optimizer.step#…`` / ``Optimizer.zero_grad#…`` close the passes of a step,
# and Megatron-core names its process groups in distributedInfo (``PIPELINE_MODEL_PARALLEL_GROUP``: the global
# ranks of one pipeline in stage order).
PIPELINE_GROUP_DESCS = ("PIPELINE_MODEL_PARALLEL_GROUP",)  # megatron-core's parallel_state


def pipeline_process_groups(traces: pl.DataFrame) -> list[list[int]]:
    """The global ranks of each process group the framework names as the pipeline (``PIPELINE_GROUP_DESCS``), in
    the traces' order. Only the pipeline groups meet the ranks and leave polars: each rank's default group lists
    every rank, 16 M Python ints at 4,096 ranks (240 MB, ~1 s)."""
    groups = process_groups(traces, pl.col("desc").is_in(PIPELINE_GROUP_DESCS) & (pl.col("ranks").list.len() > 0))
    return groups["ranks"].to_list()


def pipeline_group_stages(traces: pl.DataFrame) -> dict[int, tuple[int, int]]:
    """``rank -> (stage, pp)`` from a process group the framework names as the pipeline (``PIPELINE_GROUP_DESCS``):
    megatron-core builds it with the pipeline's global ranks in stage order (a handful of groups per trace)."""
    out: dict[int, tuple[int, int]] = {}
    for ranks in pipeline_process_groups(traces):
        for i, r in enumerate(ranks):
            out.setdefault(int(r), (i, len(ranks)))
    return out


def _top_level_ops(events: pl.DataFrame, ranks: list[int]) -> pl.DataFrame:
    """``rank, track, _top, step, start, end, is_bwd, differentiated``: the outermost compute ops (an op and
    everything nested in it), tagged backward-like by autograd's names (``names.backward_like``), with how many of
    the ops in it are of a kind autograd's backward nodes differentiate (``aten::addmm`` for ``AddmmBackward0``:
    forward work that builds the graph, not bookkeeping): on a CPU rank those of the training
    thread, on a GPU rank those of every CPU thread (autograd runs backward on its own device thread); ops inside
    torch.optim's step ranges are not a micro-batch's and are left out."""
    tracks = training_tracks(events)
    gpu = events.select(pl.col("rank").filter(pl.col("is_gpu") & (pl.col("kind") == "compute")).unique())
    cpu_ops = events.select("rank", "track", "name", "ts_ns", "dur_ns", "step", "is_gpu", "kind").filter(
        ~pl.col("is_gpu") & (pl.col("kind") == "compute") & pl.col("step").is_not_null() & pl.col("rank").is_in(ranks))
    cpu = pl.concat([cpu_ops.join(gpu, on="rank", how="anti").join(tracks, on=["rank", "track"]),
                     cpu_ops.join(gpu, on="rank")])
    # The ops autograd's nodes differentiate, by the nodes' names (``AddmmBackward0`` → ``aten::addmm``): a few
    # hundred distinct names, tested once each.
    node = cpu.select(pl.col("name").unique().cast(pl.String)).to_series().str.extract(r"^([A-Za-z]+)Backward\d*$")
    differentiated = ("aten::" + node.drop_nulls().str.to_lowercase()).unique().cast(events.schema["name"])
    ops = (
        cpu.sort("rank", "track", "ts_ns")
        .with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end"),
                      names.backward_like(pl.col("name")).alias("_bwd"),
                      pl.col("name").is_in(differentiated.implode()).alias("_diff"))
        .with_columns(pl.col("end").cum_max().shift(1).over("rank", "track").alias("_reach"))
        .with_columns((pl.col("_reach").is_null() | (pl.col("ts_ns") >= pl.col("_reach"))).cum_sum()
                      .over("rank", "track").alias("_top"))
        .group_by("rank", "track", "_top")
        .agg(pl.col("step").first(), pl.col("ts_ns").min().alias("start"), pl.col("end").max(),
             pl.col("_bwd").any().alias("is_bwd"), pl.col("_diff").sum().alias("differentiated"))
        .sort("start")
    )
    opt = iv.merge(events.filter(names.name_test(pl.col("name"),
                                                 lambda t: t.str.starts_with(names.OPTIMIZER_STEP_PREFIX))).select(
        "rank", pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")), "rank")
    return ops.filter(~inside(ops, "start", opt))


def _numbered_by_plan(rows: pl.DataFrame, plan: tuple[str, int, int, int]) -> pl.DataFrame | None:
    """``rows`` (passes with ``rank, step, phase, start, stage`` = the rank's first stage) with ``stage`` and
    ``microbatch`` from the schedule's device order (``pipeline_rules.device_order``), or None where a rank's
    passes of a step are not as many as that order has, or a rank's first stage is no device of it."""
    schedule, devices, virtual, microbatches = plan
    ranks = rows.select("rank", "stage").unique()
    if ranks["stage"].null_count() or not devices or not ((ranks["stage"] >= 0) & (ranks["stage"] < devices)).all():
        return None
    try:
        orders = [(d, o.action, o.stage, o.microbatch) for d in sorted(set(ranks["stage"].to_list()))
                  for o in device_order(schedule, pp=devices, num_microbatches=microbatches, device=d,
                                        virtual_stages=virtual)]
    except Exception:  # noqa: BLE001 - a plan the rules cannot build (ConfigError): passes stay unnumbered
        return None
    phase = {names.FORWARD: "forward", names.BACKWARD: "backward"}
    order = (pl.DataFrame(orders, schema={"stage": pl.Int32, "_a": pl.String, "_s": pl.Int32, "_mb": pl.Int32},
                          orient="row")
             .with_columns(pl.col("_a").replace_strict(phase, default=None).alias("phase")).drop_nulls("phase")
             .with_columns(pl.int_range(pl.len()).over("stage", "phase").alias("_k")))
    per = order.group_by("stage", "phase").len()
    counts = rows.group_by("rank", "step", "phase", "stage").len().join(per, on=["stage", "phase"], how="left")
    if (counts["len"] != counts["len_right"]).fill_null(True).any():
        return None
    return (rows.sort("start").with_columns(pl.int_range(pl.len()).over("rank", "step", "phase").alias("_k"))
            .join(order.select("stage", "phase", "_k", "_s", "_mb"), on=["stage", "phase", "_k"], how="left")
            .with_columns(pl.col("_s").alias("stage"), pl.col("_mb").alias("microbatch")).drop("_k", "_s", "_mb"))


def steps_of(events: pl.DataFrame, ranks: list[int]) -> pl.DataFrame:
    """``rank, step, _step_start``: where each step of ``ranks`` begins (its first event)."""
    return (events.lazy().filter(pl.col("rank").is_in(ranks) & pl.col("step").is_not_null())
            .group_by("rank", "step").agg(pl.col("ts_ns").min().alias("_step_start")).collect(**iv.COLLECT))


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def autograd_schedule(events: pl.DataFrame, stages: pl.DataFrame, traces: pl.DataFrame, *, ranks: list[int],
                      several: bool | None = None, plan: tuple[str, int, int, int] | None = None
                      ) -> tuple[pl.DataFrame, pl.DataFrame, list[str]]:
    """Forward and backward passes of ``ranks`` from what torch.profiler records with no options: ``(rows, stages,
    notes)``, the schema.SCHEDULE rows (source "autograd"), ``stages`` with the stages this could tell filled in,
    and what it inferred and could not.

    The communication calls (P2P and collectives, any direction, peer or not) and the optimizer's ranges cut each
    rank's step into windows; within a window the outermost ops from the first to the last of autograd's backward
    ops are one backward pass (from where the thread last did something else: the engine records nothing before its
    first node), the other ops before or after it forward candidates. A step runs as many forwards as backwards, so
    its most graph-building candidates (ops autograd's nodes differentiate) are the forwards; the rest (the next
    step's data, an output's detach) is other compute. In a pipeline holding one stage a rank, the k-th forward and
    the k-th backward of a step are micro-batch k (every such schedule runs its micro-batches in order,
    docs/schedules.md). A rank's stage is run.json's or the traces' (``stages``), else its place in megatron-core's
    pipeline process group, else, where the traces hold exactly two ranks exchanging P2P, which of them sends first
    (stage 0: nothing is upstream of it), else, for one pipeline with every rank traced over gloo, the order in which
    micro-batch 0's activation reaches the ranks. One stage a rank shows on the first stage: there every P2P call is
    one of its micro-batches' activations out or gradients in, as many as its passes; more calls than passes mean
    virtual stages (interleaved: the first rank also passes activations on for its later chunks), whose passes are
    then left without a micro-batch (``several``: True or False to say so
    instead, from run.json or the traces' metadata). ``plan``: run.json's ``(schedule, devices, virtual stages,
    micro-batches)`` of such a run; where every rank runs as many forwards and backwards a step as it says, the k-th
    of each phase is the k-th of that phase in the schedule's device order (``pipeline_rules.device_order``: the
    same chunk and micro-batch sequence megatron-core's interleaved 1F1B runs), which numbers them."""
    notes: list[str] = []
    empty = conform(pl.DataFrame(), SCHEDULE).clear()
    ops = _top_level_ops(events, ranks)
    if ops.height == 0 or not ops["is_bwd"].any():
        return empty, stages, notes
    comm = events.lazy().filter(
        ~pl.col("is_gpu") & pl.col("rank").is_in(ranks) & pl.col("step").is_not_null()
        & (pl.col("kind").is_in(["p2p_send", "p2p_recv", "collective"])
           | names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.OPTIMIZER_STEP_PREFIX)
                             | t.str.starts_with(names.OPTIMIZER_ZERO_GRAD_PREFIX)))
    ).select("rank", "step", pl.col("ts_ns").alias("start"), "kind",
             # a P2P call counted once: its post (c10d::send / recv_, nccl:), not gloo's span around its wait
             (pl.col("kind").is_in(["p2p_send", "p2p_recv"])
              & ~names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.GLOO_PREFIX))).alias("_call"),
             ).collect(**iv.COLLECT)
    # A pipeline's ranks only: those making P2P calls, or whose stage run.json or the traces give (a job with no
    # P2P at all is not a pipeline: its passes are not a schedule's, analysis says "no pipeline found").
    staged = stages.filter(pl.col("stage").is_not_null())["rank"].to_list()
    piped = set(comm.filter(pl.col("_call"))["rank"].unique().to_list()) | set(staged)
    ranks = [r for r in ranks if r in piped]
    ops, comm = ops.filter(pl.col("rank").is_in(ranks)), comm.filter(pl.col("rank").is_in(ranks))
    if not ranks:
        return empty, stages, notes
    # Windows: every op takes the number of cuts at or before its start on its rank.
    cuts = comm.select("rank", pl.col("start").alias("_cut")).sort("rank", "_cut")
    ops = ops.sort("start").join_asof(
        cuts.with_columns(pl.int_range(1, pl.len() + 1).over("rank").alias("_window")).sort("_cut"),
        left_on="start", right_on="_cut", by="rank", strategy="backward", check_sortedness=False,
    ).with_columns(pl.col("_window").fill_null(0))
    key = ["rank", "step", "_window"]
    bw = pl.col("is_bwd")
    ops = ops.with_columns(pl.col("start").filter(bw).min().over(key).alias("_b0"),
                           pl.col("end").filter(bw).max().over(key).alias("_b1"))
    ops = ops.with_columns(
        pl.when(pl.col("_b0").is_null() | (pl.col("end") <= pl.col("_b0"))).then(pl.lit("pre"))
        .when(pl.col("start") >= pl.col("_b1")).then(pl.lit("post")).otherwise(pl.lit("bwd")).alias("_part"))
    seg = (ops.group_by(*key, "_part").agg(pl.col("start").min(), pl.col("end").max())
           .with_columns(pl.when(pl.col("_part") == "bwd").then(pl.lit("backward")).otherwise(pl.lit("forward"))
                         .alias("phase")))
    # A forward pass ends where its activation leaves (the next call is a send) or its own backward begins (the
    # last stage: a backward in the same window, after it); other work between calls is not a pass.
    # Every pass of a step has its backward: a step runs as many forwards as backwards (one of each per
    # micro-batch and stage held). Of the forward candidates, the step's most graph-building ones (ops autograd's
    # nodes differentiate, then time) are the passes; the rest (data made for the next step, the detach of an
    # output, a helper's buffers) is other compute.
    n_bwd = seg.filter(pl.col("phase") == "backward").group_by("rank", "step").agg(pl.len().alias("_n_bwd"))
    diff = ops.group_by(*key, "_part").agg(pl.col("differentiated").sum())
    seg = (seg.join(diff, on=[*key, "_part"], how="left").join(n_bwd, on=["rank", "step"], how="left")
           .with_columns((pl.col("end") - pl.col("start")).alias("_d"))
           .with_columns(pl.when(pl.col("phase") == "forward").then(
               pl.struct(pl.col("differentiated"), pl.col("_d")).rank("ordinal", descending=True)
               .over("rank", "step", "phase")).alias("_rank_in_step"))
           .filter((pl.col("phase") == "backward")
                   | ((pl.col("differentiated") > 0) & (pl.col("_rank_in_step") <= pl.col("_n_bwd").fill_null(0))))
           .filter(pl.col("end") > pl.col("start")))
    # A backward pass begins where the thread last did something else: autograd's engine records nothing until it
    # runs the first node, and the time from the preceding call's return or forward's last op is the backward
    # call's own (its arguments, the engine starting).
    ends = (events.lazy().filter(~pl.col("is_gpu") & pl.col("rank").is_in(ranks)
                                 & (pl.col("kind").is_in(["p2p_send", "p2p_recv", "collective"])
                                    | names.name_test(pl.col("name"),
                                                      lambda t: t.str.starts_with(names.OPTIMIZER_STEP_PREFIX))))
            .select("rank", (pl.col("ts_ns") + pl.col("dur_ns")).alias("_prev")).collect(**iv.COLLECT))
    before = pl.concat([ends, seg.filter(pl.col("phase") == "forward").select("rank", pl.col("end").alias("_prev"))])
    seg = (seg.sort("start").join_asof(before.sort("_prev"), left_on="start", right_on="_prev", by="rank",
                                       strategy="backward", check_sortedness=False)
           .join(steps_of(events, ranks), on=["rank", "step"], how="left")
           .with_columns(pl.when((pl.col("phase") == "backward") & pl.col("_prev").is_not_null())
                         .then(pl.max_horizontal("_prev", "_step_start")).otherwise(pl.col("start")).alias("start")))
    counts = (seg.group_by("rank", "step").agg((pl.col("phase") == "forward").sum().alias("F"),
                                               (pl.col("phase") == "backward").sum().alias("B"))
              .join(comm.filter(pl.col("_call")).group_by("rank", "step")
                    .agg(pl.len().alias("calls"), pl.col("kind").sort_by("start").first().alias("first")),
                    on=["rank", "step"], how="left"))
    # Stages the caller does not know.
    stages = stages.clone()
    known = {r: s for r, s in stages.select("rank", "stage").rows() if s is not None}
    filled: dict[int, tuple[int, str]] = {}
    group = pipeline_group_stages(traces)
    for r in ranks:
        if r not in known and r in group:
            filled[r] = (group[r][0], "from megatron-core's pipeline process group")
    firsts = (counts.filter(pl.col("first").is_not_null()).group_by("rank")
              .agg(pl.col("first").cast(pl.String).mode().first()))
    first_of = dict(firsts.rows())
    talking = sorted(first_of)
    world = set(traces["world_size"].drop_nulls().to_list()) if "world_size" in traces.columns else set()
    if (len(talking) == 2 and world <= {2} and sorted(first_of.values()) == ["p2p_recv", "p2p_send"]
            and not any(r in known or r in filled for r in talking)):
        for r in talking:
            filled[r] = (0 if first_of[r] == "p2p_send" else 1,
                         "inferred from P2P call order (the one whose steps open with a send is stage 0)")
    # When each rank's first message of a step arrived (the first receive to return: gloo's span ends at its
    # wait's return, where a receive posted early waits; NCCL's CPU calls return at once, so ranks on GPUs have no
    # such time and are not ordered this way) and when it first sent.
    arrivals = (events.lazy().filter(~pl.col("is_gpu") & pl.col("rank").is_in(talking) & pl.col("step").is_not_null()
                                     & pl.col("kind").is_in(["p2p_send", "p2p_recv"]))
                .group_by("rank", "step")
                .agg((pl.col("ts_ns") + pl.col("dur_ns")).filter(
                    (pl.col("kind") == "p2p_recv")
                    & names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.GLOO_PREFIX))).min()
                     .alias("_in"),
                     pl.col("ts_ns").filter(pl.col("kind") == "p2p_send").min().alias("_out"))
                .collect(**iv.COLLECT))
    openers = sorted(set(arrivals.filter(pl.col("_out") < pl.col("_in").fill_null(pl.col("_out") + 1))["rank"]
                         .to_list()))
    if (len(talking) > 2 and len(openers) == 1 and world <= {len(talking)}
            and arrivals.filter(pl.col("rank") != openers[0])["_in"].null_count() == 0
            and not any(r in known or r in filled for r in talking)):
        # One pipeline, every rank traced: micro-batch 0's activation leaves the first stage (it sends before
        # anything reaches it) and reaches each next stage after the one before forwarded it, so the others' first
        # messages of a step arrive in stage order.
        order = (arrivals.with_columns(pl.when(pl.col("rank") == openers[0]).then(pl.lit(-1, pl.Int64))
                                       .otherwise(pl.col("_in")).alias("_in"))
                 .sort("step", "_in").group_by("step", maintain_order=True).agg(pl.col("rank")))
        orders = {tuple(o) for o in order["rank"].to_list()}
        if len(orders) == 1 and len(next(iter(orders))) == len(talking):
            for i, r in enumerate(next(iter(orders))):
                filled[r] = (i, "inferred from P2P order and timing (stage 0 sends before anything reaches it; "
                                "the others' first messages of a step arrive in stage order)")
        else:
            notes.append(f"{_ranks_text(talking)}: the order in which they first receive in a step differs between "
                         "steps, so their stages are not inferred from it: give run.json's stage_of_rank")
    if filled:
        src = dict(stages.select("rank", "stage_source").rows())
        new = {r: filled.get(r, (known.get(r), src.get(r)))for r in stages["rank"].to_list()}
        stages = stages.with_columns(
            pl.Series("stage", [new[r][0] for r in stages["rank"].to_list()], dtype=pl.Int32),
            pl.Series("stage_source", [new[r][1] for r in stages["rank"].to_list()], dtype=pl.String),
            pl.when(pl.col("rank").is_in(list(filled))).then(
                pl.Series([str(new[r][0]) for r in stages["rank"].to_list()], dtype=pl.String))
            .otherwise(pl.col("stages")).alias("stages"))
        by = {}
        for r, (s, how) in filled.items():
            by.setdefault(how, []).append(r)
        for how, rs in by.items():
            notes.append(f"stage of {_ranks_text(rs)} {how}: "
                         + ", ".join(f"rank {r} → stage {filled[r][0]}" for r in sorted(rs)))
    stage_now = dict(stages.select("rank", "stage").rows())
    # One stage a rank, or several: told on a first stage (stage 0) from its P2P calls against its passes.
    if several is None:
        firsts_ = counts.filter(pl.col("rank").is_in([r for r in ranks if stage_now.get(r) == 0])
                                & pl.col("calls").is_not_null())
        if firsts_.height:
            several = bool((firsts_["calls"] != firsts_["F"] + firsts_["B"]).any())
            if several:
                notes.append("the first stage makes more P2P calls per step than it runs passes "
                             f"({_ranks_text(firsts_['rank'].unique().to_list())}): its ranks hold several (virtual) "
                             "stages, as in interleaved schedules")
    rows = seg.join(stages.select("rank", "stage"), on="rank", how="left")
    numbered = _numbered_by_plan(rows, plan) if several and plan is not None else None
    if numbered is not None:
        rows = numbered
        notes.append(f"{_ranks_text(ranks)}: several stages a rank; the stage and micro-batch of each pass are the "
                     f"{plan[0]} order's for run.json's {plan[2]} stages a rank and {plan[3]} micro-batches (the k-th "
                     "forward and backward of a step are the schedule's k-th)")
    elif several:
        rows = rows.with_columns(pl.lit(None, pl.Int32).alias("microbatch"))
        notes.append(f"{_ranks_text(ranks)}: several stages a rank and no names that say which pass is whose: each "
                     "phase's time is attributed, the stage and micro-batch of a pass are not known (listed under "
                     "the rank's first stage, with no micro-batch); run.json's stages_of_rank and num_microbatches "
                     "say how many, not which")
    else:
        rows = rows.sort("start").with_columns(
            pl.int_range(pl.len(), dtype=pl.Int32).over("rank", "step", "phase").alias("microbatch"))
        if several is None:
            notes.append(f"{_ranks_text(ranks)}: one stage a rank assumed (no first stage in the traces to tell it "
                         "from its P2P calls; run.json's stages_of_rank says otherwise if it is not)")
        uneven = counts.filter(pl.col("F") != pl.col("B"))
        if uneven.height:
            notes.append(f"{_ranks_text(uneven['rank'].unique().to_list())}: forward and backward passes of a step "
                         "differ in number (first: rank {}, step {}: {} and {}), so their micro-batch numbers do "
                         "not pair".format(*uneven.sort("rank", "step").select("rank", "step", "F", "B").row(0)))
    unstaged = sorted({r for r in rows["rank"].unique().to_list() if stage_now.get(r) is None})
    if unstaged:
        notes.append(f"stage of {_ranks_text(unstaged)} not determined from the traces (no peers in the P2P calls: "
                     "record_shapes was off): their passes have no stage; give run.json's stage_of_rank")
    got = sorted(rows["rank"].unique().to_list())
    if got:
        notes.append(f"schedule of {_ranks_text(got)} inferred from torch.profiler's default events: backward "
                     "passes from autograd's ops, passes cut at the communication calls and the optimizer's ranges "
                     "(no annotations, no Python frames, no P2P peers)")
    out = rows.select("rank", "step", "stage", "microbatch", "phase", pl.col("start").alias("start_ns"),
                      pl.col("end").alias("end_ns"), pl.lit("autograd").alias("source"))
    out = pl.concat([conform(out, SCHEDULE), _optimizer_preparation(ops, rows, comm, stages)])
    return conform(out, SCHEDULE).sort("rank", "step", "start_ns"), stages, notes


def _optimizer_preparation(ops: pl.DataFrame, passes: pl.DataFrame, comm: pl.DataFrame,
                           stages: pl.DataFrame) -> pl.DataFrame:
    """An "optimizer" row per (rank, step) for the compute between the step's last pass or collective and torch.optim's
    ``Optimizer.step#`` range: the gradients' clipping and unscaling a framework does before the step (DeepSpeed's
    OptimizerStep instruction clips there), which no pass holds."""
    opt = (comm.filter(pl.col("kind").cast(pl.String).is_in(["p2p_send", "p2p_recv", "collective"]).not_())
           .group_by("rank", "step").agg(pl.col("start").min().alias("_opt")))
    before = pl.concat([passes.select("rank", "step", pl.col("end").alias("_after")),
                        comm.filter(pl.col("kind") == "collective").select("rank", "step", pl.col("start")
                                                                            .alias("_after"))])
    prep = (ops.join(opt, on=["rank", "step"])
            .join(before.join(opt, on=["rank", "step"]).filter(pl.col("_after") < pl.col("_opt"))
                  .group_by("rank", "step").agg(pl.col("_after").max()), on=["rank", "step"])
            .filter((pl.col("start") >= pl.col("_after")) & (pl.col("end") <= pl.col("_opt")))
            .group_by("rank", "step").agg(pl.col("start").min().alias("start_ns"), pl.col("_opt").first()
                                          .alias("end_ns")))
    return conform(prep.join(stages.select("rank", "stage"), on="rank", how="left").with_columns(
        pl.lit(None, pl.Int32).alias("microbatch"), pl.lit("optimizer").alias("phase"),
        pl.lit("autograd").alias("source")), SCHEDULE)
