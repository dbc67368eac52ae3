"""The independent wall-clock truth of a torch.distributed.pipelining run (collectors.pipelining_example --truth):
per rank, the share of each profiled step spent in compute calls and in blocking P2P waits, from
``time.perf_counter_ns()`` spans recorded outside the profiler; and, for the reference trainer's known workload
(``collect --work sleep``), what its side files say a replay cannot know. Nothing here reads a trace or calls
traceana.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path


def _union(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The union of ``spans`` clipped to [lo, hi], as disjoint sorted intervals."""
    out: list[tuple[int, int]] = []
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in spans)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def shares(truth_dir: Path, rank: int, steps: list[int]) -> dict[str, float]:
    """``{"compute": …, "blocked": …}``: fractions of iterations ``steps`` together (0 = the first loop iteration).
    Time in a P2P call is blocked even inside a compute action; the rest of a compute action or call is compute."""
    doc = json.loads((Path(truth_dir) / f"rank{rank}.json").read_text())
    total = {"compute": 0, "blocked": 0, "step": 0}
    for step in steps:
        lo, hi, *_ = doc["steps"][step]
        compute = _union([(s, e) for k, s, e, *_ in doc["spans"] if k == "compute"], lo, hi)
        blocked = _union([(s, e) for k, s, e, *_ in doc["spans"] if k == "blocked"], lo, hi)
        total["compute"] += _length(compute) - _overlap(compute, blocked)
        total["blocked"] += _length(blocked)
        total["step"] += hi - lo
    return {"compute": total["compute"] / total["step"], "blocked": total["blocked"] / total["step"]}


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``a`` without ``b`` (both disjoint and sorted)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > s:
                out.append((s, b[k][0]))
            s = max(s, b[k][1])
            k += 1
        if s < e:
            out.append((s, e))
    return out


def _covered(spans: list[tuple[int, int]], by: list[tuple[int, int]]) -> int:
    """How much of ``spans`` lies inside ``by`` (disjoint, sorted)."""
    starts = [s for s, _ in by]
    total = 0
    for s, e in spans:
        i = max(bisect.bisect_right(starts, s) - 1, 0)
        while i < len(by) and by[i][0] < e:
            total += max(0, min(e, by[i][1]) - max(s, by[i][0]))
            i += 1
    return total


def descheduled_disagreement(truth_dir: Path, rank: int, steps: list[int], trace_steps: list[tuple[int, int]],
                             measured: dict[str, list[tuple[int, int]]]) -> dict[str, float]:
    """For ``compute`` and ``blocked``: the share of ``steps`` where ``measured`` (intervals of each on the trace's
    clock, e.g. a tool's compute and blocked time) disagrees with the truth *while the thread was descheduled*.

    A thread that is runnable but waiting for a CPU records nothing in a trace, so a trace cannot say whether that
    time was a P2P call's, a compute call's or the Python between them; a timer around the call can. Each piece of
    the truth (a P2P call; a compute span without the P2P calls inside it; the step's time outside every span) holds
    the run delay measured inside it, and disagreement there is put down to descheduling up to that delay. On an idle
    machine the delays are ~0 and so is this. ``trace_steps``: the same steps' (start, end) on the trace's clock,
    which align the two clocks."""
    doc = json.loads((Path(truth_dir) / f"rank{rank}.json").read_text())
    offsets = sorted(t - doc["steps"][k][i] for k, bounds in zip(steps, trace_steps) for i, t in enumerate(bounds))
    offset = offsets[len(offsets) // 2]
    mine = {kind: _union([(s - offset, e - offset) for s, e in spans], -(2**62), 2**62)
            for kind, spans in measured.items()}
    explained = {"compute": 0, "blocked": 0}
    step_total = 0
    for step in steps:
        lo, hi, step_delay, *_ = doc["steps"][step]
        step_total += hi - lo
        spans = sorted(((k, max(s, lo), min(e, hi), d) for k, s, e, d in doc["spans"] if s < hi and e > lo),
                       key=lambda x: (x[1], -x[2]))
        blocked = _union([(s, e) for k, s, e, _ in spans if k == "blocked"], lo, hi)
        # pieces: (what the truth says it is, its intervals, the run delay inside)
        pieces, top, reach = [], [], lo
        for k, s, e, d in spans:
            if s >= reach:  # not inside an earlier span: a top-level one
                top.append((k, s, e, d))
                reach = e
            else:
                reach = max(reach, e)
        for k, s, e, d in top:
            if k == "blocked":
                pieces.append(("blocked", [(s, e)], d))
            else:
                inner = [x for x in spans if x[0] == "blocked" and s <= x[1] and x[2] <= e]
                pieces.append(("compute", _minus([(s, e)], blocked), d - sum(x[3] for x in inner)))
                pieces.extend(("blocked", [(x[1], x[2])], x[3]) for x in inner)
        outside = _minus([(lo, hi)], _union([(s, e) for _, s, e, _ in top], lo, hi))
        pieces.append((None, outside, step_delay - sum(d for *_, d in top)))
        for truth_says, intervals, delay in pieces:
            length = _length(intervals)
            for kind in explained:
                inside = _covered(intervals, mine.get(kind, []))
                wrong = length - inside if truth_says == kind else inside
                explained[kind] += min(max(delay, 0), wrong)
    return {kind: v / step_total for kind, v in explained.items()}


def unaccounted_ns(truth_dir: Path, rank: int, step: int) -> int:
    """What a replay fed with the step's own compute durations and transfers cannot know, on one rank: the time of
    iteration ``step`` inside neither a compute call nor a P2P call (the Python between calls, the rank waiting for a
    CPU there), the run delay inside its P2P calls (a wait that returned late because the rank was descheduled,
    not because its peer was late), and the run delay of the rank's other threads in the step: gloo moves a
    message's bytes on its socket threads, so a receive returns late when the sender's or the receiver's socket
    thread waited for a CPU, though both training threads ran (seen on CI: a 5.6 ms wait for a message posted
    before the receive, with 0.04 ms of the receiver's own delay)."""
    doc = json.loads((Path(truth_dir) / f"rank{rank}.json").read_text())
    lo, hi, _, others = doc["steps"][step]
    inside = [(k, s, e, d) for k, s, e, d in doc["spans"] if s < hi and e > lo]
    covered = _union([(s, e) for _, s, e, _ in inside], lo, hi)
    late = sum(max(d, 0) for k, _, _, d in inside if k == "blocked")
    return (hi - lo) - _length(covered) + late + max(others, 0)


def waited_between_holds_ms(run_dir: Path) -> float:
    """What a replay of a known-workload run of the reference trainer (``collect --work sleep``) fed with its own
    pass durations cannot know: the most, in one profiled step, that the ranks' training threads waited for a CPU
    outside their held passes, all ranks together, in ms. From the side files the trainer writes outside the
    profiler (``RUN/<run.json workload.spans>/rank{R}.json``, docs/known-workload.md): a step's run-queue delay
    (schedstat) less its holds'. The holds' own delay is inside the passes' measured durations, which the replay
    has; this one lands in the P2P waits, the optimizer and the Python between passes, where the replay puts their
    typical (median) time — each instant of it on the step's path at most once, so it bounds the replay's error
    either way. A few ms on a quiet machine; a loaded one widens it by what it took."""
    manifest = json.loads((Path(run_dir) / "run.json").read_text())
    folder = Path(run_dir) / manifest["workload"]["spans"]
    active = manifest["profiler"]["active"]
    waited: dict[int, int] = {}
    for f in sorted(folder.glob("rank*.json")):
        doc = json.loads(f.read_text())
        at = {name: i for i, name in enumerate(doc["span_fields"])}
        held: dict[int, int] = {}
        for s in doc["spans"]:
            held[s[at["step"]]] = held.get(s[at["step"]], 0) + s[at["run_delay_ns"]]
        fields = {name: i for i, name in enumerate(doc["step_fields"])}
        for st in doc["steps"][-active:]:
            step = st[fields["step"]]
            waited[step] = waited.get(step, 0) + max(0, st[fields["run_delay_ns"]] - held.get(step, 0))
    return max(waited.values(), default=0) / 1e6
