"""The pipeline seen from the traces: P2P messages and their pairing, the stage of each rank, and the schedule.

P2P pairing (docs/architecture.md): the k-th send a→b matches the k-th recv b←a with the same tag, channel and step.
For each pair, ``data_ready_ns = max(recv_post_ns, send_start_ns)``: before it the receiver waited for its peer, after it
bytes were moving. The schedule comes from annotations (``PP:{stage}{ACTION}{mb}``, PyTorch's ``Forward {i}`` /
``Backward {i}``) or, for ranks without any, is inferred from P2P order (see ``infer_schedule``). Nothing is invented:
a rank whose stage or micro-batches cannot be determined gets no schedule rows and a note says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from traceana import intervals as iv
from traceana import names
from traceana.classify import inside
from traceana.manifest import Manifest
from traceana.pipeline_rules import SCHEDULES, placement_of, stages_of_ranks
from traceana.schema import P2P, SCHEDULE, conform
from traceana.timeline import training_tracks

# Extra columns kept beside schema.P2P for the sender's side of each pair.
P2P_EXTRA = {"send_end_ns": pl.Int64}

MESSAGE = {
    "rank": pl.Int32, "dir": pl.String, "channel": pl.String, "peer": pl.Int32, "tag": pl.Int32,
    "nbytes": pl.Int64, "step": pl.Int32, "post_ns": pl.Int64, "end_ns": pl.Int64, "on_gpu": pl.Boolean,
    "launch_ns": pl.Int64,  # when the CPU issued it (= post_ns on CPU ranks; the kernel's launch on GPU ranks)
}


def pipeline_groups(peers: dict[int, list[int]]) -> list[tuple[int, ...]]:
    """Connected components of the P2P graph (an edge either way joins two ranks), each sorted, by lowest rank.

    Peers that are not ranks of the run (a trace that names a rank whose file is missing) are left out: they hold
    no events to analyse; ``analyze`` of the group reports their unmatched messages as it would for the whole run.
    """
    parent = {r: r for r in peers}

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for r, ps in peers.items():  # union-find over a few thousand ranks: the driver's only per-rank work
        for p in ps:
            if p in parent:
                a, b = root(r), root(p)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for r in sorted(peers):
        groups.setdefault(root(r), []).append(r)
    return [tuple(g) for _, g in sorted(groups.items())]


# --- messages and pairs --------------------------------------------------------------------------------------
def bpipe_groups(traces: pl.DataFrame) -> pl.DataFrame:
    """``rank, group_ranks``: the members (global ranks, in group-rank order) of each rank's BPipe process group,
    from the trace's process groups (ingest reads them from ``distributedInfo.pg_config``)."""
    return (
        traces.select("rank", "process_groups").explode("process_groups").unnest("process_groups")
        .filter(pl.col("desc").str.contains(names.BPIPE_GROUP_DESC, literal=True)
                & pl.col("ranks").list.contains(pl.col("rank")))
        .select(pl.col("rank").cast(pl.Int32), pl.col("ranks").cast(pl.List(pl.Int32)).alias("group_ranks"))
    )


def messages(events: pl.DataFrame, groups: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per P2P message a rank sent or received (MESSAGE columns).

    GPU ranks: the NCCL SendRecv kernel (start = when the GPU began the transfer, end = when it completed). CPU ranks:
    the post op (``c10d::send``/``c10d::recv_``, else record_param_comms / ``nccl:*``) extended to the end of the
    matching ``gloo:send``/``gloo:recv`` span, which lasts until wait() returned.
    """
    # (A few lazy queries instead of ~20 eager operations, docs/performance.md "Fixed cost".)
    comm = events.lazy().filter(pl.col("comm_dir").is_not_null() & pl.col("step").is_not_null()).collect(
        **iv.COLLECT)
    if not comm.height:  # no P2P op in a step (one rank, a data-parallel job): the queries below would find none
        return conform(pl.DataFrame(), MESSAGE)
    comm = comm.lazy()
    end = pl.col("ts_ns") + pl.col("dur_ns")
    kernels = comm.filter(pl.col("is_gpu") & (pl.col("cat") == "kernel"))
    cpu = comm.filter(~pl.col("is_gpu"))
    posts = cpu.filter(pl.col("cat") != "user_annotation").with_columns(
        pl.when(names.text(pl.col("name")).str.starts_with(names.C10D_PREFIX)).then(0)
        .when(pl.col("name") == names.RECORD_PARAM_COMMS).then(1).otherwise(2).alias("_prio")
    )
    # One post source per rank (c10d ops contain record_param_comms on some builds: do not count twice).
    posts, spans = pl.collect_all([
        posts.filter(pl.col("_prio") == pl.col("_prio").min().over("rank")).with_row_index("_post"),
        cpu.filter(pl.col("cat") == "user_annotation").select(
            "rank", "track", "comm_dir", pl.col("ts_ns").alias("_span_start"), end.alias("_span_end")),
    ], **iv.COLLECT)
    if spans.height and posts.height:
        attached = (
            spans.sort("_span_start")
            .join_asof(posts.select("rank", "track", "comm_dir", "ts_ns", "_post").sort("ts_ns"),
                       left_on="_span_start", right_on="ts_ns", by=["rank", "track", "comm_dir"],
                       strategy="backward", check_sortedness=False)
            .filter(pl.col("_post").is_not_null())
            .group_by("_post").agg(pl.col("_span_end").max())
        )
        posts = posts.join(attached, on="_post", how="left")
    else:
        posts = posts.with_columns(pl.lit(None, pl.Int64).alias("_span_end"))
    gpu_msg_ranks = kernels.select("rank").unique()
    cpu_msgs = posts.lazy().join(gpu_msg_ranks, on="rank", how="anti").with_columns(
        pl.max_horizontal(end, pl.col("_span_end")).alias("end_ns"), pl.lit(False).alias("on_gpu"))
    gpu_msgs = kernels.with_columns(end.alias("end_ns"), pl.lit(True).alias("on_gpu"))
    out = pl.concat(
        [m.select("rank", pl.col("comm_dir").cast(pl.String).alias("dir"), pl.col("channel").cast(pl.String),
                  "peer", "tag", "nbytes", "step",
                  pl.col("ts_ns").alias("post_ns"), "end_ns", "on_gpu", "launch_ns")
         for m in (cpu_msgs, gpu_msgs)],
        how="vertical_relaxed",
    ).collect(**iv.COLLECT)
    # A receive posted ahead of time (BPipe prefetches saved activations) is BPipe traffic if its wait returns
    # inside a receiving BPipe span (LOAD on the evictor, ACCEPT on the acceptor).
    receiving = iv.merge(
        events.lazy().filter(pl.col("pp_action").is_in([names.LOAD, names.ACCEPT]))
        .select("rank", pl.col("ts_ns").alias("start"), end.alias("end")).collect(**iv.COLLECT), "rank")
    if receiving.height:
        ends_inside = inside(out.with_columns((pl.col("end_ns") - 1).alias("_last")), "_last", receiving)
        out = out.with_columns(pl.when(pl.lit(ends_inside) & (pl.col("dir") == "recv")).then(pl.lit("bpipe"))
                               .otherwise(pl.col("channel")).alias("channel"))
    # c10d records the peer as a rank *within the process group*: map BPipe traffic (which runs on its own group)
    # back to global ranks.
    if groups is not None and groups.height:
        out = (
            out.join(groups, on="rank", how="left")
            .with_columns(pl.when((pl.col("channel") == "bpipe") & pl.col("group_ranks").is_not_null()
                                  & (pl.col("peer") < pl.col("group_ranks").list.len()))
                          .then(pl.col("group_ranks").list.get(pl.col("peer"), null_on_oob=True))
                          .otherwise(pl.col("peer")).alias("peer"))
            .drop("group_ranks")
        )
    return conform(out.lazy(), MESSAGE).sort("rank", "post_ns").collect(**iv.COLLECT)


def pair(msgs: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, list[str]]:
    """Match sends with recvs. Returns (pairs: schema.P2P + send_end_ns, unmatched messages, the messages with the
    channel of their pair, notes)."""
    # Messages between two ranks match in posting order per tag, whatever we think they carry (that is how gloo
    # and NCCL match them), so the channel is not a key: a pair is BPipe traffic if either side says so.
    keys = ["src", "dst", "tag", "step"]
    # A few lazy queries instead of ~30 eager operations (docs/performance.md "Fixed cost").
    m = msgs.lazy().with_columns(pl.col("tag").fill_null(-1)).with_row_index("_row")
    # A message whose peer is its own rank was recorded with a rank *within its process group* (gloo's c10d ops do
    # not say which group; NCCL's are mapped in ingest): it names no rank of the run, so it is never paired (a
    # "pair" with itself would make a one-rank ring of the P2P chain) and stays unmatched, with a note.
    to_self = m.filter(pl.col("peer") == pl.col("rank"))
    m = m.filter(pl.col("peer").is_null() | (pl.col("peer") != pl.col("rank")))

    def side(direction: str, me: str, other: str, post: str, end: str) -> pl.LazyFrame:
        """One direction's messages numbered in posting order per (src, dst, tag, step)."""
        return (
            m.filter(pl.col("dir") == direction).rename({"rank": me, "peer": other})
            .sort("post_ns").with_columns(pl.int_range(pl.len()).over(keys).cast(pl.Int32).alias("seq"))
            .select(*keys, "seq", pl.col("_row").alias(f"_{direction}_row"),
                    pl.col("channel").alias(f"{direction}_channel"), pl.col("nbytes").alias(f"{direction}_nbytes"),
                    pl.col("post_ns").alias(post), pl.col("end_ns").alias(end))
        )

    sends = side("send", "src", "dst", "send_start_ns", "send_end_ns")
    recvs = side("recv", "dst", "src", "recv_post_ns", "recv_end_ns")
    joined = (
        sends.join(recvs, on=[*keys, "seq"], how="full", coalesce=True, nulls_equal=True)
        .with_columns(pl.when((pl.col("send_channel") == "bpipe") | (pl.col("recv_channel") == "bpipe"))
                      .then(pl.lit("bpipe")).otherwise(pl.lit("p2p")).alias("channel"))
    )
    # No messages (one rank, a data-parallel job): the same empty tables, planned but not run (two queries).
    n_msgs = msgs.height
    joined = joined.collect(**iv.COLLECT) if n_msgs else _empty(joined)
    matched = joined.lazy().filter(pl.col("send_start_ns").is_not_null() & pl.col("recv_post_ns").is_not_null())
    # Clamp so that wait and transfer are never negative even on slightly skewed clocks.
    ready = pl.min_horizontal(pl.max_horizontal("recv_post_ns", "send_start_ns"), "recv_end_ns")
    pairs = matched.with_columns(
        ready.alias("data_ready_ns"), pl.coalesce("recv_nbytes", "send_nbytes").alias("nbytes"),
    ).with_columns(
        (pl.col("data_ready_ns") - pl.col("recv_post_ns")).alias("wait_ns"),
        (pl.col("recv_end_ns") - pl.col("data_ready_ns")).alias("transfer_ns"),
    )
    pairs = conform(pairs, {**P2P, **P2P_EXTRA}).sort("step", "src", "dst", "tag", "seq")
    unmatched_sends = joined.lazy().filter(pl.col("recv_post_ns").is_null() & pl.col("send_start_ns").is_not_null())
    unmatched_recvs = joined.lazy().filter(pl.col("send_start_ns").is_null() & pl.col("recv_post_ns").is_not_null())
    unmatched = pl.concat([
        to_self.select("rank", "dir", pl.lit("p2p").alias("channel"), "step", pl.col("post_ns").alias("start"),
                       pl.col("end_ns").alias("end"), pl.col("peer").alias("_peer")),
        unmatched_sends.select(pl.col("src").alias("rank"), pl.lit("send").alias("dir"), "channel", "step",
                               pl.col("send_start_ns").alias("start"), pl.col("send_end_ns").alias("end"),
                               pl.col("dst").alias("_peer")),
        unmatched_recvs.select(pl.col("dst").alias("rank"), pl.lit("recv").alias("dir"), "channel", "step",
                               pl.col("recv_post_ns").alias("start"), pl.col("recv_end_ns").alias("end"),
                               pl.col("src").alias("_peer")),
    ])
    rows = pl.concat([joined.lazy().select(pl.col("_send_row").alias("_row"), "channel"),
                      joined.lazy().select(pl.col("_recv_row").alias("_row"), "channel")]).drop_nulls("_row")
    msgs = (
        msgs.lazy().with_row_index("_row").join(rows.rename({"channel": "_pair_channel"}), on="_row", how="left")
        .with_columns(pl.coalesce("_pair_channel", "channel").alias("channel")).drop("_row", "_pair_channel")
    )
    if n_msgs:
        pairs, unmatched, msgs, to_self = pl.collect_all([pairs, unmatched, msgs, to_self.select("rank")],
                                                         **iv.COLLECT)
    else:
        pairs, unmatched, msgs, to_self = (_empty(q) for q in (pairs, unmatched, msgs, to_self.select("rank")))
    notes = []
    if to_self.height:
        on = sorted(set(to_self["rank"].to_list()))
        notes.append(f"{to_self.height} P2P messages on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} "
                     "name their own rank as the peer: the trace records peers as ranks within a process group, "
                     "and does not say which group, so they are not matched to any rank (nor used for stages or "
                     "clocks); the other peers of such a trace may be group ranks too — give run.json's "
                     "stage_of_rank, or profile with NCCL, whose messages name their group")
    # Whether a peer's trace is missing or its messages just do not line up, each rank's side is reported.
    for label, direction in (("sends", "send"), ("recvs", "recv")):
        frame = unmatched.filter(pl.col("dir") == direction) if unmatched.height else unmatched
        if frame.height:
            per = frame.group_by("rank", "_peer").agg(pl.len()).sort("rank", "_peer")
            desc = "; ".join(f"rank {a}→{b}: {n}" if label == "sends" else f"rank {a}←{b}: {n}"
                             for a, b, n in per.rows())
            # a peer with no P2P event in the run (its trace missing) is said so, not blamed on step numbers
            absent = sorted(set(per["_peer"].drop_nulls().to_list()) - set(msgs["rank"].unique().to_list()))
            why = "messages pair within a step, so ranks numbering their steps apart pair none"
            if absent:
                why = (f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))}: no P2P event in the "
                       "run (no trace, or one without its messages)"
                       + (f"; {why}" if set(per["_peer"].drop_nulls().to_list()) - set(absent) else ""))
            notes.append(f"{frame.height} P2P {label} have no counterpart in the peer's trace in the same "
                         f"ProfilerStep ({desc}; {why}); "
                         "their time counts as waiting, with no wait/transfer split")
    unmatched = unmatched.drop("_peer")
    return pairs, unmatched, msgs, notes


def _empty(query: pl.LazyFrame) -> pl.DataFrame:
    """What ``query`` gives on empty inputs: no rows, its planned columns."""
    return pl.DataFrame(schema=query.collect_schema())


# --- stages --------------------------------------------------------------------------------------------------
def stage_map(
    events: pl.DataFrame, traces: pl.DataFrame, manifest: Manifest | None, pairs: pl.DataFrame,
    msgs: pl.DataFrame | None = None, *, overlapped: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, list[str]]:
    """``rank, stage, stage_source, stages`` for every rank: run.json, else the trace's own metadata, else the stage
    in its PP: annotations, else the position in the P2P neighbour chain. Unknown stays null (with a note).

    ``stage`` is the rank's first stage; ``stages`` lists every (virtual) stage it holds, e.g. ``"0,3"`` on rank 0
    of a V schedule: from run.json's ``stages_of_rank``, else the PP: annotations, else the trace metadata's
    ``stages``, else ``stage`` alone.
    ``overlapped``: ``overlap_rows(events)``, if the caller has it already."""
    ranks = sorted(set(traces["rank"].to_list()) | set(events["rank"].unique().to_list()))
    known: dict[int, tuple[int, str]] = {}
    if manifest is not None and manifest.stage_of_rank is not None:
        for r in ranks:
            if r < len(manifest.stage_of_rank):
                known[r] = (manifest.stage_of_rank[r], "run.json")
    if "stage" in traces.columns:
        for r, s in traces.select("rank", "stage").drop_nulls().rows():
            known.setdefault(r, (s, "trace metadata"))
    overlapped = (overlap_rows(events) if overlapped is None else overlapped).lazy().select("rank", "pp_stage")
    annotated = (
        pl.concat([events.lazy().filter(pl.col("pp_stage").is_not_null()
                                        & pl.col("pp_action").is_in(list(names.COMPUTE_ACTIONS)))
                   .select("rank", "pp_stage"),
                   overlapped])
        .group_by("rank").agg(pl.col("pp_stage").min().alias("first"), pl.col("pp_stage").unique().sort().alias("all"))
        .collect(**iv.COLLECT)
    )
    # the stages in the PP: annotations, else those the trace's metadata lists (names without a stage number,
    # e.g. Megatron-LM's, leave only the metadata to tell), overridden by run.json's stages_of_rank
    virtual: dict[int, list[int]] = {**metadata_stages(traces), **{r: list(all_) for r, _, all_ in annotated.rows()}}
    for r, st in enumerate((manifest.stages_held or ()) if manifest is not None else ()):
        virtual[r] = list(st)
    for r, s, _ in annotated.rows():
        known.setdefault(r, (s, "annotations"))
    notes: list[str] = []
    p2p = pairs.filter(pl.col("channel") == "p2p") if len(known) < len(ranks) else pairs.clear()
    cut: list[Placement] = []
    if p2p.height:  # (without P2P pairs there is no chain: its inputs, a pass over the events, are not built)
        found, n = placements(p2p, *_placement_inputs(events, msgs, pairs))
        notes += n
        # A chain's first rank holds stage 0 only if nothing is upstream of it: one that also exchanges P2P with
        # a rank that has no trace here (a lost file, a run profiled on some ranks only) may have stages before it,
        # and counting positions from it numbers every rank of the chain too low.
        absent = _absent_peers(msgs if msgs is not None else pairs.clear(), ranks)
        cut = [pl_ for pl_ in found if absent.get(pl_.order[0])]
        for pl_ in cut:
            notes.append(
                f"ranks {', '.join(map(str, pl_.order))} form a P2P chain whose first rank ({pl_.order[0]}) also "
                f"exchanges P2P with rank{'s' if len(absent[pl_.order[0]]) > 1 else ''} "
                f"{', '.join(map(str, absent[pl_.order[0]]))}, which has no trace here: the stages before it are not "
                "in the run, so their stage numbers are not determined (give run.json's stage_of_rank, or the "
                "missing traces)")
        for pl_ in (x for x in found if x not in cut):
            held = pl_.stages()
            source = "inferred from P2P chain" if pl_.kind == "single" else f"{PATTERN_SOURCE} ({pl_.kind})"
            guessed = [r for r in pl_.order if r not in known]
            for i, r in enumerate(pl_.order):
                if r not in known:
                    known[r] = (i, source)  # a rank's first stage is its position, in every placement
                    virtual[r] = held[r] or []
            if guessed and pl_.kind != "single":
                notes.append(placement_note(pl_, guessed))
    unknown = [r for r in ranks if r not in known and not any(r in x.order for x in cut)]
    if unknown:
        which, they = ("rank", "it gets") if len(unknown) == 1 else ("ranks", "they get")
        facts = "no run.json" if manifest is None else "run.json gives no stage_of_rank"
        notes.append(f"stage of {which} {', '.join(map(str, unknown))} could not be determined ({facts}, no "
                     f"annotations, not on a P2P chain): {they} no schedule")
    first = [known.get(r, (None, None))[0] for r in ranks]
    return pl.DataFrame(
        {"rank": ranks, "stage": first, "stage_source": [known.get(r, (None, "unknown"))[1] for r in ranks],
         "stages": [",".join(map(str, virtual.get(r, [] if s is None else [s]))) or None for r, s in zip(ranks, first)]},
        schema={"rank": pl.Int32, "stage": pl.Int32, "stage_source": pl.String, "stages": pl.String},
    ), notes


PATTERN_SOURCE = "inferred from P2P pattern"  # stage_source of ranks whose several stages the P2P pattern showed


def _absent_peers(msgs: pl.DataFrame, ranks: list[int]) -> dict[int, list[int]]:
    """rank -> the P2P peers (channel p2p) it exchanged messages with that have no trace among ``ranks``."""
    if msgs.height == 0 or "peer" not in msgs.columns:
        return {}
    rank_col = "rank" if "rank" in msgs.columns else "src"
    gone = (msgs.lazy().filter((pl.col("channel") == "p2p") & pl.col("peer").is_not_null()
                               & ~pl.col("peer").is_in(ranks) & (pl.col("peer") != pl.col(rank_col)))
            .group_by(rank_col).agg(pl.col("peer").unique().sort()).collect(**iv.COLLECT))
    return {r: p for r, p in gone.rows()}


def several_stages(stages: pl.DataFrame) -> list[int]:
    """Ranks of a ``stage_map`` that hold several stages, or that the P2P pattern shows do (how many unknown)."""
    return sorted(stages.filter(pl.col("stages").str.contains(",", literal=True).fill_null(False)
                                | pl.col("stage_source").str.starts_with(PATTERN_SOURCE))["rank"].to_list())


def _placement_inputs(events: pl.DataFrame, msgs: pl.DataFrame | None, pairs: pl.DataFrame
                      ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """What ``placements`` reads besides the pairs: when each P2P send was issued on the CPU timeline (on a GPU
    rank the kernel's launch: the CPU runs ahead of the GPU), and each rank's first backward op of each step."""
    if msgs is not None:
        sends = msgs.filter((pl.col("dir") == "send") & (pl.col("channel") == "p2p") & pl.col("peer").is_not_null()
                            & pl.col("step").is_not_null()).select(
            "rank", "peer", "step", pl.when(pl.col("on_gpu")).then(pl.col("launch_ns")).otherwise(pl.col("post_ns"))
            .alias("at"))
    else:
        sends = pairs.filter(pl.col("channel") == "p2p").select(
            pl.col("src").alias("rank"), pl.col("dst").alias("peer"), "step", pl.col("send_start_ns").alias("at"))
    first_backward = (
        events.select("rank", "step", "ts_ns", "name", "is_gpu", "kind")  # a filter copies only these columns
        .filter(~pl.col("is_gpu") & (pl.col("kind") == "compute") & pl.col("step").is_not_null())
        .filter(_backward_like(pl.col("name")))  # the text test on those events only
        .group_by("rank", "step").agg(pl.col("ts_ns").min().alias("at"))
        .select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int32), "at")
    )
    return sends.with_columns(pl.col("rank", "peer", "step").cast(pl.Int32)), first_backward


def placement_note(placement: "Placement", ranks: list[int]) -> str:
    """What the P2P pattern showed about ``ranks`` (of ``placement``'s group), and what it could not tell."""
    p, o = len(placement.order), placement.order
    what = {
        "v": f"a V placement (rank r holds stages r and 2p−1−r, as in ZB-V and DualPipe-V: here {p} ranks, "
             f"{2 * p} stages" + (f", {placement.microbatches} micro-batches" if placement.microbatches else "") + ")",
        "looped": "a looped placement (rank r holds stages r, r+p, …, as in interleaved 1F1B, looped BFS and "
                  "zero-bubble: " + (f"{placement.virtual} stages a rank, {placement.virtual * p} stages"
                                     + (f", {placement.microbatches} micro-batches" if placement.microbatches else "")
                                     if placement.virtual else
                                     "how many stages a rank could not be determined from the message counts")
                  + ")",
        "several": "several stages a rank, in a placement that could not be determined",
    }[placement.kind]
    return (f"ranks {', '.join(map(str, ranks))} (pipeline order {'→'.join(map(str, o))}): the P2P pattern shows "
            f"{what}: {placement.why}")


@dataclass(frozen=True)
class Placement:
    """How the stages of one pipeline group (ranks joined by P2P) sit on its ranks, as its P2P pattern shows."""

    order: tuple[int, ...]  #: the group's ranks in pipeline order: the first holds stage 0
    kind: str  #: single | looped | v | several (several stages a rank, placement unknown)
    virtual: int | None  #: stages per rank; None where the pattern cannot tell
    microbatches: int | None  #: per step, where the message counts tell
    why: str  #: the evidence, for the note

    def stages(self) -> dict[int, list[int] | None]:
        """rank -> every stage it holds (None where that cannot be told)."""
        if self.kind == "single" or (self.kind in ("looped", "v") and self.virtual):
            per = stages_of_ranks(self.kind, len(self.order), self.virtual or 1)
            return {r: per[i] for i, r in enumerate(self.order)}
        return {r: None for r in self.order}


def _majority(values: list) -> object:
    return max(set(values), key=values.count) if values else None


def placements(pairs: pl.DataFrame, sends: pl.DataFrame, first_backward: pl.DataFrame
               ) -> tuple[list[Placement], list[str]]:
    """The placement of every pipeline group, from rank-pair facts (a few rows per step, not events):

    - order: the first message between two neighbours in a step is an activation (every schedule runs micro-batch
      0's forward before any backward), so it points downstream; the neighbours form a chain (one stage per rank,
      or a V) or a ring (a looped placement on 3 or more ranks: the last rank sends to the first), whose head is
      the rank that sends the step's first message.
    - several stages a rank: with one stage per rank, a message to an upstream neighbour is a gradient, sent after
      the sender's first backward work of the step. One sent before it is an activation flowing back (V, or a
      looped placement on 2 ranks).
    - which: the last stage runs the step's first backward (every other backward waits for its gradient). On the
      first rank it is a V (rank r: r, 2p−1−r); on the last a looped placement (rank r: r, r+p, …).
    - how many: a V holds two stages a rank (2m messages each way on each link); on a ring, a link carries v·m
      messages each way and the wrap-around (v−1)·m, so v = n / (n − n_wrap).

    ``pairs``: matched P2P pairs (channel p2p). ``sends``: rank, peer, step, at (when each P2P send was issued, on
    the CPU timeline). ``first_backward``: rank, step, at (the rank's first backward op of the step)."""
    if pairs.height == 0:
        return [], []
    first = (
        pairs.with_columns(pl.min_horizontal("src", "dst").alias("a"), pl.max_horizontal("src", "dst").alias("b"))
        .sort("send_start_ns").group_by("step", "a", "b", maintain_order=True).first()
        .group_by("src", "dst").agg(pl.len().alias("n"))
    )
    # Per neighbour pair, the direction most steps agree on.
    votes: dict[tuple[int, int], int] = {}
    for src, dst, n in first.rows():
        key = (min(src, dst), max(src, dst))
        votes[key] = votes.get(key, 0) + (n if src < dst else -n)
    down: dict[int, list[int]] = {}
    up: dict[int, list[int]] = {}
    for (a, b), vote in votes.items():
        u, d = (a, b) if vote >= 0 else (b, a)
        down.setdefault(u, []).append(d)
        up.setdefault(d, []).append(u)
    # connected components of the neighbour graph: one per pipeline (data-parallel replicas are separate groups)
    comp: dict[int, int] = {}
    for start in sorted(set(down) | set(up)):
        if start in comp:
            continue
        todo = [start]
        while todo:
            r = todo.pop()
            if r not in comp:
                comp[r] = start
                todo += [*down.get(r, []), *up.get(r, [])]
    counts = pairs.group_by("step", "src", "dst").agg(pl.len().alias("n"))
    first_sender = pairs.sort("send_start_ns").group_by("step", maintain_order=True).agg(pl.col("src"))
    bwd0 = {(r, s): t for r, s, t in first_backward.rows()}
    out: list[Placement] = []
    notes: list[str] = []
    for head_of in sorted(set(comp.values())):
        nodes = sorted(r for r, c in comp.items() if c == head_of)
        if any(len(down.get(r, [])) > 1 or len(up.get(r, [])) > 1 for r in nodes):
            notes.append(f"ranks {', '.join(map(str, nodes))}: the P2P neighbour graph is not a chain or a ring (a rank "
                         "talks to several up- or downstream peers): their stages cannot be inferred from it")
            continue
        heads = [r for r in nodes if r not in up]
        ring = not heads
        if ring:  # the step's first message leaves the head
            in_group = [next((x for x in srcs if x in nodes), None) for srcs in first_sender["src"].to_list()]
            heads = [_majority([x for x in in_group if x is not None])]
        order = [heads[0]]
        while len(order) < len(nodes) and down.get(order[-1]) and down[order[-1]][0] not in order:
            order.append(down[order[-1]][0])
        if len(order) < len(nodes):
            notes.append(f"ranks {', '.join(map(str, nodes))}: the P2P neighbour graph is neither a chain nor one "
                         "ring: their stages cannot be inferred from it")
            continue
        pos = {r: i for i, r in enumerate(order)}
        p = len(order)
        # the rank running the step's first backward, in most steps
        steps_ = sorted({s for (r, s) in bwd0 if r in pos})
        firsts = [min((bwd0[(r, s)], r) for r in order if (r, s) in bwd0)[1] for s in steps_]
        loss_rank = _majority(firsts)
        n = {(s, a, b): c for s, a, b, c in counts.filter(pl.col("src").is_in(order)).rows()}
        names_ = ", ".join(map(str, order))
        if ring:
            wrap = [c for (s, a, b), c in n.items() if (a, b) == (order[-1], order[0])]
            links = [c for (s, a, b), c in n.items() if a in pos and b in pos and pos[b] == pos[a] + 1]
            n1, n0 = (sorted(links)[len(links) // 2] if links else 0), (sorted(wrap)[len(wrap) // 2] if wrap else 0)
            v = n1 // (n1 - n0) if n1 > n0 and n1 % (n1 - n0) == 0 else None
            out.append(Placement(tuple(order), "looped", v, n1 // v if v else None,
                                 f"the last rank ({order[-1]}) and the first ({order[0]}) exchange P2P: the neighbours "
                                 "form a ring"))
            continue
        early = (sends.filter(pl.col("rank").is_in(order) & pl.col("peer").is_in(order))
                 .join(first_backward.rename({"at": "_bwd"}), on=["rank", "step"], how="inner")
                 .filter(pl.col("at") < pl.col("_bwd")))
        back = sorted({(r, q) for r, q in early.select("rank", "peer").rows() if pos[q] < pos[r]})
        if not back:
            out.append(Placement(tuple(order), "single", 1, None, "the P2P neighbours form a chain"))
            continue
        why = (", ".join(f"rank {r} sends to rank {q}" for r, q in back) + ", upstream, before any backward work "
               "of its step (so activations flow back towards the first rank, not only gradients)")
        if p > 1 and loss_rank == order[0]:
            both = [c for (s, a, b), c in n.items() if abs(pos[a] - pos[b]) == 1]
            m = both[0] // 2 if both and len(set(both)) == 1 and both[0] % 2 == 0 else None
            out.append(Placement(tuple(order), "v", 2, m, f"{why}, and the step's first backward runs on the first "
                                 f"rank ({order[0]}), which therefore also holds the last stage"))
        elif loss_rank == order[-1]:
            out.append(Placement(tuple(order), "looped", None, None, f"{why}, and the step's first backward runs on "
                                 f"the last rank ({order[-1]}), which holds the last stage"))
        else:
            out.append(Placement(tuple(order), "several", None, None, why))
    return out, notes


def metadata_stages(traces: pl.DataFrame) -> dict[int, list[int]]:
    """Per rank, the stages its trace metadata (the ``traceana`` object our profiler writes) lists under ``stages``,
    sorted; ranks without such a list are absent. One small JSON document per rank, parsed in Python."""
    out: dict[int, list[int]] = {}
    if "meta" in traces.columns:
        for rank, meta in traces.select("rank", "meta").rows():
            try:
                stages = json.loads(meta).get("stages") if meta else None
            except (ValueError, AttributeError):
                continue
            if isinstance(stages, list) and stages and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                           for x in stages):
                out[rank] = sorted(set(stages))
    return out


def virtual_stage_ranks(traces: pl.DataFrame) -> list[int]:
    """Ranks whose trace metadata lists several stages (``metadata_stages``)."""
    return sorted(r for r, st in metadata_stages(traces).items() if len(st) > 1)


# --- schedule ------------------------------------------------------------------------------------------------
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
    bwd = events.filter(~pl.col("is_gpu") & (pl.col("kind") == "compute") & _backward_like(pl.col("name"))).select(
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
    sp = (overlap_spans(events) if spans is None else spans).lazy().filter(pl.col("_bwd_start").is_not_null())  # one query (docs/performance.md)
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


def _backward_like(name: pl.Expr) -> pl.Expr:
    return names.name_test(name, lambda t: t.str.starts_with(names.AUTOGRAD_PREFIX) | t.str.contains(r"Backward\d*$"))


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
    roles = (
        msgs.filter((pl.col("channel") == "p2p") & pl.col("peer").is_not_null())
        .join(st.select("rank", "stage"), on="rank").join(stage_of, on="peer", how="left")
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
        .with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end"), _backward_like(pl.col("name")).alias("_bwd"))
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


# --- what the annotations show, against run.json ---------------------------------------------------------------------
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


def annotated_facts(schedule: pl.DataFrame) -> dict:
    """What the annotated forward/backward spans show: ``num_microbatches`` (the most distinct micro-batches any
    (rank, step) runs forwards of), ``interleaved`` (some rank starts a forward after one of its backwards in a
    step, as 1F1B does and GPipe never does; with the first such (rank, step, micro-batch)), and ``missing``
    ((rank, step, phase, micro-batch) rows that one annotated rank lacks while another has them in that step).
    None where nothing is annotated."""
    a = schedule.filter((pl.col("source") == "annotated") & pl.col("microbatch").is_not_null()
                        & pl.col("phase").is_in(list(names.PASS_PHASES)) & pl.col("step").is_not_null())
    if not a.height:
        return {"num_microbatches": None, "interleaved": None, "missing": None}
    fwd = pl.col("phase") == "forward"
    a = a.lazy()  # the rest is one collect_all (docs/performance.md "Fixed cost")
    per = a.group_by("rank", "step").agg(
        m=pl.col("microbatch").filter(fwd).n_unique(),
        first_b=pl.col("start_ns").filter(~fwd).min(),
        late_f=pl.col("microbatch").filter(fwd).sort_by(pl.col("start_ns").filter(fwd)).last(),
        last_f=pl.col("start_ns").filter(fwd).max(),
    )
    late = per.filter(pl.col("last_f") > pl.col("first_b")).sort("rank", "step")
    have = a.select("rank", "step", pl.col("phase").replace(dict.fromkeys(names.BACKWARD_PHASES, "backward")),
                    "microbatch").unique()
    expected = have.select("rank", "step").unique().join(have.select("step", "phase", "microbatch").unique(),
                                                          on="step")
    missing = expected.join(have, on=["rank", "step", "phase", "microbatch"], how="anti").sort(
        "rank", "step", "phase", "microbatch")
    held = a.filter(pl.col("stage").is_not_null()).group_by("rank").agg(pl.col("stage").unique().sort())
    per_rank = held.select(n=pl.col("stage").list.len())
    per, late, missing, stages, per_rank, held = pl.collect_all(
        [per, late, missing, a.select(pl.col("stage").drop_nulls().unique()),
         per_rank.select(most=pl.col("n").max(), least=pl.col("n").min(), ranks=pl.len()), held], **iv.COLLECT)
    return {"num_microbatches": int(per["m"].max() or 0) or None,
            "interleaved": late.row(0, named=True) if late.height else False,
            "missing": missing, "stages": set(stages["stage"].to_list()),
            "stages_per_rank": (per_rank["least"][0], per_rank["most"][0]) if per_rank["ranks"][0] else None,
            "stages_of_rank": dict(held.rows())}


def contradiction_notes(facts: dict, manifest: Manifest | None) -> list[str]:
    """Notes naming where run.json's schedule or micro-batch count contradicts the annotations, and the micro-batches
    whose annotations one rank lacks (``annotated_facts``)."""
    notes = []
    missing = facts.get("missing")
    if missing is not None and missing.height:
        shown = ", ".join(f"rank {r} step {s} {p} of micro-batch {mb}" for r, s, p, mb in missing.head(4).rows())
        notes.append(f"{missing.height} forward/backward annotation{'s' if missing.height > 1 else ''} missing on "
                     f"one rank while the others have them ({shown}{', …' if missing.height > 4 else ''}): that "
                     "work's time counts as other compute there, not as forward/backward")
    if manifest is None:
        return notes
    m = facts.get("num_microbatches")
    if m and manifest.num_microbatches and m != manifest.num_microbatches:
        notes.append(f"run.json says num_microbatches {manifest.num_microbatches} but the traces' annotations show {m} "
                     f"micro-batches per step: the traces' {m} are used — fix num_microbatches in run.json")
    listed = manifest.stage_of_rank or ()
    wrong = [(r, listed[r], st) for r, st in sorted(facts.get("stages_of_rank", {}).items())
             if 0 <= r < len(listed) and listed[r] not in st]
    if wrong:
        r, said, st = wrong[0]
        notes.append(f"run.json's stage_of_rank puts rank {r} on stage {said}, but its annotations name stage"
                     f"{'s' if len(st) > 1 else ''} {', '.join(map(str, st))}"
                     f"{f' (and {len(wrong) - 1} more ranks)' if len(wrong) > 1 else ''}: the per-stage tables "
                     "follow run.json, so they label that work with another stage — fix stage_of_rank in run.json")
    placement = placement_contradiction(facts, manifest)
    if placement:
        notes.append(f"{placement}: the traces' stages are what analyze uses; validate refuses to simulate it — fix "
                     "schedule (or virtual_stages) in run.json")
    kind = observed_schedule(facts, manifest)
    if kind is not None and kind != manifest.schedule:
        why = (f"rank {facts['interleaved']['rank']} starts the forward of micro-batch "
               f"{facts['interleaved']['late_f']} after a backward, as 1F1B does" if kind == "1f1b"
               else "every rank runs all its forwards before any backward, as GPipe does")
        notes.append(f"run.json says schedule {manifest.schedule} but in the traces {why}: {kind} is what the "
                     f"traces show and what validate simulates — fix schedule in run.json")
    return notes


def placement_contradiction(facts: dict, manifest: Manifest | None) -> str | None:
    """Where run.json's schedule places a number of stages on each rank (``pipeline_rules.placement_of``: one, two
    for the V schedules, run.json's ``virtual_stages`` or more than one for the looped ones, one also for
    zero-bubble) that the annotated
    ranks do not hold (``annotated_facts``' stages per rank): what run.json says against what the traces show, or
    None (no annotated stages, no run.json schedule, or they agree)."""
    seen = facts.get("stages_per_rank")
    if manifest is None or seen is None or manifest.schedule not in SCHEDULES:
        return None
    least, most = seen
    placement = placement_of(manifest.schedule)
    want = 1 if placement == "single" else 2 if placement == "v" else manifest.stages_a_rank
    if want is not None and least == most == want or want is None and least > 1:
        return None
    # torch's ScheduleInterleavedZeroBubble also runs one stage per rank: ZB-H1 (docs/schedules.md, "Bubbles")
    if want is None and manifest.schedule == "zero-bubble" and least == most == 1:
        return None
    holds = f"{least}" if least == most else f"{least} to {most}"
    says = f"{want} stage{'s' if want != 1 else ''}" if want else "several stages"
    return (f"run.json says schedule {manifest.schedule}, which places {says} on each rank, but the traces' "
            f"annotations give each rank {holds}")


def observed_schedule(facts: dict, manifest: Manifest | None) -> str | None:
    """``1f1b`` or ``gpipe`` as the annotations show it when run.json names one of those two (the only pair the
    order of forwards and backwards tells apart, one stage per rank); None when they cannot tell."""
    if manifest is None or manifest.schedule not in ("gpipe", "1f1b") or facts.get("interleaved") is None:
        return None
    if facts["interleaved"]:
        return "1f1b"
    # 1F1B's last stage alternates forward and backward from the first micro-batch on; with one micro-batch, one
    # stage, or the last stage not annotated, all-forwards-then-backwards tells nothing.
    m, pp = facts.get("num_microbatches") or 0, manifest.pp or 0
    return "gpipe" if m >= 2 and pp >= 2 and (pp - 1) in facts.get("stages", ()) else None


def traced_manifest(manifest: Manifest | None, schedule: pl.DataFrame, *, facts: dict | None = None
                    ) -> Manifest | None:
    """run.json with its ``num_microbatches`` and ``schedule`` replaced by what the annotated schedule shows where
    the two contradict (``contradiction_notes`` says so): what MFU and validate use, so that neither computes from a
    micro-batch count or a schedule the run did not have. ``facts``: ``annotated_facts(schedule)``, if the caller
    has them already."""
    import dataclasses

    from traceana.errors import BadInputError

    if manifest is None:
        return None
    facts = annotated_facts(schedule) if facts is None else facts
    changes: dict = {}
    m = facts["num_microbatches"]
    if m and manifest.num_microbatches and m != manifest.num_microbatches:
        changes["num_microbatches"] = m
    kind = observed_schedule(facts, manifest)
    if kind is not None and kind != manifest.schedule:
        changes["schedule"] = kind
    if not changes:
        return manifest
    try:
        return dataclasses.replace(manifest, **changes)
    except BadInputError:
        return manifest
