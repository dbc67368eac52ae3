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

from dataclasses import dataclass, field

import polars as pl

from traceana import intervals as iv
from traceana import schema
from traceana.errors import ConfigError
from traceana.pipeline_rules import SCHEDULES as SIM_SCHEDULES
from traceana.pipeline_rules import bpipe_pairs, bpipe_plan, bubble_windows, device_order


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
    orders = [device_order(schedule, pp=p, num_microbatches=m, device=d, virtual_stages=v) for d in range(p)]
    plans = {e: bpipe_plan("1f1b", pp=p, num_microbatches=m, evictor=e) for e in acceptor_of}
    cap = {e: plan.keep for e, plan in plans.items()}
    # The acceptor posts its receives and returns where the plan says (pipeline_rules.bpipe_plan).
    accept_after = {(plan.acceptor, j): len(v) for plan in plans.values() for j, v in plan.accept_after.items()}
    returns = {(plan.acceptor, j) for plan in plans.values() for j in plan.return_after}
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
                    # BPipe: evict what the plan says before this forward (pipeline_rules.bpipe_plan).
                    for victim in plans[d].evict_before.get(idx[d], ()):
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
                if idx[d] == 0 and (d, -1) in accept_after and costs.accept_block_ns:
                    # the acceptor posts the receives the plan takes at the start of the step
                    n = accept_after[(d, -1)]
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
                    # the acceptor returns, then accepts, what the plan says after this backward
                    n = ((d, idx[d]) in returns) + accept_after.get((d, idx[d]), 0)
                    if n and costs.accept_block_ns:
                        busy(d, end, end + n * costs.accept_block_ns, "bpipe")
                        end += n * costs.accept_block_ns
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
