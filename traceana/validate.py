"""Model versus measurement: does the simulator reproduce a measured run, and does the model predict another run?

- ``validate(analysis)``: feed the simulator with the run's own measured busy time per (stage, phase) per micro-batch,
  host time per operation and P2P costs, and compare its step time and per-stage bubble with the measured ones; compare
  the memory model's per-stage activation peak with the measured one (peak − step-start allocation).
- ``cross_run(baseline, target)``: measure the baseline run, predict the target run (e.g. the same pipeline with BPipe,
  or without recompute) from the baseline's durations only, and compare with the target's measured step time.

Every figure is a pure function of Analysis tables; errors are (estimate − measured) / measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import polars as pl

from traceana import schema
from traceana.analysis import Analysis
from traceana.errors import AnalysisError
from traceana.model.config import TrainingConfig, config_from_manifest
# activation_peak_estimate and backward_working_bytes live in the memory model; imported here for validate's callers
from traceana.model.memory import (  # noqa: F401
    activation_peak_estimate,
    backward_working_bytes,
    estimate_stage_memory,
)
from traceana.model.bpipe import (BASELINES, HELPS_ABOVE, Verdict, check_baseline, deciding_term, decompose,
                                   describe_deltas, evictions, terms_of)
from traceana.model.simulate import Costs, Simulation, StageTimes, simulate
from traceana.pipeline_rules import bpipe_plan

LOCAL_COPY_BYTES_PER_NS = 1.0  # 1 GB/s: an assumption for moving activations between processes on one host
PHASE_CATEGORIES = ("forward", "backward", "recompute", "optimizer")
# "Waiting on the pipeline": the bubbles plus exposed P2P. Measured attribution labels idle time during which one of
# the rank's own sends is still in flight as p2p, which the simulator cannot tell from a bubble; their sum compares.
WAIT_CATEGORIES = (*schema.BUBBLE_CATEGORIES, "p2p")
OVERHEAD_CATEGORIES = ("host", "other_compute")


@dataclass(frozen=True)
class Measured:
    """What the simulator is fed with, measured: per-device durations and communication costs."""

    times: StageTimes
    costs: Costs
    step_ns: dict[int, float]  # per stage: mean step time
    bubble_ns: dict[int, float]  # per stage: mean warm-up + cool-down + stall + exposed P2P
    rank_of_stage: dict[int, int]
    steps_used: int
    bpipe_step_ns: dict[int, float] = field(default_factory=dict)  # per stage: time in category "bpipe" per step


@dataclass(frozen=True)
class Validation:
    per_stage: pl.DataFrame  # one row per stage: measured, estimated and error for step, bubble, activation peak
    summary: dict[str, float | str | None]
    simulation: Simulation | None
    notes: tuple[str, ...] = field(default_factory=tuple)


def _rel(est: pl.Expr, meas: pl.Expr) -> pl.Expr:
    return pl.when(meas != 0).then((est - meas) / meas).otherwise(None)


def _steady_steps(attribution: pl.DataFrame, schedule: pl.DataFrame) -> pl.DataFrame:
    """Steps worth measuring: those with forward work on every rank, dropping the first step when there are more
    (it pays one-off costs: allocator growth, optimizer state creation, lazy initialisation)."""
    have = schedule.filter(pl.col("phase") == "forward").select("rank", "step").unique()
    ranks = attribution["rank"].n_unique()
    full = have.group_by("step").agg(pl.len().alias("n")).filter(pl.col("n") == ranks).sort("step")["step"]
    if full.len() > 1:
        full = full.slice(1)
    return pl.DataFrame({"step": full}, schema={"step": pl.Int32})


def measured_step_ms(analysis: Analysis, ranks: list[int] | None = None) -> float:
    """The run's step time: per measured step the slowest rank's window, averaged over the measured steps (the
    definition of the run's summary; the simulator's step is likewise its slowest device's)."""
    steps = _steady_steps(analysis.attribution, analysis.schedule)
    att = analysis.attribution.join(steps, on="step")
    if ranks is not None:
        att = att.filter(pl.col("rank").is_in(ranks))
    per = att.group_by("step", "rank").agg(pl.col("ns").sum()).group_by("step").agg(pl.col("ns").max())
    return float(per["ns"].mean() or 0) / 1e6


def measure(analysis: Analysis, cfg: TrainingConfig) -> Measured:
    """Per-stage durations per micro-batch from the measured attribution (busy time only, so waits inside annotation
    spans do not count as compute) and P2P costs from the matched pairs."""
    att, sched = analysis.attribution, analysis.schedule
    steps = _steady_steps(att, sched)
    if steps.height == 0:
        raise AnalysisError("no step has forward work on every rank", path=analysis.run.path,
                            fix="profile at least one complete step on all ranks")
    att = att.join(steps, on="step")
    sched = sched.join(steps, on="step")
    stage_of = dict(analysis.stages.select("rank", "stage").drop_nulls().iter_rows())
    p = cfg.pp
    rank_of_stage: dict[int, int] = {}
    for r, s in sorted(stage_of.items()):
        rank_of_stage.setdefault(s % p, r)  # the first data-parallel replica of each stage
    missing = [s for s in range(p) if s not in rank_of_stage]
    if missing:
        raise AnalysisError(f"no rank found for stages {missing}", path=analysis.run.path,
                            fix="check run.json's stage_of_rank or the traces' P2P chain")
    per_rank = (
        att.group_by("rank", "step", "category").agg(pl.col("ns").sum())
        .with_columns(pl.col("category").cast(pl.String))
        .pivot(on="category", index=["rank", "step"], values="ns")
        .fill_null(0)
    )
    for c in schema.CATEGORIES:
        if c not in per_rank.columns:
            per_rank = per_rank.with_columns(pl.lit(0, pl.Int64).alias(c))
    counts = (
        sched.filter(pl.col("phase").is_in(["forward", "backward"]))
        .group_by("rank", "step").agg(
            (pl.col("phase") == "forward").sum().alias("n_f"), (pl.col("phase") == "backward").sum().alias("n_b"))
    )
    per_rank = per_rank.join(counts, on=["rank", "step"], how="left").fill_null(0)
    means = per_rank.group_by("rank").agg(
        (pl.col("forward") / pl.col("n_f")).mean().alias("f"),
        (pl.col("backward") / pl.col("n_b")).mean().alias("b"),
        (pl.col("recompute") / pl.col("n_b")).mean().alias("r"),
        pl.col("optimizer").mean().alias("o"),
        ((pl.col("host") + pl.col("other_compute")) / (pl.col("n_f") + pl.col("n_b"))).mean().alias("h"),
        pl.sum_horizontal(*schema.CATEGORIES).mean().alias("step"),
        pl.sum_horizontal(*schema.BUBBLE_CATEGORIES, "p2p").mean().alias("bubble"),
    )
    # An operation lasts its annotation span: its compute plus the Python inside it, which delays the operation's
    # output as much as the compute does. The host time left for between operations is the rest.
    spans = (
        sched.filter(pl.col("microbatch").is_not_null())
        .with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
        .group_by("rank", "step").agg(
            pl.col("d").filter(pl.col("phase") == "forward").sum().alias("sf"),
            pl.col("d").filter(pl.col("phase") == "backward").sum().alias("sb"),
            pl.col("d").filter(pl.col("phase") == "recompute").sum().alias("sr"))
    )
    inside = (
        per_rank.join(spans, on=["rank", "step"], how="left").fill_null(0)
        .group_by("rank").agg(
            (pl.col("sf") / pl.col("n_f")).mean().alias("f_span"),
            ((pl.col("sb") - pl.col("sr")) / pl.col("n_b")).mean().alias("b_span"),
            (pl.col("sr") / pl.col("n_b")).mean().alias("r_span"),
            ((pl.col("sf") + pl.col("sb") - pl.col("forward") - pl.col("backward") - pl.col("recompute"))
             / (pl.col("n_f") + pl.col("n_b"))).mean().alias("inside"))
    )
    means = means.join(inside, on="rank", how="left").with_columns(
        pl.max_horizontal("f", "f_span").alias("f"),
        pl.max_horizontal("b", "b_span").alias("b"),
        pl.max_horizontal("r", "r_span").alias("r"),
        pl.max_horizontal(pl.lit(0.0), pl.col("h") - pl.col("inside").clip(lower_bound=0).fill_null(0)).alias("h"),
    )
    row = {r: d for r, *d in means.select("rank", "f", "b", "r", "o", "h", "step", "bubble").iter_rows()}
    if cfg.virtual_stages > 1:
        # Means are per chunk operation; the simulator takes a device's whole share and splits it over its chunks.
        v = cfg.virtual_stages
        row = {r: [x * v if i < 3 and x is not None else x for i, x in enumerate(d)] for r, d in row.items()}
    order = [rank_of_stage[s] for s in range(p)]
    times = StageTimes(
        forward_ns=tuple(float(row[r][0] or 0) for r in order),
        backward_ns=tuple(float(row[r][1] or 0) for r in order),
        recompute_ns=tuple(float(row[r][2] or 0) for r in order),
        optimizer_ns=tuple(float(row[r][3] or 0) for r in order),
        host_ns=tuple(float(row[r][4] or 0) for r in order),
    )
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
        p2p.select(pl.col("dst").alias("rank"), pl.col("recv_end").alias("t")).sort("t")
        .join_asof(sched.filter(pl.col("phase").is_in(["forward", "backward"]))
                   .select("rank", pl.col("start_ns").alias("t_op")).sort("t_op"),
                   left_on="t", right_on="t_op", by="rank", strategy="forward", check_sortedness=False)
        .select((pl.col("t_op") - pl.col("t")).alias("gap"))
        .drop_nulls()
    )
    resume = float(nxt["gap"].median() or 0) if nxt.height else 0.0
    resume = min(resume, min(times.host_ns) if times.host_ns else 0.0)
    times = StageTimes(times.forward_ns, times.backward_ns, times.recompute_ns, times.optimizer_ns,
                       tuple(max(0.0, h - resume) for h in times.host_ns))
    # BPipe, as measured: the time each evictor and acceptor spent on BPipe (attribution category "bpipe": blocking
    # evictions, exposed loads, accepting and returning) per planned eviction; the transfers themselves overlap.
    evict_block = accept_block = 0.0
    pairs_of_run = analysis.run.manifest.bpipe if analysis.run.manifest and analysis.run.manifest.bpipe else ()
    if pairs_of_run and cfg.schedule == "1f1b":
        per_step = per_rank.group_by("rank").agg(pl.col("bpipe").mean())
        spent = dict(per_step.iter_rows())
        ev_ns, acc_ns, n_ev = 0.0, 0.0, 0
        for e, q in pairs_of_run:
            n = bpipe_plan("1f1b", pp=p, num_microbatches=cfg.num_microbatches, evictor=e).evicted
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
    bpipe_step = (per_rank.group_by("rank").agg(pl.col("bpipe").mean()) if "bpipe" in per_rank.columns
                  else pl.DataFrame({"rank": [], "bpipe": []}))
    return Measured(
        times=times, costs=costs,
        bpipe_step_ns={s: float(dict(bpipe_step.iter_rows()).get(rank_of_stage[s], 0.0) or 0.0) for s in range(p)},
        step_ns={s: float(row[rank_of_stage[s]][5]) for s in range(p)},
        bubble_ns={s: float(row[rank_of_stage[s]][6]) for s in range(p)},
        rank_of_stage=rank_of_stage, steps_used=steps.height,
    )


def replay_inputs(analysis: Analysis, cfg: TrainingConfig, meas: Measured) -> tuple[StageTimes, Costs]:
    """The last measured step's own operation durations and message transfers, for a replay of that step.

    Feeding them (instead of means) checks the schedule logic itself: what is left between replay and measurement is
    what the model does not represent (per-operation host time, a different order), not run-to-run variance."""
    step = int(_steady_steps(analysis.attribution, analysis.schedule)["step"].max())
    stage_of = {r: s for s, r in meas.rank_of_stage.items()}
    rows = (
        analysis.schedule.filter((pl.col("step") == step) & pl.col("microbatch").is_not_null()
                                 & pl.col("rank").is_in(list(stage_of)))
        .with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    )
    rc = rows.filter(pl.col("phase") == "recompute").select("rank", "microbatch", pl.col("d").alias("r"))
    ops = (
        rows.filter(pl.col("phase").is_in(["forward", "backward"]))
        .join(rc, on=["rank", "microbatch"], how="left")
        .with_columns(pl.when(pl.col("phase") == "backward").then(pl.col("d") - pl.col("r").fill_null(0))
                      .otherwise(pl.col("d")).alias("d"))
    )
    per_op: dict[tuple[str, int, int], float] = {}
    for phase, stage, mb, d, r in ops.select("phase", "stage", "microbatch", "d", "r").iter_rows():
        key = "F" if phase == "forward" else "B"
        per_op[(key, stage, mb)] = float(d)
        if phase == "backward" and r is not None:
            per_op[("R", stage, mb)] = float(r)
    msgs = (
        analysis.p2p.filter((pl.col("step") == step) & (pl.col("channel") == "p2p"))
        .with_columns(pl.col("src").replace_strict(stage_of, default=None).alias("s_src"),
                      pl.col("dst").replace_strict(stage_of, default=None).alias("s_dst"))
        .drop_nulls(["s_src", "s_dst"])
        .sort("send_start")
        .with_columns(pl.int_range(pl.len()).over("src", "dst").alias("mb"))
    )
    per_msg = {
        ("F" if s_dst > s_src else "B", s_src, mb): float(x)
        for s_src, s_dst, mb, x in msgs.select("s_src", "s_dst", "mb", "transfer_ns").iter_rows()
    }
    times = StageTimes(meas.times.forward_ns, meas.times.backward_ns, meas.times.recompute_ns,
                       meas.times.optimizer_ns, meas.times.host_ns, per_op_ns=per_op)
    c = meas.costs
    return times, dataclasses.replace(c, per_message_ns=per_msg)


def sampled_step_ns(analysis: Analysis, cfg: TrainingConfig, meas: Measured, *, samples: int = 24, seed: int = 0,
                    bpipe: bool | tuple = False) -> float:
    """Mean simulated step when every operation's duration is drawn from the measured durations of its
    (stage, phase) in the steady steps (a bootstrap). On a busy or noisy machine operations do not all take their
    mean, and a pipeline's step is set by its slowest path: the mean of the maxima exceeds the maximum of the means.
    Deterministic (seeded)."""
    import random

    steps = _steady_steps(analysis.attribution, analysis.schedule)
    stage_of = {r: s for s, r in meas.rank_of_stage.items()}
    rows = (
        analysis.schedule.join(steps, on="step")
        .filter(pl.col("microbatch").is_not_null() & pl.col("rank").is_in(list(stage_of)))
        .with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    )
    rc = rows.filter(pl.col("phase") == "recompute").select("rank", "step", "microbatch", pl.col("d").alias("r"))
    ops = (
        rows.filter(pl.col("phase").is_in(["forward", "backward"]))
        .join(rc, on=["rank", "step", "microbatch"], how="left")
        .with_columns(pl.when(pl.col("phase") == "backward").then(pl.col("d") - pl.col("r").fill_null(0))
                      .otherwise(pl.col("d")).alias("d"))
    )
    ops = ops.group_by("stage", "phase").agg(pl.col("d"), pl.col("r"))
    pools = {(ph, st): (ds, [x for x in rs if x is not None]) for st, ph, ds, rs in
             ops.select("stage", "phase", "d", "r").iter_rows()}
    msgs = analysis.p2p.join(steps, on="step").filter(pl.col("channel") == "p2p")["transfer_ns"].to_list()
    rng = random.Random(seed)
    total = 0.0
    nv = cfg.pp * cfg.virtual_stages
    for _ in range(samples):
        per_op: dict[tuple[str, int, int], float] = {}
        per_msg: dict[tuple[str, int, int], float] = {}
        for st in range(nv):
            for mb in range(cfg.num_microbatches):
                f, _r = pools.get(("forward", st), ([], []))
                b, r = pools.get(("backward", st), ([], []))
                if f:
                    per_op[("F", st, mb)] = float(rng.choice(f))
                if b:
                    per_op[("B", st, mb)] = float(rng.choice(b))
                if r:
                    per_op[("R", st, mb)] = float(rng.choice(r))
                if msgs:
                    per_msg[("F", st, mb)] = float(rng.choice(msgs))
                    per_msg[("B", st, mb)] = float(rng.choice(msgs))
        times = StageTimes(meas.times.forward_ns, meas.times.backward_ns, meas.times.recompute_ns,
                           meas.times.optimizer_ns, meas.times.host_ns, per_op_ns=per_op)
        c = meas.costs
        costs = dataclasses.replace(c, per_message_ns=per_msg)
        total += simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=times, costs=costs,
                          virtual_stages=cfg.virtual_stages, bpipe=bpipe).step_ns
    return total / samples


def validate(analysis: Analysis, *, cfg: TrainingConfig | None = None, window: str = "rolling") -> Validation:
    """Simulate the run from its own measured durations and compare step time, bubble and activation memory."""
    run = analysis.run
    if cfg is None:
        if run.manifest is None:
            raise AnalysisError("validation needs run.json (model, pp, micro-batches)", path=run.path,
                                fix="collect with `traceana collect`, or write run.json")
        cfg = config_from_manifest(run.manifest)
    meas = measure(analysis, cfg)
    bpipe = tuple(run.manifest.bpipe) if run.manifest and run.manifest.bpipe else False
    sim = simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=meas.times,
                   costs=meas.costs, virtual_stages=cfg.virtual_stages, bpipe=bpipe, window=window)
    replay = None
    if cfg.virtual_stages == 1:
        r_times, r_costs = replay_inputs(analysis, cfg, meas)
        replay = simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=r_times,
                          costs=r_costs, bpipe=bpipe, window=window)
    sampled = sampled_step_ns(analysis, cfg, meas, bpipe=bpipe)
    sim_per = (
        sim.attribution.group_by("stage").agg(
            pl.col("ns").sum().alias("sim_step"),
            pl.col("ns").filter(pl.col("category").is_in(WAIT_CATEGORIES)).sum().alias("sim_bubble"))
    )
    grads_in_step = bool(run.manifest.extra.get("grads_in_step", False)) if run.manifest else False
    est_mem = activation_peak_estimate(cfg, grads_in_step=grads_in_step)
    mem = (
        analysis.stage_memory.join(_steady_steps(analysis.attribution, analysis.schedule), on="step")
        .filter(pl.col("rank").is_in(list(meas.rank_of_stage.values())))
        .group_by("stage").agg(pl.col("activation_peak_bytes").max().alias("measured_act"))
    )
    per_stage = (
        pl.DataFrame({
            "stage": list(range(cfg.pp)),
            "rank": [meas.rank_of_stage[s] for s in range(cfg.pp)],
            "measured_step_ms": [meas.step_ns[s] / 1e6 for s in range(cfg.pp)],
            "measured_bubble_ms": [meas.bubble_ns[s] / 1e6 for s in range(cfg.pp)],
            "estimated_activation_bytes": est_mem,
        }, schema_overrides={"stage": pl.Int32, "rank": pl.Int32})
        .join(sim_per.with_columns(pl.col("stage").cast(pl.Int32)), on="stage", how="left")
        .join(mem.with_columns(pl.col("stage").cast(pl.Int32)), on="stage", how="left")
        .select(
            "stage", "rank",
            "measured_step_ms", (pl.col("sim_step") / 1e6).alias("simulated_step_ms"),
            "measured_bubble_ms", (pl.col("sim_bubble") / 1e6).alias("simulated_bubble_ms"),
            pl.col("measured_act").cast(pl.Float64).alias("measured_activation_bytes"),
            "estimated_activation_bytes",
        )
        .with_columns(
            _rel(pl.col("simulated_step_ms"), pl.col("measured_step_ms")).alias("step_error"),
            _rel(pl.col("simulated_bubble_ms"), pl.col("measured_bubble_ms")).alias("bubble_error"),
            _rel(pl.col("estimated_activation_bytes"), pl.col("measured_activation_bytes")).alias("memory_error"),
        )
        .sort("stage")
    )
    ranks = list(meas.rank_of_stage.values())
    measured_step = measured_step_ms(analysis, ranks)
    last = int(_steady_steps(analysis.attribution, analysis.schedule)["step"].max())
    measured_last = float(
        analysis.attribution.filter((pl.col("step") == last) & pl.col("rank").is_in(ranks))
        .group_by("rank").agg(pl.col("ns").sum())["ns"].max()
    ) / 1e6
    rel = lambda est, ref: (est - ref) / ref if ref else None  # noqa: E731
    summary = {
        "run": str(run.path),
        "schedule": cfg.schedule,
        "pp": cfg.pp,
        "microbatches": cfg.num_microbatches,
        "bpipe": bool(bpipe),
        "recompute": cfg.recompute,
        "attention": cfg.attention,
        # every simulated figure here is a REPLAY: fed with this run's own measured durations (in sample); it checks
        # the schedule logic, not the model's power to predict (that is cross_run: --baseline OTHER_RUN)
        "kind": "replay",
        "measured_step_ms": measured_step,
        "simulated_step_ms": sim.step_ns / 1e6,
        "step_error": rel(sim.step_ns / 1e6, measured_step),
        "sampled_step_ms": sampled / 1e6,
        "sampled_error": rel(sampled / 1e6, measured_step),
        "replay_step_ms": replay.step_ns / 1e6 if replay else None,
        "replay_error": rel(replay.step_ns / 1e6, measured_last) if replay else None,
        "median_abs_memory_error": per_stage["memory_error"].abs().median(),
        "steps_used": meas.steps_used,
        "bpipe_transfer_ms": meas.costs.bpipe_ns / 1e6 if bpipe else None,
        "bpipe_ms_per_step": {s: v / 1e6 for s, v in meas.bpipe_step_ns.items()} if bpipe else None,
    }
    notes = (
        "replay, not prediction: the simulator is fed with this run's own measured durations (means, sampled, or the "
        "last step's own); a prediction uses none of them (validate RUN --baseline OTHER_RUN)",
        f"fed: host {sum(meas.times.host_ns) / cfg.pp / 1e6:.2f} ms per operation, P2P in flight "
        f"{meas.costs.p2p_ns / 1e6:.3f} ms (median); bubble = warm-up + cool-down + stall + exposed P2P"
        + (f"; BPipe from the trace: {meas.costs.bpipe_ns / 1e6:.3f} ms per transfer in flight (median), "
           + ", ".join(f"stage {s} {v / 1e6:.2f} ms" for s, v in meas.bpipe_step_ns.items() if v)
           + " per step in BPipe work" if bpipe else ""),
        "memory estimate: saved activations in flight"
        + (" + gradients allocated in the step" if grads_in_step else "") + " + one layer's backward working memory",
    )
    return Validation(per_stage=per_stage, summary=summary, simulation=sim, notes=notes)


def predict(baseline: Analysis, target: TrainingConfig, *, base_cfg: TrainingConfig | None = None,
            bpipe_ns: float | None = None) -> Simulation:
    """Predict a target configuration's step from a baseline run's measured durations.

    The same pipeline and micro-batch size are assumed (durations do not transfer across shapes); recompute is dropped
    or kept as the target says; BPipe transfers cost ``bpipe_ns`` each (by default one baseline P2P message's time
    plus the evictor's activation bytes per micro-batch at LOCAL_COPY_BYTES_PER_NS).
    """
    base_cfg = base_cfg or config_from_manifest(baseline.run.manifest)
    if (target.pp, target.microbatch_size, target.model) != (base_cfg.pp, base_cfg.microbatch_size, base_cfg.model):
        raise AnalysisError("the cross-run prediction needs the same model, pp and micro-batch size",
                            path=baseline.run.path, fix="compare runs that differ only in schedule, BPipe, recompute")
    meas = measure(baseline, base_cfg)
    t = meas.times
    if target.recompute == "none":
        t = StageTimes(t.forward_ns, t.backward_ns, (), t.optimizer_ns, t.host_ns)
    costs = meas.costs
    if target.bpipe:
        if bpipe_ns is None:
            # One eviction costs what one of the baseline's P2P messages cost (on a CPU host that is latency, not
            # bandwidth: every message here is small) plus its bytes at copy speed.
            evict = estimate_stage_memory(target)[0].activation_per_microbatch
            bpipe_ns = costs.p2p_ns + evict / LOCAL_COPY_BYTES_PER_NS
        costs = dataclasses.replace(costs, bpipe_ns=bpipe_ns)
    return simulate(target.schedule, pp=target.pp, num_microbatches=target.num_microbatches, times=t, costs=costs,
                    virtual_stages=target.virtual_stages, bpipe=bool(target.bpipe))


def noise_floor(first: Analysis, second: Analysis) -> float:
    """The same configuration measured twice: |step₁ − step₂| / their mean. A prediction cannot be judged finer."""
    x, y = measured_step_ms(first), measured_step_ms(second)
    return abs(x - y) / ((x + y) / 2) if x + y else 0.0


def cross_run(baseline: Analysis, target: Analysis, *,
              repeat: tuple[Analysis, Analysis] | None = None) -> dict[str, float | str | None]:
    """A PREDICTION: measure the baseline, predict the target from it (no duration of the target is used), compare
    with the target's measured step time; with ``repeat`` (one configuration collected twice), the noise floor.

    The model predicts the *change*: the target's step is the baseline's measured step times the ratio of the two
    simulations (target over baseline, both fed only with the baseline's measurements), so a bias the simulator has
    on this machine cancels."""
    if baseline.run.manifest is None or target.run.manifest is None:
        raise AnalysisError("cross-run validation needs run.json in both runs", path=target.run.path,
                            fix="collect both with `traceana collect`")
    base_cfg = config_from_manifest(baseline.run.manifest)
    tgt_cfg = config_from_manifest(target.run.manifest)
    sim_target = predict(baseline, tgt_cfg, base_cfg=base_cfg)
    sim_base = predict(baseline, base_cfg, base_cfg=base_cfg)
    meas_t = measure(target, tgt_cfg)
    measured = measured_step_ms(target)
    meas_b = measure(baseline, base_cfg)
    base_ms = measured_step_ms(baseline)
    ratio = sim_target.step_ns / sim_base.step_ns
    predicted = base_ms * ratio
    return {
        "kind": "prediction",
        "baseline": str(baseline.run.path),
        "target": str(target.run.path),
        "baseline_step_ms": base_ms,
        "predicted_step_ms": predicted,
        "measured_step_ms": measured,
        "error": (predicted - measured) / measured if measured else None,
        "noise_floor": noise_floor(*repeat) if repeat else None,
        "predicted_speedup": 1 / ratio,
        "measured_speedup": base_ms / measured if measured else None,
        # the target's forward+backward time per micro-batch over the baseline's: the model assumes 1 unless the
        # change (e.g. recompute) alters the work; anything else is the machine running at another speed
        "compute_ratio": (sum(meas_t.times.forward_ns) + sum(meas_t.times.backward_ns))
        / (sum(meas_b.times.forward_ns) + sum(meas_b.times.backward_ns)),
    }


RUN_RECOMPUTE = {"as-configured": None, "best-without-bpipe": "none", "full-recompute": "full"}


def bpipe_verdict_from_run(baseline: Analysis, *, cfg: TrainingConfig | None = None, bpipe_ns: float | None = None,
                           policy: str = "as-configured") -> Verdict:
    """Would BPipe help this measured (plain 1F1B) run? Both sides are predicted from the run's own measured
    durations. ``policy`` (model.bpipe.BASELINES) says what BPipe is compared with: ``as-configured`` the run as it
    ran, BPipe added and recompute kept (no device memory limit is known, so dropping recompute is not BPipe's to
    claim); ``best-without-bpipe`` both without recompute; ``full-recompute`` (the BPipe paper's comparison) the run
    with full recompute against BPipe without any. A BPipe transfer costs ``bpipe_ns`` (default: one P2P message's
    time plus stage 0's activation bytes per micro-batch at LOCAL_COPY_BYTES_PER_NS, overlapped)."""
    check_baseline(policy)
    cfg = cfg or config_from_manifest(baseline.run.manifest)
    if cfg.schedule != "1f1b" or cfg.bpipe or cfg.pp < 2:
        raise AnalysisError("a BPipe verdict needs a plain 1F1B run with pp ≥ 2", path=baseline.run.path,
                            fix="collect a 1F1B run without BPipe")
    rc = RUN_RECOMPUTE[policy]
    ref_cfg = cfg if rc is None else cfg.replace(recompute=rc)
    target = cfg.replace(bpipe=True, recompute=cfg.recompute if rc is None else "none")
    ref = predict(baseline, ref_cfg, base_cfg=cfg)
    sim = predict(baseline, target, base_cfg=cfg, bpipe_ns=bpipe_ns)
    free = predict(baseline, target, base_cfg=cfg, bpipe_ns=0.0)
    deltas = decompose(ref, sim, free)
    speedup = ref.step_ns / sim.step_ns
    deciding = deciding_term(speedup, deltas)
    helps = speedup > HELPS_ABOVE
    before, after = estimate_stage_memory(ref_cfg), estimate_stage_memory(target)
    n_ev = evictions(target)
    verb = {"no change": "would make no difference to"}.get(deciding, "would help" if helps else "would not help")
    sentence = (
        f"BPipe {verb} this run against {policy} ({speedup:.3f}×: {ref.step_ns / 1e6:.1f} → "
        f"{sim.step_ns / 1e6:.1f} ms per step predicted from its own durations"
        + (", dropping recompute" if target.recompute != ref_cfg.recompute else "")
        + f"); {describe_deltas(deltas, spec='.1f') or 'no term changes'}"
        + (f"; BPipe evicts nothing at pp={cfg.pp}, m={cfg.num_microbatches}" if n_ev == 0 else
           f"; {n_ev} evictions per step")
        + f". Deciding term: {deciding}. Model: largest stage's activations "
        f"{max(s.activation_bytes for s in before) / 2**20:.1f} → "
        f"{max(s.activation_bytes for s in after) / 2**20:.1f} MiB."
    )
    from traceana.model.bpipe import StepEstimate

    def est(c: TrainingConfig, s: Simulation, mem) -> StepEstimate:
        return StepEstimate(config=c, step_s=s.step_ns / 1e9, mfu=float("nan"), fits=None,
                            peak_bytes=max(m.total_bytes for m in mem), terms=terms_of(s.attribution),
                            efficiency=float("nan"))

    r = est(ref_cfg, ref, before)
    return Verdict(
        helps=helps, speedup=speedup, reference=r, given=est(cfg, predict(baseline, cfg, base_cfg=cfg), before),
        with_bpipe=est(target, sim, after), deciding_term=deciding, deltas=deltas, sentence=sentence,
        assumptions=("durations measured on this run (both sides predicted from them); BPipe transfer "
                     + ("as given" if bpipe_ns is not None else "= one P2P message's time + stage 0's activation "
                        "bytes per micro-batch at 1 GB/s, overlapped (a run without BPipe has no BPipe transfer "
                        "to measure; a BPipe run's own are in validate's notes)"),
                     f"baseline: {policy} ({BASELINES[policy]})"),
        baseline=policy)
