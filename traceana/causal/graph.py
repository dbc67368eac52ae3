"""The measured step as a dependency graph, and its replay on the simulator's engine (causal.scheduler).

What the graph holds, per measured step (summary.measured_steps), from tables the analysis already made:

- **operations** (``StepGraph.ops``): every rank's schedule rows (forward, backward, its I and W halves, optimizer;
  annotated or inferred, ``source``) in the order the rank ran them, plus the rank's top-level collectives that lie
  outside them. An operation's **work** (``work_ns``) is its span less the time inside it the rank waited on the
  pipeline (``pass_durations``: torch.distributed.pipelining waits for an input inside the
  action's span); it starts working at ``end − work``. A span nested in another of its rank (an optimizer span
  inside the optimizer step) is part of the outer one.
- **messages** (``StepGraph.edges``): every matched send/receive pair (``Analysis.p2p``, P2P and BPipe channels).
  Its **producer** is the last operation its sender started before posting it, its **consumer** the first operation of
  the receiver that began its work after it arrived (ARRIVAL_SLACK_NS: clocks and span edges), its **anchor** the last
  operation the receiver started before posting the receive (none: posted before the step's first). A message arrives at
  max(producer's end + send lag, anchor's end + post lag) + transfer: the transfer starts once both sides have posted
  (p2p.pair's data-ready time), so a slow receiver delays its own input and a fast one does not wait for a slow one's
  bookkeeping.
- **collectives**: a rank's k-th top-level collective of the step with the same name joins the k-th of every other
  member: the members are the trace's process group where the events name one, else the ranks of the same stage
  when several ranks hold it (data-parallel groups), else every rank that has it. All members start it when the last
  one joins; each then takes what it took after the last join.
- **host gaps** (``gap_ns``) and **waits** (``wait_ns``): the time between an operation's start and the later of its
  rank's previous end and its inputs' arrival — host work where the rank's CPU ran an op or a Python frame begun
  there (``_busy_in_gaps``), else a wait no edge explains (said per rank in a note; not work). A message whose peers
  the traces do not name is paired from the schedule (``_pairs``, p2p.peers_from_schedule); a blocking send's message
  is an input of its sender's next operation too (``blocking``).

The replay re-runs these with the measured durations through ``causal.scheduler.run_schedule`` (the same engine that
runs the rules' planned orders): each operation starts at max(previous end, inputs' arrival) + its gap. Every rank
starts its step when it did. Nothing is frozen in a variant (``_scales``): a rank's send/post lags and its tail
(to its last CPU event, not the ProfilerStep end) scale with its host time, its late start and its waits with the
step's work. On the measured durations the replay reproduces each rank's step exactly unless an
edge contradicts the timeline: an operation that started before the input the graph gives it could have arrived
(``contradicted``: its gap is taken as 0 and its replay starts late), which is counted and said.

Where an edge cannot be known: ranks without a schedule (not annotated, inference refused) have no graph
(``GraphError``); messages matched to no operation on one side are left out and counted; without process groups in
the trace, collective membership is the rule above.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import polars as pl

from traceana.causal import gpu_edges
from traceana.causal.scheduler import Costs, NullRecorder, Policy, StageTimes, Trace, product, run_schedule
from traceana.core import intervals as iv
from traceana.core import names, schema
from traceana.core.errors import AnalysisError
from traceana.core.units import NS_PER_MS
from traceana.measure import p2p
from traceana.measure.summary import data_parallel_only

ACTION_OF_PHASE = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W", "optimizer": "O"}
# What each action is, for what-ifs and the critical path: the kinds of time on a step.
KIND_OF_ACTION = {"F": "forward", "B": "backward", "I": "backward", "W": "backward", "O": "optimizer",
                  "C": "collective", "X": "other"}
KINDS = ("forward", "backward", "optimizer", "collective", "p2p", "host")
# A message may arrive this long after its consumer's work began (spans' edges are a few µs apart from the waits' ends,
# and ranks on two hosts have corrected clocks); later, the operation did not wait for it: the next one did.
ARRIVAL_SLACK_NS = 20_000

OPS = {"rank": pl.Int32, "step": pl.Int32, "seq": pl.Int32, "action": pl.String, "phase": pl.String,
       "stage": pl.Int32, "microbatch": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64, "work_ns": pl.Int64,
       "gap_ns": pl.Int64, "group": pl.String, "members": pl.Int32, "source": pl.String, "contradicted": pl.Boolean}
# Beside OPS in a built graph: the part of each operation's time before it that the rank waited on nothing the graph
# holds (``_busy_in_gaps``); a graph without it (one built by hand) has none.
WAIT = {"wait_ns": pl.Int64}
# A blocking send (``_blocking``): the step's ``edge``-th message (in the replay's order, step then _EDGE_ORDER) is
# also an input of ``rank``'s operation ``seq`` (its sender's, after the send returned).
BLOCKING = {"step": pl.Int32, "edge": pl.Int32, "rank": pl.Int32, "seq": pl.Int32}
# A message posted after a receive that blocked its rank (``_after_receives``): the step's ``edge``-th message's
# ``side`` ("send": its sender's send; "post": its receiver's post of the receive) waited on the ``via``-th message,
# whose receive returned in the lag before it; ``blocked_ns`` of that lag was the wait (taken out of the message's own
# lag in the replay), and the post came ``lag_ns`` after the awaited message's arrival (host work, scaled as lags are).
AFTER_RECEIVE = {"step": pl.Int32, "edge": pl.Int32, "side": pl.String, "via": pl.Int32, "lag_ns": pl.Int64,
                 "blocked_ns": pl.Int64}
# The part of a message's lag (``side`` as above; after the awaited message's arrival where it waited on one) that
# its rank's CPU spent inside a P2P call or a collective no edge explains (gloo's send blocking past its message's
# arrival): a wait, scaled with the step's work (rho) like the other waits, not with the rank's host time.
LAG_WAIT = {"step": pl.Int32, "edge": pl.Int32, "side": pl.String, "wait_ns": pl.Int64}
EDGES = {"step": pl.Int32, "channel": pl.String, "src": pl.Int32, "src_seq": pl.Int32, "dst": pl.Int32,
         "dst_seq": pl.Int32, "anchor_seq": pl.Int32, "send_lag_ns": pl.Int64, "post_lag_ns": pl.Int64,
         "transfer_ns": pl.Int64}
RANK_STEPS = {"rank": pl.Int32, "step": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64, "tail_ns": pl.Int64,
              "stage": pl.Int32, "replica": pl.Int32}


def pass_durations(analysis, steps: pl.DataFrame, *, unnumbered: bool = False) -> pl.DataFrame:
    """The schedule rows of ``steps`` (with a micro-batch; ``unnumbered``: also those without one, e.g. a
    multi-stage rank's spans whose names give none) and ``d``, what each operation took: its span, less the
    time inside it the rank waited on the pipeline (schema.BLOCKED_CATEGORIES, from the attribution's segments).
    torch.distributed.pipelining's runtime schedules wait for an operation's input inside its own span (the
    receive is posted earlier, waited on when the action starts); the simulator adds that wait itself. A span
    without waits (the reference trainer waits in WAIT_F / WAIT_B actions of their own) is its duration."""
    sched = (
        analysis.schedule.join(steps, on="step").filter(pl.col("microbatch").is_not_null() | unnumbered)
        .with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    )
    if analysis.segments is None:
        return sched
    passes = sched.filter(pl.col("phase").is_in(names.PASS_PHASES)).with_row_index("_op")
    waits = analysis.segments.filter(pl.col("category").cast(pl.String).is_in(schema.BLOCKED_CATEGORIES)).select(
        "rank", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))
    windows = passes.select("rank", "_op", pl.col("start_ns").alias("start"), pl.col("end_ns").alias("end"))
    waited = _time_inside(waits, windows, "_op").rename({"_inside": "_wait"})
    passes = (
        passes.join(waited, on="_op", how="left")
        .with_columns((pl.col("d") - pl.col("_wait").fill_null(0)).alias("d"))
        .drop("_op", "_wait")
    )
    return pl.concat([passes, sched.filter(~pl.col("phase").is_in(names.PASS_PHASES))])


def _time_inside(intervals: pl.DataFrame, windows: pl.DataFrame, key: str) -> pl.DataFrame:
    """Per window (``key``), the summed time of its rank's ``intervals`` (rank, start, end) inside it (``windows``:
    rank, key, start, end): what clipping the intervals to the windows and summing the pieces gives (windows
    without any: 0 or no row).

    Where a rank's intervals do not overlap (each ends by the next one's start), the time they cover before t is
    the full length of those before the last one starting at or before t, plus that one's part before t: one
    as-of join per window end, cover(end) - cover(start). Clipping joined every interval with every window of its
    rank wherever the windows overlap one another (a pass's waits, a message's lag): 2.4 GB at 4,096 ranks.
    Overlapping intervals are clipped as before."""
    spans = (intervals.lazy().filter(pl.col("end") > pl.col("start"))
             .select(pl.col("rank").cast(pl.Int32), "start", "end").sort("rank", "start")
             .with_columns(((pl.col("end") - pl.col("start")).cum_sum() - (pl.col("end") - pl.col("start")))
                           .over("rank").alias("_before"),
                           (pl.col("end") <= pl.col("start").shift(-1).over("rank")).fill_null(True).alias("_apart"))
             .collect(**iv.COLLECT))
    if not bool(spans["_apart"].all()):
        return (iv.clip(intervals, windows, on="rank", window_keys=key, keep_order=False)
                .group_by(key).agg((pl.col("end") - pl.col("start")).sum().alias("_inside")))
    spans = spans.lazy().select("rank", pl.col("start").alias("_ms"), pl.col("end").alias("_me"), "_before") \
        .sort("_ms")
    lags = windows.lazy().select(key, pl.col("rank").cast(pl.Int32), "start", "end")

    def cover(at: str) -> pl.LazyFrame:
        return (lags.select(key, "rank", at).sort(at)
                .join_asof(spans, left_on=at, right_on="_ms", by="rank", strategy="backward", check_sortedness=False)
                .select(key, (pl.col("_before") + pl.min_horizontal(at, "_me") - pl.col("_ms")).fill_null(0)
                        .alias(f"_c_{at}")))

    return cover("end").join(cover("start"), on=key).select(
        key, (pl.col("_c_end") - pl.col("_c_start")).clip(lower_bound=0).alias("_inside")).collect(**iv.COLLECT)


class GraphError(AnalysisError):
    """The run holds no graph to replay (no schedule on some ranks, no measured step)."""


class EngineMismatch(RuntimeError):
    """The batched evaluator (``replay_variants``) and the engine (``causal.scheduler.run_schedule``) disagree on the
    graph's own durations: one semantics is broken — a bug in traceana, not in the run."""


@dataclass(frozen=True)
class StepGraph:
    """The measured steps as dependency graphs (see the module docstring). ``ops``: OPS, ``edges``: EDGES,
    ``ranks``: RANK_STEPS (each rank's step window, its tail after its last operation, stage and replica)."""

    ops: pl.DataFrame
    edges: pl.DataFrame
    ranks: pl.DataFrame
    steps: tuple[int, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    unpaired: int = 0  # messages matched to no operation on a side: left out
    data_parallel: bool = False  # no P2P at all: ranks of unknown stage are each other's peers (data_parallel_only)
    # BLOCKING: sends that blocked their sender until the message was through (gloo's send waits for its receiver):
    # the message is an input of the sender's next operation too; None: none
    blocking: pl.DataFrame | None = None
    # AFTER_RECEIVE: message posts that waited on an earlier receive of their rank (DeepSpeed posts a send only after
    # its blocking receive returned); None: none
    after_receive: pl.DataFrame | None = None
    # LAG_WAIT: waits inside message lags; None: none
    lag_wait: pl.DataFrame | None = None

    @property
    def consistent(self) -> tuple[int, int]:
        """(N, M): "edges consistent with the timeline: N of M operations" — the operations none of whose inputs
        the timeline contradicts (it started after each could have arrived, and after the passes it depends on),
        of all. What the in-sample replay shows is this, not an accuracy: on the measured durations it reproduces
        the timeline wherever the edges agree with it, by construction."""
        bad = int(self.ops["contradicted"].sum()) if self.ops.height else 0
        return self.ops.height - bad, self.ops.height


def _nested_out(rows: pl.DataFrame, by: tuple[str, ...] = ("rank", "step")) -> pl.DataFrame:
    """Rows not inside an earlier row's span of the same ``by`` (nested spans are part of the outer one)."""
    return (
        rows.sort(*by, "start_ns", pl.col("end_ns"), descending=[False] * (len(by) + 1) + [True])
        .with_columns(pl.col("end_ns").cum_max().shift(1).over(*by).alias("_outer_end"))
        .filter(pl.col("_outer_end").is_null() | (pl.col("end_ns") > pl.col("_outer_end")))
        .drop("_outer_end")
    )


def _collectives(analysis, steps: pl.DataFrame, ops: pl.DataFrame, stage_of: dict[int, int],
                 gpu: list[int] = ()) -> tuple[pl.DataFrame, list[str]]:
    """Top-level collectives of the training threads outside the ranks' operations, with their group id and size
    (on the GPU ranks ``gpu``, their collective kernels: ``gpu_edges.collective_filter``)."""
    ev = analysis.events
    if ev is None or ev.height == 0:
        return pl.DataFrame(schema=OPS).drop("seq", "gap_ns", "contradicted"), []
    coll = (
        ev.lazy().filter(gpu_edges.collective_filter(list(gpu)) & pl.col("step").is_not_null())
        .join(steps.lazy(), on="step")
        .select("rank", "step", pl.col("track").cast(pl.String), pl.col("name").cast(pl.String),
                pl.col("pg").cast(pl.String),
                pl.col("ts_ns").alias("start_ns"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"))
        .collect(**iv.COLLECT)
    )
    if coll.height == 0:
        return pl.DataFrame(schema=OPS).drop("seq", "gap_ns", "contradicted"), []
    # gloo's own spans (gloo:all_reduce, …) run on its thread from the post to the completion, which the training
    # thread waits for outside any op: where a rank has them, they are its collectives; else its top-level ops.
    gloo = pl.col("name").str.starts_with("gloo:")
    coll = coll.filter(gloo | ~gloo.any().over("rank"))
    coll = _nested_out(coll, by=("rank", "step", "track")).drop("track")
    # outside every operation of its rank: a collective inside a pass is part of its work
    inside = (
        coll.with_row_index("_c").join(ops.select("rank", "step", pl.col("start_ns").alias("_s"),
                                                   pl.col("end_ns").alias("_e")), on=["rank", "step"])
        .filter((pl.col("start_ns") >= pl.col("_s")) & (pl.col("start_ns") < pl.col("_e")))["_c"].unique()
    )
    coll = coll.with_row_index("_c").filter(~pl.col("_c").is_in(inside.implode())).drop("_c")
    several = {s for s in stage_of.values() if list(stage_of.values()).count(s) > 1}
    by_stage = pl.col("rank").replace_strict(stage_of, default=None).cast(pl.String)
    scope = (pl.when(pl.col("pg").is_not_null()).then(pl.lit("pg ") + pl.col("pg"))
             .when(by_stage.cast(pl.Int32, strict=False).is_in(list(several))).then(pl.lit("stage ") + by_stage)
             .otherwise(pl.lit("all")))
    coll = (
        coll.sort("rank", "step", "start_ns").with_columns(scope.alias("_scope"))
        .with_columns(pl.int_range(pl.len()).over("rank", "step", "_scope", "name").alias("_k"))
        .with_columns(pl.concat_str(pl.col("step").cast(pl.String), "_scope", "name", pl.col("_k").cast(pl.String),
                                    separator="|").alias("group"))
        .with_columns(pl.len().over("group").cast(pl.Int32).alias("members"))
    )
    notes = []
    if coll["pg"].null_count() == coll.height:
        notes.append("the traces name no process group for their collectives: a collective's members are taken as "
                     "the ranks of its stage where several ranks hold one (data-parallel), else every rank that runs "
                     "it (the k-th of the step with the same name)")
    return coll.select("rank", "step", pl.lit("C").alias("action"), pl.lit("collective").alias("phase"),
                       pl.col("rank").replace_strict(stage_of, default=None).cast(pl.Int32).alias("stage"),
                       pl.lit(None, pl.Int32).alias("microbatch"), "start_ns", "end_ns",
                       (pl.col("end_ns") - pl.col("start_ns")).alias("work_ns"), "group", "members",
                       pl.lit("trace").alias("source")), notes


def build(analysis, steps: list[int] | None = None) -> StepGraph:
    """The dependency graph of ``steps`` (default: the measured steps) of an analysed run."""
    steps = list(analysis.summary.steps if steps is None else steps)
    if not steps:
        raise GraphError("the run has no measured step", path=analysis.run.path,
                         fix="profile at least one complete step on every rank")
    step_f = pl.DataFrame({"step": steps}, schema={"step": pl.Int32})
    ranks = sorted(analysis.attribution["rank"].unique().to_list())
    sched = analysis.schedule.join(step_f, on="step")
    have = set(sched.filter(pl.col("phase").is_in(names.PASS_PHASES))["rank"].unique().to_list())
    missing = [r for r in ranks if r not in have]
    if missing:
        raise GraphError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                         f"ha{'ve' if len(missing) > 1 else 's'} no schedule (no forward/backward annotations, and "
                         "it could not be inferred from P2P order): the step's dependency graph cannot be known",
                         path=analysis.run.path,
                         fix="profile with the PP: annotations (traceana collect / collectors.annotations) or name "
                             "rules that give the passes (docs/naming.md)")
    notes: list[str] = []
    inferred = sorted(sched.filter(pl.col("source") == "inferred")["rank"].unique().to_list())
    if inferred:
        notes.append(f"ranks {', '.join(map(str, inferred))}: operations from the schedule inferred from P2P order; "
                     "their edges are the paired messages as for annotated ranks")
    passes = pass_durations(analysis, step_f, unnumbered=True).filter(pl.col("phase").is_in(names.PASS_PHASES))
    others = sched.filter(pl.col("phase") == "optimizer").with_columns((pl.col("end_ns") - pl.col("start_ns"))
                                                                       .alias("d"))
    ops = (
        pl.concat([passes.select(*sched.columns, "d"), others.select(*sched.columns, "d")])
        .pipe(_nested_out)
        .select("rank", "step", pl.col("phase").replace_strict(ACTION_OF_PHASE).alias("action"), "phase", "stage",
                "microbatch", "start_ns", "end_ns", pl.col("d").clip(lower_bound=0).alias("work_ns"),
                pl.lit(None, pl.String).alias("group"), pl.lit(None, pl.Int32).alias("members"), "source")
    )
    # GPU ranks: an operation's work is its kernels' time (gpu_edges)
    gpu = gpu_edges.gpu_ranks(analysis)
    ops, kernels = gpu_edges.on_gpu(analysis, ops, gpu)
    stage_of = dict(analysis.stages.select("rank", "stage").drop_nulls().iter_rows())
    coll, n = _collectives(analysis, step_f, ops, stage_of, gpu)
    notes += n
    ops = (
        pl.concat([ops, coll.select(ops.columns)], how="vertical_relaxed")
        .sort("rank", "step", "start_ns", "end_ns")
        .with_columns(pl.int_range(pl.len()).over("rank", "step").cast(pl.Int32).alias("seq"))
    )
    # the receiver's collective members that were dropped leave groups short: a group holds its members present
    ops = ops.with_columns(pl.when(pl.col("group").is_not_null()).then(pl.len().over("group")).cast(pl.Int32)
                           .alias("members"))
    win = analysis.steps.join(step_f, on="step").select("rank", "step", "start_ns", "end_ns")
    pairs, n, complete = _pairs(analysis)
    notes += n
    ranks_all = sorted(analysis.attribution["rank"].unique().to_list())
    # replicas only where the job has them: with messages left unpaired, the P2P graph's components are not the
    # pipelines (each rank would be a "replica" of its own)
    replica = (p2p.replica_of(ranks_all, pairs) if complete
               else pl.DataFrame({"rank": ranks_all, "replica": [None] * len(ranks_all)},
                                 schema={"rank": pl.Int32, "replica": pl.Int32}))
    # a rank's step ends with its last CPU work of the step (the host time after its last operation: zero_grad,
    # Python), not with its ProfilerStep span's end, which the replay does not read (docs/whatif.md)
    rank_steps = (
        win.join(ops.group_by("rank", "step").agg(pl.col("end_ns").max().alias("_last")), on=["rank", "step"])
        .join(_last_cpu(analysis, step_f), on=["rank", "step"], how="left")
        .with_columns((pl.coalesce("_cpu_end", "_last") - pl.col("_last")).clip(lower_bound=0).alias("tail_ns"))
        .join(analysis.stages.select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32)), on="rank",
              how="left")
        .join(replica, on="rank", how="left")
        .select(list(RANK_STEPS)).cast(RANK_STEPS).sort("step", "rank")
    )
    edges, unpaired, sent = _edges(pairs.join(step_f, on="step"), ops, win)
    # (an NCCL send kernel blocks its communication stream, not the compute after it: gpu_edges.stream_order)
    nccl = gpu_edges.kernel_message_ranks(analysis, gpu)
    blocking = _blocking(edges, sent, ops, win).filter(~pl.col("rank").is_in(nccl))
    after_receive = _after_receives(edges, sent, ops, win)
    lag_wait = _lag_waits(analysis, edges, sent, ops, win, after_receive)
    if gpu and edges.height and sent.height == edges.height:  # a GPU rank's send and receive kernels: their streams
        after_receive, lag_wait = gpu_edges.stream_order(
            analysis, pl.concat([_arrivals(edges, ops, win), sent], how="horizontal"), gpu, after_receive, lag_wait,
            after_schema=AFTER_RECEIVE, wait_schema=LAG_WAIT, slack_ns=ARRIVAL_SLACK_NS)
    if unpaired:
        notes.append(f"{unpaired} messages have no operation on one side in their step (sent before the sender's first "
                     "operation or arriving after the receiver's last): not in the graph")
    ops = _busy_in_gaps(analysis, _gaps(ops, edges, win, blocking))
    ops = gpu_edges.split_gaps(analysis, ops, kernels, gpu, time_inside=_time_inside)  # launch → kernel
    waits = (ops.filter(pl.col("wait_ns") > 0).group_by("rank").agg(pl.col("wait_ns").sum()).sort("rank"))
    if waits.height:
        per_rank = ", ".join(f"rank {r} {w / NS_PER_MS:,.3f} ms" for r, w in waits.iter_rows())
        on_gpu = (" (on a GPU rank: its GPU sat idle with the next kernel launched already)"
                  if set(waits["rank"].to_list()) & set(gpu) else "")
        notes.append(f"waits no edge explains (the rank ran nothing on its CPU{on_gpu} and no message, collective or "
                     f"earlier operation of the graph held it): {per_rank} over the steps replayed; they are not work "
                     "— the replay shrinks them as the step's work shrinks (docs/whatif.md \"No frozen time\")")
    ops, cyc = _order_cycles(ops)
    if cyc:
        notes.append(cyc)
    bad = int(ops["contradicted"].sum())
    if bad:
        notes.append(f"edges consistent with the timeline: {ops.height - bad} of {ops.height} operations; {bad} "
                     "started before an input the graph gives them could have arrived, or before the pass they "
                     "depend on (an edge the timeline contradicts): their replay starts late")
    return StepGraph(ops=ops.select(*OPS, *WAIT).cast({**OPS, **WAIT}), edges=edges, blocking=blocking,
                     after_receive=after_receive, lag_wait=lag_wait,
                     ranks=rank_steps, steps=tuple(steps),
                     notes=tuple(notes), unpaired=unpaired, data_parallel=data_parallel_only(analysis))


def _pairs(analysis) -> tuple[pl.DataFrame, list[str], bool]:
    """The messages the graph's edges are made of: the analysis' pairs, and where the traces name no peer
    (torch.profiler's defaults: record_shapes off) the same messages with the peer of each taken from the schedule
    (``p2p.peers_from_schedule``) and paired again. Returns (pairs, notes, complete: no message left unpaired for
    want of a peer). Every message left unpaired is said: the graph holds no edge for it."""
    ev = analysis.events
    if ev is None:
        return analysis.p2p, [], True
    comm = ev.lazy().filter(pl.col("comm_dir").is_not_null() & pl.col("step").is_not_null())
    if comm.select(pl.len()).collect(**iv.COLLECT).item() == 0:
        return analysis.p2p, [], True
    msgs = p2p.messages(ev, p2p.bpipe_groups(analysis.run.traces))
    config = analysis.config
    notes: list[str] = []
    counts = {"missing": 0}
    if msgs["peer"].null_count():
        msgs, counts = p2p.peers_from_schedule(msgs, analysis.schedule)
    pairs, unmatched, _, _ = p2p.pair(msgs, link_bytes_per_s=p2p.link_bandwidth(config),
                                      ceiling=p2p.transfer_ceiling(config))
    if counts["missing"]:
        notes.append(f"{counts['missing']} P2P messages name no peer (profiled without record_shapes): "
                     f"{counts['given']} were given the rank of the adjacent stage their pass sends to or receives "
                     f"from, and paired in order between the two ranks ({pairs.height} pairs)"
                     + (f"; {counts['by_place']} of them between stages held by several ranks, the i-th rank of "
                        "one stage taken to talk to the i-th of the next (rank = stage · dp + replica)"
                        if counts["by_place"] else "")
                     + (f"; {counts['ambiguous']} not, their adjacent stage being held by several ranks (which "
                        "replica is not in the trace)" if counts["ambiguous"] else ""))
        late = pairs.filter(pl.col("recv_end_ns") < pl.col("send_start_ns")).height if pairs.height else 0
        if late:  # a receive cannot return before its send was posted: the pairing by order is contradicted
            notes.append(f"{late} of those pairs end their receive before the send was posted: the peers taken "
                         "from the schedule contradict the timeline there (their edges are kept, and counted as "
                         "contradicted where they start an operation late)")
    else:
        pairs = analysis.p2p  # (the same pairs: the analysis made them from the same messages)
    if unmatched.height:
        per = unmatched.group_by("rank", "dir").agg(pl.len()).sort("rank", "dir")
        said = ", ".join(f"rank {r}: {n} {d}{'s' if n > 1 else ''}" for r, d, n in per.rows())
        notes.append(f"{unmatched.height} P2P messages have no counterpart ({said}): the graph holds no edge for "
                     "them, so what they made their receivers wait for is a wait no edge explains, and a what-if "
                     "does not move it with its sender")
    complete = counts["missing"] == counts.get("given", 0) and not (
        unmatched.height and msgs["peer"].null_count())
    return pairs, notes, complete


def _order_cycles(ops: pl.DataFrame) -> tuple[pl.DataFrame, str | None]:
    """Operations a rank ran before the one they depend on (a backward, or its I or W half, of a micro-batch before
    that micro-batch's forward on the same stage; a W before its I): with the pipeline's own dependencies the step
    is a cycle — the backward needs the forward's activations, so no schedule can run it so. The replay follows the
    timeline there, which it cannot be trusted for: each such operation is marked ``contradicted`` and the run gets a
    note (None where there is none)."""
    key = ["rank", "step", "stage", "microbatch"]
    passes = ops.filter(pl.col("action").is_in(["F", "B", "I", "W"]) & pl.col("microbatch").is_not_null())
    if passes.height == 0:
        return ops, None
    first = passes.group_by(key).agg(pl.col("start_ns").filter(pl.col("action") == "F").min().alias("_f"),
                                     pl.col("start_ns").filter(pl.col("action") == "I").min().alias("_i"))
    early = (passes.join(first, on=key, how="left", nulls_equal=True)
             .filter(((pl.col("action") != "F") & pl.col("_f").is_not_null() & (pl.col("start_ns") < pl.col("_f")))
                     | ((pl.col("action") == "W") & pl.col("_i").is_not_null() & (pl.col("start_ns") < pl.col("_i"))))
             .select("rank", "step", "seq", "action", "stage", "microbatch"))
    if early.height == 0:
        return ops, None
    eg = early.sort("rank", "step", "seq").row(0, named=True)
    ops = ops.join(early.select("rank", "step", "seq", pl.lit(True).alias("_cyc")), on=["rank", "step", "seq"],
                   how="left").with_columns((pl.col("contradicted") | pl.col("_cyc").fill_null(False))
                                            .alias("contradicted")).drop("_cyc")
    return ops, (f"dependency cycle: {early.height} operations ran before the pass they depend on (e.g. rank "
                 f"{eg['rank']}, step {eg['step']}: {eg['action']} of micro-batch {eg['microbatch']}, stage "
                 f"{eg['stage']}, before its forward{' or I' if eg['action'] == 'W' else ''}): no schedule can run "
                 "the step in that order (a backward needs its forward's activations), so the trace's order or "
                 "names are wrong there; the replay follows the timeline for them and they count as contradicted")


def _last_cpu(analysis, steps: pl.DataFrame) -> pl.DataFrame:
    """rank, step, ``_cpu_end``: when each rank's last CPU event of the step ends (the ProfilerStep spans apart)."""
    ev = analysis.events
    if ev is None or ev.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int32, "_cpu_end": pl.Int64})
    return (
        ev.lazy().filter(~pl.col("is_gpu") & pl.col("step").is_not_null() & (pl.col("kind") != "step"))
        .join(steps.lazy(), on="step")
        .group_by("rank", "step").agg((pl.col("ts_ns") + pl.col("dur_ns")).max().alias("_cpu_end"))
        .collect(**iv.COLLECT).cast({"rank": pl.Int32, "step": pl.Int32, "_cpu_end": pl.Int64})
    )


def _edges(pairs: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame) -> tuple[pl.DataFrame, int, pl.DataFrame]:
    """Every message's producer, consumer and anchor (module docstring) with its lags and transfer, in the replay's
    order (step, _EDGE_ORDER); the number left out; each kept one's send span (send_start_ns, send_end_ns)."""
    if pairs.height == 0:
        return pl.DataFrame(schema=EDGES), 0, pl.DataFrame(schema={"send_start_ns": pl.Int64, "send_end_ns": pl.Int64,
                                                                   "recv_post_ns": pl.Int64, "recv_end_ns": pl.Int64})
    by_start = ops.select("rank", "step", "seq", "start_ns", "end_ns").sort("start_ns")
    # an operation's work starts at end − work (a collective's at its span's start)
    by_work = ops.select("rank", "step", "seq", pl.when(pl.col("action") == "C").then("start_ns")
                         .otherwise(pl.col("end_ns") - pl.col("work_ns")).alias("_ws")).sort("_ws")
    m = pairs.select("step", "channel", "src", "dst", "send_start_ns", "recv_post_ns", "recv_end_ns", "transfer_ns",
                     (pl.col("send_end_ns") if "send_end_ns" in pairs.columns else pl.lit(None, pl.Int64))
                     .alias("send_end_ns")).with_row_index("_m")
    prod = m.sort("send_start_ns").join_asof(
        by_start.rename({"rank": "src", "seq": "src_seq", "start_ns": "_ps", "end_ns": "_pe"}),
        left_on="send_start_ns", right_on="_ps", by=["src", "step"], strategy="backward", check_sortedness=False)
    cons = m.select("_m", "dst", "step", (pl.col("recv_end_ns") - ARRIVAL_SLACK_NS).alias("_t")).sort("_t").join_asof(
        by_work.rename({"rank": "dst", "seq": "dst_seq"}),
        left_on="_t", right_on="_ws", by=["dst", "step"], strategy="forward", check_sortedness=False)
    anchor = m.select("_m", "dst", "step", "recv_post_ns").sort("recv_post_ns").join_asof(
        by_start.rename({"rank": "dst", "seq": "anchor_seq", "start_ns": "_as", "end_ns": "_ae"}),
        left_on="recv_post_ns", right_on="_as", by=["dst", "step"], strategy="backward", check_sortedness=False)
    start = win.select(pl.col("rank").alias("dst"), "step", pl.col("start_ns").alias("_w"))
    e = (
        prod.join(cons.select("_m", "dst_seq", "_ws"), on="_m").join(anchor.select("_m", "anchor_seq", "_ae"),
                                                                      on="_m")
        .join(start, on=["dst", "step"], how="left")
    )
    keep = pl.col("src_seq").is_not_null() & pl.col("dst_seq").is_not_null()
    unpaired = e.filter(~keep).height
    # The message's time from both sides posted to its consumer starting work is the edge's (its transfer): where
    # the receive returned later than its bytes take (gloo waiting on its peer's progress: p2p.pair's split), the
    # wait is this message's, not the consumer's host time, and it goes with the message (docs/whatif.md) — but
    # not while the receiver ran operations of its own: a receive posted ahead of them (an irecv before the passes
    # that precede its consumer) returns only when its rank waits on it, so the transfer starts no earlier than the
    # end of the receiver's last operation before the return (``_own_end``)
    got = pl.min_horizontal("recv_end_ns", "_ws")
    own = ops.select(pl.col("rank").alias("dst"), "step", pl.col("end_ns").alias("_own_end")).sort("_own_end")
    e = (e.filter(keep).with_row_index("_o").with_columns(got.alias("_got")).sort("_got")
         .join_asof(own, left_on="_got", right_on="_own_end", by=["dst", "step"], strategy="backward",
                    allow_exact_matches=False, check_sortedness=False).sort("_o"))
    posted = pl.max_horizontal("send_start_ns", "recv_post_ns", "_own_end")
    e = e.with_columns(
        (pl.col("send_start_ns") - pl.col("_pe")).alias("send_lag_ns"),
        (pl.col("recv_post_ns") - pl.coalesce("_ae", "_w")).alias("post_lag_ns"),
        pl.max_horizontal("transfer_ns", got - posted).alias("transfer_ns"),
    )
    e = e.sort(["step", *_EDGE_ORDER], nulls_last=True, maintain_order=True)
    return (e.select(list(EDGES)).cast(EDGES), unpaired,
            e.select("send_start_ns", "send_end_ns", "recv_post_ns", "recv_end_ns"))


# Events in which a CPU thread waits rather than works (a P2P call, a collective: what it waits for is a message or
# a group's other members) and the steps' own spans; every other CPU event (an op, a Python frame, a launch) is work.
WAIT_KINDS = ("p2p_send", "p2p_recv", "p2p_call", "bpipe_transfer", "collective", "step")


def _busy_in_gaps(analysis, ops: pl.DataFrame) -> pl.DataFrame:
    """Each operation's gap split into host work (``gap_ns``: its CPU ran an op or a Python frame begun in the gap,
    outside any wait) and a wait no edge explains (``wait_ns``: the CPU ran nothing begun there, or waited in a call
    the graph holds no edge for)."""
    win = ops.select("rank", "step", "seq", (pl.col("end_ns") - pl.col("work_ns")).alias("_s"), "gap_ns", "group",
                     "start_ns")
    win = win.with_columns(pl.when(pl.col("group").is_not_null()).then("start_ns").otherwise("_s").alias("end"))
    win = win.with_columns((pl.col("end") - pl.col("gap_ns")).alias("start")).filter(pl.col("gap_ns") > 0)
    ev = analysis.events
    if ev is None or ev.height == 0 or win.height == 0:
        return ops.with_columns(pl.lit(0, pl.Int64).alias("wait_ns"))
    cpu = ev.lazy().filter(~pl.col("is_gpu") & (pl.col("dur_ns") > 0))
    spans = [pl.col("rank"), pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")]
    # a GPU rank's CPU waiting for its GPU (cudaStreamSynchronize, cudaDeviceSynchronize, …) waits too (an operation
    # on the GPU's clock has its gap split again by launch → kernel: gpu_edges.split_gaps)
    syncing = names.name_test(pl.col("name"), lambda t: t.str.contains("Synchronize")).fill_null(False)
    # (and a schedule's own wait actions: the reference trainer's WAIT_F / WAIT_B spans)
    waits = (pl.col("kind").is_in(WAIT_KINDS[:-1]) | ((pl.col("kind") == "runtime") & syncing)
             | pl.col("pp_action").is_in([names.WAIT_F, names.WAIT_B]).fill_null(False))
    busy, waiting = pl.collect_all([cpu.filter(~pl.col("kind").is_in(WAIT_KINDS) & ~waits).select(spans),
                                    cpu.filter(waits).select(spans)], **iv.COLLECT)
    windows = win.select("rank", "step", "seq", pl.col("start").alias("_w0"), pl.col("end").alias("_w1")).sort("_w0")
    keys = ["rank", "step", "seq"]

    def in_window(frame: pl.DataFrame) -> pl.DataFrame:
        """Each interval's piece inside the gap window it starts in (keys), or none."""
        return (frame.sort("start").join_asof(windows, left_on="start", right_on="_w0", by="rank",
                                              strategy="backward", check_sortedness=False)
                .filter(pl.col("_w1").is_not_null() & (pl.col("start") < pl.col("_w1")))
                .select(*keys, "start", pl.min_horizontal("end", "_w1").alias("end")))

    # host work: what the CPU began in the gap (an op, a Python frame) — not the frames enclosing the operations
    # around it (a training loop's own frame spans the whole step, its waits included) —, less its time in waits
    work = in_window(busy)
    stuck = in_window(iv.intersect(iv.merge(waiting, "rank"), win.select("rank", "start", "end"), "rank"))
    pieces = iv.subtract(iv.merge(work, keys), iv.merge(stuck, keys), keys) if stuck.height else iv.merge(work, keys)
    at = pieces.group_by(keys).agg((pl.col("end") - pl.col("start")).sum().alias("_busy"))
    return (ops.join(at, on=keys, how="left", maintain_order="left")
            .with_columns(pl.min_horizontal(pl.col("_busy").fill_null(0), "gap_ns").alias("_busy"))
            .with_columns((pl.col("gap_ns") - pl.col("_busy")).alias("wait_ns"), pl.col("_busy").alias("gap_ns"))
            .drop("_busy"))


def _arrivals(edges: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame) -> pl.DataFrame:
    """Each message's modelled arrival (``_arrive``, module docstring) on the measured durations, with its index in
    the step (``edge``; edges in the replay's order)."""
    ends = ops.select("rank", "step", "seq", "end_ns")
    return (
        edges.with_columns(pl.int_range(pl.len()).over("step").cast(pl.Int32).alias("edge"))
        .join(ends.rename({"rank": "src", "seq": "src_seq", "end_ns": "_pe"}), on=["src", "step", "src_seq"],
              maintain_order="left")
        .join(ends.rename({"rank": "dst", "seq": "anchor_seq", "end_ns": "_ae"}), on=["dst", "step", "anchor_seq"],
              how="left", maintain_order="left")
        .join(win.select(pl.col("rank").alias("dst"), "step", pl.col("start_ns").alias("_w")), on=["dst", "step"],
              maintain_order="left")
        .with_columns((pl.max_horizontal(pl.col("_pe") + pl.col("send_lag_ns"),
                                         pl.coalesce("_ae", "_w") + pl.col("post_lag_ns"))
                       + pl.col("transfer_ns")).alias("_arrive"))
    )


def _blocking(edges: pl.DataFrame, sent: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame) -> pl.DataFrame:
    """Sends that blocked (BLOCKING): the send call lasted more than ARRIVAL_SLACK_NS and returned no earlier than
    its message's modelled arrival (less ARRIVAL_SLACK_NS) — gloo's send waits for its receiver, so the sender's
    next operation waited on the message, which is then its input too: the sender's first operation that began
    its work after the arrival. (An asynchronous send, which returns at once, makes none.)"""
    if edges.height == 0 or sent.height != edges.height:
        return pl.DataFrame(schema=BLOCKING)
    arr = pl.concat([_arrivals(edges, ops, win), sent], how="horizontal").filter(
        pl.col("send_end_ns").is_not_null()
        & (pl.col("send_end_ns") - pl.col("send_start_ns") > ARRIVAL_SLACK_NS)
        & (pl.col("send_end_ns") >= pl.col("_arrive") - ARRIVAL_SLACK_NS))
    if arr.height == 0:
        return pl.DataFrame(schema=BLOCKING)
    by_work = ops.select(pl.col("rank").alias("src"), "step", pl.col("seq").alias("_seq"),
                         pl.when(pl.col("action") == "C").then("start_ns")
                         .otherwise(pl.col("end_ns") - pl.col("work_ns")).alias("_ws")).sort("_ws")
    got = (arr.sort("_arrive").join_asof(by_work, left_on="_arrive", right_on="_ws", by=["src", "step"],
                                         strategy="forward", check_sortedness=False)
           .filter(pl.col("_seq").is_not_null() & (pl.col("_seq") > pl.col("src_seq"))))
    return got.select("step", "edge", pl.col("src").alias("rank"), pl.col("_seq").alias("seq")).cast(BLOCKING).sort(
        "step", "edge")


def _after_receives(edges: pl.DataFrame, sent: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame
                    ) -> pl.DataFrame | None:
    """Message posts that waited on a receive of their rank (AFTER_RECEIVE): a send whose lag after its producer
    (or a receive's post whose lag after its anchor) holds the return of a receive of the same rank that blocked it
    — the receive waited more than ARRIVAL_SLACK_NS after it was posted (or after the lag began) for its message,
    which arrived (modelled) no later than the post. DeepSpeed's schedule runs its P2P as instructions of their own
    between the passes, and its 1F1B posts a send only after the blocking receive before it returned: that part of
    the lag is the awaited message's time, not the rank's host work (docs/whatif.md "No frozen time"). The latest
    such receive in the lag is taken. None where there is none."""
    if edges.height == 0 or sent.height != edges.height:
        return None
    arr = pl.concat([_arrivals(edges, ops, win), sent], how="horizontal")
    recvs = arr.select("step", pl.col("dst").alias("rank"), pl.col("edge").alias("via"),
                       pl.col("recv_post_ns").alias("_rp"), pl.col("recv_end_ns").alias("_re"),
                       pl.col("_arrive").alias("_ra")).sort("_re")
    posts = pl.concat([
        arr.select("step", pl.col("src").alias("rank"), "edge", pl.lit("send").alias("side"),
                   pl.col("_pe").alias("_ref"), pl.col("send_start_ns").alias("_t")),
        arr.select("step", pl.col("dst").alias("rank"), "edge", pl.lit("post").alias("side"),
                   pl.coalesce("_ae", "_w").alias("_ref"), pl.col("recv_post_ns").alias("_t")),
    ])
    got = (
        posts.sort("_t").join_asof(recvs, left_on="_t", right_on="_re", by=["rank", "step"], strategy="backward",
                                   check_sortedness=False)
        .filter(pl.col("via").is_not_null() & (pl.col("via") != pl.col("edge")) & (pl.col("_re") > pl.col("_ref"))
                & (pl.col("_ra") <= pl.col("_t")))
        .with_columns((pl.col("_ra") - pl.max_horizontal("_rp", "_ref")).alias("blocked_ns"),
                      (pl.col("_t") - pl.col("_ra")).alias("lag_ns"))
        .filter(pl.col("blocked_ns") > ARRIVAL_SLACK_NS)
    )
    if got.height == 0:
        return None
    return got.select(list(AFTER_RECEIVE)).cast(AFTER_RECEIVE).sort("step", "edge", "side")


def _lag_waits(analysis, edges: pl.DataFrame, sent: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame,
               after_receive: pl.DataFrame | None) -> pl.DataFrame | None:
    """LAG_WAIT: each message side's time inside P2P calls and collectives (WAIT_KINDS) in its lag — from its
    producer's end (send) or anchor's end (post), or from the awaited message's arrival where the post waited on a
    receive (``_after_receives``), to the post. None where there is none."""
    ev = analysis.events
    if ev is None or ev.height == 0 or edges.height == 0 or sent.height != edges.height:
        return None
    arr = pl.concat([_arrivals(edges, ops, win), sent], how="horizontal")
    sides = pl.concat([
        arr.select("step", pl.col("src").alias("rank"), "edge", pl.lit("send").alias("side"),
                   pl.col("_pe").alias("start"), pl.col("send_start_ns").alias("end")),
        arr.select("step", pl.col("dst").alias("rank"), "edge", pl.lit("post").alias("side"),
                   pl.coalesce("_ae", "_w").alias("start"), pl.col("recv_post_ns").alias("end")),
    ])
    if after_receive is not None:
        sides = (sides.join(after_receive.select("step", "edge", "side", "lag_ns"), on=["step", "edge", "side"],
                            how="left")
                 .with_columns(pl.when(pl.col("lag_ns").is_not_null()).then(pl.col("end") - pl.col("lag_ns"))
                               .otherwise("start").alias("start")).drop("lag_ns"))
    sides = sides.filter(pl.col("end") > pl.col("start")).with_row_index("_k")
    if sides.height == 0:
        return None
    calls = (ev.lazy().filter(~pl.col("is_gpu") & (pl.col("dur_ns") > 0)
                              & pl.col("kind").cast(pl.String).is_in(WAIT_KINDS[:-1]))
             .select(pl.col("rank").cast(pl.Int32), pl.col("ts_ns").alias("start"),
                     (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")).collect(**iv.COLLECT))
    if calls.height == 0:
        return None
    inside = _time_inside(iv.merge(calls, "rank"), sides.select("rank", "_k", "start", "end"), "_k") \
        .rename({"_inside": "wait_ns"})
    got = sides.join(inside, on="_k").filter(pl.col("wait_ns") > ARRIVAL_SLACK_NS)
    if got.height == 0:
        return None
    return got.select(list(LAG_WAIT)).cast(LAG_WAIT).sort("step", "edge", "side")


def _gaps(ops: pl.DataFrame, edges: pl.DataFrame, win: pl.DataFrame, blocking: pl.DataFrame | None = None
          ) -> pl.DataFrame:
    """Each operation's gap: its working start less the later of its rank's previous end (the step's start for the
    first) and its inputs' modelled arrival (module docstring; a blocking send's message is its sender's next
    operation's input too); negative: contradicted, taken as 0."""
    arr = _arrivals(edges, ops, win)
    inputs = [arr.select(pl.col("dst").alias("rank"), "step", pl.col("dst_seq").alias("seq"), "_arrive")]
    if blocking is not None and blocking.height:
        inputs.append(blocking.join(arr.select("step", "edge", "_arrive"), on=["step", "edge"])
                      .select("rank", "step", "seq", "_arrive"))
    e = pl.concat(inputs).group_by("rank", "step", "seq").agg(pl.col("_arrive").max())
    out = (
        ops.join(e, on=["rank", "step", "seq"], how="left")
        .join(win.select("rank", "step", pl.col("start_ns").alias("_w")), on=["rank", "step"])
        .sort("rank", "step", "seq")
        .with_columns(pl.coalesce(pl.col("end_ns").shift(1).over("rank", "step"), "_w").alias("_prev"),
                      (pl.col("end_ns") - pl.col("work_ns")).alias("_s"))
    )
    # a collective's members start at its last join: the gap is to the member's own span start, its work what it
    # took after the last member joined
    join = pl.col("start_ns").max().over("group")
    out = out.with_columns(
        pl.when(pl.col("group").is_not_null()).then(pl.col("start_ns")).otherwise("_s").alias("_s"),
    ).with_columns(
        pl.when(pl.col("group").is_not_null()).then((pl.col("end_ns") - join).clip(lower_bound=0))
        .otherwise("work_ns").alias("work_ns"),
        (pl.col("_s") - pl.max_horizontal("_prev", "_arrive")).alias("_gap"),
    )
    return out.with_columns((pl.col("_gap") < 0).alias("contradicted"),
                            pl.col("_gap").clip(lower_bound=0).alias("gap_ns"))


@dataclass(frozen=True)
class Replay:
    """One step replayed: per rank its start, replayed end and step (``ranks``: rank, start_ns, end_ns, step_ns),
    every operation's replayed start and end (``ops``: rank, seq, start_ns, end_ns, bound: what set its start —
    "device" (the rank's previous operation), "input" (``from_rank``/``from_seq``: the message's producer, or the
    receiver's own operation after which it posted the receive), "group" (a collective: ``from_*`` the member that
    joined last)), on the run's clock."""

    step: int
    ranks: pl.DataFrame
    ops: pl.DataFrame

    @property
    def step_ns(self) -> int:
        """The pipeline's step: its slowest rank's (summary's step time)."""
        return int(self.ranks["step_ns"].max())


_EDGE_ORDER = ["dst", "dst_seq", "src", "src_seq", "anchor_seq", "send_lag_ns", "post_lag_ns"]


def _in_plan_order(ops: pl.DataFrame, edges: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``ops`` and ``edges`` in the order ``_plan`` numbers them (operations by step, rank, seq; messages by step,
    _EDGE_ORDER): the one order in which the engine (``_values``) and the batched evaluator (``replay_variants``)
    read a variant's durations, and the critical path the measured transfers."""
    return (ops.sort("step", "rank", "seq"),
            edges.sort(["step", *_EDGE_ORDER], nulls_last=True, maintain_order=True))

_PLANS: dict[int, tuple["StepGraph", dict]] = {}  # a graph's replay structure per step (what-ifs replay it often)


def _plan(g: StepGraph, step: int) -> dict:
    """What does not change between replays of one step: the ranks, each one's order, what each operation makes,
    the collectives, and each message's consumer, producer, anchor and lags (in _EDGE_ORDER)."""
    entry = _PLANS.get(id(g))
    if entry is None or entry[0] is not g:
        if len(_PLANS) >= 8:
            _PLANS.clear()
        entry = _PLANS[id(g)] = (g, {})
    if step in entry[1]:
        return entry[1][step]
    ops, edges = _in_plan_order(g.ops.filter(pl.col("step") == step), g.edges.filter(pl.col("step") == step))
    win = g.ranks.filter(pl.col("step") == step).sort("rank")
    ranks = win["rank"].to_list()
    dev = {r: i for i, r in enumerate(ranks)}
    orders: list[list[tuple]] = [[("X", r, -1)] for r in ranks]
    groups: dict[tuple, tuple[str, int]] = {}
    key_of: dict[tuple[int, int], tuple] = {}
    keys = []
    for r, seq, action, grp, members in ops.select("rank", "seq", "action", "group", "members").iter_rows():
        op = (action, r, seq)
        orders[dev[r]].append(op)
        keys.append((r, seq))
        key_of[(r, seq)] = product(op)
        if grp is not None:
            groups[op] = (grp, members)
    messages = [((dst, d_seq), key_of[(src, s_seq)], float(send_lag),
                 key_of[(dst, a_seq)] if a_seq is not None else ("X", dst, -1), float(post_lag))
                for src, s_seq, dst, d_seq, a_seq, send_lag, post_lag in edges.select(
                    "src", "src_seq", "dst", "dst_seq", "anchor_seq", "send_lag_ns", "post_lag_ns").iter_rows()]
    msg_dev = [(dev[src], dev[dst]) for src, dst in edges.select("src", "dst").iter_rows()]
    # a post after a receive that blocked its rank: the wait leaves the message's own lag and the message waits on
    # the awaited one (its arrival + the host work after it): {message: [(side, awaited message, lag)]}
    chains: dict[int, list[tuple[str, int, float]]] = {}
    if g.after_receive is not None:
        for j, side, via, lag, blocked in g.after_receive.filter(pl.col("step") == step).select(
                "edge", "side", "via", "lag_ns", "blocked_ns").iter_rows():
            c, made, send_lag, anchor, post_lag = messages[j]
            messages[j] = ((c, made, max(0.0, send_lag - blocked), anchor, post_lag) if side == "send"
                           else (c, made, send_lag, anchor, max(0.0, post_lag - blocked)))
            chains.setdefault(j, []).append((side, via, float(lag)))
    # a lag's time inside P2P calls no edge explains is a wait (scaled with rho): out of the host lag, {message:
    # (send side's, post side's)}; where the side waited on a receive, the wait lies after the awaited arrival
    lag_wait: dict[int, list[float]] = {}
    if g.lag_wait is not None:
        for j, side, w in g.lag_wait.filter(pl.col("step") == step).select("edge", "side", "wait_ns").iter_rows():
            c, made, send_lag, anchor, post_lag = messages[j]
            w = float(w)
            at = lag_wait.setdefault(j, [0.0, 0.0])
            if side == "send":
                w = min(w, send_lag)
                messages[j] = (c, made, send_lag - w, anchor, post_lag)
                at[0] = w
            else:
                w = min(w, post_lag)
                messages[j] = (c, made, send_lag, anchor, post_lag - w)
                at[1] = w
            chains[j] = [(sd_, via, max(0.0, lag - w) if sd_ == side else lag) for sd_, via, lag in chains.get(j, [])]
    lag_wait = {j: tuple(w) for j, w in lag_wait.items()}
    # a blocking send's message is also an input of its sender's next operation: (that operation, the message)
    blocking = ([((r, seq), j) for j, r, seq in g.blocking.filter(pl.col("step") == step)
                 .select("edge", "rank", "seq").iter_rows()] if g.blocking is not None else [])
    origin = int(win["start_ns"].min())
    # waits no edge explains, in keys' order
    wait = [float(x) for x in ops["wait_ns"].to_list()] if "wait_ns" in ops.columns else [0.0] * ops.height
    total0 = float(ops["work_ns"].sum() + ops["gap_ns"].sum() + edges["transfer_ns"].sum())
    plan = {"win": win, "ranks": ranks, "dev": dev, "orders": orders, "groups": groups, "keys": keys,
            "messages": messages, "msg_dev": msg_dev, "blocking": blocking,
            "chains": {j: c for j, c in chains.items() if c}, "lag_wait": lag_wait,
            "origin": origin,
            "total0": total0, "wait": wait,
            "offset": [float(x - origin) for x in win["start_ns"].to_list()], "tail": win["tail_ns"].to_list(),
            "member_seq": {(grp, r): seq for (_, r, seq), (grp, _n) in groups.items()}}
    entry[1][step] = plan
    return plan


def _values(g: StepGraph, ops: pl.DataFrame | None, edges: pl.DataFrame | None
            ) -> dict[int, tuple[list[float], list[float], list[float]]]:
    """Per step the operations' work and gaps (in _plan's order) and the messages' transfers (in _EDGE_ORDER): one
    sort of each frame for all the steps."""
    o, e = _in_plan_order(g.ops if ops is None else ops, g.edges if edges is None else edges)
    o = o.select("step", pl.col("work_ns", "gap_ns").cast(pl.Float64))
    e = e.select("step", pl.col("transfer_ns").cast(pl.Float64))
    steps, work, gap = o["step"].to_list(), o["work_ns"].to_list(), o["gap_ns"].to_list()
    e_steps, transfer = e["step"].to_list(), e["transfer_ns"].to_list()
    out: dict[int, tuple[list[float], list[float], list[float]]] = {}
    i = j = 0
    for step in sorted(set(steps) | set(e_steps)):
        i2, j2 = i, j
        while i2 < len(steps) and steps[i2] == step:
            i2 += 1
        while j2 < len(e_steps) and e_steps[j2] == step:
            j2 += 1
        out[step] = (work[i:i2], gap[i:i2], transfer[j:j2])
        i, j = i2, j2
    return out


def _scales(plan: dict, w_list: list[float], g_list: list[float], t_list: list[float],
            run_host: dict[int, tuple[float, float]]) -> tuple[list[float], float]:
    """What the time the graph holds no operation for scales with in a variant (docs/whatif.md "No frozen time"):
    per rank its host ratio (its host gaps in the variant over the measured ones, summed over all the graph's steps:
    ``run_host``, from ``_run_host``; the step's ratio where it measured none) — the rank's lags before a send or a
    receive's post and its tail after its last operation are its CPU's host work — and the step's ratio ``rho`` (all
    its work, gaps and transfers in the variant over the measured ones): a rank that started the step late waited on
    the previous step, taken to shrink as this one does.

    Why over all steps: one step's host gaps can be a few hundred µs beside tens of ms of lags; a variant that gives
    that rank its typical gaps (the ideal: medians over steps) then multiplied the lags by 35 (a 1F1B step replayed at
    2,429 ms instead of 1,056 from one 5 ms gap, at load 10). Over the run the ratio is what the variant does to the
    rank's host work, not one step's noise; a single step, doubled durations or ``host*k`` are unchanged by it."""
    total0 = plan["total0"]
    rho = (sum(w_list) + sum(g_list) + sum(t_list)) / total0 if total0 > 0 else 1.0
    ratios = [run_host.get(r, (0.0, 0.0)) for r in plan["ranks"]]
    host = [x / h if h > 0 else rho for x, h in ratios]
    return host, rho


def _run_host(g: StepGraph, ops: pl.DataFrame | None, gaps: list[pl.Expr] | None = None
              ) -> dict[int, tuple[list[float], float]]:
    """Per rank its host gaps summed over the graph's steps: (in each variant: the expressions ``gaps`` over ``ops``,
    or ``ops``' gap_ns; the graph's measured), what ``_scales``' host ratio divides."""
    gaps = [pl.col("gap_ns")] if gaps is None else gaps
    frame = g.ops if ops is None else ops
    var = frame.group_by("rank").agg([x.cast(pl.Float64).sum().alias(f"_{i}") for i, x in enumerate(gaps)])
    meas = g.ops.group_by("rank").agg(pl.col("gap_ns").cast(pl.Float64).sum().alias("_m"))
    both = var.join(meas, on="rank", how="left")
    cols = [f"_{i}" for i in range(len(gaps))]
    return {r: (list(v), float(m or 0.0)) for r, *v, m in both.select("rank", *cols, "_m").iter_rows()}


def _own_pieces(plan: dict, j: int) -> list[tuple[tuple, list[tuple]]]:
    """Message ``j``'s own two terms unevaluated (``_chained_terms``): its producer + send lag, its anchor + post lag,
    each lag its host part ("h") and, where part of it was a wait inside a P2P call (``plan["lag_wait"]``), that
    wait ("r": × rho)."""
    _, made, send_lag, anchor, post_lag = plan["messages"][j]
    sd, dd = plan["msg_dev"][j]
    w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
    return [(made, [("h", send_lag, sd)] + ([("r", w_s)] if w_s else [])),
            (anchor, [("h", post_lag, dd)] + ([("r", w_p)] if w_p else []))]


def _folded(plan: dict) -> list[int]:
    """The messages whose terms are not the plain two (a post that waited on a receive, a wait inside a lag)."""
    return sorted(set(plan["chains"]) | set(plan["lag_wait"]))


def _awaited_first(plan: dict, done) -> Iterator[int]:
    """The folded messages (``_folded``), each after the messages its posts waited on (depth first; a loop is cut):
    ``done(j)`` says whether j has its terms already — the caller fills them in as each is yielded. The one order
    the engine's terms (``_message_terms``) and the batched evaluator's (``_chained_terms``) are built in."""
    chains = plan["chains"]
    for j0 in _folded(plan):
        stack, on = [j0], {j0}
        while stack:
            j = stack[-1]
            todo = [v for _, v, _ in chains.get(j, ()) if not done(v) and v not in on]
            if todo:
                stack += todo
                on.update(todo)
                continue
            stack.pop()
            on.discard(j)
            if not done(j):
                yield j


def _chained_terms(plan: dict, limit: int) -> dict[int, list[tuple[tuple, list[tuple]]]] | None:
    """``_message_terms`` unevaluated, for the ``_folded`` messages: per message its terms as (product, pieces), a
    term's lag being the left fold of its pieces — ("h", lag, device): lag × that device's host ratio, ("t",
    message): that message's transfer, ("r", ns): ns × the step's rho — in the engine's order of additions.
    Duplicates are kept (the engine's latest-per-product is the same maximum: rounding is monotone). None past
    ``limit`` terms in all."""
    chains = plan["chains"]
    out: dict[int, list[tuple[tuple, list[tuple]]]] = {}
    total = 0
    for j in _awaited_first(plan, out.__contains__):
        sd, dd = plan["msg_dev"][j]
        w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
        terms = _own_pieces(plan, j)
        for side, via, lag in chains.get(j, ()):
            if via not in out:  # (a loop: cut, as the engine cuts it)
                continue
            scale, w = (sd, w_s) if side == "send" else (dd, w_p)
            tail = [("t", via), ("h", lag, scale)] + ([("r", w)] if w else [])
            terms += [(k, [*pieces, *tail]) for k, pieces in out[via]]
        total += len(terms)
        if total > limit:
            return None
        out[j] = terms
    return out


def _fold(pieces: list[tuple], host: list[float], t_list: list[float], rho: float) -> float:
    """A term's lag: its pieces added left to right (``_chained_terms``)."""
    v = 0.0
    for i, p in enumerate(pieces):
        x = p[1] * host[p[2]] if p[0] == "h" else t_list[p[1]] if p[0] == "t" else p[1] * rho
        v = x if i == 0 else v + x
    return v


def _message_terms(plan: dict, host: list[float], t_list: list[float], rho: float = 1.0) -> list[tuple]:
    """Each message's terms for the engine (``Input``): (product, lag) pairs whose latest end + lag is when both sides
    had posted it — its producer's end + send lag, its anchor's end + post lag, and for a post that waited on a
    receive of its rank (``plan["chains"]``) the awaited message's terms + its transfer + the lag after it
    (recursively, the latest lag per product kept; an awaited message is always earlier, a loop is cut); a lag's wait
    inside a P2P call (``plan["lag_wait"]``) scales with ``rho``."""
    msgs, dev_of, chains = plan["messages"], plan["msg_dev"], plan["chains"]
    folded = set(_folded(plan))
    out: list[tuple | None] = [None] * len(msgs)
    for j, (_, made, send_lag, anchor, post_lag) in enumerate(msgs):
        if j not in folded:
            sd, dd = dev_of[j]
            out[j] = ((made, send_lag * host[sd]), (anchor, post_lag * host[dd]))
    for j in _awaited_first(plan, lambda v: out[v] is not None):
        sd, dd = dev_of[j]
        w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
        best: dict[tuple, float] = {}
        for k, pieces in _own_pieces(plan, j):
            lag = _fold(pieces, host, t_list, rho)
            best[k] = max(best.get(k, lag), lag)
        for side, via, lag in chains.get(j, ()):
            if out[via] is None:  # (a loop: the timeline contradicts the pairing there; the link is cut)
                continue
            scale, w = (host[sd], w_s) if side == "send" else (host[dd], w_p)
            for k, t in out[via]:
                x = t + t_list[via] + lag * scale
                if w:
                    x = x + w * rho
                best[k] = max(best.get(k, x), x)
        out[j] = tuple(best.items())
    return out  # type: ignore[return-value]


def _run(g: StepGraph, step: int, ops: pl.DataFrame | None, edges: pl.DataFrame | None, values=None,
         run_host=None):
    """The engine on one step: (plan, the engine's Trace, when each device is free at the end)."""
    plan = _plan(g, step)
    w_list, g_list, t_list = (values or _values(g, ops, edges)).get(step, ([], [], []))
    if run_host is None:
        run_host = _run_host(g, ops)
    host, rho = _scales(plan, w_list, g_list, t_list, {r: (v[0], m) for r, (v, m) in run_host.items()})
    work = dict(zip(plan["keys"], w_list))
    gaps = {k: (x + w * rho, x + w * rho) for k, x, w in zip(plan["keys"], g_list, plan["wait"])}
    inputs: dict[tuple, list] = {}
    terms = _message_terms(plan, host, t_list, rho)
    for j, ((consumer, *_), transfer) in enumerate(zip(plan["messages"], t_list)):
        inputs.setdefault(consumer, []).append((terms[j], transfer))
    for consumer, j in plan["blocking"]:
        inputs.setdefault(consumer, []).append((terms[j], t_list[j]))
    trace = Trace()
    starts = [float(round(o * rho)) for o in plan["offset"]]
    tails = [round(t * h) for t, h in zip(plan["tail"], host)]
    _, free = run_schedule(
        plan["orders"], rec=NullRecorder(), policy=Policy(), times=StageTimes(forward_ns=(0.0,), backward_ns=(0.0,)),
        costs=Costs(), pp=len(plan["ranks"]), virtual_stages=1, schedule="measured", num_microbatches=1,
        dur=lambda a, r, seq: 0.0 if a == "R" or seq < 0 else work[(r, seq)],
        inputs=lambda d, op: inputs.get((op[1], op[2]), ()),
        gap=lambda d, i, op: gaps.get((op[1], op[2]), (0.0, 0.0)), groups=plan["groups"], trace=trace,
        free0=starts)
    return plan, trace, free, starts, tails


def replay_steps_ns(g: StepGraph, *, ops: pl.DataFrame | None = None, edges: pl.DataFrame | None = None
                    ) -> list[int]:
    """``replay(...).step_ns`` of every step of the graph, without the per-operation tables (what a what-if needs)."""
    values = _values(g, ops, edges)
    run_host = _run_host(g, ops)
    out = []
    for step in g.steps:
        plan, _, free, starts, tails = _run(g, step, None, None, values, run_host)
        per_rank = _rank_steps_ns(free, tails, starts)
        out.append(max(per_rank))
        if ops is None and edges is None:
            plan["engine_ns"] = per_rank  # the measured durations' replay, for replay_variants' invariant
    return out


def _rank_steps_ns(free: list[float], tails: list[int], starts: list[float]) -> list[int]:
    """Each rank's replayed step (ns) from the engine's end state: its end rounded, plus its tail, less its start."""
    return [round(f) + t - int(s0) for f, t, s0 in zip(free, tails, starts)]


def _engine_measured(g: StepGraph) -> list[list[int]]:
    """The engine's replay of the graph's own durations, every step's every rank (in ``_plan``'s order of ranks),
    kept in the plans once computed (a what-if replays them anyway: ``replay``)."""
    have = [_plan(g, step).get("engine_ns") for step in g.steps]
    if None in have:
        replay_steps_ns(g)
        have = [_plan(g, step)["engine_ns"] for step in g.steps]
    return have


# Below this many operations ``replay_variants`` replays each variant on the engine itself (a tiny run's what-if in a
# few ms, without importing numpy); above it, all variants at once.
BATCH_FROM_OPS = 2_000
# replay_variants' durations held at once per kind (variants × operations): 64 variants of a 4,096-rank step (270,336
# operations) held ~1.3 GB of matrices and their frames; at 8 M (29 variants) the diagnosis' what-if peaked there
# at ~600 MB over the graph; at this many, 7 variants a chunk (docs/performance.md "Thousands of small ranks")
VARIANT_CELLS = 2_000_000


def replay_variants(g: StepGraph, ops: pl.DataFrame, edges: pl.DataFrame,
                    variants: list[tuple[pl.Expr, pl.Expr, pl.Expr]], *, chunk: int = 64) -> list[list[int]]:
    """``replay_steps_ns`` of many variants of the graph's durations at once: each variant is (work, gap, transfer),
    polars expressions over ``ops`` (the graph's ops, what-if columns added) and ``edges``, giving work_ns, gap_ns and
    transfer_ns. Returns per variant the replayed step (ns) of every step of the graph.

    The engine (``replay_steps_ns``: causal.scheduler.run_schedule) defines what a replay is; this evaluates the same
    thing for many variants together. With each rank's order, the messages and the collectives fixed (``_plan``: the
    orders, inputs and groups the engine is given), a replay is a longest path through a fixed acyclic graph: every
    operation starts at max(its previous operation's end, each input's max(producer's end + send lag, anchor's end +
    post lag) + transfer) + gap (a collective: the latest of its members'), ends at start + work. numpy evaluates it
    level by level (an operation's level: one more than its inputs'), one column per variant, with the engine's own
    float additions in the engine's order, so the result is the engine's to the nanosecond (tests/causal/test_whatif.py
    checks every variant of the runs in tests/data, test_one_engine.py graphs of over 10^4 operations from traces). At
    run time every call also evaluates the graph's own durations, which must give the engine's replay of them rank by
    rank (``_check_measured``; EngineMismatch, a bug, if not). A graph whose dependencies form a cycle, or whose chains
    of posts that waited on receives are too long to unfold (``_chained_terms``), goes to the engine, which says so, and
    so does a small graph (under ``BATCH_FROM_OPS`` operations: the engine's
    few milliseconds a replay cost less than importing numpy, docs/performance.md "Fixed cost")."""
    if not variants:
        return []
    levels = {step: _levels(g, step) for step in g.steps} if ops.height >= BATCH_FROM_OPS else {None: None}
    if any(lv is None for lv in levels.values()):
        return [replay_steps_ns(g, ops=ops.with_columns(w.alias("work_ns"), gp.alias("gap_ns")),
                                edges=edges.with_columns(t.alias("transfer_ns"))) for w, gp, t in variants]
    import numpy as np

    # (variants a chunk: at most VARIANT_CELLS durations of each kind at once, the matrices' memory bounded on big
    # graphs; each variant's column is evaluated alone, so the chunks do not change a result)
    chunk = max(1, min(chunk, VARIANT_CELLS // max(ops.height, edges.height, 1)))
    o_keys, e_keys = ["step", "rank", "seq"], ["step", *_EDGE_ORDER]

    def used(frame: pl.DataFrame, exprs: list[pl.Expr], keys: list[str]) -> pl.DataFrame:
        """(only the columns the variants read are sorted and held: a 4,096-rank what-if's ops carry ~40)"""
        need = set(keys).union(*(x.meta.root_names() for x in exprs))
        return frame.select([c for c in frame.columns if c in need])

    o, e = _in_plan_order(used(ops, [x for w, gp, _ in variants for x in (w, gp)], o_keys),
                          used(edges, [t for _, _, t in variants], e_keys))
    o_steps, e_steps = o["step"].to_numpy(), e["step"].to_numpy()
    # The run-time invariants (one semantics), on every call: the first chunk also evaluates the graph's own
    # durations, which must give the engine's replay of them (replay_steps_ns), every rank to the nanosecond, and
    # those durations all doubled, which must give twice that (_check_measured); else a bug, said as one. The
    # variants' frames must be the graph's rows (the levels index them): said as a bug too.
    g_o, g_e = _in_plan_order(g.ops.select(*o_keys, "work_ns", "gap_ns"), g.edges.select(*e_keys, "transfer_ns"))
    if not (o.select(o_keys).equals(g_o.select(o_keys)) and e.select(e_keys).equals(g_e.select(e_keys))):
        raise EngineMismatch(f"replay_variants was given {ops.height:,} operations and {edges.height:,} messages that "
                             f"are not the graph's ({g.ops.height:,}, {g.edges.height:,}): the variants' frames must "
                             "be the graph's own rows, columns added — a bug, report it")

    def matrix(frame: pl.DataFrame, exprs: list[pl.Expr]) -> np.ndarray:
        if frame.height == 0:
            return np.zeros((len(exprs), 0))
        m = frame.select([x.cast(pl.Float64).alias(f"_{i}") for i, x in enumerate(exprs)]).to_numpy()
        return np.ascontiguousarray(m.T, dtype=np.float64)  # variants × rows (polars gives columns whole)

    # (the graph's own durations beside the variants' frames, row for row: the keys are the same, in the same order)
    o = o.with_columns(g_o["work_ns"].alias("_own_work"), g_o["gap_ns"].alias("_own_gap"))
    e = e.with_columns(g_e["transfer_ns"].alias("_own_transfer"))
    probes = [(pl.col("_own_work") * k, pl.col("_own_gap") * k, pl.col("_own_transfer") * k) for k in (1, 2)]
    o_idx = [np.flatnonzero(o_steps == step) for step in g.steps]
    e_idx = [np.flatnonzero(e_steps == step) for step in g.steps]
    out: list[list[int]] = []
    for c0 in range(0, len(variants), chunk):
        part = variants[c0:c0 + chunk]
        rows = [*probes, *part] if c0 == 0 else part
        work = matrix(o, [w for w, _, _ in rows])
        gap = matrix(o, [gp for _, gp, _ in rows])
        transfer = matrix(e, [t for _, _, t in rows])
        run_host = _run_host(g, o, [gp for _, gp, _ in rows])
        per_step = [_evaluate(levels[step], work[:, oi], gap[:, oi], transfer[:, ei],
                              run_host=_host_columns(run_host, _plan(g, step)["ranks"], len(rows)))
                    for step, oi, ei in zip(g.steps, o_idx, e_idx)]
        if c0 == 0:
            _check_measured(g, [s[0] for s in per_step], [s[1] for s in per_step])
            per_step = [s[2:] for s in per_step]
        out += [[int(s[v].max()) for s in per_step] for v in range(len(part))]
    return out


def _levels(g: StepGraph, step: int):
    """The fixed graph the engine replays for ``step`` (``_plan``'s orders, inputs and groups) as arrays for
    ``_evaluate``, grouped by level; None when its dependencies form a cycle."""
    import numpy as np

    plan = _plan(g, step)
    if "levels" in plan:
        return plan["levels"]
    chained = _chained_terms(plan, 64 * len(plan["messages"]) + 1_000) if _folded(plan) else {}
    if chained is None:  # (posts waiting on receives in chains too long to unfold: the engine replays them)
        plan["levels"] = None
        return None
    keys, dev, n = plan["keys"], plan["dev"], len(plan["keys"])
    r_of = np.array([dev[r] for r, _ in keys], dtype=np.int64)
    # node n + d: device d's start (its free0); a rank's first operation follows it, a receive posted before the
    # step's first operation is anchored on it
    pos = {k: i for i, k in enumerate(keys)}
    node_of = {product(op): pos[(op[1], op[2])] for order in plan["orders"] for op in order[1:]}
    node_of.update({("X", r, -1): n + d for r, d in dev.items()})
    prev = np.arange(-1, n - 1, dtype=np.int64)
    first = np.ones(n, dtype=bool)
    first[1:] = r_of[1:] != r_of[:-1]
    prev[first] = n + r_of[first]
    m_dst = np.array([pos[c] for c, *_ in plan["messages"]], dtype=np.int64)
    m_src = np.array([node_of[made] for _, made, *_ in plan["messages"]], dtype=np.int64)
    m_anc = np.array([node_of[anchor] for _, _, _, anchor, _ in plan["messages"]], dtype=np.int64)
    m_sl = np.array([sl for _, _, sl, _, _ in plan["messages"]], dtype=np.float64)
    m_pl = np.array([p for *_, p in plan["messages"]], dtype=np.float64)
    m_sd = np.array([sd for sd, _ in plan["msg_dev"]], dtype=np.int64)
    m_dd = np.array([dd for _, dd in plan["msg_dev"]], dtype=np.int64)
    t_col = np.arange(len(plan["messages"]), dtype=np.int64)  # each input's transfer: its message's column
    # a post that waited on a receive: one more input row per term of the awaited messages (both sides its
    # product, its lag the fold of its pieces, evaluated per variant in _evaluate), with the message's transfer
    folds: list[list[tuple]] = [[] for _ in plan["messages"]]
    x_dst, x_node, x_col = [], [], []
    for j, terms in chained.items():
        # (its first term in the message's own row, both sides that product; the others rows of their own)
        folds[j] = terms[0][1]
        m_anc[j] = m_src[j]
        for k, pieces in terms[1:]:
            x_dst.append(m_dst[j])
            x_node.append(node_of[k])
            x_col.append(j)
            folds.append(pieces)
    if x_dst:
        nx = np.array(x_node, dtype=np.int64)
        m_dst, m_src, m_anc = np.r_[m_dst, x_dst], np.r_[m_src, nx], np.r_[m_anc, nx]
        m_sl, m_pl = np.r_[m_sl, np.zeros(nx.size)], np.r_[m_pl, np.zeros(nx.size)]
        m_sd, m_dd, t_col = np.r_[m_sd, np.zeros(nx.size, np.int64)], np.r_[m_dd, np.zeros(nx.size, np.int64)], np.r_[
            t_col, np.array(x_col, dtype=np.int64)]
    msg_rows: dict[int, list[int]] = {}
    for i, j in enumerate(t_col.tolist()):
        msg_rows.setdefault(j, []).append(i)
    if plan["blocking"]:  # a blocking send's message, again, as an input of its sender's next operation
        rows_b = [(c, i) for c, j in plan["blocking"] for i in msg_rows[j]]
        bj = np.array([i for _, i in rows_b], dtype=np.int64)
        folds += [folds[i] for i in bj.tolist()]
        m_dst = np.r_[m_dst, np.array([pos[c] for c, _ in rows_b], dtype=np.int64)]
        m_src, m_anc, m_sl, m_pl = np.r_[m_src, m_src[bj]], np.r_[m_anc, m_anc[bj]], np.r_[m_sl, m_sl[bj]], np.r_[
            m_pl, m_pl[bj]]
        m_sd, m_dd, t_col = np.r_[m_sd, m_sd[bj]], np.r_[m_dd, m_dd[bj]], np.r_[t_col, t_col[bj]]
    # the folds as padded columns: piece p of every row that has one (kind 0 host, 1 transfer), rows in m_dst's order
    width = max((len(f) for f in folds), default=0)
    fold_cols = []
    for p in range(width):
        rows_p = [i for i, f in enumerate(folds) if len(f) > p]
        kinds = [folds[i][p][0] for i in rows_p]
        fold_cols.append((np.array(rows_p, dtype=np.int64),
                          np.array([{"h": 0, "t": 1, "r": 2}[k] for k in kinds], dtype=np.int64),
                          np.array([folds[i][p][1] if k == "t" else 0 for i, k in zip(rows_p, kinds)], dtype=np.int64),
                          np.array([folds[i][p][1] if k != "t" else 0.0 for i, k in zip(rows_p, kinds)]),
                          np.array([folds[i][p][2] if k == "h" else 0 for i, k in zip(rows_p, kinds)],
                                   dtype=np.int64)))
    has_fold = np.array([bool(f) for f in folds], dtype=bool)
    gid = {}
    grp = np.full(n, -1, dtype=np.int64)
    for op, (name, _members) in plan["groups"].items():
        grp[pos[(op[1], op[2])]] = gid.setdefault(name, len(gid))
    # levels (Kahn's order over units: an operation, or a collective's members together)
    unit = np.where(grp >= 0, n + grp, np.arange(n))
    preds: list[list[int]] = [[] for _ in range(n + len(gid))]
    for a, b in zip(np.concatenate([prev, m_src, m_anc]).tolist(),
                    np.concatenate([np.arange(n), m_dst, m_dst]).tolist()):
        if a < n:
            preds[unit[b]].append(int(unit[a]))
    succ: list[list[int]] = [[] for _ in preds]
    need = [0] * len(preds)
    for u, ps in enumerate(preds):
        for p in set(ps):
            if p == u:
                plan["levels"] = None
                return None
            succ[p].append(u)
            need[u] += 1
    level = [0] * len(preds)
    ready = [u for u in range(len(preds)) if need[u] == 0 and (u >= n or grp[u] < 0)]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for s in succ[u]:
            level[s] = max(level[s], level[u] + 1)
            need[s] -= 1
            if need[s] == 0:
                ready.append(s)
    if seen != len(set(unit.tolist())):
        plan["levels"] = None
        return None
    lv = np.array(level, dtype=np.int64)[unit]
    by_level = []
    e_lv = lv[m_dst] if m_dst.size else m_dst
    for L in np.unique(lv).tolist():
        nodes = np.flatnonzero(lv == L)
        es = np.flatnonzero(e_lv == L)
        es = es[np.argsort(m_dst[es], kind="stable")]
        d = m_dst[es]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]]) if d.size else d
        at = np.searchsorted(nodes, d[starts]) if d.size else d
        gm = nodes[grp[nodes] >= 0]
        gm = gm[np.argsort(grp[gm], kind="stable")]
        gs = grp[gm]
        g_starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]]) if gs.size else gs
        g_counts = np.diff(np.r_[g_starts, gs.size]) if gs.size else gs
        fp = np.flatnonzero(has_fold[es]) if es.size else es  # (rows whose lag is a fold: their global index)
        by_level.append((nodes, prev[nodes], t_col[es], m_src[es], m_anc[es], m_sl[es], m_pl[es], m_sd[es], m_dd[es],
                         starts, at, np.searchsorted(nodes, gm), g_starts, g_counts, (fp, es[fp])))
    win = plan["win"]
    last = np.array([n + d for d in range(len(plan["ranks"]))], dtype=np.int64)
    is_last = np.r_[r_of[1:] != r_of[:-1], True] if n else np.zeros(0, dtype=bool)
    last[r_of[is_last]] = np.flatnonzero(is_last)  # each device's last operation (its start where it has none)
    plan["levels"] = (n, by_level, np.array(plan["offset"]), last, plan["origin"],
                      np.array(plan["tail"], dtype=np.float64), plan["total0"],
                      np.array(plan["wait"], dtype=np.float64), (m_dst.size, fold_cols))
    return plan["levels"]


def _host_columns(run_host: dict, ranks: list[int], v: int):
    """``_run_host``'s sums as _evaluate reads them: (variants × this step's ranks, the measured per rank)."""
    import numpy as np

    none = ([0.0] * v, 0.0)
    var = np.array([run_host.get(r, none)[0] for r in ranks], dtype=np.float64).reshape(len(ranks), v).T
    meas = np.array([run_host.get(r, none)[1] for r in ranks], dtype=np.float64)
    return var, meas


def _check_measured(g: StepGraph, batched: list, doubled: list) -> None:
    """``replay_variants``' run-time invariants, per step on each rank's step (ns): the batched evaluator's replay of
    the graph's own durations is the engine's (``_engine_measured``, which a what-if has made anyway: ``replay``),
    and its replay of them all doubled is twice that. The second holds because nothing in a replay is frozen
    (docs/whatif.md "No frozen time": lags, tails, late starts and waits scale with the host ratio and rho, both then
    exactly 2), and exactly, every figure being a whole number of ns far below 2**53; it checks the scaling the
    measured durations (ratios of 1) cannot, at the cost of one more variant row. EngineMismatch naming the step,
    the first rank that differs and both figures."""
    engine = _engine_measured(g)
    for what, got, want in (("the measured durations", batched, engine),
                            ("the measured durations all doubled (twice the engine's replay of them)", doubled,
                             [[2 * x for x in e] for e in engine])):
        for step, b, e in zip(g.steps, got, want):
            b = [int(x) for x in b]
            if got is doubled and not _plan(g, step)["total0"] > 0:
                continue  # (a step of no work, gaps or transfers at all: its ratios are 1, not 2, by _scales' rule)
            if b != e:
                ranks = _plan(g, step)["ranks"]
                bad = [i for i, (x, y) in enumerate(zip(b, e)) if x != y]
                i = bad[0]
                raise EngineMismatch(
                    f"the batched replay and the engine disagree on {what}: step {step}, rank {ranks[i]}: batched "
                    f"{b[i]:,} ns, engine {e[i]:,} ns ({len(bad)} of {len(e)} ranks differ; the step: batched "
                    f"{max(b):,} ns, engine {max(e):,} ns): one semantics is broken (graph._evaluate against "
                    "causal.scheduler.run_schedule) — a bug, report it")


def _evaluate(levels, work, gap, transfer, *, run_host):
    """_levels' graph with ``work``/``gap`` (variants × operations) and ``transfer`` (variants × messages): each
    variant's every rank's step (ns; variants × ranks, in ``_plan``'s order), as ``replay_steps_ns`` computes it
    (``replay_variants``; the step is the slowest rank's)."""
    import numpy as np

    n, by_level, offset, last, origin, tail, total0, wait, (n_rows, fold_cols) = levels
    v = work.shape[0]
    # _scales, per variant: the ranks' host ratios (over the run's steps: _run_host, as _host_columns lays it out)
    # and the step's
    sums, h0 = run_host
    rho = ((work.sum(axis=1) + gap.sum(axis=1) + transfer.sum(axis=1)) / total0 if total0 > 0
           else np.ones(v))
    host = np.where(h0[None, :] > 0, sums / np.where(h0 > 0, h0, 1.0)[None, :], rho[:, None])
    starts = np.round(offset[None, :] * rho[:, None])
    end = np.empty((v, n + offset.size))
    end[:, n:] = starts
    # the lags that are folds (a post that waited on a receive: _chained_terms), left to right as the engine adds
    fold = np.zeros((v, n_rows)) if fold_cols else None
    for p, (rows_p, kind, col, lag, dev) in enumerate(fold_cols):
        piece = np.where(kind[None, :] == 1, transfer[:, col],
                         np.where(kind[None, :] == 2, lag[None, :] * rho[:, None], lag[None, :] * host[:, dev]))
        fold[:, rows_p] = piece if p == 0 else fold[:, rows_p] + piece
    for nodes, prev, es, src, anc, sl, pl_, sd, dd, m_starts, at, gpos, g_starts, g_counts, (fp, fi) in by_level:
        t = end[:, prev]
        if es.size:
            lag_s, lag_p = sl[None, :] * host[:, sd], pl_[None, :] * host[:, dd]
            if fp.size:
                lag_s[:, fp] = fold[:, fi]
                lag_p[:, fp] = fold[:, fi]
            arrive = np.maximum(end[:, src] + lag_s, end[:, anc] + lag_p) + transfer[:, es]
            ready = np.maximum.reduceat(arrive, m_starts, axis=1)
            t[:, at] = np.maximum(t[:, at], ready)
        t += gap[:, nodes] + wait[None, nodes] * rho[:, None]
        if gpos.size:  # a collective starts when its last member joins
            t[:, gpos] = np.repeat(np.maximum.reduceat(t[:, gpos], g_starts, axis=1), g_counts, axis=1)
        t += work[:, nodes]
        end[:, nodes] = t
    steps = (np.round(end[:, last]).astype(np.int64) + np.round(tail[None, :] * host).astype(np.int64)
             - starts.astype(np.int64))
    return steps


def replay(g: StepGraph, step: int, *, ops: pl.DataFrame | None = None, edges: pl.DataFrame | None = None) -> Replay:
    """Replay ``step`` of the graph on the scheduler's engine (causal.scheduler.run_schedule), with ``ops``'
    work_ns/gap_ns and ``edges``' transfer_ns (default: the graph's own, as measured; a what-if passes changed ones,
    the same rows)."""
    plan, trace, free, starts, tails = _run(g, step, ops, edges)
    ranks, origin, member_seq = plan["ranks"], plan["origin"], plan["member_seq"]
    if ops is None and edges is None:
        plan["engine_ns"] = _rank_steps_ns(free, tails, starts)

    def source(bound) -> tuple[str, int | None, int | None]:
        if bound == "device":
            return "device", None, None
        if bound[0] == "group":  # the member that joined last: the path goes on through its own collective
            last = ranks[bound[2]]
            return "group", last, member_seq[(bound[1], last)]
        return "input", bound[1], bound[2]

    rows = [(op[1], op[2], origin + round(start), origin + round(end), *source(bound))
            for (d, i), (op, _f, _ready, start, end, bound) in trace.ops.items() if op[2] >= 0]
    op_rows = pl.DataFrame(rows, schema={"rank": pl.Int32, "seq": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64,
                                         "bound": pl.String, "from_rank": pl.Int32, "from_seq": pl.Int32},
                           orient="row").sort("rank", "seq")
    rank_rows = pl.DataFrame(
        {"rank": ranks, "start_ns": [origin + int(s) for s in starts],
         "end_ns": [origin + round(f) + t for f, t in zip(free, tails)]},
        schema={"rank": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64},
    ).with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("step_ns"))
    return Replay(step=step, ranks=rank_rows, ops=op_rows)


def critical_path(g: StepGraph, r: Replay) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The replayed step's critical path and every operation's slack.

    The path runs back from the end of the slowest rank's step (the step time): each operation to what set its start
    (``Replay.ops.bound``): the rank's previous operation (the gap between them is host time), a message's producer
    (its lag and transfer are P2P time) or the receiver's own operation that posted the receive, or a collective's
    last member to join. Returns (``path``: one row per piece of time on it — rank, stage, seq (null for time
    between operations), kind (forward, backward, optimizer, collective, other, p2p, host), start_ns, end_ns,
    ms; ``slack``: rank, seq, slack_ns — how much later the operation could end without lengthening the step: the
    latest end allowed by everything that waits on it (each rank's step may end at its start + the step time), less
    its replayed end)."""
    step = r.step
    own = g.ops.filter(pl.col("step") == step)
    # what the replay put before each operation: its host gap and its wait (scaled as the replay scaled it: the
    # replayed start less the later of its previous end and its inputs' arrival is what the walk below reads)
    ops = (own.select("rank", "seq", "action", "stage", "work_ns", "gap_ns", "group",
                      (pl.col("wait_ns") if "wait_ns" in own.columns else pl.lit(0, pl.Int64)).alias("_wait"))
           .join(r.ops, on=["rank", "seq"]))
    edges = g.edges.filter(pl.col("step") == step)
    win = g.ranks.filter(pl.col("step") == step).join(r.ranks.select("rank", pl.col("end_ns").alias("_end")),
                                                      on="rank")
    info = {(rk, sq): (a, st, w, gp, grp, s0, e0, b, fr, fs)
            for rk, sq, a, st, w, gp, grp, s0, e0, b, fr, fs in ops.select(
                "rank", "seq", "action", "stage", "work_ns", pl.col("gap_ns") + pl.col("_wait"), "group", "start_ns",
                "end_ns", "bound", "from_rank", "from_seq").iter_rows()}
    wait_of = dict(((rk, sq), wt) for rk, sq, wt in ops.select("rank", "seq", "_wait").iter_rows())

    def before_op(rk: int, st, sq: int, t0: int, t1: int) -> None:
        """The time [t0, t1) before operation (rk, sq) on the path: its wait no edge explains first, then host."""
        if t1 <= t0:
            return
        wt = min(wait_of.get((rk, sq), 0), t1 - t0)
        if wt > 0:
            pieces.append((rk, st, None, "wait", t0, t0 + wt))
        if t1 > t0 + wt:
            pieces.append((rk, st, None, "host", t0 + wt, t1))
    start_of = dict(win.select("rank", "start_ns").iter_rows())
    tail = dict(win.select("rank", "tail_ns").iter_rows())
    last_seq = dict(ops.group_by("rank").agg(pl.col("seq").max()).iter_rows())
    step_ns = int((win["_end"] - win["start_ns"]).max())
    # --- slack: latest finishes, from the last operations back (max-plus constraints of the replay) ---
    after: dict[tuple[int, int], list[tuple[tuple[int, int], int]]] = {}  # op -> (successor, lag before its gap)
    for rk, sq in info:
        if (rk, sq + 1) in info:
            after.setdefault((rk, sq), []).append(((rk, sq + 1), 0))
    # each message's inputs as the replay has them (_message_terms on the measured durations: a post that waited on
    # a receive has the awaited message's producers among them), for its consumer and, sent blocking, its sender's
    # next operation
    plan = _plan(g, step)
    t_meas = (_in_plan_order(own.select("step", "rank", "seq"), edges.select("step", *_EDGE_ORDER, "transfer_ns"))[1]  # (edges only)
              ["transfer_ns"].cast(pl.Float64).to_list())
    terms = _message_terms(plan, [1.0] * len(plan["ranks"]), t_meas)
    held = [(plan["messages"][j][0], j) for j in range(len(terms))] + list(plan["blocking"])
    for consumer, j in held:
        for k, lag in terms[j]:
            if k[2] >= 0:  # (not a rank's step start)
                after.setdefault((k[1], k[2]), []).append((consumer, lag + t_meas[j]))
    post_lag_of = {(dst, d_seq, a_seq): post_lag for dst, d_seq, a_seq, post_lag in
                   edges.select("dst", "dst_seq", "anchor_seq", "post_lag_ns").iter_rows() if a_seq is not None}
    members: dict[str, list[tuple[int, int]]] = {}
    for key, v in info.items():
        if v[4] is not None:
            members.setdefault(v[4], []).append(key)
    latest_finish: dict[tuple[int, int], float] = {}
    group_start: dict[str, float] = {}  # a collective's, once every member has its latest finish (set once each)

    def latest_start(key: tuple[int, int]) -> float:
        grp = info[key][4]
        if grp is None:
            return latest_finish[key] - info[key][2]
        # a collective starts when its last member joins: the same for every member (asked by each member's
        # predecessors: at 512 members, 512 x 512 terms a collective when made each time)
        if grp not in group_start:  # (a member without its latest finish yet raises KeyError: not kept)
            group_start[grp] = min(latest_finish[k] - info[k][2] for k in members[grp])
        return group_start[grp]

    for key in sorted(info, key=lambda k: (info[k][5], info[k][6]), reverse=True):
        rk, sq = key
        bound = start_of[rk] + step_ns - tail[rk] if sq == last_seq[rk] else float("inf")
        for succ, lag in after.get(key, ()):
            try:  # (every successor starts later, so it came first; a member of a collective, all of them)
                bound = min(bound, latest_start(succ) - info[succ][3] - lag)
            except KeyError:
                continue
        latest_finish[key] = bound
    # (replayed times are whole nanoseconds: a few ns below zero is rounding)
    slack = pl.DataFrame([(rk, sq, max(0, int(latest_finish[(rk, sq)] - info[(rk, sq)][6]))) for rk, sq in info],
                         schema={"rank": pl.Int32, "seq": pl.Int32, "slack_ns": pl.Int64}, orient="row")
    # --- the path: back from the slowest rank's last operation ---
    stage_of = dict(win.select("rank", "stage").iter_rows())
    end_rank = int(win.sort(pl.col("_end") - pl.col("start_ns"), descending=True)["rank"][0])
    pieces: list[tuple] = []
    key = (end_rank, last_seq[end_rank])
    end_t = int(win.filter(pl.col("rank") == end_rank)["_end"][0])
    a, st, w, gp, grp, s0, e0, b, fr, fs = info[key]
    if end_t > e0:
        pieces.append((end_rank, stage_of.get(end_rank), None, "host", e0, end_t))
    seen = set()
    joined = False  # the walk jumped to a collective's last member: its time is on the path once
    while key is not None and key not in seen:
        seen.add(key)
        rk, sq = key
        a, st, w, gp, grp, s0, e0, b, fr, fs = info[key]
        if not joined:
            pieces.append((rk, st, sq, KIND_OF_ACTION[a], s0, e0))
        joined = b == "group"
        if b == "device":
            prev = (rk, sq - 1) if (rk, sq - 1) in info else None
            before_op(rk, st, sq, info[prev][6] if prev else start_of[rk], s0)
            key = prev
        elif b == "group":
            key = (fr, fs)
        else:  # an input: the gap after it arrived is host; before, the message's transfer is P2P, and the time
            # from the producer's end to the send (or from the receiver's operation to its posting the receive) too
            src_end = info[(fr, fs)][6] if fs >= 0 else start_of[fr]  # (-1: the rank's step start)
            arrive = s0 - gp
            before_op(rk, st, sq, arrive, s0)
            lag = post_lag_of.get((rk, sq, fs)) if fr == rk else None
            if lag is not None and lag > 0:  # the receiver's own time before it posted the receive
                pieces.append((rk, st, None, "host", src_end, min(arrive, src_end + lag)))
                src_end = min(arrive, src_end + lag)
            if arrive > src_end:
                pieces.append((rk, st, None, "p2p", src_end, arrive))
            key = (fr, fs) if fs >= 0 else None
    # the path spans the slowest rank's step: from its start (a path that begins on a rank that started later
    # begins with that rank's wait on the previous step; time before the slowest rank's start is not in its step)
    # to its end, so the time on it is the step printed beside it
    first = start_of[end_rank]
    begin = min((p[4] for p in pieces), default=first)
    if begin > first:
        at = min(pieces, key=lambda p: p[4])
        pieces.append((at[0], at[1], None, "previous step", first, begin))
    pieces = [(*p[:4], max(p[4], first), p[5]) for p in pieces if p[5] > first]
    path = pl.DataFrame(pieces, schema={"rank": pl.Int32, "stage": pl.Int32, "seq": pl.Int32, "kind": pl.String,
                                        "start_ns": pl.Int64, "end_ns": pl.Int64}, orient="row").sort("start_ns")
    path = path.with_columns(((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_MS).alias("ms"),
                             pl.lit(step, pl.Int32).alias("step"))
    return path, slack


def on_path(paths: list[pl.DataFrame]) -> pl.DataFrame:
    """Time on the critical path per step, mean over the steps given: group (kind, stage, rank), id, ms, fraction
    (of the path)."""
    if not paths:
        return pl.DataFrame(schema={"group": pl.String, "id": pl.String, "ms": pl.Float64, "fraction": pl.Float64})
    both = pl.concat(paths)
    n = len(paths)
    total = both["ms"].sum() / n
    out = []
    for grp in ("kind", "stage", "rank"):
        out.append(both.group_by(grp).agg((pl.col("ms").sum() / n).alias("ms"))
                   .select(pl.lit(grp).alias("group"), pl.col(grp).cast(pl.String).alias("id"), "ms")
                   .sort("ms", descending=True))
    return pl.concat(out).with_columns((pl.col("ms") / total if total else pl.lit(None)).alias("fraction"))
