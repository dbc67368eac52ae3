"""A discrete-event simulator of pipeline schedules: GPipe, 1F1B, interleaved 1F1B and BPipe-1F1B.

Each device runs its schedule's operations in a fixed order (the order is the schedule); an operation starts when the
device is free and its input has arrived: the forward of virtual stage v needs the activation of stage v−1, the
backward of v needs the gradient of v+1 (the last stage needs only its own forward). A message leaves when the
producing operation ends; the sender is busy ``send_ns`` posting it and it arrives ``p2p_ns`` later. With recompute,
a backward starts by re-running ``recompute_ns`` of forward work (as torch.utils.checkpoint does once the gradient has
arrived). Every device then runs its optimizer step.

Orders:
- GPipe (Huang et al. 2019): all forwards, then all backwards (micro-batch 0 first, as torch's ScheduleGPipe).
- 1F1B (Narayanan et al. 2021 §2.2.1, PipeDream-Flush): stage s runs min(p−s−1, m) warm-up forwards, then alternates
  one forward and one backward, then drains the remaining backwards.
- Interleaved 1F1B (Narayanan et al. 2021 §2.2.2; Megatron-LM's schedules.py): device s owns virtual stages
  s, s+p, …; forwards go in rounds of p micro-batches through chunk 0, 1, …, v−1 (backwards through v−1, …, 0), with
  (p−s−1)·2 + (v−1)·p warm-up forwards.
- BPipe (Kim et al. 2023): 1F1B where each evictor (stage s < p/2) keeps at most ⌈(n_s + n_{p−1−s})/2⌉
  micro-batches' activations: before a forward that would exceed the cap (counting the load its next backward
  needs) it sends the newest resident micro-batch's activations to its acceptor (p−1−s), and loads them back when that
  micro-batch's backward comes (collectors/bpipe.py's plan). Overlapped: transfers run in the background, the load
  overlapping the wait for the incoming gradient; only waiting for it is exposed. Not overlapped: the evictor is busy
  for each transfer.

The output has the measured tables' schemas (schema.SCHEDULE with source "simulated", schema.ATTRIBUTION with the same
categories and rules: per device the categories tile the step window and sum to the step time; idle time before the
device's first forward is ``bubble_warmup``, after its last forward ``bubble_cooldown`` (the drain), in between
``bubble_stall``;
waiting while a message is in flight is ``p2p``, waiting for a BPipe load is ``bpipe``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import polars as pl

from traceana import schema
from traceana.errors import ConfigError
from traceana.model.memory import bpipe_pairs, microbatches_in_flight

SIM_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class StageTimes:
    """Durations in ns of one micro-batch's operations, per virtual stage (p·v entries; p for plain schedules).

    ``backward_ns`` excludes recomputation, which is ``recompute_ns``. ``optimizer_ns`` is per device.
    """

    forward_ns: tuple[float, ...]
    backward_ns: tuple[float, ...]
    recompute_ns: tuple[float, ...] = ()
    optimizer_ns: tuple[float, ...] = ()
    host_ns: tuple[float, ...] = ()  # per device: host time (Python, launches) before each operation
    # Replay: exact durations of single operations, keyed (phase "F"/"B"/"R", virtual stage, micro-batch); they
    # override the per-stage values above (used to check the schedule logic against a measured timeline).
    per_op_ns: dict[tuple[str, int, int], float] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_ns)
        if n == 0 or len(self.backward_ns) != n or (self.recompute_ns and len(self.recompute_ns) != n):
            raise ConfigError(
                "stage times need one forward, backward (and recompute) duration per stage",
                fix="give equally long tuples",
            )
        if any(x < 0 for x in (*self.forward_ns, *self.backward_ns, *self.recompute_ns, *self.optimizer_ns,
                               *self.host_ns)):
            raise ConfigError("stage times must not be negative", fix="check the durations")

    @classmethod
    def uniform(cls, stages: int, *, forward: float, backward: float, recompute: float = 0.0,
                optimizer: float = 0.0, devices: int | None = None) -> StageTimes:
        return cls(
            forward_ns=(forward,) * stages,
            backward_ns=(backward,) * stages,
            recompute_ns=(recompute,) * stages,
            optimizer_ns=(optimizer,) * (devices or stages),
        )


@dataclass(frozen=True)
class Costs:
    """Communication costs in ns. ``p2p_ns``: one activation/gradient message in flight (latency + bytes/bandwidth);
    ``send_ns``: the sender's own time posting it; ``bpipe_ns``: one micro-batch's activations evicted or loaded."""

    p2p_ns: float = 0.0
    send_ns: float = 0.0
    bpipe_ns: float = 0.0
    bpipe_overlap: bool = True
    resume_ns: float = 0.0  # after a message arrives, until the receiver computes (wake-up, Python after the wait)
    evict_block_ns: float = 0.0  # BPipe: the evictor's own time per eviction (posting, copying), in line
    accept_block_ns: float = 0.0  # BPipe: the acceptor's own time to accept, and again to return, one micro-batch
    # Replay: in-flight time of single messages keyed ("F" activation / "B" gradient, producing stage, micro-batch).
    per_message_ns: dict[tuple[str, int, int], float] | None = None

    @staticmethod
    def transfer_ns(nbytes: float, *, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> float:
        return (latency_s + nbytes / bandwidth_bytes_per_s) * 1e9


@dataclass(frozen=True)
class Simulation:
    schedule: pl.DataFrame  # schema.SCHEDULE, source "simulated"
    attribution: pl.DataFrame  # schema.ATTRIBUTION
    step_ns: int
    peak_in_flight: tuple[float, ...]  # per device: most micro-batches' activations held at once (own + accepted)
    evicted: tuple[int, ...] = field(default_factory=tuple)  # per device: micro-batches it evicted


# --- operation orders ----------------------------------------------------------------------------------------------
def device_order(schedule: str, *, pp: int, num_microbatches: int, device: int,
                 virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """The (action "F"/"B", virtual stage, micro-batch) sequence a device runs in one step."""
    p, m, d, v = pp, num_microbatches, device, virtual_stages
    if schedule == "gpipe":
        return [("F", d, j) for j in range(m)] + [("B", d, j) for j in range(m)]
    if schedule == "1f1b":
        fwd = [("F", d, j) for j in range(m)]
        bwd = [("B", d, j) for j in range(m)]
        warm = min(p - d - 1, m)
    elif schedule == "interleaved-1f1b":
        groups = [range(r, min(r + p, m)) for r in range(0, m, p)]
        fwd = [("F", c * p + d, j) for g in groups for c in range(v) for j in g]
        bwd = [("B", c * p + d, j) for g in groups for c in reversed(range(v)) for j in g]
        warm = min((p - d - 1) * 2 + (v - 1) * p, m * v)
    else:
        raise ConfigError(f"cannot simulate schedule {schedule!r}", fix=f"use one of {', '.join(SIM_SCHEDULES)}")
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[len(fwd) - warm:]


def bpipe_plan(order: list[tuple[str, int, int]], cap: int) -> dict[int, list[int]]:
    """Evictions of one evictor: operation index (a forward) -> micro-batches evicted just before it.

    The rule of collectors/bpipe.py's ``eviction_plan`` (and Kim et al. 2023): before a forward that would take the
    resident count over ``cap`` — counting the load the next backward needs — evict the resident micro-batch whose
    backward is furthest away (the newest); an evicted micro-batch is resident again from its backward. It depends
    only on the order, so both partners (and the simulator) know it in advance."""
    resident: set[int] = set()
    evicted: set[int] = set()
    plan: dict[int, list[int]] = {}
    for i, (action, _, mb) in enumerate(order):
        if action == "F":
            nxt = order[i + 1] if i + 1 < len(order) else None
            needed = nxt[2] if nxt is not None and nxt[0] == "B" else None
            need = 1 + (needed in evicted)
            while len(resident) + need > cap:
                candidates = resident - {needed}
                if not candidates:
                    break
                victim = max(candidates)
                resident.discard(victim)
                evicted.add(victim)
                plan.setdefault(i, []).append(victim)
            resident.add(mb)
        else:
            evicted.discard(mb)
            resident.discard(mb)
    return plan


def bpipe_acceptor_peak(order: list[tuple[str, int, int]], victims: list[int], *, acceptor: int,
                        evictor: int) -> tuple[int, int]:
    """(own, accepted) micro-batches an acceptor holds at its peak when, as collectors/bpipe.py does it, it posts the
    receive for evicted micro-batch e (allocating its buffer) before its own forward of e − (q − s) and frees it after
    returning it, right after its own backward of e."""
    accept_at: dict[int, int] = {}
    for e in victims:
        x = max(0, e - (acceptor - evictor))
        accept_at[x] = accept_at.get(x, 0) + 1
    own = foreign = 0
    best = (0, 0)
    for action, _, mb in order:
        if action == "F":
            foreign += accept_at.get(mb, 0)
            own += 1
            if own + foreign > sum(best):
                best = (own, foreign)
        else:
            own -= 1
            if mb in victims:
                foreign -= 1
    return best


# --- the simulation --------------------------------------------------------------------------------------------------
def _split_wait(start: float, end: float, windows: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Label the pieces of an idle span [start, end): inside a window its category (earlier windows win), else idle."""
    if end <= start:
        return []
    cuts = sorted({start, end, *(x for w0, w1, _ in windows for x in (w0, w1) if start < x < end)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        cat = next((c for w0, w1, c in windows if w0 <= mid < w1), "idle")
        if out and out[-1][2] == cat and out[-1][1] == a:
            out[-1] = (out[-1][0], b, cat)
        else:
            out.append((a, b, cat))
    return out


def simulate(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    times: StageTimes,
    costs: Costs = Costs(),
    virtual_stages: int = 1,
    bpipe: bool | tuple[tuple[int, int], ...] = False,
    rank_of_device: tuple[int, ...] | None = None,
    step: int = 0,
    window: str = "rolling",
) -> Simulation:
    """Simulate one training step; see the module docstring for the rules.

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

    def dur(kind: tuple[float, ...], vs: int, op: tuple[str, int] | None = None) -> float:
        if op is not None and times.per_op_ns and (op[0], vs, op[1]) in times.per_op_ns:
            return times.per_op_ns[(op[0], vs, op[1])]
        if not kind:
            return 0.0
        return kind[vs % p] / v if per_chunk else kind[vs]

    pairs: tuple[tuple[int, int], ...] = ()
    if bpipe:
        if schedule != "1f1b" or v != 1:
            raise ConfigError("BPipe is simulated on plain 1F1B only", fix="use schedule 1f1b without interleaving")
        pairs = bpipe_pairs(p) if bpipe is True else tuple(bpipe)
    acceptor_of = dict(pairs)
    cap = {
        e: math.ceil(
            (microbatches_in_flight("1f1b", pp=p, stage=e, num_microbatches=m)
             + microbatches_in_flight("1f1b", pp=p, stage=a, num_microbatches=m)) / 2
        )
        for e, a in pairs
    }

    orders = [device_order(schedule, pp=p, num_microbatches=m, device=d, virtual_stages=v) for d in range(p)]
    plans = {e: bpipe_plan(orders[e], cap[e]) for e in cap}
    # The acceptor q = p−1−s accepts micro-batch e before its own forward of e − (q − s) and returns it right after
    # its own backward of e (collectors/bpipe.py).
    accept_before: dict[tuple[int, int], int] = {}
    returns: set[tuple[int, int]] = set()
    for e_dev, plan in plans.items():
        q = acceptor_of[e_dev]
        for victims in plan.values():
            for victim in victims:
                key = (q, max(0, victim - (q - e_dev)))
                accept_before[key] = accept_before.get(key, 0) + 1
                returns.add((q, victim))
    idx = [0] * p
    free = [0.0] * p
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    segments: list[list[tuple[float, float, str]]] = [[] for _ in range(p)]  # busy or labelled-wait spans
    rows: list[tuple[int, int, int, str, float, float]] = []  # device, vstage, mb, phase, start, end
    held_events: list[tuple[float, float, int]] = []  # (time, ±micro-batches of the device's layers, device)
    resident: dict[int, list[int]] = {e: [] for e in acceptor_of}
    evicted_at: dict[tuple[int, int], float] = {}  # (evictor, mb) -> time the eviction completed
    link_free = {e: 0.0 for e in acceptor_of}  # one BPipe link per pair, transfers serialise on it
    n_evicted = [0] * p

    def busy(d: int, start: float, end: float, cat: str) -> None:
        if end > start:
            segments[d].append((start, end, cat))

    def note_held(t: float, d: int, delta: float) -> None:
        held_events.append((t, delta, d))

    loaded_at: dict[tuple[int, int], tuple[float, float]] = {}  # (evictor, mb) -> (load issued, load done)

    def issue_load(d: int, mb: int, after: float) -> None:
        issue = max(after, evicted_at.pop((d, mb)), link_free[d])
        loaded = issue + costs.bpipe_ns
        link_free[d] = loaded
        loaded_at[(d, mb)] = (issue, loaded)
        note_held(loaded, acceptor_of[d], -1.0)
        note_held(loaded, d, 1.0)
        resident[d].append(mb)

    def arrival(src_vs: int, dst_dev: int, ready: float, key: tuple[str, int, int]
                ) -> tuple[float, list[tuple[float, float, str]]]:
        """When a message produced at ``ready`` by virtual stage src_vs reaches device dst_dev, and its p2p window."""
        if src_vs % p == dst_dev:
            return ready, []
        if costs.per_message_ns and key in costs.per_message_ns:
            t = ready + costs.per_message_ns[key]
            return t, [(ready, t, "p2p")]
        t = ready + costs.send_ns + costs.p2p_ns
        return t + costs.resume_ns, [(ready, t, "p2p"), (t, t + costs.resume_ns, "host")]

    total = sum(len(o) for o in orders)
    done = 0
    while done < total:
        progressed = False
        for d in range(p):
            while idx[d] < len(orders[d]):
                action, vs, mb = orders[d][idx[d]]
                windows: list[tuple[float, float, str]] = []
                if action == "F":
                    if vs == 0:
                        ready = 0.0
                    elif (vs - 1, mb) in f_end:
                        ready, windows = arrival(vs - 1, d, f_end[(vs - 1, mb)], ("F", vs - 1, mb))
                    else:
                        break
                else:
                    if vs == nv - 1:
                        if (vs, mb) not in f_end:
                            break
                        ready = f_end[(vs, mb)]
                    elif (vs + 1, mb) in b_end:
                        ready, windows = arrival(vs + 1, d, b_end[(vs + 1, mb)], ("B", vs + 1, mb))
                    else:
                        break
                if times.host_ns and times.host_ns[d]:
                    # Host work (Python, launching) happens before the device can post and wait for its input.
                    busy(d, free[d], free[d] + times.host_ns[d], "host")
                    free[d] += times.host_ns[d]
                start = max(free[d], ready)
                if action == "B" and (d, mb) in evicted_at:
                    if costs.bpipe_overlap:
                        issue_load(d, mb, free[d])  # nothing prefetched it: load now
                    else:
                        # Blocking load right before this backward.
                        issue = max(free[d], evicted_at[(d, mb)], link_free[d])
                        for a, b, c in _split_wait(free[d], issue, windows):
                            busy(d, a, b, c)
                        issue_load(d, mb, issue)
                        busy(d, issue, loaded_at[(d, mb)][1], "bpipe")
                        free[d] = loaded_at.pop((d, mb))[1]
                        start = max(free[d], ready)
                if action == "B" and (d, mb) in loaded_at:
                    issue, loaded = loaded_at.pop((d, mb))
                    windows = [(max(issue, free[d]), loaded, "bpipe"), *windows]
                    start = max(start, loaded)
                for a, b, c in _split_wait(free[d], start, windows):
                    busy(d, a, b, c)
                t = start
                if action == "F" and d in cap:
                    # BPipe: evict what the plan says before this forward (bpipe_plan; collectors/bpipe.py).
                    for victim in plans[d].get(idx[d], ()):
                        resident[d].remove(victim)
                        n_evicted[d] += 1
                        if costs.evict_block_ns:
                            busy(d, t, t + costs.evict_block_ns, "bpipe")
                            t += costs.evict_block_ns
                        ev_start = max(t, link_free[d])
                        ev_end = ev_start + costs.bpipe_ns
                        link_free[d] = ev_end
                        evicted_at[(d, victim)] = ev_end
                        note_held(ev_end, d, -1.0)
                        note_held(ev_end, acceptor_of[d], 1.0)
                        if not costs.bpipe_overlap:
                            busy(d, ev_start, ev_end, "bpipe")
                            t = ev_end
                if action == "F" and (d, mb) in accept_before and costs.accept_block_ns:
                    # the acceptor posts its receive for an evicted micro-batch before this forward of its own
                    n = accept_before[(d, mb)]
                    busy(d, t, t + n * costs.accept_block_ns, "bpipe")
                    t += n * costs.accept_block_ns
                if action == "F":
                    end = t + dur(times.forward_ns, vs, ("F", mb))
                    busy(d, t, end, "forward")
                    rows.append((d, vs, mb, "forward", t, end))
                    f_end[(vs, mb)] = end
                    note_held(end, d, 1.0 / v)
                    if d in cap:
                        resident[d].append(mb)
                    if costs.send_ns and vs != nv - 1 and (vs + 1) % p != d:
                        busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                else:
                    r = dur(times.recompute_ns, vs, ("R", mb))
                    if r:
                        busy(d, t, t + r, "recompute")
                        rows.append((d, vs, mb, "recompute", t, t + r))
                    end = t + r + dur(times.backward_ns, vs, ("B", mb))
                    busy(d, t + r, end, "backward")
                    rows.append((d, vs, mb, "backward", t, end))  # measured B spans include their recompute
                    b_end[(vs, mb)] = end
                    if (d, mb) in returns and costs.accept_block_ns:
                        busy(d, end, end + costs.accept_block_ns, "bpipe")
                        end += costs.accept_block_ns
                    note_held(end, d, -1.0 / v)
                    if d in cap and mb in resident[d]:
                        resident[d].remove(mb)
                    if costs.send_ns and vs != 0 and (vs - 1) % p != d:
                        busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                idx[d] += 1
                done += 1
                progressed = True
        if not progressed:
            raise ConfigError(
                f"the {schedule} schedule deadlocks with pp={p}, micro-batches={m}, virtual stages={v}",
                fix="use a micro-batch count the schedule supports (interleaving wants a multiple of pp)",
            )

    # Activations held per device over time (frees before arrivals at equal times), for the peak.
    held = [0.0] * p
    peak = [0.0] * p
    for _, delta, d in sorted(held_events):
        held[d] += delta
        peak[d] = max(peak[d], held[d])

    # Optimizer, then the step windows.
    opt_end = []
    for d in range(p):
        o = times.optimizer_ns[d] if times.optimizer_ns else 0.0
        busy(d, free[d], free[d] + o, "optimizer")
        if o:
            rows.append((d, d, -1, "optimizer", free[d], free[d] + o))
        opt_end.append(free[d] + o)
    step_ns = max(opt_end)
    att_rows = []
    for d in range(p):
        w0, w1 = (opt_end[d] - step_ns, opt_end[d]) if window == "rolling" else (0.0, step_ns)
        segs = sorted(segments[d])
        first_f = min((r[4] for r in rows if r[0] == d and r[3] == "forward"), default=w0)
        last_f = max((r[5] for r in rows if r[0] == d and r[3] == "forward"), default=w1)
        tiles: list[tuple[float, float, str]] = []
        cursor = w0
        for a, b, c in segs:
            if a > cursor:
                tiles.append((cursor, a, "idle"))
            tiles.append((a, b, c))
            cursor = b
        if cursor < w1:
            tiles.append((cursor, w1, "idle"))
        # Idle → bubble by position relative to the first and the last forward (split spans that straddle), as the
        # measured attribution does (traceana/attribution.py: after the last forward only the drain is left).
        acc: dict[str, int] = {c: 0 for c in schema.CATEGORIES}
        for a, b, c in tiles:
            ia, ib = round(a), round(b)
            if c != "idle":
                acc[c] += ib - ia
                continue
            for lo, hi, cat in ((-math.inf, first_f, "bubble_warmup"), (first_f, last_f, "bubble_stall"),
                                (last_f, math.inf, "bubble_cooldown")):
                lo_, hi_ = max(a, lo), min(b, hi)
                if hi_ > lo_:
                    acc[cat] += round(hi_) - round(lo_)
        rank = rank_of_device[d] if rank_of_device else d
        window_ns = round(w1) - round(w0)
        for c in schema.CATEGORIES:
            att_rows.append((rank, step, d, c, acc[c], acc[c] / window_ns if window_ns else 0.0))

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
    attribution = pl.DataFrame(att_rows, schema=list(schema.ATTRIBUTION.items()), orient="row")
    return Simulation(
        schedule=schema.check(sched, schema.SCHEDULE, "simulated schedule"),
        attribution=schema.check(attribution, schema.ATTRIBUTION, "simulated attribution"),
        step_ns=round(step_ns),
        peak_in_flight=tuple(peak),
        evicted=tuple(n_evicted),
    )


def bubble_fraction(sim: Simulation) -> pl.DataFrame:
    """Per rank: the share of the step spent in the three bubble categories."""
    return (
        sim.attribution.filter(pl.col("category").is_in(schema.BUBBLE_CATEGORIES))
        .group_by("rank", "stage")
        .agg(pl.col("fraction").sum().alias("bubble_fraction"))
        .sort("rank")
    )
