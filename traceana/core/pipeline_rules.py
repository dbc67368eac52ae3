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
- ``looped-bfs``, ``zero-bubble`` (ZB-1P: the backward split into I and W, W deferred into the bubbles; Qi et al.
  2023), ``zbv`` (ZB-V, V placement) and ``dualpipev`` (DualPipe-V, V placement, overlapped F+B pairs): torch 2.13's
  orders (torch.distributed.pipelining.schedules), rewritten here without torch; docs/schedules.md has the rules.
Placement (stage → device) is ``device_of_stage``: looped, or V for ``V_SCHEDULES``.

BPipe (Kim et al. 2023, ICML): in 1F1B stage s holds p−s micro-batches while stage p−1−s holds s+1. The *evictor*
s < p/2 keeps at most ⌈(n_s + n_{p−1−s})/2⌉ micro-batches (the pair's balanced level) and sends the rest to its
*acceptor* p−1−s; see ``bpipe_plan`` for when, and ``BPipePlan.accept_after`` for when the acceptor takes them.

Bubbles (``bubble_windows``): a rank's idle time in a step is *warm-up* before its first forward work, *cool-down*
after its last forward work (what is left is the drain, waiting for gradients), and a *stall* in between.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import polars as pl

from traceana.core import names, schema
from traceana.core.errors import ConfigError
from traceana.core.intervals import ENGINE
from traceana.core.schedule_names import (  # the names, listed once (several virtual stages on a device, V, I/W)
    MULTI_STAGE_SCHEDULES, ONE_STAGE_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES)

FORWARD, BACKWARD = names.FORWARD, names.BACKWARD  # the actions of an order
BACKWARD_INPUT, BACKWARD_WEIGHT = names.BACKWARD_INPUT, names.BACKWARD_WEIGHT  # a backward split in two (I, W)
# SCHEDULES: every schedule run.json names (but "unknown"); V_SCHEDULES: device d holds stages d and 2p−1−d;
# SPLIT_BACKWARD_SCHEDULES: backwards split into I and W (traceana.core.schedule_names, imported above)
BPIPE_SCHEDULES = ("1f1b",)  # where BPipe applies (``bpipe_applies``): one stage a device


class Op(NamedTuple):
    """One operation of a device's order: ``action`` F, B, I or W of ``microbatch`` on virtual ``stage``."""

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
    check_virtual_stages(schedule, virtual_stages)
    p, m = pp, num_microbatches
    if schedule in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // p):
        raise ConfigError(f"{schedule} needs the micro-batches ({m}) to be a multiple of its rounds "
                          f"(max(1, m // pp) = {max(1, m // p)}), as torch's schedule does",
                          fix="use a multiple of pp micro-batches")
    if schedule == "dualpipev" and m < 2 * p:
        raise ConfigError(f"dualpipev needs at least as many micro-batches as stages (2·pp = {2 * p}), got {m}",
                          fix=f"use at least {2 * p} micro-batches")


def check_virtual_stages(schedule: str, virtual_stages: int) -> None:
    """Virtual stages per device each schedule takes: 1 for GPipe and 1F1B, exactly 2 for the V schedules, any for
    the looped ones."""
    if schedule in V_SCHEDULES and virtual_stages != 2:
        raise ConfigError(f"schedule {schedule!r} places exactly 2 stages on each device, not {virtual_stages}",
                          fix="use 2 virtual stages")
    if schedule not in MULTI_STAGE_SCHEDULES and virtual_stages > 1:
        raise ConfigError(f"schedule {schedule!r} has one stage per device, not {virtual_stages}",
                          fix=f"use one of {', '.join(MULTI_STAGE_SCHEDULES)} for virtual stages")


def default_virtual_stages(schedule: str) -> int:
    """Virtual stages per device when none are given: 2 for the V schedules (the only count they take), else 1."""
    return 2 if schedule in V_SCHEDULES else 1


# --- placement: which device holds which stage -------------------------------------------------------------------
PLACEMENTS = ("single", "looped", "v")


def placement_of(schedule: str) -> str:
    """A schedule's stage placement: ``v`` for the V schedules, ``looped`` for the other multi-stage ones, else
    ``single`` (one stage per device)."""
    return "v" if schedule in V_SCHEDULES else "looped" if schedule in MULTI_STAGE_SCHEDULES else "single"


def device_of(placement: str, stage: int, *, pp: int) -> int:
    """The device holding virtual ``stage`` under ``placement`` — the one placement rule. ``single``: stage s on
    device s. ``looped`` (Narayanan et al. 2021 §2.2.2; torch's interleaved, looped-BFS and zero-bubble schedules):
    s mod p. ``v`` (Qi et al. 2023's ZB-V; torch's ZBV and DualPipe-V): the stages zig-zag, s mod p in even chunks
    and p−1−(s mod p) in odd ones, so with 2 chunks device d holds d and 2p−1−d, the first device the first and the
    last stage, and the last device runs stages p−1 and p back to back (torch's ``generate_stage_to_rank_mapping``,
    style "v")."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown stage placement {placement!r}", fix=f"use one of {', '.join(PLACEMENTS)}")
    chunk, within = divmod(stage, pp)
    return pp - 1 - within if placement == "v" and chunk % 2 else within


def device_of_stage(schedule: str, stage: int, *, pp: int) -> int:
    """The device holding virtual ``stage`` of ``schedule`` (``device_of`` its ``placement_of``)."""
    return device_of(placement_of(schedule), stage, pp=pp)


def stages_of_device(schedule: str, *, pp: int, device: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The virtual stages a device holds, in model order."""
    return tuple(s for s in range(pp * virtual_stages) if device_of_stage(schedule, s, pp=pp) == device)


def stages_of_ranks(placement: str, ranks: int, virtual: int = 1) -> list[list[int]]:
    """The virtual stages each of ``ranks`` pipeline ranks holds under ``placement`` (``device_of``): ``single``
    rank r: r; ``looped`` r, r+p, …, r+(v−1)p; ``v`` r and 2p−1−r (always two)."""
    chunks = {"single": 1, "v": 2}.get(placement, virtual)
    return [[s for s in range(ranks * chunks) if device_of(placement, s, pp=ranks) == r] for r in range(ranks)]


def pipeline_messages(schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """Activation and gradient messages between devices in one step: 2·m per stage boundary that crosses devices.
    1F1B: 2m(p−1). A V placement has 2p−1 boundaries of which one (p−1 → p, on the last device) is local: 2m(2p−2),
    twice 1F1B's (Qi et al. 2023, ZB-V: twice the pipeline communication of 1F1B)."""
    nv = pp * virtual_stages
    crossing = sum(device_of_stage(schedule, s, pp=pp) != device_of_stage(schedule, s + 1, pp=pp)
                   for s in range(nv - 1))
    return 2 * num_microbatches * crossing


def warmup_forwards(schedule: str, *, pp: int, num_microbatches: int, device: int, virtual_stages: int = 1) -> int:
    """Warm-up forwards of a device: all m for GPipe; min(p−d−1, m) for 1F1B and min((p−d−1)·2 + (v−1)·p, m·v)
    for interleaved 1F1B (Megatron's counts, before the steady forward-backward pairs begin with a forward); for
    the other schedules, the forwards before its first backward of any kind (B or I)."""
    _check(schedule, pp, num_microbatches, device, virtual_stages)
    p, m, d, v = pp, num_microbatches, device, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - d - 1, m)
    if schedule == "interleaved-1f1b":
        return min((p - d - 1) * 2 + (v - 1) * (m // max(1, m // p)), m * v)
    order = device_order(schedule, pp=pp, num_microbatches=num_microbatches, device=device,
                         virtual_stages=virtual_stages)
    return next((i for i, op in enumerate(order) if op.action != FORWARD), len(order))


def device_order(schedule: str, *, pp: int, num_microbatches: int, device: int,
                 virtual_stages: int = 1) -> list[Op]:
    """The compute operations one device runs in one step, in order (torch 2.13's orders, without their idle slots;
    an overlapped forward+backward of DualPipe-V is its forward then its backward, the order torch runs them in).
    A new list each call, of orders built once per configuration (the BPipe verdict asks for the same ones
    thousands of times)."""
    return list(_device_order(schedule, pp, num_microbatches, device, virtual_stages))


@functools.lru_cache(maxsize=256)
def _device_order(schedule: str, pp: int, num_microbatches: int, device: int, virtual_stages: int) -> tuple[Op, ...]:
    return tuple(_build_order(schedule, pp=pp, num_microbatches=num_microbatches, device=device,
                              virtual_stages=virtual_stages))


def _build_order(schedule: str, *, pp: int, num_microbatches: int, device: int, virtual_stages: int) -> list[Op]:
    _check(schedule, pp, num_microbatches, device, virtual_stages)
    p, m, d, v = pp, num_microbatches, device, virtual_stages
    if schedule in ONE_STAGE_SCHEDULES:
        warm = m if schedule == "gpipe" else min(p - d - 1, m)
        fwd = [Op(FORWARD, d, j) for j in range(m)]
        bwd = [Op(BACKWARD, d, j) for j in range(m)]
        order = fwd[:warm]
        for i in range(len(fwd) - warm):
            order += [fwd[warm + i], bwd[i]]
        return order + bwd[len(fwd) - warm:]
    if schedule == "looped-bfs":
        return _looped_bfs(p, m, d, v)
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return _interleaved(p, m, d, v, zero_bubble=schedule == "zero-bubble")
    if schedule == "zbv":
        return _zbv(p, m, d)
    return _dualpipev(p, m, d)


def _looped_bfs(p: int, m: int, d: int, v: int) -> list[Op]:
    """Breadth-first (Lamy-Poirier 2023; torch's ScheduleLoopedBFS): every micro-batch through the device's first
    chunk, then its next, …; backwards chunk by chunk from the last, micro-batches in reverse order."""
    chunks = [c * p + d for c in range(v)]
    return ([Op(FORWARD, s, j) for s in chunks for j in range(m)]
            + [Op(BACKWARD, s, j) for s in reversed(chunks) for j in reversed(range(m))])


def _interleaved(p: int, m: int, d: int, v: int, *, zero_bubble: bool) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2.2) and its zero-bubble form ZB-1P (Qi et al. 2023), as torch's
    ``_get_1f1b_rank_ops`` builds them: micro-batches go in rounds of m / max(1, m // p) through chunk 0, 1, …
    (backwards through v−1, …, 0); warm-up (v−1)·round + k·(p−1−d) forwards (k = 2; 1 for zero-bubble), capped at
    m·v; then one forward and one backward (I for zero-bubble) at a time, then the remaining backwards. Zero-bubble:
    device d runs its first d backwards' W late — each W after the I that comes d backwards later, the rest at the
    end — so the W passes fill the bubbles of the drain."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - d), m * v)
    steady = m * v - warm
    back = BACKWARD_INPUT if zero_bubble else BACKWARD

    def f_stage(k: int) -> int:
        return (k // per_round) % v * p + d

    def b_stage(k: int) -> int:
        return (v - 1 - ((k - warm) // per_round) % v) * p + d

    counters: dict[tuple[str, int], int] = {}

    def op(action: str, stage: int) -> Op:
        mb = counters.get((action, stage), 0)
        counters[(action, stage)] = mb + 1
        return Op(action, stage, mb)

    order: list[Op] = []
    backwards: list[int] = []  # the step index of every backward so far, for its W
    n_w = 0
    for k in range(warm + steady + warm):
        if k < warm + steady:
            order.append(op(FORWARD, f_stage(k)))
        if k >= warm:
            order.append(op(back, b_stage(k)))
            backwards.append(k)
            if zero_bubble and k - warm >= d:
                order.append(op(BACKWARD_WEIGHT, b_stage(backwards[n_w])))
                n_w += 1
    while zero_bubble and n_w < len(backwards):
        order.append(op(BACKWARD_WEIGHT, b_stage(backwards[n_w])))
        n_w += 1
    return order


def _zbv(p: int, m: int, d: int) -> list[Op]:
    """ZB-V (Qi et al. 2023 §6; torch's ScheduleZBVZeroBubble): device d holds chunk 0 = stage d and chunk 1 =
    stage 2p−1−d. Warm-up 2(p−d)−1 forwards of chunk 0, then d pairs (F chunk 1, F chunk 0), then p−d triples
    (F, I, W of chunk 1); steady: (F, I, W of chunk 0; F, I, W of chunk 1) until every forward ran; cool-down d
    pairs of I (chunk 0, chunk 1), p−d pairs (I, W of chunk 0), then the W left on chunk 1, then on chunk 0. Built
    for n = max(2p−1, m) micro-batches; those ≥ m are dropped, as torch does."""
    n = max(2 * p - 1, m)
    c0, c1 = d, 2 * p - 1 - d
    cnt = {k: 0 for k in ("f0", "f1", "b0", "b1", "w0", "w1")}
    order: list[Op] = []

    def add(action: str, stage: int, key: str) -> None:
        order.append(Op(action, stage, cnt[key]))
        cnt[key] += 1

    for _ in range(2 * (p - d) - 1):
        add(FORWARD, c0, "f0")
    for _ in range(d):
        add(FORWARD, c1, "f1")
        add(FORWARD, c0, "f0")
    for _ in range(p - d):
        add(FORWARD, c1, "f1")
        order += [Op(BACKWARD_INPUT, c1, cnt["b1"]), Op(BACKWARD_WEIGHT, c1, cnt["b1"])]
        cnt["b1"] += 1
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
        if cnt["f0"] < n:
            add(FORWARD, c0, "f0")
        order += [Op(BACKWARD_INPUT, c0, cnt["b0"]), Op(BACKWARD_WEIGHT, c0, cnt["b0"])]
        cnt["b0"] += 1
        add(FORWARD, c1, "f1")
        order += [Op(BACKWARD_INPUT, c1, cnt["b1"]), Op(BACKWARD_WEIGHT, c1, cnt["b1"])]
        cnt["b1"] += 1
    cnt["w0"], cnt["w1"] = cnt["b0"], cnt["b1"]
    for _ in range(d):
        add(BACKWARD_INPUT, c0, "b0")
        add(BACKWARD_INPUT, c1, "b1")
    for _ in range(p - d):
        add(BACKWARD_INPUT, c0, "b0")
        add(BACKWARD_WEIGHT, c0, "w0")
    while cnt["w1"] < cnt["b1"]:
        add(BACKWARD_WEIGHT, c1, "w1")
    while cnt["w0"] < cnt["b0"]:
        add(BACKWARD_WEIGHT, c0, "w0")
    return [o for o in order if o.microbatch < m]


def _dualpipev(p: int, m: int, d: int) -> list[Op]:
    """DualPipe-V (DeepSeek-AI 2024, arXiv 2412.19437; torch's ScheduleDualPipeV), device d holding stages d and
    2p−1−d: (1) 2(p−d−1) forwards of chunk 0; (2) d+1 pairs F chunk 0, F chunk 1; (3) p−d−1 times I chunk 1, a
    pending W, F chunk 1; (4) m−2p+d+1 times an overlapped (F chunk 0, B chunk 1) — plain on the last device's first
    — and an overlapped (F chunk 1, B chunk 0); (5) p−d−1 times B chunk 1, overlapped (F chunk 1, B chunk 0);
    (6) d+1 pairs of backwards chunk 1, chunk 0, switching to I (W deferred) half-way; (7) p−d−1 times a pending W,
    a backward of chunk 0; (8) the pending W. An overlapped pair is its forward then its backward."""
    s0, s1 = d, 2 * p - 1 - d
    cnt: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) whose W is still to run
    order: list[Op] = []

    def add(stage: int, action: str) -> None:
        key = (stage, BACKWARD_INPUT if action == BACKWARD else action)
        mb = cnt.get(key, 0)
        order.append(Op(action, stage, mb))
        cnt[key] = mb + 1
        if action == BACKWARD_INPUT:
            pending.append((stage, mb))

    def weight() -> None:
        if pending:
            stage, mb = pending.pop(0)
            order.append(Op(BACKWARD_WEIGHT, stage, mb))

    for _ in range(2 * (p - d - 1)):
        add(s0, FORWARD)
    for _ in range(d + 1):
        add(s0, FORWARD)
        add(s1, FORWARD)
    for _ in range(p - d - 1):
        add(s1, BACKWARD_INPUT)
        weight()
        add(s1, FORWARD)
    for i in range(m - 2 * p + d + 1):
        add(s0, FORWARD)  # overlapped with the next backward, except on the last device's first
        add(s1, BACKWARD)
        add(s1, FORWARD)
        add(s0, BACKWARD)
    for _ in range(p - d - 1):
        add(s1, BACKWARD)
        add(s1, FORWARD)
        add(s0, BACKWARD)
    split = False
    for i in range(d + 1):
        if i == (d + 1) // 2 and d % 2 == 1:
            split = True
        add(s1, BACKWARD_INPUT if split else BACKWARD)
        if i == (d + 1) // 2 and d % 2 == 0:
            split = True
        add(s0, BACKWARD_INPUT if split else BACKWARD)
    for _ in range(p - d - 1):
        weight()
        add(s0, BACKWARD_INPUT if split else BACKWARD)
    for _ in range(d + 1):
        weight()
    return order


def peak_in_flight(order: list[Op], *, virtual_stages: int = 1) -> float:
    """Most micro-batches whose forward ran and whose backward has not ended, in units of the device's whole share
    of layers (a chunk of a multi-stage device is 1/v of it, so the count may be fractional). A split backward
    ends with its W: the weight gradient needs the layer inputs the forward saved, so a micro-batch is held until
    its W has run (Qi et al. 2023, §2: W keeps M_W of the M_B an I needs; counted whole, an upper bound)."""
    live = peak = 0
    for op in order:
        live += {FORWARD: 1, BACKWARD: -1, BACKWARD_WEIGHT: -1}.get(op.action, 0)
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
def stage_layer_ranges(layers: int, stages: int, layers_per_stage: tuple[int, ...] | None = None) -> list[range]:
    """The transformer blocks (global indices) of each stage: contiguous, in stage order. ``layers_per_stage`` (one
    count a stage, checked by ``layers_refusal``): that split (``collect --layers-per-stage``, run.json's
    ``layers_per_stage``); None: the balanced split, earlier stages taking the remainder (the last stage also holds
    the logits, the first only the embedding)."""
    if layers_per_stage is not None:
        return layer_ranges(layers_per_stage)
    if stages <= 0 or layers < stages:
        raise ConfigError(f"{layers} layers cannot be split over {stages} stages",
                          fix="use at most as many stages as layers")
    base, extra = divmod(layers, stages)
    starts = [s * base + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def layer_ranges(counts: tuple[int, ...]) -> list[range]:
    """The blocks (global indices) of each stage of a split given as one count a stage: contiguous, in stage
    order (``stage_layer_ranges``' rule)."""
    out, start = [], 0
    for k in counts:
        out.append(range(start, start + k))
        start += k
    return out


def parse_layers(text: str, *, flag: str = "--layers-per-stage") -> tuple[int, ...]:
    """``--layers-per-stage 3,3,2`` (collect's and whatif's): one block count a device (stage), comma-separated; a
    ConfigError (one line) otherwise. Whether the counts fit the run is ``layers_refusal``'s."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or any(x < 0 for x in out):
        raise ConfigError(f"{flag} {text!r} is not a comma-separated list of layer counts",
                          fix=f"give one layer count a stage, e.g. {flag} 3,3,2")
    return out


def layers_refusal(layers_per_stage: tuple[int, ...], *, layers: int, pp: int,
                   virtual_stages: int = 1) -> tuple[str, str] | None:
    """Why a split of the transformer blocks over the devices cannot be run, as (why, fix), or None: one count a
    device summing to the model's blocks, and every chunk at least one block — ``stage_layer_ranges``' rule, which
    is the one ``traceana collect`` splits its model by (it refuses fewer blocks than stages)."""
    n = tuple(layers_per_stage)
    if len(n) != pp or sum(n) != layers:
        return (f"layers per stage {','.join(map(str, n))} must be {pp} counts (one a device) summing to the "
                f"model's {layers} layers", f"give {pp} counts that sum to {layers}")
    short = [d for d, k in enumerate(n) if k < virtual_stages]
    if short:
        k = n[short[0]]
        held = f"{k} layer{'' if k == 1 else 's'}"
        return ((f"device {short[0]} would hold {held} for its {virtual_stages} chunks" if virtual_stages > 1 else
                 f"stage {short[0]} would hold {held}")
                + ": every " + ("chunk" if virtual_stages > 1 else "stage")
                + " needs at least one (as collect splits its model)",
                f"give every stage at least {virtual_stages} layer{'s' if virtual_stages > 1 else ''}")
    return None


def stage_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage of ``stage_layer_ranges``."""
    return tuple(len(r) for r in stage_layer_ranges(layers, stages))


# --- BPipe ---------------------------------------------------------------------------------------------------------------
def why_no_bpipe(schedule: str, *, pp: int | None = None, virtual_stages: int = 1) -> str | None:
    """Why BPipe does not apply to this pipeline, or None where it does: the one rule the collector, the model, the
    simulator, validation and the verdict ask (``bpipe_applies``).

    BPipe (Kim et al. 2023) pairs stage s with p−1−s of a 1F1B pipeline, one stage a device: 1F1B leaves stage s
    holding p−s micro-batches, so the early stages hold more than their partners and can lend them the difference.
    GPipe holds all m micro-batches on every stage at its peak: an acceptor has no room its evictor lacks, and an
    eviction only moves activations onto a stage already at its own peak (keeping k on the evictor, the acceptor
    would hold m + m − k). Schedules with several stages a device, or a split backward, are not what BPipe's plan
    is defined on."""
    if schedule == "gpipe":
        return ("GPipe holds all its micro-batches on every stage at once, so a BPipe acceptor has no room its "
                "evictor lacks: an eviction would only move activations onto a stage already at its own peak")
    if schedule not in BPIPE_SCHEDULES or virtual_stages != 1:
        return (f"BPipe pairs the stages of a 1F1B pipeline with one stage a device; {schedule}"
                + (f" with {virtual_stages} stages a device" if virtual_stages != 1 else "") + " is not one")
    if pp is not None and pp < 2:
        return "BPipe needs at least 2 pipeline stages (an evictor and an acceptor)"
    return None


def bpipe_applies(schedule: str, *, pp: int | None = None, virtual_stages: int = 1) -> bool:
    """Whether BPipe is defined on this pipeline (``why_no_bpipe`` says why not)."""
    return why_no_bpipe(schedule, pp=pp, virtual_stages=virtual_stages) is None


def check_bpipe(schedule: str, *, pp: int | None = None, virtual_stages: int = 1,
                fix: str = "use --schedule 1f1b with --bpipe") -> None:
    """ConfigError (``why_no_bpipe``'s reason) where BPipe does not apply."""
    why = why_no_bpipe(schedule, pp=pp, virtual_stages=virtual_stages)
    if why is not None:
        raise ConfigError(f"BPipe is defined on the 1F1B schedule: {why}", fix=fix)


def plan_refusal(schedule: str, *, pp: int, num_microbatches: int, bpipe: bool = False,
                 bpipe_inflight: int | None = None, layers_per_stage: tuple[int, ...] | None = None,
                 layers: int | None = None, virtual_stages: int = 1) -> tuple[str, str] | None:
    """Why a pipeline plan cannot be run, as (why, fix), or None: the rules ``traceana collect`` refuses a plan by
    (collectors.trainer.config) and a plan what-if refuses the same one by (traceana.causal.whatif) — BPipe where it
    does not apply (``why_no_bpipe``), 1F1B that never reaches its steady state (fewer micro-batches than stages), and
    BPipe that balances nothing (no pair's ``bpipe_plan`` evicts); with ``layers_per_stage`` (of a model of
    ``layers`` blocks) also ``layers_refusal``."""
    if layers_per_stage is not None:
        why_layers = layers_refusal(layers_per_stage, layers=layers, pp=pp, virtual_stages=virtual_stages)
        if why_layers is not None:
            return why_layers
    why = why_no_bpipe(schedule, pp=pp) if bpipe else None
    if why is not None:
        return why, ("use --pp 2 or more, or drop --bpipe" if pp < 2 else "use --schedule 1f1b, or drop --bpipe")
    if schedule == "1f1b" and num_microbatches < pp:
        return (f"1F1B with {num_microbatches} micro-batches for {pp} stages never reaches its steady state",
                f"use --microbatches {pp} or more, or --schedule gpipe")
    if bpipe and not any(bpipe_plan(schedule, pp=pp, num_microbatches=num_microbatches, evictor=e,
                                    keep=bpipe_inflight).evicted for e, _ in bpipe_pairs(pp)):
        held = [microbatches_in_flight(schedule, pp=pp, stage=s, num_microbatches=num_microbatches)
                for s in range(pp)]
        if all(held[e] <= held[a] for e, a in bpipe_pairs(pp)):
            why = (f"every stage already holds as many micro-batches as its partner ({schedule} keeps "
                   f"{', '.join(f'{h:g}' for h in held)} on stages 0..{pp - 1})")
        else:
            why = ("no evictor would hold fewer micro-batches than it does without it (the acceptor would have to "
                   "take the next before returning the last)")
        # --bpipe-inflight is suggested only with a value under which the rules' plan does evict
        keeps = bpipe_keeps_that_evict(schedule, pp=pp, num_microbatches=num_microbatches)
        fix = "drop --bpipe" + (", or use --pp 4 or more" if pp < 4 else "") + (
            f", or force evictions with --bpipe-inflight {keeps[-1]}" if keeps and bpipe_inflight is None else "")
        return (f"BPipe can balance nothing at --pp {pp} with {num_microbatches} micro-batches ({schedule}): {why}",
                fix)
    return None


def bpipe_keeps_that_evict(schedule: str, *, pp: int, num_microbatches: int) -> tuple[int, ...]:
    """The keeps (``--bpipe-inflight`` values) under which some pair's plan evicts anything, smallest first: what
    a suggestion to force evictions may offer (none at 1F1B's pp 2, whose evictor's only other resident micro-batch
    is always the one its next backward needs)."""
    if not bpipe_applies(schedule, pp=pp):
        return ()
    most = max((int(microbatches_in_flight(schedule, pp=pp, stage=e, num_microbatches=num_microbatches))
                for e, _ in bpipe_pairs(pp)), default=0)
    return tuple(k for k in range(1, most) if any(
        _plan(schedule, pp=pp, num_microbatches=num_microbatches, evictor=e, keep=k).evicted for e, _ in bpipe_pairs(pp)))


def bpipe_pairs(pp: int) -> tuple[tuple[int, int], ...]:
    """BPipe's (evictor, acceptor) pairs: stage s with p−1−s for s < p/2 (the middle stage of an odd p is unpaired)."""
    return tuple((s, pp - 1 - s) for s in range(pp // 2))


def bpipe_pair_of(stage: int, pp: int) -> tuple[int, int] | None:
    """(evictor, acceptor) containing ``stage``, or None for the middle stage of an odd pipeline."""
    partner = pp - 1 - stage
    return None if partner == stage else (min(stage, partner), max(stage, partner))


@functools.lru_cache(maxsize=256)  # a pure function of the configuration, asked for again by every plan
def bpipe_inflight(schedule: str, *, pp: int, num_microbatches: int, evictor: int) -> int:
    """How many micro-batches the evictor keeps (the rules' bpipe_inflight, where run.json or --bpipe-inflight gives
    none): the level that makes the pair's larger peak smallest.

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
    """BPipe's plan for the pair of ``evictor`` (keep from ``bpipe_inflight`` unless given); see ``_plan``."""
    if keep is None:
        keep = bpipe_inflight(schedule, pp=pp, num_microbatches=num_microbatches, evictor=evictor)
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
    check_bpipe(schedule, fix="use schedule 1f1b with BPipe")
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
    whose plan evicts something, each evictor keeping ``keep``, default ``bpipe_inflight``) and without it elsewhere:
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
    marks = forward_work.lazy().group_by("rank", "step").agg(pl.col("start").min().alias("_f0"),
                                                            pl.col("end").max().alias("_f1"))
    w = steps.lazy().select("rank", "step", "start", "end").join(marks, on=["rank", "step"], how="left")
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
    return (pl.concat(parts).filter(pl.col("end") > pl.col("start")).sort("rank", "step", "start")
            .collect(engine=ENGINE))  # one query (docs/performance.md "Fixed cost")
