"""The measured step as a dependency graph (replayed on the simulator's engine by causal.replay; its critical path:
causal.critical_path).

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

Where an edge cannot be known: ranks without a schedule (not annotated, inference refused) have no graph
(``GraphError``); messages matched to no operation on one side are left out and counted; without process groups in
the trace, collective membership is the rule above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from traceana.causal import gpu_edges
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
# Beside OPS in a built graph: each operation's lane (gpu_edges: on a GPU rank its stream, gpu_edges.CPU_LANE where it
# launched no kernel; a CPU rank's all 0). The replay runs a rank's operations one after another on each lane, the
# lanes side by side, ordered between them by ``StepGraph.after``; a graph without it (one built by hand) has one lane.
LANE = {"lane": pl.Int32}
# A blocking send (``_blocking``): the step's ``edge``-th message (in the replay's order, step then EDGE_ORDER) is
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
UNPAIRED = {"step": pl.Int32, "n": pl.Int64}  # per step, the messages matched to no operation on a side (left out)
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
    # gpu_edges.AFTER: what orders a rank's operations across its lanes (streams run at once); None: one lane each
    after: pl.DataFrame | None = None

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
                 gpu: list[int] = ()) -> tuple[pl.DataFrame, tuple[int, int]]:
    """Top-level collectives of the training threads outside the ranks' operations, with their group id and size
    among these ranks (on the GPU ranks ``gpu``, their collective kernels: ``gpu_edges.collective_filter``), and
    (how many, how many of them name their process group)."""
    ev = analysis.events
    if ev is None or ev.height == 0:
        return pl.DataFrame(schema={**OPS, **LANE}).drop("seq", "gap_ns", "contradicted"), (0, 0)
    coll = (
        ev.lazy().filter(gpu_edges.collective_filter(list(gpu)) & pl.col("step").is_not_null())
        .join(steps.lazy(), on="step")
        .select("rank", "step", pl.col("track").cast(pl.String), pl.col("name").cast(pl.String),
                pl.col("pg").cast(pl.String), gpu_edges.collective_lane(),
                pl.col("ts_ns").alias("start_ns"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"))
        .collect(**iv.COLLECT)
    )
    if coll.height == 0:
        return pl.DataFrame(schema={**OPS, **LANE}).drop("seq", "gap_ns", "contradicted"), (0, 0)
    # gloo's own spans (gloo:all_reduce, …) run on its thread from the post to the completion, which the training
    # thread waits for outside any op: where a rank has them, they are its collectives; else its top-level ops.
    gloo = pl.col("name").str.starts_with("gloo:")
    coll = coll.filter(gloo | ~gloo.any().over("rank"))
    coll = _nested_out(coll, by=("rank", "step", "track")).drop("track")
    # outside every operation of its rank: a collective inside a pass is part of its work (on a GPU rank, a pass on
    # its stream: a collective kernel on its own stream runs beside the compute, gpu_edges.lane_order)
    inside = (
        coll.with_row_index("_c").join(ops.select("rank", "step", pl.col("start_ns").alias("_s"),
                                                   pl.col("end_ns").alias("_e"), pl.col("lane").alias("_lane")),
                                       on=["rank", "step"])
        .filter((pl.col("start_ns") >= pl.col("_s")) & (pl.col("start_ns") < pl.col("_e"))
                & ((pl.col("lane") == pl.col("_lane")) | (pl.col("_lane") == gpu_edges.CPU_LANE)))["_c"].unique()
    )
    coll = coll.with_row_index("_c").filter(~pl.col("_c").is_in(inside.implode())).drop("_c")
    # (without a process group: "all" here; ``assemble`` names the stage where several ranks of the job hold it)
    scope = pl.when(pl.col("pg").is_not_null()).then(pl.lit("pg ") + pl.col("pg")).otherwise(pl.lit("all"))
    coll = (
        coll.sort("rank", "step", "start_ns").with_columns(scope.alias("_scope"))
        .with_columns(pl.int_range(pl.len()).over("rank", "step", "_scope", "name").alias("_k"))
        .with_columns(pl.concat_str(pl.col("step").cast(pl.String), "_scope", "name", pl.col("_k").cast(pl.String),
                                    separator="|").alias("group"))
        .with_columns(pl.len().over("group").cast(pl.Int32).alias("members"))
    )
    named = coll.height - coll["pg"].null_count()
    return coll.select("rank", "step", pl.lit("C").alias("action"), pl.lit("collective").alias("phase"),
                       pl.col("rank").replace_strict(stage_of, default=None).cast(pl.Int32).alias("stage"),
                       pl.lit(None, pl.Int32).alias("microbatch"), "start_ns", "end_ns",
                       (pl.col("end_ns") - pl.col("start_ns")).alias("work_ns"), "group", "members",
                       pl.lit("trace").alias("source"), "lane"), (coll.height, named)


@dataclass(frozen=True)
class GraphPart:
    """Some ranks' graph before the facts of the whole job (``build_part``; ``assemble`` joins the parts of a job):
    the frames of StepGraph for those ranks over ``steps`` (edge indices numbered within the part; ``ranks``
    without the replica; a collective's ``group``, ``members`` and ``work_ns`` among the part's ranks, its scope
    "all" where the traces name no process group), and what the notes and the job-wide rules read: the messages
    left out per step (UNPAIRED), the ranks linked by a pair (src, dst), ``PairFacts``, the (rank, step) rows of an
    inferred schedule, the collectives (how many, how many name their group), whether the ranks hold no P2P at
    all (``summary.data_parallel_only``) and which are GPU ranks. Plain frames and values: picklable (a worker builds one pipeline group's,
    causal.group_graph)."""

    ops: pl.DataFrame
    edges: pl.DataFrame
    ranks: pl.DataFrame
    steps: tuple[int, ...]
    blocking: pl.DataFrame
    after_receive: pl.DataFrame
    lag_wait: pl.DataFrame
    after: pl.DataFrame | None
    unpaired: pl.DataFrame
    links: pl.DataFrame
    pairs: PairFacts
    inferred: pl.DataFrame
    collectives: tuple[int, int]
    no_p2p: bool
    gpu: tuple[int, ...] = ()  # the ranks whose operations are their GPU's (gpu_edges.gpu_ranks)


def build(analysis, steps: list[int] | None = None) -> StepGraph:
    """The dependency graph of ``steps`` (default: the measured steps) of an analysed run: ``assemble`` of the one
    part ``build_part`` makes of every rank (causal.group_graph builds it one pipeline group a task, the same
    graph)."""
    steps = list(analysis.summary.steps if steps is None else steps)
    return assemble([build_part(analysis, steps)], steps, path=analysis.run.path)


def build_part(analysis, steps: list[int]) -> GraphPart:
    """The ranks of ``analysis``' graph over ``steps``, as far as they alone tell it (``GraphPart``): everything but
    a collective's members in other parts, the stage scope of collectives without a process group, the replicas
    and the notes. GraphError where a rank has no schedule, or there is no step."""
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
    inferred = (sched.filter(pl.col("source") == "inferred").select(pl.col("rank").cast(pl.Int32),
                                                                    pl.col("step").cast(pl.Int32)).unique())
    passes = pass_durations(analysis, step_f, unnumbered=True).filter(pl.col("phase").is_in(names.PASS_PHASES))
    others = sched.filter(pl.col("phase") == "optimizer").with_columns((pl.col("end_ns") - pl.col("start_ns"))
                                                                       .alias("d"))
    gpu = gpu_edges.gpu_ranks(analysis)
    ops = (
        pl.concat([passes.select(*sched.columns, "d"), others.select(*sched.columns, "d")])
        .pipe(gpu_edges.nest_lane, analysis, gpu)  # (nested within a stream: another stream's run beside it)
        .pipe(_nested_out, by=("rank", "step", "_nest")).drop("_nest")
        .select("rank", "step", pl.col("phase").replace_strict(ACTION_OF_PHASE).alias("action"), "phase", "stage",
                "microbatch", "start_ns", "end_ns", pl.col("d").clip(lower_bound=0).alias("work_ns"),
                pl.lit(None, pl.String).alias("group"), pl.lit(None, pl.Int32).alias("members"), "source")
    )
    # GPU ranks: an operation's work is its kernels' time (gpu_edges)
    ops, kernels = gpu_edges.on_gpu(analysis, ops, gpu)
    stage_of = dict(analysis.stages.select("rank", "stage").drop_nulls().iter_rows())
    coll, coll_facts = _collectives(analysis, step_f, ops, stage_of, gpu)
    ops = (
        pl.concat([ops, coll.select(ops.columns)], how="vertical_relaxed")
        .sort("rank", "step", "start_ns", "end_ns")
        .with_columns(pl.int_range(pl.len()).over("rank", "step").cast(pl.Int32).alias("seq"))
    )
    ops, after = gpu_edges.lane_order(ops)  # operations of one rank on two streams at once
    win = analysis.steps.join(step_f, on="step").select("rank", "step", "start_ns", "end_ns")
    pairs, pair_facts = _pairs(analysis)
    # a rank's step ends with its last CPU work of the step (the host time after its last operation: zero_grad,
    # Python), not with its ProfilerStep span's end, which the replay does not read (docs/whatif.md)
    rank_steps = (
        win.join(ops.group_by("rank", "step").agg(pl.col("end_ns").max().alias("_last")), on=["rank", "step"])
        .join(_last_cpu(analysis, step_f), on=["rank", "step"], how="left")
        .with_columns((pl.coalesce("_cpu_end", "_last") - pl.col("_last")).clip(lower_bound=0).alias("tail_ns"))
        .join(analysis.stages.select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32)), on="rank",
              how="left")
        .with_columns(pl.lit(None, pl.Int32).alias("replica"))
        .select(list(RANK_STEPS)).cast(RANK_STEPS).sort("step", "rank")
    )
    edges, unpaired, sent = _edges(pairs.join(step_f, on="step"), ops, win)
    if after is not None:  # (on a rank of several lanes, a message's ends by stream: gpu_edges.message_ends)
        edges, sent = gpu_edges.message_ends(edges, sent, ops, win, order=EDGE_ORDER, schema=EDGES,
                                             slack_ns=ARRIVAL_SLACK_NS)
    # (an NCCL send kernel blocks its communication stream, not the compute after it: gpu_edges.stream_order)
    nccl = gpu_edges.kernel_message_ranks(analysis, gpu)
    blocking = _blocking(edges, sent, ops, win).filter(~pl.col("rank").is_in(nccl))
    after_receive = _after_receives(edges, sent, ops, win)
    lag_wait = _lag_waits(analysis, edges, sent, ops, win, after_receive)
    if gpu and edges.height and sent.height == edges.height:  # a GPU rank's send and receive kernels: their streams
        after_receive, lag_wait = gpu_edges.stream_order(
            analysis, pl.concat([_arrivals(edges, ops, win), sent], how="horizontal"), gpu, after_receive, lag_wait,
            after_schema=AFTER_RECEIVE, wait_schema=LAG_WAIT, slack_ns=ARRIVAL_SLACK_NS)
    ops = _busy_in_gaps(analysis, _gaps(ops, edges, win, blocking, after))
    ops = gpu_edges.split_gaps(analysis, ops, kernels, gpu, time_inside=_time_inside)  # launch → kernel
    return GraphPart(ops=ops.select(*OPS, *WAIT, *LANE).cast({**OPS, **WAIT, **LANE}), edges=edges,
                     ranks=rank_steps, steps=tuple(steps), blocking=blocking, after_receive=after_receive,
                     lag_wait=lag_wait, after=after, unpaired=unpaired,
                     links=pairs.select(pl.col("src").cast(pl.Int32), pl.col("dst").cast(pl.Int32)).unique(),
                     pairs=pair_facts, inferred=inferred, collectives=coll_facts,
                     no_p2p=data_parallel_only(analysis), gpu=tuple(gpu))


def renumbered(frame: pl.DataFrame | None, new_of: pl.DataFrame, cols: tuple[str, ...]) -> pl.DataFrame | None:
    """``frame``'s rows whose edge indices (``cols``: the step's message numbers) are all in ``new_of`` (step, _old,
    _new), renumbered (``assemble``: every part's edges into the job's; causal.group_replay: the job's into a
    group's)."""
    if frame is None:
        return None
    out = frame
    for c in cols:
        out = out.join(new_of.rename({"_old": c}), on=["step", c], how="inner").drop(c).rename({"_new": c})
    return out.select(frame.columns).cast(frame.schema)


def assemble(parts: list[GraphPart], steps: list[int], *, path=None) -> StepGraph:
    """The job's graph over ``steps`` (each part holds them) from the parts its ranks were built in: their frames
    together (each part's edge numbers renumbered to the step's messages in the replay's order, step then
    EDGE_ORDER), then what only the whole job tells — a collective without a process group taken as its stage's
    where several ranks hold one (data-parallel), a collective's members and its work (what a member took after the
    last one joined) over every part, the replicas (the P2P graph's components, where no message was left
    unpaired), cycles, the notes. One part (``build``) and a job's pipeline groups (causal.group_graph) give the
    same graph."""
    steps = list(steps)
    if not steps:
        raise GraphError("the run has no measured step", path=path,
                         fix="profile at least one complete step on every rank")
    lacking = [p for p in parts if not set(steps) <= set(p.steps)]
    if lacking:
        r = lacking[0].ranks["rank"].unique().sort().to_list()
        raise GraphError(f"ranks {', '.join(map(str, r[:8]))} were built over steps that are not all the job's "
                         f"measured steps ({', '.join(map(str, steps))})", path=path,
                         fix="build the graph over the measured steps")
    step_f = pl.DataFrame({"step": steps}, schema={"step": pl.Int32})

    def pick(frame):
        return None if frame is None else frame.join(step_f, on="step", how="semi")

    ops = pl.concat([pick(p.ops) for p in parts])
    ranks = pl.concat([pick(p.ranks) for p in parts]).sort("step", "rank")
    # the step's messages in the replay's order, across the parts (an edge's receiver is in one part)
    numbered = [pick(p.edges).with_columns(pl.int_range(pl.len()).over("step").cast(pl.Int32).alias("_old"),
                                           pl.lit(k, pl.Int32).alias("_part")) for k, p in enumerate(parts)]
    edges = (pl.concat(numbered).sort(["step", *EDGE_ORDER], nulls_last=True, maintain_order=True)
             .with_columns(pl.int_range(pl.len()).over("step").cast(pl.Int32).alias("_new")))
    moved = [edges.filter(pl.col("_part") == k).select("step", "_old", "_new") for k in range(len(parts))]

    def joined(attr: str, cols: tuple[str, ...]) -> pl.DataFrame | None:
        frames = [renumbered(pick(getattr(p, attr)), moved[k], cols) for k, p in enumerate(parts)
                  if getattr(p, attr) is not None]
        return pl.concat(frames) if frames else None

    blocking = joined("blocking", ("edge",))
    after_receive = joined("after_receive", ("edge", "via"))
    lag_wait = joined("lag_wait", ("edge",))
    afters = [pick(p.after) for p in parts if p.after is not None]
    after = pl.concat(afters) if afters else None
    edges = edges.drop("_old", "_part", "_new")
    # a collective no process group names: its stage's where several ranks of the job hold that stage
    stage_of = ranks.select("rank", "stage").drop_nulls().unique()
    several = stage_of.group_by("stage").agg(pl.len()).filter(pl.col("len") > 1)["stage"].to_list()
    stage = pl.col("rank").replace_strict(dict(stage_of.iter_rows()), default=None)
    scoped = pl.concat_str(pl.col("group").str.extract(r"^(\d+)\|all\|"), pl.lit("|stage "), stage.cast(pl.String),
                           pl.col("group").str.replace(r"^\d+\|all", ""))
    ops = ops.with_columns(pl.when(pl.col("group").str.contains(r"^\d+\|all\|") & stage.is_in(several))
                           .then(scoped).otherwise("group").alias("group"))
    # the receiver's collective members that were dropped leave groups short: a group holds its members present;
    # each starts it when the last joins and works for what it took after that
    grouped = pl.col("group").is_not_null()
    ops = ops.with_columns(
        pl.when(grouped).then(pl.len().over("group")).cast(pl.Int32).alias("members"),
        pl.when(grouped).then((pl.col("end_ns") - pl.col("start_ns").max().over("group")).clip(lower_bound=0))
        .otherwise("work_ns").alias("work_ns"),
    ).sort("rank", "step", "seq")
    facts = PairFacts.combined([p.pairs for p in parts])
    ranks_all = ranks["rank"].unique().sort().to_list()
    links = pl.concat([p.links for p in parts]).unique()
    replica = (p2p.replica_of(ranks_all, links) if facts.complete
               else pl.DataFrame({"rank": ranks_all, "replica": [None] * len(ranks_all)},
                                 schema={"rank": pl.Int32, "replica": pl.Int32}))
    ranks = ranks.drop("replica").join(replica, on="rank", how="left").select(list(RANK_STEPS)).cast(RANK_STEPS)
    notes: list[str] = []
    inferred = pl.concat([p.inferred for p in parts]).join(step_f, on="step", how="semi")["rank"].unique().sort()
    if inferred.len():
        notes.append(f"ranks {', '.join(map(str, inferred.to_list()))}: operations from the schedule inferred from P2P "
                     "order; their edges are the paired messages as for annotated ranks")
    n_coll, n_named = (sum(p.collectives[i] for p in parts) for i in (0, 1))
    if n_coll and not n_named:
        notes.append("the traces name no process group for their collectives: a collective's members are taken as "
                     "the ranks of its stage where several ranks hold one (data-parallel), else every rank that runs "
                     "it (the k-th of the step with the same name)")
    notes += gpu_edges.lane_notes(ops)
    notes += facts.notes()
    unpaired = int(pl.concat([p.unpaired for p in parts]).join(step_f, on="step", how="semi")["n"].sum())
    if unpaired:
        notes.append(f"{unpaired} messages have no operation on one side in their step (sent before the sender's first "
                     "operation or arriving after the receiver's last): not in the graph")
    waits = (ops.filter(pl.col("wait_ns") > 0).group_by("rank").agg(pl.col("wait_ns").sum()).sort("rank"))
    if waits.height:
        gpu = {r for p in parts for r in p.gpu}
        per_rank = ", ".join(f"rank {r} {w / NS_PER_MS:,.3f} ms" for r, w in waits.iter_rows())
        on_gpu = (" (on a GPU rank: its GPU sat idle with the next kernel launched already)"
                  if set(waits["rank"].to_list()) & gpu else "")
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
    return StepGraph(ops=ops.select(*OPS, *WAIT, *LANE).cast({**OPS, **WAIT, **LANE}), edges=edges,
                     blocking=blocking, after_receive=after_receive, lag_wait=lag_wait, after=after,
                     ranks=ranks.sort("step", "rank"), steps=tuple(steps), notes=tuple(notes), unpaired=unpaired,
                     data_parallel=all(p.no_p2p for p in parts))


# What ``_pairs`` found, summed over the parts of a job (``assemble`` says it): messages naming no peer, given one from
# the schedule, of them between stages of several ranks and not given one (ambiguous), the pairs made from them, those
# pairs the timeline contradicts, and whether any message still names no peer
PAIR_COUNTS = ("missing", "given", "by_place", "ambiguous", "pairs", "late")


@dataclass(frozen=True)
class PairFacts:
    """``_pairs``' counts (PAIR_COUNTS), its messages with no counterpart (rank, dir, len) and whether a message still
    names no peer: what the graph's notes and the replicas' rule (``complete``) read, summable over parts."""

    counts: dict
    unmatched: pl.DataFrame
    no_peer: bool = False

    @staticmethod
    def combined(facts: list[PairFacts]) -> PairFacts:
        un = pl.concat([f.unmatched for f in facts]) if facts else _NO_UNMATCHED
        return PairFacts(counts={k: sum(f.counts.get(k, 0) for f in facts) for k in PAIR_COUNTS},
                         unmatched=un.group_by("rank", "dir").agg(pl.col("len").sum()).sort("rank", "dir"),
                         no_peer=any(f.no_peer for f in facts))

    @property
    def complete(self) -> bool:
        """No message left unpaired for want of a peer: the P2P graph's components are the pipelines."""
        return self.counts.get("missing", 0) == self.counts.get("given", 0) and not (
            self.unmatched.height and self.no_peer)

    def notes(self) -> list[str]:
        c, notes = self.counts, []
        if c.get("missing"):
            notes.append(f"{c['missing']} P2P messages name no peer (profiled without record_shapes): "
                         f"{c['given']} were given the rank of the adjacent stage their pass sends to or receives "
                         f"from, and paired in order between the two ranks ({c['pairs']} pairs)"
                         + (f"; {c['by_place']} of them between stages held by several ranks, the i-th rank of "
                            "one stage taken to talk to the i-th of the next (rank = stage · dp + replica)"
                            if c.get("by_place") else "")
                         + (f"; {c['ambiguous']} not, their adjacent stage being held by several ranks (which "
                            "replica is not in the trace)" if c.get("ambiguous") else ""))
            if c.get("late"):  # a receive cannot return before its send was posted: the pairing by order is contradicted
                notes.append(f"{c['late']} of those pairs end their receive before the send was posted: the peers "
                             "taken from the schedule contradict the timeline there (their edges are kept, and counted "
                             "as contradicted where they start an operation late)")
        un = self.unmatched
        if un.height:
            total = int(un["len"].sum())
            said = ", ".join(f"rank {r}: {n} {d}{'s' if n > 1 else ''}" for r, d, n in un.rows())
            notes.append(f"{total} P2P messages have no counterpart ({said}): the graph holds no edge for "
                         "them, so what they made their receivers wait for is a wait no edge explains, and a what-if "
                         "does not move it with its sender")
        return notes


_NO_UNMATCHED = pl.DataFrame(schema={"rank": pl.Int32, "dir": pl.String, "len": pl.UInt32})


def _pairs(analysis) -> tuple[pl.DataFrame, PairFacts]:
    """The messages the graph's edges are made of: the analysis' pairs, and where the traces name no peer
    (torch.profiler's defaults: record_shapes off) the same messages with the peer of each taken from the schedule
    (``p2p.peers_from_schedule``) and paired again. Returns (pairs, what was found: ``PairFacts``, whose notes say
    every message left unpaired: the graph holds no edge for it)."""
    ev = analysis.events
    none = PairFacts(counts={}, unmatched=_NO_UNMATCHED)
    if ev is None:
        return analysis.p2p, none
    comm = ev.lazy().filter(pl.col("comm_dir").is_not_null() & pl.col("step").is_not_null())
    if comm.select(pl.len()).collect(**iv.COLLECT).item() == 0:
        return analysis.p2p, none
    msgs = p2p.messages(ev, p2p.bpipe_groups(analysis.run.traces))
    config = analysis.config
    counts = {"missing": 0}
    if msgs["peer"].null_count():
        msgs, counts = p2p.peers_from_schedule(msgs, analysis.schedule)
    pairs, unmatched, _, _ = p2p.pair(msgs, link_bytes_per_s=p2p.link_bandwidth(config),
                                      ceiling=p2p.transfer_ceiling(config))
    counts = {**counts, "pairs": pairs.height if counts["missing"] else 0,
              "late": (pairs.filter(pl.col("recv_end_ns") < pl.col("send_start_ns")).height
                       if counts["missing"] and pairs.height else 0)}
    if not counts["missing"]:
        pairs = analysis.p2p  # (the same pairs: the analysis made them from the same messages)
    per = (unmatched.group_by("rank", "dir").agg(pl.len()).cast(_NO_UNMATCHED.schema) if unmatched.height
           else _NO_UNMATCHED)
    return pairs, PairFacts(counts=counts, unmatched=per, no_peer=bool(msgs["peer"].null_count()))


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


def _edges(pairs: pl.DataFrame, ops: pl.DataFrame, win: pl.DataFrame
           ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """Every message's producer, consumer and anchor (module docstring) with its lags and transfer, in the replay's
    order (step, EDGE_ORDER); the number left out per step (UNPAIRED); each kept one's send span (send_start_ns,
    send_end_ns)."""
    if pairs.height == 0:
        return pl.DataFrame(schema=EDGES), pl.DataFrame(schema=UNPAIRED), pl.DataFrame(schema={"send_start_ns": pl.Int64, "send_end_ns": pl.Int64,
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
    unpaired = e.filter(~keep).group_by("step").agg(pl.len().alias("n")).cast(UNPAIRED)
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
    e = e.sort(["step", *EDGE_ORDER], nulls_last=True, maintain_order=True)
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
    """Sends that blocked (BLOCKING): the send's span (the post to the return of its wait: gloo's ``gloo:send``
    annotation, p2p.messages) lasted more than ARRIVAL_SLACK_NS and returned no earlier than its message's modelled
    arrival (less ARRIVAL_SLACK_NS), and the sender sat in it when the message arrived — its operation before the
    gated one ended by the arrival (plus ARRIVAL_SLACK_NS) and the gated one began its work after the span's return
    (less ARRIVAL_SLACK_NS). The message is then an input of that operation, the sender's first that began its work
    after the span's return. A blocking send (gloo's send, a wait() right after an isend) is one; an isend or
    batch_isend_irecv whose wait comes later (torch.distributed.pipelining's 1F1B waits on its sends before the
    next send, after the next pass) is one only where the sender reached that wait before the message was through
    — its span stays open while it runs other operations, which then did not wait on it."""
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
    got = (arr.with_columns((pl.col("send_end_ns") - ARRIVAL_SLACK_NS).alias("_ret")).sort("_ret")
           .join_asof(by_work, left_on="_ret", right_on="_ws", by=["src", "step"], strategy="forward",
                      check_sortedness=False)
           .filter(pl.col("_seq").is_not_null() & (pl.col("_seq") > pl.col("src_seq")))
           .join(ops.select(pl.col("rank").alias("src"), "step", (pl.col("seq") + 1).alias("_seq"),
                            pl.col("end_ns").alias("_prev_end")), on=["src", "step", "_seq"], how="left")
           .filter(pl.col("_prev_end").is_null() | (pl.col("_prev_end") <= pl.col("_arrive") + ARRIVAL_SLACK_NS)))
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


def _gaps(ops: pl.DataFrame, edges: pl.DataFrame, win: pl.DataFrame, blocking: pl.DataFrame | None = None,
          after: pl.DataFrame | None = None) -> pl.DataFrame:
    """Each operation's gap: its working start less the later of its rank's previous end (the step's start for the
    first; on its lane, and the ends of the operations of the rank's other lanes it came after: ``after``,
    gpu_edges.lane_order) and its inputs' modelled arrival (module docstring; a blocking send's message is its
    sender's next operation's input too); negative: contradicted, taken as 0."""
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
        .with_columns(pl.coalesce(pl.col("end_ns").shift(1).over(*gpu_edges.chain(ops)), "_w").alias("_prev"),
                      (pl.col("end_ns") - pl.col("work_ns")).alias("_s"))
    )
    if after is not None:
        out = (out.join(gpu_edges.after_ends(after, ops), on=["rank", "step", "seq"], how="left", maintain_order="left")
               .with_columns(pl.max_horizontal("_prev", "_after").alias("_prev")).drop("_after"))
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


# The order of a step's messages (``edge`` numbers them in it), the one the replay's plan reads them in (causal.replay,
# causal.critical_path, validation.plan import it)
EDGE_ORDER = ["dst", "dst_seq", "src", "src_seq", "anchor_seq", "send_lag_ns", "post_lag_ns"]
