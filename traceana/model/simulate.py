"""A discrete-event simulator of pipeline schedules: every schedule of the pipeline rules (GPipe, 1F1B, interleaved
1F1B, looped BFS, zero-bubble ZB-1P, ZB-V, DualPipe-V) and BPipe-1F1B.

Each device runs its schedule's operations in a fixed order (the order is the schedule); an operation starts when the
device is free and its input has arrived: the forward of virtual stage v needs the activation of stage v−1, the
backward of v needs the gradient of v+1 (the last stage needs only its own forward). A split backward (Qi et al.
2023) is I, which needs that gradient and sends its own upstream, and W, which needs only its I; a micro-batch's
activations are held from its forward until its B or W ends. Stages sit on devices by the rules' placement
(``device_of_stage``: looped or V); a message between two stages of one device costs nothing. A message leaves when the
producing operation ends; the sender is busy ``send_ns`` posting it and it arrives ``p2p_ns`` later. With recompute,
a backward starts by re-running ``recompute_ns`` of forward work (as torch.utils.checkpoint does once the gradient has
arrived). Every device then runs its optimizer step.

Orders are the pipeline rules' (pipeline_rules.device_order: GPipe, 1F1B, interleaved 1F1B, …). The scheduler is
causal.scheduler (``run_schedule``), which asks a ``Policy`` at each operation what a variant adds: BPipe (Kim et al.
2023) is one, model.bpipe_policy, following the rules' eviction plan.

The output has the measured tables' schemas (schema.SCHEDULE with source "simulated", schema.ATTRIBUTION with the same
categories and rules: per device the categories tile the step window and sum to the step time; idle time before the
device's first forward is ``bubble_warmup``, after its last forward ``bubble_cooldown`` (the drain), in between
``bubble_stall``, by pipeline_rules.bubble_windows; waiting while a message is in flight is ``p2p``, waiting for a
BPipe load is ``bpipe``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import polars as pl

from traceana.causal.scheduler import Costs, Policy, Recorder, StageTimes, run_schedule
from traceana.core import intervals as iv
from traceana.core import schema
from traceana.core.errors import ConfigError
from traceana.core.pipeline_rules import SCHEDULES as SIM_SCHEDULES
from traceana.core.pipeline_rules import bpipe_pairs, bubble_windows, check_bpipe, device_of_stage, device_order
from traceana.core.units import NS_PER_S
from traceana.model.bpipe_policy import BPipePolicy

MAX_STEP_NS = 2**62  # a simulated step longer than this (~146 years) cannot be held as Int64 nanoseconds

__all__ = ["SIM_SCHEDULES", "Costs", "Simulation", "StageTimes", "bubble_fraction", "engine_inputs", "simulate"]

# Work = durations (ns) keyed (action, virtual stage, micro-batch): action F, B (the whole backward, recompute
# excluded), I and W (a split backward's halves; with B, W is B's weight-gradient part) or R (a backward's recompute);
# micro-batch None: every micro-batch of that stage (a modelled duration), else one micro-batch's (a measured one).
Work = Mapping[tuple[str, int, "int | None"], float]


@dataclass(frozen=True)
class Simulation:
    schedule: pl.DataFrame  # schema.SCHEDULE, source "simulated"
    attribution: pl.DataFrame  # schema.ATTRIBUTION
    step_ns: int
    peak_in_flight: tuple[float, ...]  # per device: most micro-batches' activations held at once (own + accepted)
    evicted: tuple[int, ...] = field(default_factory=tuple)  # per device: micro-batches it evicted


def engine_inputs(work: Work, *, device_of_work: tuple[int, ...], stages: int,
                  messages: Mapping[tuple[str, int, int], float] | None = None, p2p_ns: float | None = None,
                  optimizer_ns: tuple[float, ...] = (), host_ns: tuple[float, ...] = (),
                  costs: Costs = Costs()) -> tuple[StageTimes, Costs]:
    """The engine's inputs (StageTimes, Costs) for a plan of ``stages`` virtual stages from per-operation work:
    the one path from durations to the engine, whether they are measured (``traceana whatif``'s plans: each pass's
    measured work per micro-batch, each message's measured time in flight) or modelled (``traceana estimate``: FLOPs
    at an efficiency, one duration a stage, every message the link's time).

    ``work`` (``Work``) is keyed by the virtual stages it was measured or modelled on, ``device_of_work[s]`` the
    device of its stage s. Each stage's duration of an action is its ``None`` entry, else the mean of its
    micro-batches; a micro-batch whose work differs from that is kept as it is (``StageTimes.per_op_ns``; one the work
    does not have runs at its stage's). The backward is B, else I + W; W its weight-gradient part (none: the
    simulator's half). Where the plan's stages are another placement of the layers (``stages`` ≠ the work's: 1F1B ↔
    interleaved) the work is summed per device and the simulator splits it over the device's chunks; no single
    operation or message is kept then. ``messages``: each message's time in flight keyed ("F" activation / "B"
    gradient, producing stage, micro-batch); ``p2p_ns`` the time of any other (default: their median, 0 without
    any). ``costs``: the other costs (BPipe's, the sender's), kept."""
    n_work, devices = len(device_of_work), max(device_of_work) + 1
    stage_of: dict[tuple[str, int], float] = {}
    by_stage: dict[tuple[str, int], list[float]] = {}
    for (a, s, mb), x in work.items():
        if mb is None:
            stage_of[(a, s)] = x
        else:
            by_stage.setdefault((a, s), []).append(x)
    for k, xs in by_stage.items():  # equal durations keep their value exactly (a sum over them would round)
        stage_of.setdefault(k, xs[0] if min(xs) == max(xs) else math.fsum(xs) / len(xs))
    actions = {a for a, _ in stage_of}

    def col(a: str) -> list[float]:
        return [stage_of.get((a, s), 0.0) for s in range(n_work)]

    fwd = col("F")
    bwd = col("B") if "B" in actions else [i + w for i, w in zip(col("I"), col("W"))]
    wgt = col("W") if "W" in actions else []
    rec = col("R") if "R" in actions else []
    per_op: dict | None = {(a, s, mb): x for (a, s, mb), x in work.items()
                           if mb is not None and x != stage_of[(a, s)]} or None
    msgs = dict(messages or {})
    if p2p_ns is None:
        p2p_ns = sorted(msgs.values())[len(msgs) // 2] if msgs else 0.0
    per_message: dict | None = {k: x for k, x in msgs.items() if x != p2p_ns} or None
    if stages != n_work:  # another placement of the layers: per device, split over its chunks by the simulator
        def per_device(xs: list[float]) -> list[float]:
            out = [0.0] * devices
            for s, x in enumerate(xs):
                out[device_of_work[s]] += x
            return out

        fwd, bwd, wgt, rec = (per_device(xs) if xs else xs for xs in (fwd, bwd, wgt, rec))
        per_op = per_message = None
    times = StageTimes(forward_ns=tuple(fwd), backward_ns=tuple(bwd), recompute_ns=tuple(rec),
                       optimizer_ns=tuple(optimizer_ns), host_ns=tuple(host_ns), weight_ns=tuple(wgt),
                       per_op_ns=per_op)
    return times, dataclasses.replace(costs, p2p_ns=p2p_ns, per_message_ns=per_message)


def simulate(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    times: StageTimes,
    costs: Costs = Costs(),
    virtual_stages: int = 1,
    bpipe: bool | tuple[tuple[int, int], ...] = False,
    bpipe_inflight: int | None = None,
    rank_of_device: tuple[int, ...] | None = None,
    step: int = 0,
    window: str = "rolling",
) -> Simulation:
    """Simulate one training step; see the module docstring for the rules.

    ``bpipe``: True for every pair, or the pairs; each evictor keeps ``bpipe_inflight`` (default: the rules' keep).
    ``window``: "rolling" gives each device the step window that ends when its optimizer ends (as ProfilerStep
    boundaries do: the previous step's idle tail becomes this step's warm-up); "synchronous" starts every window at 0.
    """
    p, m, v = pp, num_microbatches, virtual_stages
    if p <= 0 or m <= 0 or v <= 0:
        raise ConfigError(f"pp, micro-batches and virtual stages must be positive, got {p}, {m}, {v}",
                          fix="check the configuration")
    nv = p * v
    if len(times.forward_ns) not in (nv, p):
        raise ConfigError(f"stage times have {len(times.forward_ns)} entries for {nv} virtual stages",
                          fix="give one duration per (virtual) stage")
    per_chunk = len(times.forward_ns) == p and v > 1  # per-device durations: split over the chunks
    device_of = tuple(device_of_stage(schedule, s, pp=p) for s in range(nv))
    # A split backward: W is ``weight_ns`` of the backward (half of it if not given: Qi et al. 2023's T_B = T_W),
    # I the rest.
    weight = times.weight_ns or tuple(b / 2 for b in times.backward_ns)
    kinds = {"F": times.forward_ns, "B": times.backward_ns, "R": times.recompute_ns, "W": weight,
             "I": tuple(b - w for b, w in zip(times.backward_ns, weight))}

    def dur(action: str, vs: int, mb: int) -> float:
        if times.per_op_ns and (action, vs, mb) in times.per_op_ns:
            return times.per_op_ns[(action, vs, mb)]
        kind = kinds[action]
        if not kind:
            return 0.0
        return kind[device_of[vs]] / v if per_chunk else kind[vs]

    orders = [device_order(schedule, pp=p, num_microbatches=m, device=d, virtual_stages=v) for d in range(p)]
    if bpipe:
        check_bpipe(schedule, virtual_stages=v, fix="use schedule 1f1b without interleaving")
        policy: Policy = BPipePolicy(schedule=schedule, pairs=bpipe_pairs(p) if bpipe is True else tuple(bpipe), pp=p,
                                     num_microbatches=m, costs=costs, keep=bpipe_inflight)
    else:
        policy = Policy()
    rec = Recorder(p)
    rows, free = run_schedule(orders, rec=rec, policy=policy, times=times, costs=costs, pp=p, virtual_stages=v, dur=dur,
                              schedule=schedule, num_microbatches=m, device_of=device_of)
    segments, n_evicted = rec.segments, policy.evicted(p)

    # Activations held per device over time (frees before arrivals at equal times), for the peak.
    held = [0.0] * p
    peak = [0.0] * p
    for _, delta, d in sorted(rec.held):
        held[d] += delta
        peak[d] = max(peak[d], held[d])

    # Optimizer, then the step windows.
    opt_end = []
    for d in range(p):
        o = times.optimizer_ns[d] if times.optimizer_ns else 0.0
        rec.busy(d, free[d], free[d] + o, "optimizer")
        if o:
            rows.append((d, d, -1, "optimizer", free[d], free[d] + o))
        opt_end.append(free[d] + o)
    step_ns = max(opt_end)
    if not math.isfinite(step_ns) or step_ns > MAX_STEP_NS:  # the tables below hold nanoseconds as Int64
        raise ConfigError(f"the simulated step would last {step_ns / NS_PER_S:.3g} s, more than the "
                          f"{MAX_STEP_NS / NS_PER_S / 86400 / 365:.0f} years traceana's nanosecond tables hold",
                          fix="check the model shape, micro-batch size, micro-batches and bandwidths")
    tile_rows: list[tuple[int, int, int, str]] = []  # device, start, end, category ("idle" where nothing runs)
    window_rows: list[tuple[int, int, int, int]] = []  # device, step, start, end
    for d in range(p):
        w0, w1 = (opt_end[d] - step_ns, opt_end[d]) if window == "rolling" else (0.0, step_ns)
        window_rows.append((d, step, round(w0), round(w1)))
        cursor = w0
        for a, b, c in sorted(segments[d]):
            if a > cursor:
                tile_rows.append((d, round(cursor), round(a), "idle"))
            tile_rows.append((d, round(a), round(b), c))
            cursor = b
        if cursor < w1:
            tile_rows.append((d, round(cursor), round(w1), "idle"))
    attribution = _attribution(tile_rows, window_rows, rows, step=step, rank_of_device=rank_of_device)

    sched = pl.DataFrame(
        {
            "rank": [rank_of_device[r[0]] if rank_of_device else r[0] for r in rows],
            "step": [step] * len(rows),
            "stage": [r[1] for r in rows],
            "microbatch": [r[2] if r[2] >= 0 else None for r in rows],
            "phase": [r[3] for r in rows],
            "start_ns": [round(r[4]) for r in rows],
            "end_ns": [round(r[5]) for r in rows],
            "source": ["simulated"] * len(rows),
        },
        schema=schema.SCHEDULE,
    ).sort("rank", "start_ns", "phase")
    return Simulation(
        schedule=schema.check(sched, schema.SCHEDULE, "simulated schedule"),
        attribution=schema.check(attribution, schema.ATTRIBUTION, "simulated attribution"),
        step_ns=round(step_ns),
        peak_in_flight=tuple(peak),
        evicted=tuple(n_evicted),
    )


def _attribution(tiles: list[tuple[int, int, int, str]], windows: list[tuple[int, int, int, int]],
                 ops: list[tuple[int, int, int, str, float, float]], *, step: int,
                 rank_of_device: tuple[int, ...] | None) -> pl.DataFrame:
    """schema.ATTRIBUTION of the simulated step: busy tiles by their category, idle ones by the pipeline rules'
    bubble windows (pipeline_rules.bubble_windows, the rule the measured attribution uses)."""
    iv_schema = {"rank": pl.Int32, "start": pl.Int64, "end": pl.Int64}
    tile = pl.DataFrame(tiles, schema={**iv_schema, "category": pl.String}, orient="row")
    win = pl.DataFrame(windows, schema={"rank": pl.Int32, "step": pl.Int32, "start": pl.Int64, "end": pl.Int64},
                       orient="row")
    fwd = pl.DataFrame([(d, step, round(a), round(b)) for d, _, _, ph, a, b in ops if ph == "forward"],
                       schema=win.schema, orient="row")
    idle = tile.filter(pl.col("category") == "idle").drop("category")
    bubbles = iv.clip(idle, bubble_windows(win, fwd), on="rank", window_keys="category")
    parts = pl.concat([tile.filter(pl.col("category") != "idle"), bubbles.select(tile.columns)])
    ns = parts.group_by("rank", "category").agg((pl.col("end") - pl.col("start")).sum().alias("ns"))
    grid = win.select("rank", "step", (pl.col("end") - pl.col("start")).alias("_w")).join(
        pl.DataFrame({"category": list(schema.CATEGORIES)}), how="cross")
    out = (
        grid.join(ns, on=["rank", "category"], how="left")
        .with_columns(pl.col("ns").fill_null(0), pl.col("rank").alias("stage"))
        .with_columns(pl.when(pl.col("_w") > 0).then(pl.col("ns") / pl.col("_w")).otherwise(0.0).alias("fraction"))
    )
    if rank_of_device:
        out = out.with_columns(pl.col("rank").replace_strict(dict(enumerate(rank_of_device)), return_dtype=pl.Int32))
    return out.select(list(schema.ATTRIBUTION)).cast(schema.ATTRIBUTION)


def bubble_fraction(sim: Simulation) -> pl.DataFrame:
    """Per rank: the share of the step spent in the three bubble categories."""
    return (
        sim.attribution.filter(pl.col("category").is_in(schema.BUBBLE_CATEGORIES))
        .group_by("rank", "stage")
        .agg(pl.col("fraction").sum().alias("bubble_fraction"))
        .sort("rank")
    )
