"""The pipeline simulator's scheduler: every device runs its operations in order, each when the device is free and
its input has arrived (model.simulate's docstring gives the rules), with a ``Policy`` asked at each operation for
what a variant adds (BPipe: model.bpipe_policy). Pure Python over the schedule's operations (a few thousand at most),
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from traceana.core.errors import ConfigError
from traceana.core.pipeline_rules import Op
from traceana.core.units import NS_PER_S


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


class NullRecorder(Recorder):
    """Records nothing: a measured replay needs only when each operation ran (``Trace``), not the labelled spans."""

    def __init__(self, devices: int = 0) -> None:
        super().__init__(0)

    def busy(self, d: int, start: float, end: float, cat: str) -> None:
        pass

    def note_held(self, t: float, d: int, delta: float) -> None:
        pass

    def wait(self, d: int, start: float, end: float, windows: list[tuple[float, float, str]]) -> None:
        pass


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


# An operation's input: the latest of ``terms`` (the product of an operation, keyed as ``product`` names it, plus a lag
# in ns), then ``delay`` ns more; ``delay`` None: the costs' message rule between two devices (nothing on one device).
Input = tuple[tuple[tuple[tuple, float], ...], "float | None"]
# Actions beyond a pass: what a measured step also holds (optimizer, collective, other work), their phase names.
OTHER_PHASES = {"O": "optimizer", "C": "collective", "X": "other_compute"}


def product(op: tuple) -> tuple:
    """What an operation makes that others wait for: a forward its activation ("F", stage, micro-batch), a B or I the
    stage's input gradient ("B", stage, micro-batch); any other operation itself."""
    action, vs, mb = op
    if action == "F":
        return ("F", vs, mb)
    if action in ("B", "I"):
        return ("B", vs, mb)
    return tuple(op)


def rule_inputs(op: tuple, *, stages: int) -> tuple[Input, ...]:
    """The pipeline rules' inputs of a planned operation (see the module docstring of model.simulate): a forward of
    virtual stage v needs v−1's activation, a B or I v+1's gradient (the last stage its own forward), a W its I."""
    action, vs, mb = op

    def made_by(key: tuple) -> tuple[Input]:
        return ((((key, 0.0),), None),)

    if action == "F":
        return () if vs == 0 else made_by(("F", vs - 1, mb))
    if action == "W":
        return made_by(("B", vs, mb))
    return made_by(("F", vs, mb) if vs == stages - 1 else ("B", vs + 1, mb))


@dataclass
class Trace:
    """What a run of the scheduler did per operation, for a measured replay and its critical path: per (device,
    index in its order) the operation, when the device was free for it (after its own host time), when its inputs
    were ready (after the time it takes once they are), its start and end, and what bound the start: "device" (its
    previous operation), the product key of the input that arrived last, or ("group", id, device) for a
    collective's last member to join (its device)."""

    ops: dict[tuple[int, int], tuple[tuple, float, float, float, float, object]] = field(default_factory=dict)


def run_schedule(orders: list[list[Op]], *, rec: Recorder, policy: Policy, times: StageTimes, costs: Costs, pp: int,
         virtual_stages: int, dur, schedule: str, num_microbatches: int, device_of: tuple[int, ...] | None = None,
         inputs=None, gap=None, groups: dict | None = None, trace: Trace | None = None,
         free0: list[float] | None = None, lanes: dict | None = None
         ) -> tuple[list[tuple[int, int, int, str, float, float]], list[float]]:
    """The scheduler: run every device's operations in order, each when the device is free and its inputs have
    arrived (see the module docstring), asking ``policy`` at each. ``dur(action, virtual stage, micro-batch)``
    gives an operation's duration (action F, B, I, W or R for recompute; O, C, X: OTHER_PHASES). ``device_of``:
    the device of every virtual stage (pipeline_rules.device_of_stage; default looped). Returns the operation rows
    (device, virtual stage, micro-batch, phase, start, end) and when each device is free at the end.

    One engine for the plan and the measurement. Planned (the default): the orders are the rules', their inputs
    ``rule_inputs``, each device's host time ``times.host_ns`` before every operation. Measured (causal.replay):
    ``inputs(device, op)`` gives each operation's inputs (``Input``: the paired messages' producers and the
    receiver's own post), ``gap(device, index, op)`` its (pre, post): the operation starts at max(free + pre,
    inputs ready + post); ``groups[op] = (id, members)``: a collective, which starts when its last member joins;
    ``free0``: when each device starts; ``trace`` records what bound every start (the critical path's input).
    ``lanes[op] = (lane, after)``: a device running operations at once on several lanes (a GPU rank's streams,
    causal.gpu_edges): the operation follows the previous one of its lane, not of its device, and the products
    ``after`` (operations of its device's other lanes, earlier in its order) — bound ("after", device's rank, seq)
    where one of them set its start; the device is free at the end when its last lane is.

    A backward is B (whole), or I then W (Qi et al. 2023): I needs the gradient from the next stage and sends its
    own upstream at once; W needs only its own I, and frees the micro-batch's activations."""
    p, v = len(orders), virtual_stages
    nv = pp * v
    planned = inputs is None
    dev = device_of or tuple(s % pp for s in range(nv))
    idx = [0] * p
    free = list(free0) if free0 is not None else [0.0] * p
    lane_free: dict[tuple, float] = {}  # (device, lane) -> when the lane is free (``lanes``)
    first_free = list(free)
    ends: dict[tuple, tuple[float, int]] = {}  # product -> (when it is made, device)
    joined: dict[object, dict[int, float]] = {}  # collective id -> member device -> when it joined
    rows: list[tuple[int, int, int, str, float, float]] = []
    if planned:
        inputs = lambda d, op: rule_inputs(op, stages=nv)  # noqa: E731

    def arrival(src: int, d: int, ready: float, key: tuple, delay: float | None
                ) -> tuple[float, list[tuple[float, float, str]]]:
        """When an input made at ``ready`` on device ``src`` reaches device ``d``, and its wait windows."""
        if delay is not None:
            return ready + delay, [(ready, ready + delay, "p2p")]
        if src == d:
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
                ready, bound = 0.0, "device"
                blocked = False
                for terms, delay in inputs(d, op):
                    if any(k not in ends for k, _ in terms):
                        blocked = True
                        break
                    t0, k0 = max((ends[k][0] + lag, k) for k, lag in terms)
                    t, w = arrival(ends[k0][1], d, t0, k0, delay)
                    if t >= ready:
                        ready, windows, bound = t, w, k0
                if blocked:
                    break
                pre, post = gap(d, idx[d], op) if gap else (times.host_ns[d] if times.host_ns else 0.0, 0.0)
                lane = lanes.get(op) if lanes else None
                cur, after_bound = free[d], "device"
                if lane is not None:  # (its lane's previous end, and what it came after on the other lanes)
                    cur = lane_free.get((d, lane[0]), first_free[d])
                    for k in lane[1]:
                        if ends[k][0] > cur:
                            cur, after_bound = ends[k][0], ("after", k[1], k[2])
                f = cur + pre
                if post:
                    windows = [*windows, (ready, ready + post, "host")]
                    ready += post
                join = None
                if groups and op in groups:
                    gid, members = groups[op]
                    here = joined.setdefault(gid, {})
                    here.setdefault(d, max(f, ready))
                    if len(here) < members:
                        break
                    join = max(here.values())
                if pre:
                    # Host work (Python, launching) happens before the device can post and wait for its input.
                    rec.busy(d, cur, f, "host")
                device_free = free[d]
                free[d] = f
                free[d], start, windows = policy.before_start(rec, d, idx[d], op, free=free[d],
                                                              start=max(free[d], ready), ready=ready, windows=windows)
                if join is not None and join > start:
                    last = max(here, key=lambda m: here[m])  # the member that joined last
                    start, bound = join, ("group", groups[op][0], last)
                elif ready <= free[d]:
                    bound = after_bound
                rec.wait(d, free[d], start, windows)
                t = policy.before_work(rec, d, idx[d], op, start)
                if action == "F":
                    end = t + dur("F", vs, mb)
                    rec.busy(d, t, end, "forward")
                    rows.append((d, vs, mb, "forward", t, end))
                    ends[product(op)] = (end, d)
                    end = policy.after_work(rec, d, idx[d], op, end)
                    rec.note_held(end, d, 1.0 / v)
                    if planned and costs.send_ns and vs != nv - 1 and dev[vs + 1] != d:
                        rec.busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                elif action == "W":
                    end = t + dur("W", vs, mb)
                    rec.busy(d, t, end, "backward_weight")
                    rows.append((d, vs, mb, "backward_weight", t, end))
                    ends[product(op)] = (end, d)
                    end = policy.after_work(rec, d, idx[d], op, end)
                    rec.note_held(end, d, -1.0 / v)
                    free[d] = end
                elif action in OTHER_PHASES:  # a measured step's optimizer, collective or other work
                    end = t + dur(action, vs, mb)
                    rec.busy(d, t, end, OTHER_PHASES[action])
                    rows.append((d, vs, mb, OTHER_PHASES[action], t, end))
                    ends[product(op)] = (end, d)
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
                    ends[product(op)] = (end, d)
                    end = policy.after_work(rec, d, idx[d], op, end)
                    if action == "B":
                        rec.note_held(end, d, -1.0 / v)
                    if planned and costs.send_ns and vs != 0 and dev[vs - 1] != d:
                        rec.busy(d, end, end + costs.send_ns, "p2p")
                        end += costs.send_ns
                    free[d] = end
                if lane is not None:
                    lane_free[(d, lane[0])] = free[d]
                    free[d] = max(device_free, free[d])
                if trace is not None:
                    trace.ops[(d, idx[d])] = (op, f, ready, start, rows[-1][5], bound)
                idx[d] += 1
                done += 1
                progressed = True
        if not progressed:
            if not planned:
                stuck = [(d, orders[d][idx[d]]) for d in range(p) if idx[d] < len(orders[d])]
                raise ConfigError(f"the measured step's dependencies form a cycle ({len(stuck)} devices wait on each "
                                  f"other, e.g. device {stuck[0][0]} at {stuck[0][1]})",
                                  fix="report it: the messages were paired with operations that contradict them")
            raise ConfigError(
                f"the {schedule} schedule deadlocks with pp={pp}, micro-batches={num_microbatches}, virtual stages={v}",
                fix="use a micro-batch count the schedule supports (interleaving wants a multiple of pp)",
            )
    return rows, free
