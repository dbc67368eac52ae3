"""GPU ranks in the step graph (causal.graph.build): kernel time, launch → kernel and stream order (issue 32).

On a GPU rank the analysis' schedule rows already span the GPU work their CPU range launched (first compute kernel's
start to the last one's end, ``attribution.gpu_schedule_extents``: the kernels whose runtime launch, found by
correlation id, lies in the row's CPU range), and its P2P messages are its NCCL send/receive kernels (``p2p.messages``).
What this module adds to the graph, all on the GPU's clock:

- **kernel time** (``on_gpu``): an operation's work is the union of its kernels (compute, copies, memsets: the
  rank's GPU work that is not communication), the kernels being those running inside its extent (the latest
  operation starting at or before a kernel's start, if the kernel starts before its end — of the kernel's stream,
  where that is an operation's lane: two operations at once on two streams keep their own), plus the GPU's own idle
  time between kernels it had enqueued already (under ``KERNEL_WAIT_NS``). The rest of the idle time inside the
  extent is not work: it is part of the gap before the operation's work, split below.
- **collectives** (``collective_filter``): a GPU rank's collectives are its NCCL collective kernels (all-reduce,
  all-gather, …: the kind collective, the launching op's process group), not the CPU call that enqueued them: the
  kernel waits on the GPU for every member's kernel, so the members join at the last one's start and each takes what
  it took after that. (NCCL's batched send/receive kernels, ``SendRecv`` with no direction, join no group: which
  peer they talk to is not in the trace, gpu.batched_p2p_notes.)
- **launch → kernel and stream order** (``split_gaps``): the time before an operation's work on a GPU rank, from the
  later of its previous operation's end (the stream's order: one operation at a time, in the order they ran; on its
  lane where the rank ran streams at once, below, the idle time being its lane's) and its
  inputs' arrival (a message's receive kernel, a collective's last member), is the GPU's idle time before each of
  its kernels. Where a kernel's launch (the runtime call's start) came after the idle time began, the GPU waited
  for its CPU to enqueue it: host work (the CPU's Python, its launches, the launch latency), which a what-if of host
  time moves. Where the kernel had been enqueued already, the stream waited for something the graph holds no edge for
  (another stream's work, an event): a wait no edge explains, said in the build's note — except the part of it when
  the rank's GPU ran work of no operation (a kernel launched outside every pass: host work too).
- **stream order between communication kernels** (``stream_order``): a send or receive kernel runs after the one
  before it on its stream (NCCL's: one per communicator); where that one ended inside the message side's lag (its
  producer's end, or its anchor's, to the kernel's start) and this kernel had been launched by then, the side waited
  on that kernel's message: a chain as ``graph._after_receives`` makes for a CPU rank's post after a blocking receive,
  so the side is posted no earlier than that message's arrival and moves with it. The rest of a lag is host work
  where the kernel was launched after the lag began, else a wait no edge explains (LAG_WAIT). An NCCL send kernel
  blocks its stream, not the compute after it: no blocking-send edge (``kernel_message_ranks``; gloo's, sent from
  a GPU rank's CPU, keeps it).

A CPU rank's wait in ``cudaDeviceSynchronize`` (or any call that waits for the GPU) is not in the graph at all on
this clock: it overlaps the kernels it waits for, which are the operations' work; what the CPU did after it returned
is the host time before the next kernel it launched. Making a kernel shorter ends such a wait sooner by as much.

- **streams at once** (``nest_lane``, ``lane_order``): an operation's lane is the stream of the kernel it begins with
  (``on_gpu``; a collective's, its kernel's stream: ``collective_lane``; one that launched no kernel, CPU_LANE). In a
  step where the rank began an operation's work before an earlier one ended, on two lanes or more (DualPipe's
  forward of micro-batch k+1 beside the backward of k, an all-reduce on its stream beside compute), each operation
  follows the previous one of its lane (the stream's order) and, on each other lane, the latest operation there
  that ended by its start (what the timeline shows it came after: an event, or its launch after that end): two
  that ran at once have no edge between them, and the replay (``replay._lanes``, the engine's ``lanes``) runs them
  at once. A span nested in another is part of it only on the same stream (``nest_lane``). A step the rank ran one
  operation at a time keeps its one chain (lane 0), which these edges would reproduce exactly. There a message's
  ends are taken by stream (``message_ends``): a send's producer the operation that ended last by its start, a
  receive's anchor likewise, its consumer the first operation of the payload's kind after its arrival.

Not modelled: the traces' cross-stream events (Kineto's ``cuda_sync`` "Stream Wait Event", with
``wait_on_cuda_event_record_corr_id``: the loader does not read them), so two operations that overlapped stay
independent even where one waited on an event recorded part way through the other; a message's consumer on a rank
running two forwards (or two backwards) at once is the first of them after its arrival; a communication kernel
queued behind a collective kernel on its stream. docs/whatif.md "GPU ranks" has the hand-built steps.
"""

from __future__ import annotations

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.measure import gpu, timeline

# GPU work that is an operation's own time (timeline._GPU_BUSY: what the schedule's GPU extents are made of).
WORK_KINDS = ("compute", "memcpy", "memset")
# Per GPU kernel of an operation (``on_gpu``): its operation (rank, step, and the operation's start ``_os`` on the
# GPU's clock, which names it until the graph numbers the operations), its span and its launch.
# ``_kw``: the idle time before the kernel that is its operation's own (a kernel wait: below).
# ``_ks``: the step the kernel was launched in (the events' step; null outside every step); ``stream``: its stream;
# ``_ol``: its operation's lane (with ``_os`` it names the operation: two operations may begin at one instant on two
# streams).
KERNELS = {"rank": pl.Int32, "step": pl.Int32, "_os": pl.Int64, "start": pl.Int64, "end": pl.Int64,
           "launch_ns": pl.Int64, "_kw": pl.Int64, "_ks": pl.Int32, "stream": pl.Int32, "_ol": pl.Int32}
# Idle time shorter than gpu.KERNEL_WAIT_BELOW_NS before a kernel that was enqueued when its predecessor in the same
# operation ended is the GPU's own time between kernels (HolisticTraceAnalysis' "kernel wait", gpu.idle_breakdown's
# rule): part of the operation's work, not a wait; longer, or before a kernel launched late, it is split as the gap
# is (split_gaps: the same rule as idle_breakdown's "host wait").
KERNEL_WAIT_NS = gpu.KERNEL_WAIT_BELOW_NS


def gpu_ranks(analysis) -> list[int]:
    """The ranks whose traces hold GPU work (``timeline.gpu_ranks``: their busy timeline is the GPU's): their
    operations are on the GPU's clock."""
    ev = analysis.events
    if ev is None or ev.height == 0:
        return []
    return timeline.gpu_ranks(ev)["rank"].to_list()


def kernel_message_ranks(analysis, ranks: list[int]) -> list[int]:
    """The GPU ranks whose P2P messages are kernels (NCCL's send and receive kernels, with a direction): a rank
    sending with gloo from its CPU (host staging) has CPU posts and waits as messages, a CPU rank's."""
    ev = analysis.events
    if not ranks or ev is None:
        return []
    return sorted(ev.lazy().filter(pl.col("is_gpu") & pl.col("comm_dir").is_not_null() & pl.col("rank").is_in(ranks))
                  .select(pl.col("rank").unique()).collect(**iv.COLLECT)["rank"].to_list())


def _launch() -> pl.Expr:
    """A GPU event's launch (its runtime call's start; null where none launched it: ``launch_ns`` is then its own
    start)."""
    return pl.when(pl.col("launch_ns") != pl.col("ts_ns")).then(pl.col("launch_ns")).alias("launch_ns")


# An operation's lane (``on_gpu``, the graph's ``lane`` column): on a GPU rank the stream of the kernel it begins with
# (a collective: its kernel's stream); an operation that launched no kernel runs on its CPU's clock, lane CPU_LANE; a
# CPU rank's operations all on lane 0 (its one thread: one chain, as before the lanes).
CPU_LANE = -1


def _cpu_lane(ranks: list[int]) -> pl.Expr:
    """The lane of an operation on no stream: CPU_LANE on a GPU rank, 0 on a CPU rank."""
    return (pl.when(pl.col("rank").is_in(ranks)).then(pl.lit(CPU_LANE)).otherwise(pl.lit(0))
            .cast(pl.Int32).alias("lane"))


def _begins_on(rows: pl.DataFrame, kernels: pl.DataFrame) -> pl.DataFrame:
    """``rows`` (rank, start_ns, end_ns, …) with ``_lane``: the stream of a kernel (``kernels``: rank, start, end,
    stream) that begins at the row's start — one that also has a kernel ending at the row's end where two streams
    begin a kernel at that instant (a forward and a backward enqueued on two streams, both let go by one event) —,
    null where none does."""
    k = kernels.select(pl.col("rank").cast(pl.Int32), "start", "end", pl.col("stream").cast(pl.Int32))
    begins = k.select("rank", pl.col("start").alias("start_ns"), pl.col("stream").alias("_lane")).unique()
    ends = k.select("rank", pl.col("end").alias("end_ns"), pl.col("stream").alias("_lane"), pl.lit(True).alias("_e")) \
        .unique(["rank", "end_ns", "_lane"])
    r = rows.with_row_index("_row")
    got = (r.select("_row", pl.col("rank").cast(pl.Int32), "start_ns", "end_ns")
           .join(begins, on=["rank", "start_ns"]).join(ends, on=["rank", "end_ns", "_lane"], how="left")
           .sort("_row", pl.col("_e").fill_null(False), "_lane", descending=[False, True, False])
           .unique("_row", keep="first").select("_row", "_lane"))
    return r.join(got, on="_row", how="left", maintain_order="left").drop("_row")


def nest_lane(rows: pl.DataFrame, analysis, ranks: list[int]) -> pl.DataFrame:
    """``rows`` (schedule rows, on the GPU's clock on GPU ranks) with ``_nest``: what a span is nested within
    (``graph._nested_out``' key beside rank and step) — on a GPU rank whose rows begin with kernels of several
    streams, the stream of the kernel a row begins with (a forward on stream 8 inside a backward's span on stream 7
    runs beside it, not in it; CPU_LANE where none), else 0 (every span of the rank, as before the lanes)."""
    ev = analysis.events
    rows = rows.with_columns(pl.lit(0, pl.Int32).alias("_nest"))
    if not ranks or ev is None or rows.height == 0:
        return rows
    kernels = (ev.lazy().filter(pl.col("is_gpu") & (pl.col("dur_ns") > 0) & pl.col("kind").is_in(WORK_KINDS)
                                & pl.col("rank").is_in(ranks))
               .select("rank", pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end"),
                       "stream").collect(**iv.COLLECT))
    got = _begins_on(rows.drop("_nest"), kernels)
    multi = got.group_by("rank").agg(pl.col("_lane").drop_nulls().n_unique().alias("_n")).filter(pl.col("_n") > 1)
    if multi.height == 0:
        return rows
    return (got.with_columns(pl.when(pl.col("rank").is_in(multi["rank"].implode()))
                             .then(pl.col("_lane").fill_null(CPU_LANE)).otherwise(0).cast(pl.Int32).alias("_nest"))
            .drop("_lane"))


def on_gpu(analysis, ops: pl.DataFrame, ranks: list[int]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``ops`` (rank, step, start_ns, end_ns, work_ns, …: the schedule's rows, a GPU rank's spanning its kernels)
    with each GPU rank's operation's work the union of the kernels that run in it — the rank's GPU work that is not
    communication, each kernel the latest operation's starting at or before it, if it starts before that one's end
    —, and those kernels (KERNELS; the GPU work of no operation, e.g. launched outside every pass, with ``_os``
    null)."""
    ev = analysis.events
    if not ranks or ev is None:
        return ops.with_columns(_cpu_lane(ranks)), pl.DataFrame(schema=KERNELS)
    work = (ev.lazy().filter(pl.col("is_gpu") & (pl.col("dur_ns") > 0)
                             & pl.col("kind").is_in(WORK_KINDS) & pl.col("rank").is_in(ranks))
            .select(pl.col("rank").cast(pl.Int32), pl.col("ts_ns").alias("start"),
                    (pl.col("ts_ns") + pl.col("dur_ns")).alias("end"), _launch(), pl.col("step").alias("_ks"),
                    pl.col("stream").cast(pl.Int32))
            .sort("start").collect(**iv.COLLECT))
    if work.height == 0:
        return ops.with_columns(_cpu_lane(ranks)), pl.DataFrame(schema=KERNELS)
    # the operations on the GPU's clock: those whose span begins with a kernel's start and ends with one's end (an
    # operation that launched no kernel keeps its CPU span, and claims none); its lane: the stream of the kernel it
    # begins with
    kend = work.select("rank", pl.col("end").alias("end_ns")).unique()
    starts = (_begins_on(ops.filter(pl.col("rank").is_in(ranks)), work).filter(pl.col("_lane").is_not_null())
              .join(kend, on=["rank", "end_ns"], how="semi")
              .select("rank", "step", pl.col("start_ns").alias("_os"), pl.col("end_ns").alias("_oe"), "_lane")
              .sort("_os"))
    # each kernel the latest operation's of its stream starting at or before it, where its stream is an operation's
    # lane on the rank (two operations running at once on two streams each keep their own kernels); else (a copy on
    # a side stream) the latest operation's of the rank
    lanes = starts.select("rank", pl.col("_lane").alias("stream")).unique()
    on_lane = work.join(lanes, on=["rank", "stream"], how="semi")
    off_lane = work.join(lanes, on=["rank", "stream"], how="anti")
    work = pl.concat([
        on_lane.join_asof(starts.with_columns(pl.col("_lane").alias("stream")).rename({"_lane": "_ol"}),
                          left_on="start", right_on="_os", by=["rank", "stream"], strategy="backward",
                          check_sortedness=False),
        off_lane.join_asof(starts.rename({"_lane": "_ol"}), left_on="start", right_on="_os", by="rank",
                           strategy="backward", check_sortedness=False)], how="diagonal_relaxed")
    work = (work
            .with_columns(pl.when(pl.col("start") < pl.col("_oe")).then(pl.col(c)).alias(c)
                          for c in ("step", "_os", "_ol"))
            .with_columns(pl.when(pl.col("_os").is_not_null()).then(pl.min_horizontal("end", "_oe"))
                          .otherwise("end").alias("end"))  # (a kernel running past its operation's end: its part)
            .sort("rank", "step", "_os", "_ol", "start")
            .with_columns(pl.col("end").cum_max().shift(1).over("rank", "step", "_os", "_ol").alias("_prev"))
            .with_columns(pl.when(pl.col("_os").is_not_null() & (pl.col("start") > pl.col("_prev"))
                                  & (pl.col("start") - pl.col("_prev") < KERNEL_WAIT_NS)
                                  & (pl.col("launch_ns").is_null() | (pl.col("launch_ns") <= pl.col("_prev"))))
                          .then(pl.col("start") - pl.col("_prev")).otherwise(0).alias("_kw"))
            .select(list(KERNELS)).cast(KERNELS))
    ops = _begins_on(ops, work)
    own = work.filter(pl.col("_os").is_not_null())
    op_key = ["rank", "step", "_os", "_ol"]
    union = (iv.merge(own.select(*op_key, "start", "end"), op_key)
             .group_by(op_key).agg((pl.col("end") - pl.col("start")).sum().alias("_u"))
             .join(own.group_by(op_key).agg(pl.col("_kw").sum()), on=op_key)
             .with_columns(pl.col("_u") + pl.col("_kw")))
    ops = (ops.join(union, left_on=["rank", "step", "start_ns", "_lane"], right_on=op_key, how="left",
                    maintain_order="left")
           .with_columns(pl.coalesce("_u", "work_ns").alias("work_ns")).drop("_u", "_kw")
           .with_columns(pl.coalesce("_lane", _cpu_lane(ranks)).cast(pl.Int32).alias("lane")).drop("_lane"))
    return ops, work.sort("rank", "start")


# A cross-lane edge (``lane_order``): operation ``seq`` of ``rank`` starts its work no earlier than the end of
# operation ``after_seq`` of the same rank, on another lane.
AFTER = {"step": pl.Int32, "rank": pl.Int32, "seq": pl.Int32, "after_seq": pl.Int32}


def lane_order(ops: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """``ops`` with one lane (0) where a rank's step ran its operations one at a time, and what orders a rank's
    operations across its lanes where it ran some at once (AFTER; None where none did): there each operation comes
    after the one before it on its own lane (the stream's order: ``graph._gaps``) and,
    on each other lane of its rank, after the latest operation there that ended by the time it began its work — the
    timeline shows it came after that one (an event it waited on, the CPU launching it after it returned); an
    operation that began its work before another lane's operation ended ran beside it and has no edge from it: the
    two overlap in the replay. ``ops``: the graph's operations numbered (``seq``) with their ``lane``.

    With a rank's operations one at a time (whatever their streams) these edges would order them as the one chain
    does — each operation's predecessors are then ancestors of its previous one, whose end is the latest in every
    variant —, so such a rank's step keeps its one chain (lane 0: the graph and its figures as before the lanes).
    The edges are one as-of join per lane id (a handful: the streams' numbers), linear in the operations."""
    if "lane" not in ops.columns or ops.height == 0:
        return ops, None
    ws = (pl.when(pl.col("group").is_not_null()).then("start_ns")
          .otherwise(pl.col("end_ns") - pl.col("work_ns")).alias("_ws"))
    # a step in which the rank began an operation's work before an earlier one of it ended, on two lanes or more
    multi = (ops.select("rank", "step", "seq", "lane", "end_ns", ws).sort("rank", "step", "seq")
             .with_columns(pl.col("end_ns").cum_max().shift(1).over("rank", "step").alias("_before"))
             .group_by("rank", "step")
             .agg((pl.col("lane").n_unique() > 1) & (pl.col("_ws") < pl.col("_before")).any())
             .filter(pl.col("lane")).select("rank", "step"))
    ops = (ops.join(multi.with_columns(pl.lit(True).alias("_multi")), on=["rank", "step"], how="left",
                    maintain_order="left")
           .with_columns(pl.when(pl.col("_multi")).then("lane").otherwise(0).cast(pl.Int32).alias("lane"))
           .drop("_multi"))
    if multi.height == 0:
        return ops, None
    o = (ops.join(multi, on=["rank", "step"], how="semi")
         .select("rank", "step", "seq", "lane", "end_ns", ws))
    out = []
    for lane in sorted(o["lane"].unique().to_list()):  # (the lanes' ids, not the events)
        right = (o.filter(pl.col("lane") == lane)
                 .select("rank", "step", pl.col("seq").alias("after_seq"), pl.col("end_ns").alias("_pe")).sort("_pe"))
        hit = (o.filter(pl.col("lane") != lane).sort("_ws")
               .join_asof(right, left_on="_ws", right_on="_pe", by=["rank", "step"], strategy="backward",
                          check_sortedness=False)
               .filter(pl.col("after_seq").is_not_null() & (pl.col("after_seq") < pl.col("seq"))))
        out.append(hit.select(list(AFTER)).cast(AFTER))
    after = pl.concat(out).sort("step", "rank", "seq", "after_seq")
    return ops, (after if after.height else None)


def message_ends(edges: pl.DataFrame, sent: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame, *, order: list[str],
                 schema: dict, slack_ns: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``graph._edges``' messages (``edges``, with ``sent``: their kernels' spans, row for row) with their ends on
    a rank of several lanes (``lane_order``) taken by stream, not by start: there the operation started last
    before a send can be one running beside its producer on another stream (DualPipe's backward of micro-batch k
    beside the forward of k+1 whose activation is sent). A send kernel starts after the kernels it sends from
    have ended (the stream waits on their event): its **producer** is the operation of its rank that ended last
    by the send's start; a receive kernel is posted on its stream after what it follows ended: its **anchor**
    likewise; its **consumer** is the first operation that began its work after it arrived (less ``slack_ns``, as
    graph._edges) of the payload's kind — an activation (its producer a forward) feeds a forward, a gradient (a
    backward or its input half) a backward or its input half (docs/whatif.md "GPU ranks"). Where none is, the
    message keeps the graph's. Lags follow their new ends; the rows are sorted again (``order``), ``sent`` with
    them. ``win``: the ranks' step windows (an anchor-less post lags from its rank's start)."""
    multi = (ops.group_by("rank", "step").agg(pl.col("lane").n_unique().alias("_n")).filter(pl.col("_n") > 1)
             .select("rank", "step", pl.lit(True).alias("_m")))
    if edges.height == 0 or multi.height == 0:
        return edges, sent
    e = (pl.concat([edges, sent], how="horizontal").with_row_index("_i")
         .join(multi.rename({"rank": "src", "_m": "_ms"}), on=["src", "step"], how="left")
         .join(multi.rename({"rank": "dst", "_m": "_md"}), on=["dst", "step"], how="left"))
    by_end = ops.select("rank", "step", "seq", "end_ns").sort("end_ns")
    prod = (e.filter(pl.col("_ms").is_not_null()).select("_i", "src", "step", "send_start_ns").sort("send_start_ns")
            .join_asof(by_end.rename({"rank": "src", "seq": "_src", "end_ns": "_pe"}), left_on="send_start_ns",
                       right_on="_pe", by=["src", "step"], strategy="backward", check_sortedness=False)
            .filter(pl.col("_src").is_not_null()).select("_i", "_src", "_pe"))
    anchor = (e.filter(pl.col("_md").is_not_null()).select("_i", "dst", "step", "recv_post_ns").sort("recv_post_ns")
              .join_asof(by_end.rename({"rank": "dst", "seq": "_anc", "end_ns": "_ae"}), left_on="recv_post_ns",
                         right_on="_ae", by=["dst", "step"], strategy="backward", check_sortedness=False)
              .filter(pl.col("_anc").is_not_null()).select("_i", "_anc", "_ae"))
    e = (e.join(prod, on="_i", how="left").join(anchor, on="_i", how="left")
         .with_columns(pl.coalesce("_src", "src_seq").alias("src_seq"),
                       pl.when(pl.col("_src").is_not_null()).then(pl.col("send_start_ns") - pl.col("_pe"))
                       .otherwise("send_lag_ns").alias("send_lag_ns"),
                       pl.coalesce("_anc", "anchor_seq").alias("anchor_seq"),
                       pl.when(pl.col("_anc").is_not_null()).then(pl.col("recv_post_ns") - pl.col("_ae"))
                       .otherwise("post_lag_ns").alias("post_lag_ns")))
    # the consumer: the first operation of the payload's kind that began its work after the arrival
    payload = pl.col("action").replace({"I": "B"})
    kind = ops.select(pl.col("rank").alias("src"), "step", pl.col("seq").alias("src_seq"),
                      payload.alias("_kind"))
    by_work = (ops.filter(pl.col("action").is_in(["F", "B", "I"]))
               .select(pl.col("rank").alias("dst"), "step", pl.col("seq").alias("_dst"), payload.alias("_kind"),
                       (pl.col("end_ns") - pl.col("work_ns")).alias("_ws")).sort("_ws"))
    cons = (e.filter(pl.col("_md").is_not_null()).join(kind, on=["src", "step", "src_seq"], how="left")
            .filter(pl.col("_kind").is_in(["F", "B"]))
            .select("_i", "dst", "step", "_kind", (pl.col("recv_end_ns") - slack_ns).alias("_t")).sort("_t")
            .join_asof(by_work, left_on="_t", right_on="_ws", by=["dst", "step", "_kind"], strategy="forward",
                       check_sortedness=False)
            .filter(pl.col("_dst").is_not_null()).select("_i", "_dst"))
    e = (e.join(cons, on="_i", how="left").with_columns(pl.coalesce("_dst", "dst_seq").alias("dst_seq"))
         .sort(["step", *order], nulls_last=True, maintain_order=True))
    return e.select(list(schema)).cast(schema), e.select(sent.columns)


def chain(ops: pl.DataFrame) -> list[str]:
    """What a rank's one-after-another order runs over (``graph._gaps``' previous operation): its lane's operations
    where the graph has lanes, else the rank's."""
    return ["rank", "step", "lane"] if "lane" in ops.columns else ["rank", "step"]


def after_ends(after: pl.DataFrame, ops: pl.DataFrame) -> pl.DataFrame:
    """rank, step, seq, ``_after``: the latest end of the operations of other lanes each operation came after."""
    ends = ops.select("rank", "step", pl.col("seq").alias("after_seq"), pl.col("end_ns").alias("_after"))
    return (after.join(ends, on=["rank", "step", "after_seq"]).group_by("rank", "step", "seq")
            .agg(pl.col("_after").max()))


def collective_lane() -> pl.Expr:
    """A collective event's lane (``graph._collectives``): a GPU rank's collective kernel its stream, a CPU call 0
    (the CPU rank's one chain)."""
    return pl.when(pl.col("is_gpu")).then(pl.col("stream")).otherwise(0).cast(pl.Int32).alias("lane")


def lane_notes(ops: pl.DataFrame) -> list[str]:
    """What the build says of the lanes: the ranks whose operations ran at once on two streams (and how many such
    pairs it found), and where the order could not be told from streams (an operation that launched no kernel:
    its CPU's clock)."""
    if "lane" not in ops.columns:
        return []
    multi = ops.group_by("rank", "step").agg(pl.col("lane").n_unique().alias("_n")).filter(pl.col("_n") > 1)
    o = ops.join(multi, on=["rank", "step"], how="semi").select("rank", "step", "seq", "lane", "start_ns", "end_ns")
    # (beside another stream's: an operation that began before an earlier one of its rank ended, not on its lane)
    o = (o.sort("rank", "step", "seq")
         .with_columns(pl.col("end_ns").cum_max().shift(1).over("rank", "step").alias("_before"),
                       pl.col("end_ns").cum_max().shift(1).over("rank", "step", "lane").alias("_mine")))
    both = o.filter((pl.col("start_ns") < pl.col("_before"))
                    & (pl.col("_mine").is_null() | (pl.col("start_ns") >= pl.col("_mine"))))
    if both.height == 0:
        return []
    ranks = sorted(both["rank"].unique().to_list())
    said = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    notes = [f"rank{'s' if len(ranks) > 1 else ''} {said}: {both.height} operations began before an earlier one of "
             "their rank ended, on another stream: they run at once in the replay, ordered by their streams and by "
             "what the timeline shows each came after on the other streams (the latest operation there that ended "
             "before it began). The traces' cross-stream events (cudaStreamWaitEvent) are not read: two operations that "
             "ran at once have no edge between them in any what-if, even where one waited on an event recorded part "
             "way through the other"]
    cpu = o.filter((pl.col("lane") == CPU_LANE) & pl.col("rank").is_in(ranks))
    if cpu.height:
        notes.append(f"{cpu.height} operations of those ranks launched no kernel: their stream is unknown, and they "
                     "are ordered by their CPU spans against the streams' operations")
    return notes


def _kernel_keys(work: pl.DataFrame, ops: pl.DataFrame) -> pl.DataFrame:
    """``work`` (on_gpu's kernels) with ``_key``: its rank and lane in one integer (rank · 1024 + the lane's index
    on the rank): an operation's kernels its lane's, a kernel of no operation its stream's lane where that is one of
    the rank's lanes, else every lane's (a copy on a side stream holds each lane's idle time alike)."""
    lanes = (ops.select("rank", "lane").unique().sort("rank", "lane")
             .with_columns(pl.int_range(pl.len()).over("rank").alias("_li")))
    key = (pl.col("rank") * 1024 + pl.col("_li")).cast(pl.Int32).alias("_key")
    # (a step the rank ran one operation at a time has one lane: lane_order)
    multi = (ops.group_by("rank", "step").agg(pl.col("lane").n_unique().alias("_n")).filter(pl.col("_n") > 1)
             .select("rank", "step", pl.lit(True).alias("_multi")))
    work = (work.with_columns(pl.coalesce("step", "_ks").alias("_st"))
            .join(multi.rename({"step": "_st"}), on=["rank", "_st"], how="left").drop("_st"))
    one = work.filter(pl.col("_multi").is_null()).with_columns(pl.lit(0, pl.Int32).alias("lane"))
    work = work.filter(pl.col("_multi").is_not_null())
    mine = work.filter(pl.col("_os").is_not_null()).with_columns(pl.col("_ol").alias("lane"))
    free = work.filter(pl.col("_os").is_null())
    on_lane = free.join(lanes.select("rank", pl.col("lane").alias("stream")), on=["rank", "stream"], how="semi") \
        .with_columns(pl.col("stream").alias("lane"))
    anywhere = free.join(lanes.select("rank", pl.col("lane").alias("stream")), on=["rank", "stream"], how="anti") \
        .join(lanes.select("rank", "lane"), on="rank")
    return (pl.concat([one, mine, on_lane, anywhere], how="diagonal_relaxed")
            .join(lanes, on=["rank", "lane"], how="left")
            .with_columns(key).filter(pl.col("_key").is_not_null()))


def collective_filter(ranks: list[int]) -> pl.Expr:
    """Which collective events are a rank's collectives (``graph._collectives``' filter): a CPU rank's calls, a GPU
    rank's collective kernels — the kernel waits on the GPU for every member's, so the members join at the last
    one's start — but not NCCL's batched send/receive kernels (``SendRecv`` without a direction: which peer they
    talk to is not in the trace, ``gpu.batched_p2p_notes``), which join no group."""
    on_gpu_rank = pl.col("rank").is_in(ranks)
    batched = names.name_test(pl.col("name"), lambda t: t.str.contains("(?i)sendrecv")).fill_null(False)
    return (pl.col("kind") == "collective") & pl.when(on_gpu_rank).then(pl.col("is_gpu") & ~batched) \
        .otherwise(~pl.col("is_gpu"))


def split_gaps(analysis, ops: pl.DataFrame, work: pl.DataFrame, ranks: list[int], *, time_inside) -> pl.DataFrame:
    """The GPU ranks' operations' gaps split into host work (``gap_ns``) and a wait no edge explains (``wait_ns``)
    by launch → kernel (module docstring): ``ops``, the graph's operations numbered (``seq``) with their whole gap
    in ``gap_ns`` + ``wait_ns`` (``graph._gaps``, ``graph._busy_in_gaps``); ``work``, ``on_gpu``'s kernels. A GPU
    rank's operation whose kernels are unknown (it launched none: on the CPU's clock) keeps its split.
    ``time_inside``: graph._time_inside (the time of non-overlapping intervals inside windows, by as-of joins)."""
    keys = ["rank", "step", "seq"]
    total = pl.col("gap_ns") + pl.col("wait_ns")
    mine = ops.filter(pl.col("rank").is_in(ranks) & (total > 0))
    if mine.height == 0 or not ranks:
        return ops
    # each operation's kernels: a pass's (``work``), a collective's own kernel (its span, its launch)
    passes = (work.filter(pl.col("_os").is_not_null())
              .join(mine.filter(pl.col("group").is_null()).select("rank", "step", pl.col("start_ns").alias("_os"),
                                                                   "lane", "seq"), on=["rank", "step", "_os"])
              # (an operation of a step run one at a time has lane 0: lane_order)
              .filter((pl.col("lane") == 0) | (pl.col("lane") == pl.col("_ol")))
              .select(*keys, "start", "end", "launch_ns", "_kw"))
    launches = (analysis.events.lazy().filter(pl.col("is_gpu") & (pl.col("kind") == "collective")
                                              & pl.col("rank").is_in(ranks))
                .select(pl.col("rank").cast(pl.Int32), pl.col("ts_ns").alias("start_ns"), _launch())
                .collect(**iv.COLLECT).unique(["rank", "start_ns"]))
    colls = (mine.filter(pl.col("group").is_not_null())
             .join(launches, on=["rank", "start_ns"], how="left")
             .select(*keys, pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"), "launch_ns",
                     pl.lit(0, pl.Int64).alias("_kw")))
    # the gap lies before the operation's work: from (its working start − the gap) — the later of its previous
    # operation's end and its inputs' arrival —, then between its kernels (idle inside its extent)
    w0 = (pl.when(pl.col("group").is_not_null()).then("start_ns")
          .otherwise(pl.col("end_ns") - pl.col("work_ns")) - total).alias("_w0")
    k = (pl.concat([passes, colls]).join(mine.select(*keys, w0), on=keys)
         .sort(*keys, "start")
         .with_columns(pl.col("end").cum_max().shift(1).over(keys).alias("_before"))
         .with_columns(pl.max_horizontal("_w0", "_before").alias("_a"))
         .with_columns((pl.col("start") - pl.col("_a") - pl.col("_kw")).clip(lower_bound=0).alias("_idle")))
    # Each stretch before a kernel: the time in it the rank's GPU ran other work — work of no operation (a kernel
    # launched outside every pass: host work), or another operation's (the previous step's still running when this
    # step began, the CPU ahead across the step's start; an operation on another stream): a wait, as a late start
    # is —, and the time it ran nothing: host work where the kernel was launched after the GPU fell idle (it waited
    # for its CPU), else a wait no edge explains (enqueued: it waited for what the graph holds no edge for)
    # (per lane: on a rank running two streams at once, what the other stream ran is not this one's; ``_key``
    # stands for the rank and lane in the interval helpers, which group by ``rank``)
    lanes = "lane" in ops.columns
    if lanes:
        work = _kernel_keys(work, ops)
        lane_key = (ops.select("rank", "lane").unique().sort("rank", "lane")
                    .with_columns(pl.int_range(pl.len()).over("rank").alias("_li")))
        mine_key = (mine.select(*keys, "lane").join(lane_key, on=["rank", "lane"])
                    .select(*keys, (pl.col("rank") * 1024 + pl.col("_li")).cast(pl.Int32).alias("_key")))
    else:
        work = work.with_columns(pl.col("rank").alias("_key"))
        mine_key = mine.select(*keys, pl.col("rank").alias("_key"))
    stretches = (k.filter((pl.col("_kw") == 0) & (pl.col("start") > pl.col("_a")))
                 .join(mine_key, on=keys)
                 .select(*keys, "_key", "launch_ns", pl.col("_a").alias("start"), pl.col("start").alias("end"))
                 .with_row_index("_k"))
    if stretches.height == 0:
        host = k.group_by(keys).agg(pl.lit(0, pl.Int64).alias("_host"))
    else:
        spans = work.select(pl.col("_key").alias("rank"), "start", "end")
        busy_all = iv.merge(spans, "rank")
        # (work of no operation launched in a step not in the graph — the warm-up step before it — is that step's)
        steps = ops["step"].unique().implode()
        busy_free = iv.merge(work.filter(pl.col("_os").is_null() & (pl.col("_ks").is_null()
                                                                    | pl.col("_ks").is_in(steps)))
                             .select(pl.col("_key").alias("rank"), "start", "end"), "rank")
        windows = stretches.select(pl.col("_key").alias("rank"), "_k", "start", "end")
        covered = time_inside(busy_all, windows, "_k").rename({"_inside": "_all"})
        free = (time_inside(busy_free, windows, "_k").rename({"_inside": "_free"}) if busy_free.height
                else pl.DataFrame(schema={"_k": pl.UInt32, "_free": pl.Int64}))
        # when the GPU last fell idle in the stretch: the end of the last work that began before the kernel
        last = (stretches.select("_k", pl.col("_key").alias("rank"), pl.col("end").alias("_t")).sort("_t")
                .join_asof(busy_all.select("rank", pl.col("start").alias("_bs"), pl.col("end").alias("_be"))
                           .sort("_bs"), left_on="_t", right_on="_bs", by="rank", strategy="backward",
                           allow_exact_matches=False, check_sortedness=False)
                .select("_k", pl.when(pl.col("_be").is_not_null()).then(pl.min_horizontal("_be", "_t"))
                        .alias("_last")))
        st = (stretches.join(covered, on="_k", how="left").join(free, on="_k", how="left").join(last, on="_k",
                                                                                                 how="left")
              .with_columns(pl.col("_all", "_free").fill_null(0))
              .with_columns((pl.col("end") - pl.col("start") - pl.col("_all")).clip(lower_bound=0).alias("_idle"),
                            pl.max_horizontal("start", pl.col("_last").fill_null(pl.col("start"))).alias("_fell")))
        late = pl.col("launch_ns").is_not_null() & (pl.col("launch_ns") > pl.col("_fell"))
        host = st.group_by(keys).agg((pl.col("_free") + pl.when(late).then("_idle").otherwise(0)).sum()
                                     .alias("_host"))
    host = k.select(keys).unique().join(host, on=keys, how="left").with_columns(pl.col("_host").fill_null(0))
    return (ops.join(host, on=keys, how="left", maintain_order="left")
            .with_columns(pl.when(pl.col("_host").is_not_null()).then(pl.min_horizontal("_host", total))
                          .otherwise("gap_ns").alias("_h"))
            .with_columns(pl.when(pl.col("_host").is_not_null()).then(total - pl.col("_h")).otherwise("wait_ns")
                          .alias("wait_ns"), pl.col("_h").alias("gap_ns"))
            .drop("_host", "_h"))


def stream_order(analysis, arr: pl.DataFrame, ranks: list[int], after_receive: pl.DataFrame | None,
                 lag_wait: pl.DataFrame | None, *, after_schema: dict, wait_schema: dict, slack_ns: int
                 ) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """A GPU rank's message sides in the order of their stream (``graph._after_receives``' AFTER_RECEIVE rows and
    ``graph._lag_waits``' LAG_WAIT rows, the GPU ranks' sides made again by the GPU's rules; the CPU ranks' are kept).

    ``arr``: the step's messages with their index (``edge``), modelled arrival (``_arrive``), producer's end (``_pe``),
    anchor's end (``_ae``, else the step's start ``_w``) and their kernels' spans (send_start_ns …, recv_end_ns). A
    send or receive kernel runs after the one before it on its stream (NCCL's: one per communicator): where that one
    ended inside this side's lag and this kernel had been launched by then, the side waited on that kernel's message
    (posted no earlier than its arrival: the chain ``_after_receives`` makes for a post after a receive that blocked
    a CPU rank; a send kernel is through when its message arrived). The rest of the lag, from its start (or the
    awaited arrival) to the kernel's start, is host work where the kernel was launched after it began (the CPU enqueued
    it late), else a wait no edge explains (enqueued, the stream idle: launch → kernel, as ``split_gaps``).
    ``slack_ns``: graph.ARRIVAL_SLACK_NS."""
    ev = analysis.events
    if not ranks or ev is None or arr.height == 0:
        return after_receive, lag_wait
    comm = (ev.lazy().filter(pl.col("is_gpu") & pl.col("comm_dir").is_not_null() & pl.col("rank").is_in(ranks))
            .select(pl.col("rank").cast(pl.Int32), pl.col("ts_ns").alias("_t"), pl.col("stream").alias("_stream"),
                    _launch()).collect(**iv.COLLECT).unique(["rank", "_t"], keep="first"))
    if comm.height == 0:
        return after_receive, lag_wait
    sides = pl.concat([
        arr.select("step", pl.col("src").alias("rank"), "edge", pl.lit("send").alias("side"),
                   pl.col("_pe").alias("_ref"), pl.col("send_start_ns").alias("_t"),
                   pl.coalesce("send_end_ns", "_arrive").alias("_end"), "_arrive"),
        arr.select("step", pl.col("dst").alias("rank"), "edge", pl.lit("post").alias("side"),
                   pl.coalesce("_ae", "_w").alias("_ref"), pl.col("recv_post_ns").alias("_t"),
                   pl.col("recv_end_ns").alias("_end"), "_arrive"),
    ]).join(comm, on=["rank", "_t"])
    if sides.height == 0:
        return after_receive, lag_wait
    by = ["rank", "step", "_stream"]
    sides = (sides.sort(*by, "_t")
             .with_columns(pl.col(c).shift(1).over(by).alias(f"_p{c}") for c in ("edge", "_t", "_end", "_arrive")))
    # the kernel before it on its stream ended inside the lag, with this one launched already: it waited on it
    queued = (pl.col("_pedge").is_not_null() & (pl.col("_p_end") > pl.col("_ref"))
              & pl.col("launch_ns").is_not_null() & (pl.col("launch_ns") <= pl.col("_p_end"))
              & (pl.col("_p_arrive") <= pl.col("_t") + slack_ns))
    sides = sides.with_columns(
        pl.when(queued).then(pl.col("_p_arrive") - pl.max_horizontal("_p_t", "_ref")).alias("blocked_ns"),
        pl.when(queued).then((pl.col("_t") - pl.col("_p_arrive")).clip(lower_bound=0)).alias("lag_ns"))
    chained = sides.filter(pl.col("blocked_ns") > slack_ns)
    # the rest of the lag: from its start (or the awaited arrival) to the kernel's start
    sides = (sides.join(chained.select("step", "edge", "side", pl.lit(True).alias("_chained")),
                        on=["step", "edge", "side"], how="left")
             .with_columns(pl.when(pl.col("_chained").fill_null(False)).then(pl.col("_t") - pl.col("lag_ns"))
                           .otherwise("_ref").alias("_from"))
             .with_columns(pl.when(pl.col("launch_ns").is_not_null() & (pl.col("launch_ns") <= pl.col("_from")))
                           .then((pl.col("_t") - pl.col("_from")).clip(lower_bound=0)).otherwise(0)
                           .alias("wait_ns")))
    mine = sides.select("step", "edge", "side")

    def replaced(frame: pl.DataFrame | None, new: pl.DataFrame, schema: dict) -> pl.DataFrame | None:
        kept = (frame.join(mine, on=["step", "edge", "side"], how="anti") if frame is not None
                else pl.DataFrame(schema=schema))
        out = pl.concat([kept, new.select(list(schema)).cast(schema)]).sort("step", "edge", "side")
        return out if out.height else None

    return (replaced(after_receive, chained.rename({"_pedge": "via"}), after_schema),
            replaced(lag_wait, sides.filter(pl.col("wait_ns") > 0), wait_schema))
