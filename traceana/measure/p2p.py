"""P2P messages and their pairing, and the pipeline groups (the P2P graph's components).

Pairing (docs/architecture.md): the k-th send a→b matches the k-th recv b←a with the same tag, channel and step.
For each pair, ``data_ready_ns = max(recv_post_ns, send_start_ns)``: before it the receiver waited for its peer, after it
bytes were moving. On GPU ranks the two sides are the NCCL kernels: a receive kernel spins until the send kernel has
started (and a send kernel until the receive's has), so the same split separates waiting from moving bytes there.
Moving ``nbytes`` takes at least ``nbytes / link_bytes_per_s`` (``min_transfer_ns``): where the measured split leaves
less (clocks of two hosts a little apart, a timeline converted from another tool), the split moves earlier, so that no
transfer is shorter than the link allows; the bandwidth assumed is ``LINK_BYTES_PER_S`` unless run.json's
``link_bytes_per_s`` gives the run's own.

Between two CPU ranks (gloo) a message also takes at most ``max_transfer_ns``: its bytes over the slowest link such a
pair plausibly has (``CPU_LINK_BYTES_PER_S``, or run.json's ``link_bytes_per_s``) plus one message's latency
(``CPU_MESSAGE_LATENCY_NS``, or run.json's ``p2p_latency_ns``). The receive returns when the peer's process has made
the progress the transfer needs (gloo moves bytes on both processes' threads: the sender's post, its loop writing the
socket), so a receive that returns later than that after both sides were ready was waiting on its peer, not moving
bytes: the split moves later, to ``recv_end_ns − max_transfer_ns`` (the bytes are taken to move last, just before the
return). GPU ranks have no ceiling (a NCCL kernel moves bytes from the moment both kernels run). The ceiling is never
below the floor. Nothing is invented: messages without a counterpart stay unmatched, with a
note.
"""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.schema import P2P, conform
from traceana.core.units import GB, MB, NS_PER_MS, NS_PER_S, NS_PER_US
from traceana.ingest.process_groups import process_groups
from traceana.measure.classify import inside

# Extra columns kept beside schema.P2P for the sender's side of each pair, and the shortest transfer its bytes allow.
P2P_EXTRA = {"send_end_ns": pl.Int64, "min_transfer_ns": pl.Int64, "max_transfer_ns": pl.Int64}
# The link a transfer's floor assumes (bytes/s): the fastest a pipeline message between two GPUs takes, NVLink 4
# (H100 SXM: 900 GB/s both directions, 450 GB/s one way; NVIDIA H100 datasheet). The floor must not exceed the real
# transfer time, so the assumption is the fastest link, not a typical one: a slower link's transfers are longer than
# the floor, which then changes nothing. run.json's ``link_bytes_per_s`` replaces it.
LINK_BYTES_PER_S = 450e9
# The transfer ceiling between CPU ranks (module doc) must not fall short of a real transfer, so it assumes the slowest
# link a gloo pipeline plausibly runs over, 1 Gb/s Ethernet (125e6 bytes/s; loopback and faster networks take less),
# and a message's latency beyond its bytes: gloo's post, its loop thread writing and reading the socket, the waiting
# thread waking up. 300 µs covers every message that found both sides ready in the gloo runs of tests/data (Megatron
# 1F1B and interleaved, DeepSpeed: 57-270 µs from both ready to the receive's return, profiler overhead included;
# the others, 0.7-5.8 ms, waited on the peer: docs/schedules.md "Waiting or transfer"). run.json's
# ``link_bytes_per_s`` and ``p2p_latency_ns`` replace them.
CPU_LINK_BYTES_PER_S = 125e6
CPU_MESSAGE_LATENCY_NS = 300_000

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


def bpipe_groups(traces: pl.DataFrame) -> pl.DataFrame:
    """``rank, group_ranks``: the members (global ranks, in group-rank order) of each rank's BPipe process group,
    from the trace's process groups (ingest reads them from ``distributedInfo.pg_config``)."""
    return (
        process_groups(traces, pl.col("desc").str.contains(names.BPIPE_GROUP_DESC, literal=True))
        .filter(pl.col("ranks").list.contains(pl.col("rank")))
        .select(pl.col("rank").cast(pl.Int32), pl.col("ranks").cast(pl.List(pl.Int32)).alias("group_ranks"))
    )


# The communication events' columns ``messages`` reads.
_COMM_READ = ("rank", "comm_dir", "step", "is_gpu", "cat", "name", "track", "ts_ns", "dur_ns", "channel", "peer", "tag",
              "nbytes", "launch_ns")


def messages(events: pl.DataFrame, groups: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per P2P message a rank sent or received (MESSAGE columns).

    GPU ranks: the NCCL SendRecv kernel (start = when the GPU began the transfer, end = when it completed). CPU ranks:
    the post op (``c10d::send``/``c10d::recv_``, else record_param_comms / ``nccl:*``) extended to the end of the
    matching ``gloo:send``/``gloo:recv`` span, which lasts until wait() returned.
    """
    # (A few lazy queries instead of ~20 eager operations, docs/performance.md "Fixed cost".)
    # (only the columns read below: the classified events hold ~27, and the graph passes them all — 236 MiB
    # above its input at 4,096 ranks with every column, 90 MiB with these)
    have = events.collect_schema().names()
    comm = (events.lazy().filter(pl.col("comm_dir").is_not_null() & pl.col("step").is_not_null())
            .select([c for c in _COMM_READ if c in have]).collect(**iv.COLLECT))
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


def link_bandwidth(config) -> float:
    """The bandwidth (bytes/s) the transfer floor assumes: the run's ``link_bytes_per_s`` (``RunConfig``, from
    run.json), else LINK_BYTES_PER_S."""
    return float(config.link_bytes_per_s or LINK_BYTES_PER_S)


def transfer_ceiling(config) -> tuple[float, int]:
    """(bytes/s, latency ns) of the transfer ceiling between CPU ranks (module doc): the run's ``link_bytes_per_s``
    and ``p2p_latency_ns`` (``RunConfig``, from run.json) where given, else CPU_LINK_BYTES_PER_S and
    CPU_MESSAGE_LATENCY_NS."""
    latency = config.p2p_latency_ns
    return (float(config.link_bytes_per_s or CPU_LINK_BYTES_PER_S),
            int(latency) if latency is not None else CPU_MESSAGE_LATENCY_NS)


def pair(msgs: pl.DataFrame, *, link_bytes_per_s: float = LINK_BYTES_PER_S,
         ceiling: tuple[float, int] = (CPU_LINK_BYTES_PER_S, CPU_MESSAGE_LATENCY_NS),
         ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, list[str]]:
    """Match sends with recvs. Returns (pairs: schema.P2P + P2P_EXTRA, unmatched messages, the messages with the
    channel of their pair, notes). ``link_bytes_per_s``: the link the transfer floor assumes; ``ceiling``: the
    (bytes/s, latency ns) of the ceiling between CPU ranks (module doc)."""
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
                    pl.col("on_gpu").alias(f"_{direction}_on_gpu"),
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
    # Clamp so that wait and transfer are never negative even on slightly skewed clocks, so that the transfer is
    # never shorter than its bytes take on the link, and, between CPU ranks, never longer than its bytes on the
    # slowest link plus a message's latency (module doc).
    ready = pl.min_horizontal(pl.max_horizontal("recv_post_ns", "send_start_ns"), "recv_end_ns")
    floor = (pl.col("nbytes").cast(pl.Float64) * (NS_PER_S / link_bytes_per_s)).ceil().cast(pl.Int64).fill_null(0)
    top = ((pl.col("nbytes").cast(pl.Float64).fill_null(0) * (NS_PER_S / ceiling[0])).ceil().cast(pl.Int64) + ceiling[1])
    cpu_pair = ~pl.col("_send_on_gpu").fill_null(True) & ~pl.col("_recv_on_gpu").fill_null(True)
    pairs = matched.with_columns(
        pl.coalesce("recv_nbytes", "send_nbytes").alias("nbytes"),
    ).with_columns(floor.alias("min_transfer_ns")).with_columns(
        pl.when(cpu_pair).then(pl.max_horizontal(top, "min_transfer_ns")).alias("max_transfer_ns"),
    ).with_columns(
        pl.max_horizontal(pl.min_horizontal(pl.max_horizontal(ready, pl.col("recv_end_ns") - pl.col("max_transfer_ns")),
                                            pl.col("recv_end_ns") - pl.col("min_transfer_ns")),
                          "recv_post_ns").alias("data_ready_ns"),
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
    floored = (pairs.with_columns(ready.alias("_measured_ready"))
               .filter(pl.col("data_ready_ns") < pl.col("_measured_ready"))) if pairs.height else pairs
    if floored.height:
        notes.append(f"{floored.height} of {pairs.height} P2P messages left less transfer time after the peer was "
                     f"ready than their bytes take at {link_bytes_per_s / GB:g} GB/s (the link assumed: "
                     f"{'run.json link_bytes_per_s' if link_bytes_per_s != LINK_BYTES_PER_S else 'NVLink 4, one way'}"
                     "): their wait/transfer split was moved earlier by "
                     f"{(floored['_measured_ready'] - floored['data_ready_ns']).sum() / NS_PER_MS:,.3f} ms in all, so no "
                     "transfer is shorter than the link allows (clocks of two hosts a little apart, or a faster link: "
                     "set run.json's link_bytes_per_s)")
    waited = (pairs.with_columns(ready.alias("_measured_ready"))
              .filter(pl.col("data_ready_ns") > pl.col("_measured_ready"))) if pairs.height else pairs
    if waited.height:
        per, worst = waiting_per_rank_step(waited)
        notes.append(f"{waited.height} of {pairs.height} P2P messages between CPU ranks returned later after both "
                     f"sides were ready than their bytes and a message's latency need ({ceiling[0] / MB:g} MB/s, "
                     f"{ceiling[1] / NS_PER_US:g} µs; run.json link_bytes_per_s, p2p_latency_ns): that time counts as "
                     "waiting on the peer's process, not transfer (docs/schedules.md \"Waiting or transfer\") — "
                     f"{per['ns'].sum() / NS_PER_MS:,.3f} ms on the receiving ranks over {per.height} "
                     f"rank-step{'s' if per.height != 1 else ''} "
                     "(messages waiting at once counted once), at most "
                     f"{worst['ns'] / NS_PER_MS:,.3f} ms on rank {worst['rank']} in step {worst['step']}")
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


def waiting_per_rank_step(waited: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """The receiving ranks' waiting on their peers' processes (``_measured_ready`` → ``data_ready_ns`` of each
    message that waited) as time per (rank, step): the spans merged, so that messages in flight at once count once
    and no rank waits longer than it ran. Returns (rank, step, ns) and its largest row."""
    spans = (waited.select(pl.col("dst").alias("rank"), "step", pl.col("_measured_ready").alias("_s"),
                           pl.col("data_ready_ns").alias("_e"))
             .sort("rank", "step", "_s"))
    key = ["rank", "step"]
    merged = (
        spans.with_columns(_reach=pl.col("_e").cum_max().shift(1).over(key))
        .with_columns(_block=(pl.col("_reach").is_null() | (pl.col("_s") > pl.col("_reach"))).cum_sum().over(key))
        .group_by(*key, "_block").agg(pl.col("_s").min(), pl.col("_e").max())
        .group_by(key).agg(ns=(pl.col("_e") - pl.col("_s")).sum())
        .sort(key)
    )
    return merged, merged.sort("ns", descending=True).row(0, named=True)


def _empty(query: pl.LazyFrame) -> pl.DataFrame:
    """What ``query`` gives on empty inputs: no rows, its planned columns."""
    return pl.DataFrame(schema=query.collect_schema())



# A message's peer where the trace names none (torch.profiler's defaults: record_shapes off, so c10d's Concrete
# Inputs are not written): its direction is its pass's. A send belongs to the pass its rank last started before
# posting it; a receive to the pass that consumed it: the one running when it returned (torch.distributed.pipelining
# waits inside the action), else the next to start. A forward sends its activation to the next stage and receives
# from the previous one; a backward (B, or its input half I) sends its gradient to the previous stage and receives
# from the next one.
SENDS_TO = {"forward": 1, "backward": -1, "backward_input": -1}
RECEIVES_FROM = {"forward": -1, "backward": 1, "backward_input": 1}


def peers_from_schedule(msgs: pl.DataFrame, schedule: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """``msgs`` (MESSAGE) with each missing peer taken from the schedule (rank, step, stage, phase, start_ns, end_ns):
    the rank holding the adjacent stage its pass sends to or receives from (module constants above); pairing then
    matches them in order between the two ranks, as gloo and NCCL do. A peer stays unknown where the pass is not
    known (no schedule row around it), the adjacent stage does not exist, or several ranks hold it (data-parallel
    replicas, unless every such stage holds as many ranks as its neighbour: then by place, below). Returns the
    messages and counts: ``missing`` (messages without a peer), ``given`` (peers taken from the schedule),
    ``by_place`` (of those, between stages of several ranks: the i-th rank of one to the i-th of the other),
    ``ambiguous`` (left unknown: their adjacent stage held by several ranks, a different number)."""
    missing = msgs.filter(pl.col("peer").is_null() & (pl.col("channel") == "p2p"))
    counts = {"missing": missing.height, "given": 0, "ambiguous": 0, "by_place": 0}
    if missing.height == 0 or schedule.height == 0:
        return msgs, counts
    passes = (schedule.filter(pl.col("phase").is_in(list(SENDS_TO)) & pl.col("stage").is_not_null())
              .select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int32), pl.col("stage").cast(pl.Int32),
                      pl.col("phase").cast(pl.String), "start_ns", "end_ns").sort("start_ns"))
    holders = passes.group_by("stage").agg(pl.col("rank").unique().sort().alias("_holders"))
    # a rank's place among its stage's ranks (its replica where each stage's ranks are its replicas in rank order)
    place = (passes.select("rank", "stage").unique().sort("rank")
             .with_columns(pl.int_range(pl.len()).over("stage").alias("_place"))
             .join(holders.select("stage", pl.col("_holders").list.len().alias("_n")), on="stage")
             .group_by("rank").agg(pl.col("_place").first(), pl.col("_n").first()))
    m = missing.with_row_index("_i").with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int32))
    sends = (m.filter(pl.col("dir") == "send").sort("post_ns")
             .join_asof(passes.rename({"start_ns": "_ps", "end_ns": "_pe"}), left_on="post_ns", right_on="_ps",
                        by=["rank", "step"], strategy="backward", check_sortedness=False)
             .with_columns(pl.col("phase").replace_strict(SENDS_TO, default=None).alias("_dir")))
    recv = m.filter(pl.col("dir") == "recv").sort("end_ns")
    running = recv.join_asof(passes.rename({"start_ns": "_ps", "end_ns": "_pe"}), left_on="end_ns", right_on="_ps",
                             by=["rank", "step"], strategy="backward", check_sortedness=False)
    nxt = recv.join_asof(passes.rename({"start_ns": "_ps", "end_ns": "_pe", "stage": "_ns", "phase": "_nph"}),
                         left_on="end_ns", right_on="_ps", by=["rank", "step"], strategy="forward",
                         check_sortedness=False).select("_i", "_ns", "_nph")
    recvs = (running.join(nxt, on="_i", how="left")
             .with_columns(pl.when(pl.col("_pe") >= pl.col("end_ns")).then("stage").otherwise("_ns").alias("stage"),
                           pl.when(pl.col("_pe") >= pl.col("end_ns")).then("phase").otherwise("_nph").alias("phase"))
             .with_columns(pl.col("phase").replace_strict(RECEIVES_FROM, default=None).alias("_dir")))
    both = pl.concat([sends.select("_i", "rank", "stage", "_dir"), recvs.select("_i", "rank", "stage", "_dir")])
    # several ranks per stage: the i-th rank of one stage is taken to talk to the i-th of the next (the layout
    # rank = stage · dp + replica of Megatron, DeepSpeed and traceana collect) where both hold as many ranks
    peer = (both.with_columns((pl.col("stage") + pl.col("_dir")).alias("stage"))
            .join(holders, on="stage", how="left").join(place, on="rank", how="left")
            .with_columns(pl.when(pl.col("_holders").list.len() == 1).then(pl.col("_holders").list.first())
                          .when(pl.col("_holders").list.len() == pl.col("_n"))
                          .then(pl.col("_holders").list.get(pl.col("_place"), null_on_oob=True))
                          .alias("_peer"),
                          (pl.col("_holders").list.len() > 1).fill_null(False).alias("_ambiguous")))
    counts["by_place"] = int((peer["_ambiguous"] & peer["_peer"].is_not_null()).sum())
    counts["ambiguous"] = int((peer["_ambiguous"] & peer["_peer"].is_null()).sum())
    filled = m.join(peer.select("_i", "_peer"), on="_i", how="left")
    counts["given"] = int(filled["_peer"].is_not_null().sum())
    out = pl.concat([msgs.filter(~(pl.col("peer").is_null() & (pl.col("channel") == "p2p"))),
                     filled.with_columns(pl.col("_peer").alias("peer")).drop("_i", "_peer").cast(msgs.schema)],
                    how="vertical_relaxed")
    return out.sort("rank", "post_ns"), counts


def replica_of(ranks: list[int], pairs: pl.DataFrame) -> pl.DataFrame:
    """rank, replica: each rank's pipeline group (the ranks joined by P2P, p2p.pipeline_groups), numbered by
    their lowest rank. No pair at all among several ranks (their messages name no peer, or there are none): which
    ranks form a pipeline is not known, and no replica is invented (null: not one "replica" per rank)."""
    if pairs.height == 0 and len(ranks) > 1:
        return pl.DataFrame({"rank": ranks, "replica": [None] * len(ranks)},
                            schema={"rank": pl.Int32, "replica": pl.Int32})
    peers: dict[int, set[int]] = {r: set() for r in ranks}
    for a, b in pairs.select("src", "dst").unique().rows():  # one row per linked rank pair
        if a in peers and b in peers:
            peers[a].add(b)
            peers[b].add(a)
    groups = pipeline_groups({r: sorted(p) for r, p in peers.items()})
    return pl.DataFrame([(r, i) for i, g in enumerate(groups) for r in g],
                        schema={"rank": pl.Int32, "replica": pl.Int32}, orient="row")


def pipeline_replicas(analysis) -> pl.DataFrame:
    """``replica_of`` the analysis' ranks."""
    return replica_of(sorted(analysis.attribution["rank"].unique().to_list()), analysis.p2p)
