"""The pipeline simulator's scheduler: every device runs its operations in order, each when the device is free and
its input has arrived (model.simulate's docstring gives the rules), with a ``Policy`` asked at each operation for
what a variant adds (BPipe: model.bpipe_policy). Pure Python over the schedule's operations (a few thousand at most),
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceana.errors import ConfigError
from traceana.pipeline_rules import Op
from traceana.units import NS_PER_S


@dataclass(frozen=True)
class StageTimes:
    """Durations in ns of one micro-batch's operations, per virtual stage (p·v entries; p for plain schedules).

    ``backward_ns`` excludes recomputation, which is ``recompute_ns``. ``optimizer_ns`` is per device.
    ``weight_ns``: the weight-gradient part (W) of ``backward_ns``, for schedules that split the backward (the
    input-gradient part I is the rest); empty: half of it, Qi et al. 2023's T_B = T_W.
    """

    forward_ns: tuple[float, ...]
    backward_ns: tuple[float, ...]
    recompute_ns: tuple[float, ...] = ()
    optimizer_ns: tuple[float, ...] = ()
    host_ns: tuple[float, ...] = ()  # per device: host time (Python, launches) before each operation
    weight_ns: tuple[float, ...] = ()
    # Replay: exact durations of single operations, keyed (phase "F"/"B"/"I"/"W"/"R", virtual stage, micro-batch); they
    # override the per-stage values above (used to check the schedule logic against a measured timeline).
    per_op_ns: dict[tuple[str, int, int], float] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_ns)
        if n == 0 or len(self.backward_ns) != n or (self.recompute_ns and len(self.recompute_ns) != n) or (
                self.weight_ns and len(self.weight_ns) != n):
            raise ConfigError(
                "stage times need one forward, backward (and recompute) duration per stage",
                fix="give equally long tuples",
            )
        if any(x < 0 for x in (*self.forward_ns, *self.backward_ns, *self.recompute_ns, *self.optimizer_ns,
                               *self.host_ns, *self.weight_ns)):
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
        return (latency_s + nbytes / bandwidth_bytes_per_s) * NS_PER_S


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


class Recorder:
    """What the scheduler and its policy record: per device the busy (or labelled-wait) spans, and the changes in
    activations held (time, ±micro-batches of the device's layers, device)."""

    def __init__(self, devices: int) -> None:
        self.segments: list[list[tuple[float, float, str]]] = [[] for _ in range(devices)]
        self.held: list[tuple[float, float, int]] = []

    def busy(self, d: int, start: float, end: float, cat: str) -> None:
        if end > start:
            self.segments[d].append((start, end, cat))

    def note_held(self, t: float, d: int, delta: float) -> None:
        self.held.append((t, delta, d))

    def wait(self, d: int, start: float, end: float, windows: list[tuple[float, float, str]]) -> None:
        for a, b, c in _split_wait(start, end, windows):
            self.busy(d, a, b, c)


class Policy:
    """What the scheduler asks at each operation beyond the schedule's own rules; this one adds nothing. BPipe
    (model.bpipe_policy.BPipePolicy) is one: evictions before forwards, loads before backwards, the acceptor's work.

    ``before_start`` may delay an operation past ``start`` (returns the new free time, start and wait windows);
    ``before_work`` and ``after_work`` may add the device's own time before / after its compute (return the new
    time)."""

    def before_start(self, rec: Recorder, d: int, i: int, op: Op, *, free: float, start: float, ready: float,
                     windows: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, float, str]]]:
        return free, start, windows

    def before_work(self, rec: Recorder, d: int, i: int, op: Op, t: float) -> float:
        return t

    def after_work(self, rec: Recorder, d: int, i: int, op: Op, end: float) -> float:
        return end

    def evicted(self, devices: int) -> tuple[int, ...]:
        return (0,) * devices


def run_schedule(orders: list[list[Op]], *, rec: Recorder, policy: Policy, times: StageTimes, costs: Costs, pp: int,
         virtual_stages: int, dur, schedule: str, num_microbatches: int, device_of: tuple[int, ...] | None = None
         ) -> tuple[list[tuple[int, int, int, str, float, float]], list[float]]:
    """The scheduler: run every device's operations in order, each when the device is free and its input has
    arrived (see the module docstring), asking ``policy`` at each. ``dur(action, virtual stage, micro-batch)``
    gives an operation's duration (action F, B, I, W or R for recompute). ``device_of``: the device of every virtual stage
    (pipeline_rules.device_of_stage; default looped). Returns the operation rows (device, virtual stage,
    micro-batch, phase, start, end) and when each device is free at the end.

    A backward is B (whole), or I then W (Qi et al. 2023): I needs the gradient from the next stage and sends its
    own upstream at once; W needs only its own I, and frees the micro-batch's activations."""
    p, v = pp, virtual_stages
    nv = p * v
    dev = device_of or tuple(s % p for s in range(nv))
    idx = [0] * p
    free = [0.0] * p
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}  # end of the B or I that produced the stage's input gradient
    rows: list[tuple[int, int, int, str, float, float]] = []

    def arrival(src_vs: int, dst_dev: int, ready: float, key: tuple[str, int, int]
                ) -> tuple[float, list[tuple[float, float, str]]]:
        """When a message produced at ``ready`` by virtual stage src_vs reaches device dst_dev, and its p2p window."""
        if dev[src_vs] == dst_dev:
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
                op = orders[d][idx[d]]
                action, vs, mb = op
                windows: list[tuple[float, float, str]] = []
                if action == "F":
                    if vs == 0:
                        ready = 0.0
                    elif (vs - 1, mb) in f_end:
                        ready, windows = arrival(vs - 1, d, f_end[(vs - 1, mb)], ("F", vs - 1, mb))
                    else:
                        break
                elif action == "W":
                    if (vs, mb) not in b_end:
                        break
                    ready = b_end[(vs, mb)]
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
                    rec.busy(d, free[d], free[d] + times.host_ns[d], "host")
                    free[d] += times.host_ns[d]
                free[d], start, windows = policy.before_start(rec, d, idx[d], op, free=free[d],
                                                              start=max(free[d], ready), ready=ready, windows=windows)
                rec.wait(d, free[d], start, windows)
                t = policy.before_work(rec, d, idx[d], op, start)
                if action == "F":
                    end = t + dur("F", vs, mb)
                    rec.busy(d, t, end, "forward")
                    rows.append((d, vs, mb, "forward", t, end))
                    f_end[(vs, mb)] = end
                    end = policy.after_work(rec, d, idx[d], op, end)
                    rec.note_held(end, d, 1.0 / v)
                    if costs.send_ns and vs != nv - 1 and dev[vs + 1] != d:
                        rec.busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                elif action == "W":
                    end = t + dur("W", vs, mb)
                    rec.busy(d, t, end, "backward_weight")
                    rows.append((d, vs, mb, "backward_weight", t, end))
                    end = policy.after_work(rec, d, idx[d], op, end)
                    rec.note_held(end, d, -1.0 / v)
                    free[d] = end
                else:
                    phase = "backward" if action == "B" else "backward_input"
                    r = dur("R", vs, mb)
                    if r:
                        rec.busy(d, t, t + r, "recompute")
                        rows.append((d, vs, mb, "recompute", t, t + r))
                    end = t + r + dur(action, vs, mb)
                    rec.busy(d, t + r, end, phase)
                    rows.append((d, vs, mb, phase, t, end))  # measured B spans include their recompute
                    b_end[(vs, mb)] = end
                    end = policy.after_work(rec, d, idx[d], op, end)
                    if action == "B":
                        rec.note_held(end, d, -1.0 / v)
                    if costs.send_ns and vs != 0 and dev[vs - 1] != d:
                        rec.busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                idx[d] += 1
                done += 1
                progressed = True
        if not progressed:
            raise ConfigError(
                f"the {schedule} schedule deadlocks with pp={p}, micro-batches={num_microbatches}, virtual stages={v}",
                fix="use a micro-batch count the schedule supports (interleaving wants a multiple of pp)",
            )
    return rows, free
