"""What validation measures on a run: per-stage durations per micro-batch and communication costs, over the
measured steps of the run's summary (traceana.measure.summary), to feed the simulator."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import polars as pl

from traceana.causal.graph import pass_durations  # (each operation's own time: the graph's too)
from traceana.core import names, schema
from traceana.core.errors import AnalysisError
from traceana.core.flops import stage_flops
from traceana.core.pipeline_rules import bpipe_applies, bpipe_plan
from traceana.core.run_config import RUN_JSON
from traceana.core.training_config import TrainingConfig
from traceana.core.units import MS_PER_S
from traceana.measure.analysis import Analysis
from traceana.measure.timeline import shift
from traceana.model.simulate import Costs, StageTimes


__all__ = ["LAYER_WORK", "Measured", "layer_work", "measure", "measured_efficiency", "pass_durations", "shared_cpus"]


@dataclass(frozen=True)
class Measured:
    """What the simulator is fed with, measured: per-device durations and communication costs."""

    times: StageTimes
    costs: Costs
    step_ns: dict[int, float]  # per stage: mean step time
    blocked_ns: dict[int, float]  # per stage: mean blocked time (bubble: warm-up + stall + cool-down, + exposed P2P)
    rank_of_stage: dict[int, int]
    steps_used: int
    bpipe_step_ns: dict[int, float] = field(default_factory=dict)  # per stage: time in category "bpipe" per step


def shared_cpus(analysis: Analysis) -> str | None:
    """A note when the run's CPU ranks had fewer processors than ranks (run.json's ``host_cpus`` and
    ``ranks_per_host``), else None. The simulator gives every stage its own device; ranks time-sharing cores do not
    compute at once, so a replay then underestimates the step by up to ranks/cores (docs/model.md)."""
    m = analysis.config
    if not m.host_cpus or not m.ranks_per_host or m.ranks_per_host <= m.host_cpus:
        return None
    if analysis.run.events.select(pl.col("is_gpu").any()).item():
        return None  # GPU ranks compute on their own devices; the host's cores only launch
    return (f"{m.ranks_per_host} CPU ranks shared {m.host_cpus} cores on one host: they could not all compute at "
            f"once, which the simulator (one device per stage) does not model, so its steps can be up to "
            f"{m.ranks_per_host / m.host_cpus:.1f}× too short here; an error of that size is the machine, not the model")


def measure(analysis: Analysis, cfg: TrainingConfig) -> Measured:
    """Per-stage durations per micro-batch from the measured attribution (busy time only, so waits inside annotation
    spans do not count as compute) and P2P costs from the matched pairs."""
    steps = pl.DataFrame({"step": list(analysis.summary.steps)}, schema={"step": pl.Int32})
    att = analysis.attribution.join(steps, on="step")
    sched = analysis.schedule.join(steps, on="step")
    if sched.filter(pl.col("phase") == "forward")["rank"].n_unique() < att["rank"].n_unique() or steps.height == 0:
        raise AnalysisError("no step has forward work on every rank", path=analysis.run.path,
                            fix="profile at least one complete step on all ranks")
    stage_of = dict(analysis.stages.select("rank", "stage").drop_nulls().iter_rows())
    p = cfg.pp
    rank_of_stage: dict[int, int] = {}
    for r, s in sorted(stage_of.items()):
        rank_of_stage.setdefault(s % p, r)  # the first data-parallel replica of each stage
    missing = [s for s in range(p) if s not in rank_of_stage]
    if missing:
        c = analysis.config
        listed = c.stages_of_rank if c.stages_of_rank and c.source("stages_of_rank") == RUN_JSON else {}
        absent = sorted({r for r, st in listed.items() if any(s % p in missing for s in st)} - set(analysis.run.ranks))
        if absent:  # run.json names the stage's ranks: their traces are what is missing
            raise AnalysisError(f"stages {missing} have no trace: run.json places them on rank"
                                f"{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))}, whose trace is "
                                "not in the run", path=analysis.run.path,
                                fix="copy the missing rank traces into the run directory, or re-collect")
        raise AnalysisError(f"no rank found for stages {missing}", path=analysis.run.path,
                            fix="check run.json's stage_of_rank or the traces' P2P chain")
    per_rank = analysis.per_rank_step.join(steps, on="step").select(
        "rank", "step", "step_ns", "blocked_ns", *(pl.col(f"{c}_ns").alias(c) for c in schema.CATEGORIES))
    # A micro-batch's backward on a stage is one B, or one I and one W (zero-bubble schedules, Qi et al. 2023): the
    # backward duration fed is the whole backward per micro-batch (B, or I + W), the W part separately; host time
    # is per operation (F, B, I and W each).
    counts = (
        sched.filter(pl.col("phase").is_in(names.PASS_PHASES))
        .group_by("rank", "step").agg(
            (pl.col("phase") == "forward").sum().alias("n_f"),
            pl.col("phase").is_in(["backward", "backward_input"]).sum().alias("n_b"),
            (pl.col("phase") == "backward_weight").sum().alias("n_w"),
            pl.len().alias("n_ops"))
    )
    per_rank = per_rank.join(counts, on=["rank", "step"], how="left").fill_null(0)
    whole_backward = pl.col("backward") + pl.col("backward_input") + pl.col("backward_weight")
    means = per_rank.group_by("rank").agg(
        (pl.col("forward") / pl.col("n_f")).mean().alias("f"),
        (whole_backward / pl.col("n_b")).mean().alias("b"),
        (pl.col("backward_weight") / pl.col("n_w")).mean().alias("w"),
        (pl.col("recompute") / pl.col("n_b")).mean().alias("r"),
        pl.col("optimizer").mean().alias("o"),
        ((pl.col("host") + pl.col("other_compute")) / pl.col("n_ops")).mean().alias("h"),
        pl.col("step_ns").mean().alias("step"),
        pl.col("blocked_ns").mean().alias("blocked"),
    )
    # An operation lasts its annotation span: its compute plus the Python inside it, which delays the operation's
    # output as much as the compute does. The host time left for between operations is the rest.
    span = pl.col("d").filter
    spans = (
        pass_durations(analysis, steps)
        .group_by("rank", "step").agg(
            span(pl.col("phase") == "forward").sum().alias("sf"),
            span(pl.col("phase").is_in(names.BACKWARD_PHASES)).sum().alias("sb"),
            span(pl.col("phase") == "backward_weight").sum().alias("sw"),
            span(pl.col("phase") == "recompute").sum().alias("sr"))
    )
    inside = (
        per_rank.join(spans, on=["rank", "step"], how="left").fill_null(0)
        .group_by("rank").agg(
            (pl.col("sf") / pl.col("n_f")).mean().alias("f_span"),
            ((pl.col("sb") - pl.col("sr")) / pl.col("n_b")).mean().alias("b_span"),
            (pl.col("sw") / pl.col("n_w")).mean().alias("w_span"),
            (pl.col("sr") / pl.col("n_b")).mean().alias("r_span"),
            ((pl.col("sf") + pl.col("sb") - pl.col("forward") - whole_backward - pl.col("recompute"))
             / pl.col("n_ops")).mean().alias("inside"))
    )
    means = means.join(inside, on="rank", how="left").with_columns(
        pl.max_horizontal("f", "f_span").alias("f"),
        pl.max_horizontal("b", "b_span").alias("b"),
        pl.max_horizontal("w", "w_span").fill_nan(None).alias("w"),
        pl.max_horizontal("r", "r_span").alias("r"),
        pl.max_horizontal(pl.lit(0.0), pl.col("h") - pl.col("inside").clip(lower_bound=0).fill_null(0)).alias("h"),
    )
    if cfg.virtual_stages > 1:
        # Means are per chunk operation; the simulator takes a device's whole share and splits it over its chunks.
        means = means.with_columns(pl.col("f", "b", "w", "r") * cfg.virtual_stages)
    order = pl.DataFrame({"rank": [rank_of_stage[s] for s in range(p)]}, schema={"rank": means.schema["rank"]})
    per_stage = order.join(means, on="rank", how="left")  # one row per stage, in stage order
    split = per_stage["w"].is_not_null().all()  # W durations where the schedule ran any, else the rules' default
    per_stage = per_stage.fill_null(0.0)

    def col(name: str) -> tuple[float, ...]:
        return tuple(float(x) for x in per_stage[name])

    times = StageTimes(forward_ns=col("f"), backward_ns=col("b"), recompute_ns=col("r"), optimizer_ns=col("o"),
                       host_ns=col("h"), weight_ns=col("w") if split else ())
    pairs = analysis.p2p.join(steps, on="step")
    p2p = pairs.filter(pl.col("channel") == "p2p")
    bp = pairs.filter(pl.col("channel") == "bpipe")
    # Sends are posted without blocking (isend; the post is host time, already in host_ns), so the sender pays
    # nothing in line; a message is in flight from the send's start to the receive's end: the receiver's transfer.
    # After a receive completes, the receiver needs time before it computes: waking up (on an oversubscribed CPU the
    # scheduler decides) and the Python between wait() and the kernel. Measured as the median gap from a message's
    # arrival to the start of the receiver's next forward/backward; it is part of the measured host time, so it is
    # taken out of the per-operation host time and put where it lies, on the message's critical path.
    nxt = (
        p2p.select(pl.col("dst").alias("rank"), pl.col("recv_end_ns").alias("t")).sort("t")
        .join_asof(sched.filter(pl.col("phase").is_in(names.PASS_PHASES))
                   .select("rank", pl.col("start_ns").alias("t_op")).sort("t_op"),
                   left_on="t", right_on="t_op", by="rank", strategy="forward", check_sortedness=False)
        .select((pl.col("t_op") - pl.col("t")).alias("gap"))
        .drop_nulls()
    )
    resume = float(nxt["gap"].median() or 0) if nxt.height else 0.0
    resume = min(resume, min(times.host_ns) if times.host_ns else 0.0)
    times = dataclasses.replace(times, host_ns=tuple(max(0.0, h - resume) for h in times.host_ns))
    # BPipe, as measured: the time each evictor and acceptor spent on BPipe (attribution category "bpipe": blocking
    # evictions, exposed loads, accepting and returning) per planned eviction; the transfers themselves overlap.
    evict_block = accept_block = 0.0
    pairs_of_run = analysis.config.bpipe or ()
    if pairs_of_run and bpipe_applies(cfg.schedule, pp=p, virtual_stages=cfg.virtual_stages):
        per_step = per_rank.group_by("rank").agg(pl.col("bpipe").mean())
        spent = dict(per_step.iter_rows())
        ev_ns, acc_ns, n_ev = 0.0, 0.0, 0
        for e, q in pairs_of_run:
            n = bpipe_plan(cfg.schedule, pp=p, num_microbatches=cfg.num_microbatches, evictor=e,
                           keep=cfg.bpipe_inflight).evicted
            if n:
                ev_ns += spent.get(rank_of_stage[e], 0.0) or 0.0
                acc_ns += spent.get(rank_of_stage[q], 0.0) or 0.0
                n_ev += n
        if n_ev:
            evict_block, accept_block = ev_ns / n_ev, acc_ns / (2 * n_ev)
    costs = Costs(
        p2p_ns=float(p2p["transfer_ns"].median() or 0) if p2p.height else 0.0,
        send_ns=0.0,
        # one eviction or load in flight, as the trace's BPipe messages took (median); 0 in a run without BPipe
        bpipe_ns=float(bp["transfer_ns"].median() or 0) if bp.height else 0.0,
        bpipe_overlap=True,
        resume_ns=resume,
        evict_block_ns=evict_block,
        accept_block_ns=accept_block,
    )
    bpipe_step = order.join(per_rank.group_by("rank").agg(pl.col("bpipe").mean()), on="rank", how="left")
    return Measured(
        times=times, costs=costs,
        bpipe_step_ns=dict(enumerate(float(x or 0.0) for x in bpipe_step["bpipe"])),
        step_ns=dict(enumerate(col("step"))),
        blocked_ns=dict(enumerate(col("blocked"))),
        rank_of_stage=rank_of_stage, steps_used=steps.height,
    )


def measured_efficiency(analysis: Analysis, *, peak_flops: float | None = None) -> tuple[int, str, float]:
    """Compute efficiency E(b) of a traced run, the quantity Huang et al. 2024 estimate BPipe's benefit from: the
    FLOPs its stages computed per measured step (recompute included: what the hardware did) over the time they spent
    computing (forward + backward, or its I and W halves, + recompute: the attribution's busy time) times the
    device's peak FLOP/s, summed
    over stages. Returns (micro-batch size, attention, E). ``peak_flops`` defaults to run.json's."""
    m = analysis.config  # the traces' micro-batches and schedule where run.json contradicts them
    peak = peak_flops or m.peak_flops
    if not m.has_run_json or m.model is None or not m.pp or not m.microbatch_size or not m.num_microbatches:
        raise AnalysisError("measuring compute efficiency needs run.json with the model, pp and micro-batching",
                            path=analysis.run.path, fix="collect the run with `traceana collect`")
    if not peak:
        raise AnalysisError("measuring compute efficiency needs the device's peak FLOP/s", path=analysis.run.path,
                            fix="pass --peak-flops (FLOP/s per device) or record peak_flops in run.json")
    per = analysis.summary.per_stage.filter(pl.col("stage").is_not_null())
    # every stage some rank holds (several on a looped or V rank, whose per-stage row is under its first)
    held = {int(s) for listed in analysis.stages["stages"].drop_nulls().to_list() for s in listed.split(",")}
    if held != set(range(m.pp)):
        raise AnalysisError(f"found {len(held & set(range(m.pp)))} of {m.pp} stages", path=analysis.run.path,
                            fix="check run.json's stage_of_rank or the traces' P2P chain")
    layers = m.stage_layers()  # run.json's layers_per_stage, else the even split
    if layers is None:
        raise AnalysisError(f"run.json's layers_per_stage ({len(m.layers_per_stage or ())} entries) does not say how "
                            f"the layers of its {m.pp} stages divide", path=analysis.run.path,
                            fix="give layers_per_stage one entry per stage")
    flops = sum(stage_flops(m.model, layers=layers[s], microbatch_size=m.microbatch_size,
                            recompute=m.recompute or "none", last=s == m.pp - 1) for s in range(m.pp))
    # the passes (F, B, or I and W) and their recomputation
    passes = [f"{c}_ms" for c in (*names.PASS_PHASES, "recompute")]
    compute_s = float(per.select(pl.sum_horizontal(*passes).sum()).item()) / MS_PER_S
    if compute_s <= 0:
        raise AnalysisError("the run has no forward or backward compute time", path=analysis.run.path,
                            fix="profile complete steps with forward/backward annotations")
    # stage_flops counts a stage's whole tensor-parallel group; the peak is per device
    return m.microbatch_size, m.attention or "sdpa", flops * m.num_microbatches / (compute_s * peak * m.tp)


LAYER_WORK = {"rank": pl.Int32, "step": pl.Int32, "stage": pl.Int32, "layer": pl.Int32, "action": pl.String,
              "microbatch": pl.Int32, "work_ns": pl.Int64, "spans": pl.UInt32}
_LAYER_PASS_PHASE = {names.FORWARD: "forward", names.BACKWARD: "backward", names.BACKWARD_INPUT: "backward_input",
                     names.BACKWARD_WEIGHT: "backward_weight", names.RECOMPUTE: "backward"}


def layer_work(analysis: Analysis) -> tuple[pl.DataFrame, list[str]]:
    """Measured per-layer work (LAYER_WORK: per rank, measured step, stage, layer, action, micro-batch) from the
    layer spans the reference trainer records inside each pass (``PP:1F0/L5``, names.LAYER_PATTERN): a block's
    spans of one pass summed (a known-workload full backward holds its input and weight parts apart), RECOMPUTE
    beside the backward that holds it. A span counts where it lies inside its own pass's span of a measured step
    (the schedule's annotated row of that rank, stage, micro-batch and phase); one that does not is dropped and
    said. Empty, with the reason in the notes, where the run has none, or where its ranks are GPU ranks (a CPU span
    there times the launches, not the kernels)."""
    empty = pl.DataFrame(schema=LAYER_WORK)
    ev = analysis.events if analysis.events is not None else analysis.run.events  # (a cached analysis keeps none)
    if ev is None or ev.height == 0:
        return empty, ["the analysis holds no events: per-layer work is not measured"]
    spans = ev.filter(~pl.col("is_gpu") & names.name_test(
        pl.col("name"), lambda t: t.str.starts_with(names.PP_PREFIX) & t.str.contains(names.LAYER_PATTERN)))
    if spans.height == 0:
        return empty, ["no layer spans (PP:{stage}F{mb}/L{layer}) in the traces: per-layer work is not measured"]
    if ev.select(pl.col("is_gpu").any()).item():
        return empty, ["layer spans on GPU ranks time the launches, not the kernels: per-layer work is not "
                       "measured from them"]
    if analysis.events is None:  # the loaded events: on the schedule's aligned clock
        spans = shift(spans, analysis.clock_offsets, ["ts_ns"])
    parsed = (spans.with_columns(**names.layer_columns(names.text(pl.col("name"))))
              .filter(pl.col("layer").is_not_null() & pl.col("stage").is_not_null()
                      & pl.col("microbatch").is_not_null())
              .with_columns(pl.col("action").replace_strict(_LAYER_PASS_PHASE, default=None).alias("phase"),
                            (pl.col("ts_ns") + pl.col("dur_ns")).alias("end"))
              .filter(pl.col("phase").is_not_null())
              .select("rank", "stage", "microbatch", "phase", "action", "layer", "ts_ns", "end", "dur_ns")
              .sort("ts_ns"))
    steps = pl.DataFrame({"step": list(analysis.summary.steps)}, schema={"step": pl.Int32})
    passes = (analysis.schedule.join(steps, on="step").filter(pl.col("microbatch").is_not_null())
              .select("rank", "stage", "microbatch", "phase", "step", "start_ns", "end_ns").sort("start_ns"))
    inside = (parsed.join_asof(passes, left_on="ts_ns", right_on="start_ns", by=["rank", "stage", "microbatch", "phase"],
                               strategy="backward", check_sortedness=False)
              .with_columns((pl.col("step").is_not_null() & (pl.col("end") <= pl.col("end_ns"))).alias("_in")))
    notes = []
    # spans of unmeasured steps (the warm-up step) find the step before them or none: only those of a measured
    # step's time are kept; a span that starts inside a measured step's pass but ends after it is said
    lo, hi = passes["start_ns"].min(), passes["end_ns"].max()
    stray = inside.filter(~pl.col("_in") & (pl.col("ts_ns") >= lo) & (pl.col("ts_ns") <= hi)).height
    if stray:
        notes.append(f"{stray} layer spans of the measured steps lie outside their own pass's span: not counted")
    work = (inside.filter(pl.col("_in"))
            .group_by("rank", "step", "stage", "layer", "action", "microbatch")
            .agg(pl.col("dur_ns").sum().alias("work_ns"), pl.len().cast(pl.UInt32).alias("spans")))
    if work.height == 0:
        return empty, ["no layer span lies inside a pass of a measured step: per-layer work is not measured"]
    return work.select(list(LAYER_WORK)).cast(LAYER_WORK).sort("rank", "step", "stage", "layer", "action",
                                                               "microbatch"), notes
