"""The model's in-sample prediction: the simulator fed with a run's own measured durations, against the run's
measurement (``validate``; JSON ``kind`` "in_sample_prediction"). "Replay" is a word of the what-if only (the measured
step's graph replayed, traceana.causal.whatif); here the simulator predicts.

It checks the schedule logic, not the model's power to predict another run (that is ``prediction.cross_run``).
Also the memory model's per-stage activation peak against the measured one. Errors are (estimate − measured) / measured.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import polars as pl

from traceana.core.errors import AnalysisError
from traceana.core.keyed import keyed
from traceana.core.pipeline_rules import device_of_stage
from traceana.core.run_config import RUN_JSON
from traceana.core.schema import BLOCKED_CATEGORIES
from traceana.core.training_config import TrainingConfig
from traceana.core.units import NS_PER_MS
from traceana.measure.analysis import Analysis
from traceana.model.memory import activation_peak_estimate
from traceana.model.simulate import Costs, Simulation, StageTimes, simulate
from traceana.validation.measurement import Measured, measure, pass_durations, shared_cpus

# The waits compared are "blocked" time, the bubble plus exposed P2P (schema.BLOCKED_CATEGORIES): measured
# attribution labels idle time during which one of the rank's own sends is still in flight as p2p, which the simulator
# cannot tell from a bubble; their sum compares.


@dataclass(frozen=True)
class Validation:
    per_stage: pl.DataFrame  # one row per stage: measured, estimated and error for step, blocked, activation peak
    summary: dict[str, float | str | None]
    simulation: Simulation | None
    notes: tuple[str, ...] = field(default_factory=tuple)


def _rel(est: pl.Expr, meas: pl.Expr) -> pl.Expr:
    return pl.when(meas != 0).then((est - meas) / meas).otherwise(None)


OP_OF_PHASE = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}  # simulator op keys


def _op_key() -> pl.Expr:
    """A pass's simulator key letter (``OP_OF_PHASE``) from its phase."""
    return pl.col("phase").replace_strict(OP_OF_PHASE, return_dtype=pl.String).alias("op")


def _message_kind(forward: pl.Expr) -> pl.Expr:
    """A message's simulator key letter: "F" (an activation) where ``forward``, else "B" (a gradient)."""
    return pl.when(forward).then(pl.lit("F")).otherwise(pl.lit("B")).alias("kind")


def _op_durations(rows: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Every pass's duration (phase, ``keys``, d): a backward's span (B, or the I that begins a split one) holds its
    recompute, which is its own operation in the simulator, so it is taken out."""
    rc = rows.filter(pl.col("phase") == "recompute").select(*keys, pl.col("d").alias("r"))
    return (
        rows.filter(pl.col("phase").is_in(list(OP_OF_PHASE)))
        .join(rc, on=keys, how="left")
        .with_columns(pl.when(pl.col("phase").is_in(["backward", "backward_input"]))
                      .then(pl.col("d") - pl.col("r").fill_null(0)).otherwise(pl.col("d")).alias("d"))
    )


def _messages_by_producer(analysis: Analysis, cfg: TrainingConfig, rows: pl.DataFrame, step: int,
                          rank_of_device: dict[int, int]) -> dict[tuple[str, int, int], float]:
    """In-flight time of each message of ``step`` keyed as the simulator asks for it (F activation / B gradient,
    producing stage, micro-batch). The passes that send are known from the rules' placement (a forward of stage s
    sends to the device of s+1, a B or I to that of s−1, unless it is the same device); a rank posts its sends in
    the order it ran them, so the k-th message from rank a to rank b is the k-th such pass of a towards b (an
    overlapped F+B posts both after the pair: the order still holds)."""
    nv = cfg.pp * cfg.virtual_stages
    dev = {s: device_of_stage(cfg.schedule, s, pp=cfg.pp) for s in range(nv)}
    sends = [
        (ph, st, mb, end, rank_of_device.get(dev[st]), rank_of_device.get(dev[to]))
        for ph, st, mb, end in rows.filter(pl.col("phase").is_in(["forward", "backward", "backward_input"]))
        .select("phase", "stage", "microbatch", "end_ns").iter_rows()
        for to in [st + 1 if ph == "forward" else st - 1] if 0 <= to < nv and dev[to] != dev[st]
    ]
    producers = (
        pl.DataFrame(sends, schema={"phase": pl.String, "stage": pl.Int32, "microbatch": pl.Int32, "end_ns": pl.Int64,
                                    "src": pl.Int32, "dst": pl.Int32}, orient="row")
        .sort("end_ns").with_columns(pl.int_range(pl.len()).over("src", "dst").alias("k"))
    )
    msgs = (
        analysis.p2p.filter((pl.col("step") == step) & (pl.col("channel") == "p2p"))
        .select("src", "dst", "send_start_ns", "transfer_ns").sort("send_start_ns")
        .with_columns(pl.int_range(pl.len()).over("src", "dst").alias("k"))
        .join(producers, on=["src", "dst", "k"])
    )
    return keyed(msgs.select(_message_kind(pl.col("phase") == "forward"), "stage", "microbatch", "transfer_ns"),
                 "transfer_ns")


def replay_inputs(analysis: Analysis, cfg: TrainingConfig, meas: Measured) -> tuple[StageTimes, Costs]:
    """The last measured step's own operation durations and message transfers, for a replay of that step.

    Feeding them (instead of means) checks the schedule logic itself: what is left between replay and measurement is
    what the model does not represent (per-operation host time, a different order), not run-to-run variance."""
    step = max(analysis.summary.steps)
    stage_of = {r: s for s, r in meas.rank_of_stage.items()}
    rows = pass_durations(analysis, pl.DataFrame({"step": [step]}, schema={"step": pl.Int32})).filter(
        pl.col("rank").is_in(list(stage_of)))
    per_op = keyed(_op_durations(rows, ["stage", "microbatch"]).select(_op_key(), "stage", "microbatch", "d"), "d")
    per_op |= keyed(rows.filter(pl.col("phase") == "recompute").select(pl.lit("R"), "stage", "microbatch", "d"), "d")
    msgs = (
        analysis.p2p.filter((pl.col("step") == step) & (pl.col("channel") == "p2p"))
        .with_columns(pl.col("src").replace_strict(stage_of, default=None).alias("s_src"),
                      pl.col("dst").replace_strict(stage_of, default=None).alias("s_dst"))
        .drop_nulls(["s_src", "s_dst"])
        .sort("send_start_ns")
        .with_columns(pl.int_range(pl.len()).over("src", "dst").alias("mb"))
    )
    if cfg.virtual_stages == 1:  # one stage per device: a message's stages are its ranks'
        per_msg = keyed(msgs.select(_message_kind(pl.col("s_dst") > pl.col("s_src")), "s_src", "mb", "transfer_ns"),
                        "transfer_ns")
    else:  # several: which pass sent a message, from the order the sender ran its passes in
        per_msg = _messages_by_producer(analysis, cfg, rows, step, meas.rank_of_stage)
    times = dataclasses.replace(meas.times, per_op_ns=per_op)
    c = meas.costs
    return times, dataclasses.replace(c, per_message_ns=per_msg)


def sampled_step_ns(analysis: Analysis, cfg: TrainingConfig, meas: Measured, *, samples: int = 24, seed: int = 0,
                    bpipe: bool | tuple = False) -> float:
    """Mean simulated step when every operation's duration is drawn from the measured durations of its
    (stage, phase) in the steady steps (a bootstrap). On a busy or noisy machine operations do not all take their
    mean, and a pipeline's step is set by its slowest path: the mean of the maxima exceeds the maximum of the means.
    Deterministic (seeded)."""
    steps = pl.DataFrame({"step": list(analysis.summary.steps)}, schema={"step": pl.Int32})
    stage_of = {r: s for s, r in meas.rank_of_stage.items()}
    rows = pass_durations(analysis, steps).filter(pl.col("rank").is_in(list(stage_of)))
    ops = _op_durations(rows, ["step", "stage", "microbatch"]).group_by("stage", "phase").agg(pl.col("d"))
    pools = keyed(ops.select(_op_key(), "stage", "d"), "d", convert=None)
    recomputes = rows.filter(pl.col("phase") == "recompute").group_by("stage").agg(pl.col("d"))
    pools |= keyed(recomputes.select(pl.lit("R"), "stage", "d"), "d", convert=None)
    msgs = analysis.p2p.join(steps, on="step").filter(pl.col("channel") == "p2p")["transfer_ns"].to_list()
    rng = random.Random(seed)
    total = 0.0
    nv = cfg.pp * cfg.virtual_stages
    for _ in range(samples):
        per_op: dict[tuple[str, int, int], float] = {}
        per_msg: dict[tuple[str, int, int], float] = {}
        for st in range(nv):
            for mb in range(cfg.num_microbatches):
                for op in ("F", "B", "I", "W", "R"):
                    if pools.get((op, st)):
                        per_op[(op, st, mb)] = float(rng.choice(pools[(op, st)]))
                if msgs:
                    per_msg[("F", st, mb)] = float(rng.choice(msgs))
                    per_msg[("B", st, mb)] = float(rng.choice(msgs))
        times = dataclasses.replace(meas.times, per_op_ns=per_op)
        c = meas.costs
        costs = dataclasses.replace(c, per_message_ns=per_msg)
        total += simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=times, costs=costs,
                          virtual_stages=cfg.virtual_stages, bpipe=bpipe, bpipe_inflight=cfg.bpipe_inflight).step_ns
    return total / samples


def validate(analysis: Analysis, *, cfg: TrainingConfig | None = None, window: str = "rolling") -> Validation:
    """Simulate the run from its own measured durations and compare step time, bubble and activation memory."""
    run = analysis.run
    if cfg is None:
        if not analysis.config.has_run_json:
            raise AnalysisError("validation needs run.json (model, pp, micro-batches)", path=run.path,
                                fix="collect with `traceana collect`, or write run.json")
        cfg = analysis.config.training_config(path=run.path)
    meas = measure(analysis, cfg)
    bpipe = tuple(analysis.config.bpipe) if analysis.config.bpipe else False
    sim = simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=meas.times,
                   costs=meas.costs, virtual_stages=cfg.virtual_stages, bpipe=bpipe, bpipe_inflight=cfg.bpipe_inflight,
                   window=window)
    r_times, r_costs = replay_inputs(analysis, cfg, meas)
    replay = simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=r_times,
                      costs=r_costs, virtual_stages=cfg.virtual_stages, bpipe=bpipe, bpipe_inflight=cfg.bpipe_inflight,
                      window=window)
    sampled = sampled_step_ns(analysis, cfg, meas, bpipe=bpipe)
    sim_per = (
        sim.attribution.group_by("stage").agg(
            pl.col("ns").sum().alias("sim_step"),
            pl.col("ns").filter(pl.col("category").is_in(BLOCKED_CATEGORIES)).sum().alias("sim_blocked"))
    )
    grads_in_step = analysis.config.grads_in_step
    est_mem = activation_peak_estimate(cfg, grads_in_step=grads_in_step)
    mem = (
        analysis.stage_memory.filter(pl.col("step").is_in(analysis.summary.steps))
        .filter(pl.col("rank").is_in(list(meas.rank_of_stage.values())))
        .group_by("stage").agg(pl.col("activation_peak_bytes").max().alias("measured_act"))
    )
    per_stage = (
        pl.DataFrame({
            "stage": list(range(cfg.pp)),
            "rank": [meas.rank_of_stage[s] for s in range(cfg.pp)],
            "measured_step_ms": [meas.step_ns[s] / NS_PER_MS for s in range(cfg.pp)],
            "measured_blocked_ms": [meas.blocked_ns[s] / NS_PER_MS for s in range(cfg.pp)],
            "estimated_activation_bytes": est_mem,
        }, schema_overrides={"stage": pl.Int32, "rank": pl.Int32})
        .join(sim_per.with_columns(pl.col("stage").cast(pl.Int32)), on="stage", how="left")
        .join(mem.with_columns(pl.col("stage").cast(pl.Int32)), on="stage", how="left")
        .select(
            "stage", "rank",
            "measured_step_ms", (pl.col("sim_step") / NS_PER_MS).alias("simulated_step_ms"),
            "measured_blocked_ms", (pl.col("sim_blocked") / NS_PER_MS).alias("simulated_blocked_ms"),
            pl.col("measured_act").cast(pl.Float64).alias("measured_activation_bytes"),
            "estimated_activation_bytes",
        )
        .with_columns(
            _rel(pl.col("simulated_step_ms"), pl.col("measured_step_ms")).alias("step_error"),
            _rel(pl.col("simulated_blocked_ms"), pl.col("measured_blocked_ms")).alias("blocked_error"),
            _rel(pl.col("estimated_activation_bytes"), pl.col("measured_activation_bytes")).alias("memory_error"),
        )
        .sort("stage")
    )
    ranks = list(meas.rank_of_stage.values())
    measured_step = analysis.summary.step_ms
    last = max(analysis.summary.steps)
    measured_last = float(
        analysis.attribution.filter((pl.col("step") == last) & pl.col("rank").is_in(ranks))
        .group_by("rank").agg(pl.col("ns").sum())["ns"].max()
    ) / NS_PER_MS
    rel = lambda est, ref: (est - ref) / ref if ref else None  # noqa: E731
    summary = {
        "run": str(run.path),
        "schedule": cfg.schedule,
        "pp": cfg.pp,  # devices; with virtual_stages > 1 each holds that many stages (run.json's pp: all stages)
        "virtual_stages": cfg.virtual_stages,
        "microbatches": cfg.num_microbatches,
        "bpipe": bool(bpipe),
        "recompute": cfg.recompute,
        "attention": cfg.attention,
        # every simulated figure here is an IN-SAMPLE prediction: fed with this run's own measured durations; it checks
        # the schedule logic, not the model's power to predict (that is cross_run: --baseline OTHER_RUN)
        "kind": "in_sample_prediction",
        "measured_step_ms": measured_step,
        "simulated_step_ms": sim.step_ns / NS_PER_MS,
        "step_error": rel(sim.step_ns / NS_PER_MS, measured_step),
        "sampled_step_ms": sampled / NS_PER_MS,
        "sampled_error": rel(sampled / NS_PER_MS, measured_step),
        "last_step_predicted_ms": replay.step_ns / NS_PER_MS if replay else None,
        "last_step_error": rel(replay.step_ns / NS_PER_MS, measured_last) if replay else None,
        "median_abs_memory_error": per_stage["memory_error"].abs().median(),
        "steps_used": meas.steps_used,
        "bpipe_transfer_ms": meas.costs.bpipe_ns / NS_PER_MS if bpipe else None,
        "bpipe_ms_per_step": {s: v / NS_PER_MS for s, v in meas.bpipe_step_ns.items()} if bpipe else None,
    }
    notes = (
        "in-sample prediction: the simulator is fed with this run's own measured durations (means, sampled, or the "
        "last step's own); a cross-run prediction uses none of them (validate RUN --baseline OTHER_RUN)",
        f"fed: host {sum(meas.times.host_ns) / cfg.pp / NS_PER_MS:.2f} ms per operation, P2P in flight "
        f"{meas.costs.p2p_ns / NS_PER_MS:.3f} ms (median); blocked = the bubble (warm-up + stall + cool-down) + exposed P2P"
        + (f"; BPipe from the trace: {meas.costs.bpipe_ns / NS_PER_MS:.3f} ms per transfer in flight (median), "
           + ", ".join(f"stage {s} {v / NS_PER_MS:.2f} ms" for s, v in meas.bpipe_step_ns.items() if v)
           + " per step in BPipe work" if bpipe and any(meas.bpipe_step_ns.values())
           else "; BPipe: run.json says it is on, but the traces hold no BPipe transfer, so its transfers are "
                "simulated as free — check run.json's bpipe" if bpipe else ""),
        "memory estimate: saved activations in flight"
        + (" + gradients allocated and freed in the step" if grads_in_step else "")
        + " + one layer's backward working memory",
    ) + tuple(n for n in (shared_cpus(analysis),) if n)
    c = analysis.config  # (the reconciled facts; ``overruled``: what run.json said of those the traces replaced)
    said = {k: c.overruled[k] for k in ("schedule", "num_microbatches") if k in c.overruled}
    # (run.json gave the micro-batches: they are its, or the traces' overruled them)
    if said and (c.source("num_microbatches") == RUN_JSON or "num_microbatches" in said):
        notes += (f"simulated as the traces show it: schedule {c.schedule}, {c.num_microbatches} micro-batches "
                  f"(run.json says {said.get('schedule', c.schedule)}, "
                  f"{said.get('num_microbatches', c.num_microbatches)}) — fix run.json",)
    return Validation(per_stage=per_stage, summary=summary, simulation=sim, notes=notes)
