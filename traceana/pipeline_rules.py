"""The pipeline rules, each written once: what every device runs and in which order, how many micro-batches'
activations it holds, BPipe's pairs and eviction plan, which layers each stage owns, and how idle time is named.

Everything that needs one of these rules imports it from here: the reference trainer (collectors/), the simulator
and the memory model (traceana/model/), attribution and validation. Nothing here knows traces or torch.

Schedules (per-device operation orders; an operation is (action, virtual stage, micro-batch)):
- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards, micro-batch 0 first (as torch's ScheduleGPipe).
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): stage s runs min(p−s−1, m) warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards; it holds at most min(p−s, m)
  micro-batches' activations instead of m.
- ``interleaved-1f1b`` (Narayanan et al. 2021 §2.2.2; Megatron-LM's schedules.py): device d owns virtual stages
  d, d+p, …; forwards go in rounds of p micro-batches through chunk 0, 1, …, v−1 (backwards through v−1, …, 0), with
  min((p−d−1)·2 + (v−1)·p, m·v) warm-up forwards.

BPipe (Kim et al. 2023, ICML): in 1F1B stage s holds p−s micro-batches while stage p−1−s holds s+1. The *evictor*
s < p/2 keeps at most ⌈(n_s + n_{p−1−s})/2⌉ micro-batches (the pair's balanced level) and sends the rest to its
*acceptor* p−1−s; see ``bpipe_plan`` for when, and ``BPipePlan.accept_after`` for when the acceptor takes them.

Bubbles (``bubble_windows``): a rank's idle time in a step is *warm-up* before its first forward work, *cool-down*
after its last forward work (what is left is the drain, waiting for gradients), and a *stall* in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import polars as pl

from traceana import names, schema
from traceana.errors import ConfigError

FORWARD, BACKWARD = names.FORWARD, names.BACKWARD  # the actions of an order
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
BPIPE_SCHEDULES = ("gpipe", "1f1b")  # GPipe balances nothing by itself (every stage holds m); an explicit keep


class Op(NamedTuple):
    """One operation of a device's order: ``action`` "F" or "B" of ``microbatch`` on virtual ``stage``."""

    action: str
    stage: int
    microbatch: int


def _check(schedule: str, pp: int, num_microbatches: int, device: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"no rules for schedule {schedule!r}", fix=f"use one of {', '.join(SCHEDULES)}")
    if pp <= 0 or num_microbatches <= 0 or virtual_stages <= 0:
        raise ConfigError(f"pp, micro-batches and virtual stages must be positive, got {pp}, {num_microbatches}, "
                          f"{virtual_stages}", fix="check the configuration")
    if not 0 <= device < pp:
        raise ConfigError(f"stage {device} is outside 0..{pp - 1}", fix="check the pipeline degree")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise ConfigError(f"schedule {schedule!r} has one stage per device, not {virtual_stages}",
                          fix="use interleaved-1f1b for virtual stages")


def warmup_forwards(schedule: str, *, pp: int, num_microbatches: int, device: int, virtual_stages: int = 1) -> int:
    """Forwards a device runs before its first backward (all of them for GPipe)."""
    _check(schedule, pp, num_microbatches, device, virtual_stages)
    p, m, d, v = pp, num_microbatches, device, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - d - 1, m)
    return min((p - d - 1) * 2 + (v - 1) * p, m * v)


def device_order(schedule: str, *, pp: int, num_microbatches: int, device: int,
                 virtual_stages: int = 1) -> list[Op]:
    """The operations one device runs in one step, in order."""
    p, m, d, v = pp, num_microbatches, device, virtual_stages
    warm = warmup_forwards(schedule, pp=p, num_microbatches=m, device=d, virtual_stages=v)
    if schedule == "interleaved-1f1b":
        rounds = [range(r, min(r + p, m)) for r in range(0, m, p)]
        fwd = [Op(FORWARD, c * p + d, j) for g in rounds for c in range(v) for j in g]
        bwd = [Op(BACKWARD, c * p + d, j) for g in rounds for c in reversed(range(v)) for j in g]
    else:
        fwd = [Op(FORWARD, d, j) for j in range(m)]
        bwd = [Op(BACKWARD, d, j) for j in range(m)]
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[len(fwd) - warm:]


def peak_in_flight(order: list[Op], *, virtual_stages: int = 1) -> float:
    """Most micro-batches whose forward ran and whose backward has not, in units of the device's whole share of
    layers (a chunk of an interleaved device is 1/v of it, so the count may be fractional)."""
    live = peak = 0
    for op in order:
        live += 1 if op.action == FORWARD else -1
        peak = max(peak, live)
    return peak / virtual_stages


def microbatches_in_flight(schedule: str, *, pp: int, stage: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Peak micro-batches whose activations a device holds: m for GPipe, min(p−s, m) for 1F1B, and for interleaved
    1F1B Megatron's (p−s−1)·2 + (v−1)·p + 1 chunks, i.e. Korthikanti et al. 2022's p·(1 + (p−1)/(pv)) on stage 0."""
    order = device_order(schedule, pp=pp, num_microbatches=num_microbatches, device=stage,
                         virtual_stages=virtual_stages)
    return peak_in_flight(order, virtual_stages=virtual_stages)


# --- stage layer split -------------------------------------------------------------------------------------------------
def stage_layer_ranges(layers: int, stages: int) -> list[range]:
    """Contiguous, balanced split of the transformer blocks; earlier stages take the remainder (the last stage also
    holds the logits, the first only the embedding)."""
    if stages <= 0 or layers < stages:
        raise ConfigError(f"{layers} layers cannot be split over {stages} stages",
                          fix="use at most as many stages as layers")
    base, extra = divmod(layers, stages)
    starts = [s * base + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def stage_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage of ``stage_layer_ranges``."""
    return tuple(len(r) for r in stage_layer_ranges(layers, stages))


# --- BPipe ---------------------------------------------------------------------------------------------------------------
def bpipe_pairs(pp: int) -> tuple[tuple[int, int], ...]:
    """BPipe's (evictor, acceptor) pairs: stage s with p−1−s for s < p/2 (the middle stage of an odd p is unpaired)."""
    return tuple((s, pp - 1 - s) for s in range(pp // 2))


def bpipe_pair_of(stage: int, pp: int) -> tuple[int, int] | None:
    """(evictor, acceptor) containing ``stage``, or None for the middle stage of an odd pipeline."""
    partner = pp - 1 - stage
    return None if partner == stage else (min(stage, partner), max(stage, partner))


def bpipe_keep(schedule: str, *, pp: int, num_microbatches: int, evictor: int) -> int:
    """How many micro-batches the evictor keeps: the level that makes the pair's larger peak smallest.

    Half of what the pair holds, ⌈(n_e + n_a)/2⌉, is the aim (Kim et al. 2023: ⌈(p+1)/2⌉ for 1F1B with m ≥ p). The
    acceptor cannot return one micro-batch before it must take the next, so on some pairs (every pair of p = 3, the
    inner pairs of odd p) it would briefly hold one more than that; the keep is then raised until neither partner
    holds more than the larger of the two does. When that is the evictor's own n_e, BPipe balances nothing on this
    pair and the keep is n_e (nothing is evicted)."""
    n_e = int(microbatches_in_flight(schedule, pp=pp, stage=evictor, num_microbatches=num_microbatches))
    n_a = int(microbatches_in_flight(schedule, pp=pp, stage=pp - 1 - evictor, num_microbatches=num_microbatches))
    best_keep, best_peak = n_e, max(n_e, n_a)
    for keep in range(n_e - 1, math.ceil((n_e + n_a) / 2) - 1, -1):
        held = bpipe_held(_plan(schedule, pp=pp, num_microbatches=num_microbatches, evictor=evictor, keep=keep),
                          schedule=schedule, pp=pp, num_microbatches=num_microbatches)
        peak = max(sum(h) for h in held.values())
        if peak < best_peak:
            best_keep, best_peak = keep, peak
    return best_keep


@dataclass(frozen=True)
class BPipePlan:
    """What one evictor/acceptor pair does in a step; indices are positions in each device's ``device_order``.

    ``evict_before``: evictor operation (a forward) -> micro-batches sent away just before it.
    ``load_before``: evictor operation (a backward) -> the evicted micro-batch it brings back first.
    ``accept_after``: acceptor operation -> micro-batches whose receive it posts (allocating their buffers) right
    after that operation; -1 means at the start of the step.
    ``return_after``: acceptor operation (a backward) -> micro-batches it sends back (and frees) right after it.
    """

    evictor: int
    acceptor: int
    keep: int
    evict_before: dict[int, tuple[int, ...]]
    load_before: dict[int, int]
    accept_after: dict[int, tuple[int, ...]]
    return_after: dict[int, tuple[int, ...]]
    order: tuple[int, ...]  # evicted micro-batches in eviction order

    @property
    def evicted(self) -> int:
        return len(self.order)


def bpipe_plan(schedule: str, *, pp: int, num_microbatches: int, evictor: int, keep: int | None = None) -> BPipePlan:
    """BPipe's plan for the pair of ``evictor`` (keep from ``bpipe_keep`` unless given); see ``_plan``."""
    if keep is None:
        keep = bpipe_keep(schedule, pp=pp, num_microbatches=num_microbatches, evictor=evictor)
    return _plan(schedule, pp=pp, num_microbatches=num_microbatches, evictor=evictor, keep=keep)


def _plan(schedule: str, *, pp: int, num_microbatches: int, evictor: int, keep: int) -> BPipePlan:
    """BPipe's plan for the pair of ``evictor``: a pure function of the configuration, so both partners (and the
    simulator, the memory model and validation) know it in advance and nothing is negotiated at run time.

    Evictor: before a forward that would take it over ``keep`` (counting the load its next backward needs) it evicts
    the resident micro-batch whose backward is furthest away (the newest); an evicted micro-batch comes back just
    before its own backward. Evicting *before* the forward is what lowers the peak: the new activations are never
    on the device together with the ones they displace.

    Acceptor: it takes an evicted micro-batch as late as it can while the evictor can still send without waiting on
    it: right after its own backward of the last micro-batch whose backward the evictor ran before the eviction
    (that gradient passes through the acceptor first, so the receive is posted before the evictor gets there; at
    the start of the step when there is none). It returns a micro-batch right after its own backward of it (the
    evictor's backward of it waits for that gradient anyway) and frees it then. So the acceptor holds a foreign
    micro-batch only while it has given one of its own backwards' memory back, and stays at the balanced level.
    """
    if schedule not in BPIPE_SCHEDULES:
        raise ConfigError(f"BPipe is defined for {', '.join(BPIPE_SCHEDULES)}, not {schedule!r}",
                          fix="use schedule 1f1b with BPipe")
    p, m = pp, num_microbatches
    pair = bpipe_pair_of(evictor, p)
    if pair is None or pair[0] != evictor:
        raise ConfigError(f"stage {evictor} is not a BPipe evictor of a {p}-stage pipeline",
                          fix=f"evictors are stages 0..{p // 2 - 1}")
    acceptor = pair[1]
    ev_order = device_order(schedule, pp=p, num_microbatches=m, device=evictor)
    resident: set[int] = set()
    evicted: set[int] = set()
    evict_before: dict[int, tuple[int, ...]] = {}
    load_before: dict[int, int] = {}
    last_backward: int | None = None  # micro-batch of the evictor's latest backward so far
    accept_on: dict[int | None, list[int]] = {}  # acceptor's backward micro-batch (None: step start) -> victims
    order: list[int] = []
    for i, op in enumerate(ev_order):
        if op.action == FORWARD:
            nxt = ev_order[i + 1] if i + 1 < len(ev_order) else None
            needed = nxt.microbatch if nxt is not None and nxt.action == BACKWARD else None
            need = 1 + (needed in evicted)
            victims: list[int] = []
            while len(resident) + need > keep:
                candidates = resident - {needed}
                if not candidates:
                    break
                victim = max(candidates)  # backwards run in micro-batch order: the newest is needed last
                resident.discard(victim)
                evicted.add(victim)
                victims.append(victim)
            if victims:
                evict_before[i] = tuple(victims)
                order += victims
                accept_on.setdefault(last_backward, []).extend(victims)
            resident.add(op.microbatch)
            continue
        if op.microbatch in evicted:
            evicted.discard(op.microbatch)
            resident.add(op.microbatch)
            load_before[i] = op.microbatch
        if op.microbatch not in resident:
            raise ConfigError(f"BPipe plan: micro-batch {op.microbatch} has no activations at its backward",
                              fix="report this configuration: the plan is inconsistent")
        resident.discard(op.microbatch)
        last_backward = op.microbatch
    acc_order = device_order(schedule, pp=p, num_microbatches=m, device=acceptor)
    backward_at = {op.microbatch: j for j, op in enumerate(acc_order) if op.action == BACKWARD}
    accept_after = {(-1 if mb is None else backward_at[mb]): tuple(v) for mb, v in accept_on.items()}
    return_after = {backward_at[e]: (e,) for e in order}
    return BPipePlan(evictor=evictor, acceptor=acceptor, keep=keep, evict_before=evict_before,
                     load_before=load_before, accept_after=accept_after, return_after=return_after,
                     order=tuple(order))


def bpipe_held(plan: BPipePlan, *, schedule: str, pp: int, num_microbatches: int) -> dict[int, tuple[int, int]]:
    """(own, foreign) micro-batches each partner holds at its peak under ``plan``, counted as the plan runs: the
    evictor's own resident set; the acceptor's own in-flight micro-batches plus those it accepted and whose return
    has not completed (a return completes when the evictor takes it; the acceptor waits for that before it takes
    the next)."""
    p, m = pp, num_microbatches
    out: dict[int, tuple[int, int]] = {}
    ev = device_order(schedule, pp=p, num_microbatches=m, device=plan.evictor)
    live, best = 0, 0
    for i, op in enumerate(ev):
        live -= len(plan.evict_before.get(i, ()))
        live += 1 if op.action == FORWARD else (1 if i in plan.load_before else 0)
        best = max(best, live)
        if op.action == BACKWARD:
            live -= 1
    out[plan.evictor] = (best, 0)
    acc = device_order(schedule, pp=p, num_microbatches=m, device=plan.acceptor)
    own, foreign, returning = 0, len(plan.accept_after.get(-1, ())), 0
    peak = (0, foreign)
    for j, op in enumerate(acc):
        own += 1 if op.action == FORWARD else 0
        if own + foreign + returning > sum(peak):
            peak = (own, foreign + returning)
        if op.action == BACKWARD:
            own -= 1
            n = len(plan.return_after.get(j, ()))
            foreign, returning = foreign - n, returning + n  # sent back; freed once the evictor has taken it
        if plan.accept_after.get(j):
            returning = 0  # the acceptor waits for its returns to complete before it takes the next
            foreign += len(plan.accept_after[j])
        if own + foreign + returning > sum(peak):
            peak = (own, foreign + returning)
    out[plan.acceptor] = peak
    return out


def bpipe_holding(schedule: str, *, pp: int, num_microbatches: int, pairs: tuple[tuple[int, int], ...] | None = None,
                  keep: int | None = None) -> list[tuple[float, float]]:
    """(own, foreign) micro-batches every stage holds at its peak, with BPipe on ``pairs`` (default: every pair
    whose plan evicts something, each evictor keeping ``keep``, default ``bpipe_keep``) and without it elsewhere:
    the one accounting the memory model, the simulator's check and validation share."""
    p, m = pp, num_microbatches
    held = [(microbatches_in_flight(schedule, pp=p, stage=s, num_microbatches=m), 0.0) for s in range(p)]
    for evictor, acceptor in bpipe_pairs(p) if pairs is None else pairs:
        plan = bpipe_plan(schedule, pp=p, num_microbatches=m, evictor=evictor, keep=keep)
        if plan.evicted:
            for stage, (own, foreign) in bpipe_held(plan, schedule=schedule, pp=p, num_microbatches=m).items():
                held[stage] = (float(own), float(foreign))
    return held


# --- bubbles -----------------------------------------------------------------------------------------------------------
BUBBLE_WARMUP, BUBBLE_COOLDOWN, BUBBLE_STALL = schema.BUBBLE_CATEGORIES


def bubble_windows(steps: pl.DataFrame, forward_work: pl.DataFrame) -> pl.DataFrame:
    """The three bubble windows of every (rank, step): warm-up [step start, first forward work), stall [first forward
    work, last forward work), cool-down [last forward work, step end).

    ``steps``: rank, step, start, end. ``forward_work``: rank, step, start, end of the rank's forward work (busy time
    labelled forward; on a GPU the kernels, which run later than the CPU annotation says). A step without forward
    work is one stall window. Idle or waiting time is a bubble of the window it falls in (``intervals.clip``)."""
    marks = forward_work.group_by("rank", "step").agg(pl.col("start").min().alias("_f0"),
                                                     pl.col("end").max().alias("_f1"))
    w = steps.select("rank", "step", "start", "end").join(marks, on=["rank", "step"], how="left")
    has_f = pl.col("_f0").is_not_null()
    f0 = pl.min_horizontal(pl.max_horizontal("_f0", "start"), "end")
    f1 = pl.max_horizontal(pl.min_horizontal("_f1", "end"), f0)
    parts = [
        w.filter(has_f).select("rank", "step", pl.lit(BUBBLE_WARMUP).alias("category"), "start", f0.alias("end")),
        w.select("rank", "step", pl.lit(BUBBLE_STALL).alias("category"),
                 pl.when(has_f).then(f0).otherwise("start").alias("start"),
                 pl.when(has_f).then(f1).otherwise("end").alias("end")),
        w.filter(has_f).select("rank", "step", pl.lit(BUBBLE_COOLDOWN).alias("category"), f1.alias("start"), "end"),
    ]
    return pl.concat(parts).filter(pl.col("end") > pl.col("start")).sort("rank", "step", "start")


# --- placements ----------------------------------------------------------------------------------------------------
PLACEMENTS = ("single", "looped", "v")


def stages_of_ranks(placement: str, ranks: int, virtual: int = 1) -> list[list[int]]:
    """The virtual stages each of ``ranks`` pipeline ranks holds: ``single`` (rank r: r), ``looped`` (rank r: r,
    r+p, …, r+(v−1)p; Narayanan et al. 2021 §2.2.2, torch's interleaved, looped-BFS and zero-bubble schedules) or
    ``v`` (rank r: r and 2p−1−r; Qi et al. 2023's ZB-V, torch's ZBV and DualPipe-V: the last rank holds the two middle
    stages and the first rank the first and the last)."""
    if placement == "v":
        return [[r, 2 * ranks - 1 - r] for r in range(ranks)]
    if placement == "single":
        return [[r] for r in range(ranks)]
    if placement == "looped":
        return [[r + k * ranks for k in range(virtual)] for r in range(ranks)]
    raise ConfigError(f"unknown stage placement {placement!r}", fix=f"use one of {', '.join(PLACEMENTS)}")
