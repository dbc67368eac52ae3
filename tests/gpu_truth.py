"""Expected GPU shares of a Kineto trace, derived from the raw JSON alone: kept apart from traceana's code on
purpose (it imports nothing of traceana, and spells its own rules), so that a test comparing traceana's shares to
these compares two independent readings of the same file (issue 26, item 5).

How it reads a trace (plain Python over the JSON events, by correlation id):
- steps: the CPU's ``ProfilerStep#N`` complete events (none: the whole trace, from its first complete event to
  the last one's end, as step -1);
- GPU work: complete events of category ``kernel``, ``gpu_memcpy``, ``gpu_memset``;
- each GPU event's launch: the ``cuda_runtime`` / ``cuda_driver`` (or ``hip_runtime``) event with the same
  ``args.correlation``: its start time and thread;
- communication work: a kernel whose name says NCCL/RCCL or all-to-all / send-receive, or any GPU work whose
  launch lies inside a communication call on the same thread (a cpu_op or annotation named ``c10d::…``,
  ``nccl:…`` or ``record_param_comms``); everything else is compute (copies and memsets included: the GPU is busy);
- shares of a step (its CPU span): ``compute`` = the union of compute work inside the step over the step;
  ``communication_exposed`` = the union of communication work not covered by compute, over the step;
  ``optimizer`` = the union of compute work launched inside an ``Optimizer.step#…`` annotation; ``idle`` = the rest
  of the step that no GPU work covers;
- streams: per stream, the union of its work in the step.

Run as a script to print a trace's figures: ``python tests/gpu_truth.py TRACE.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from decimal import Decimal
from collections import defaultdict
from pathlib import Path

COMM_KERNEL = re.compile(r"nccl|rccl|all_?to_?all|send_?recv", re.IGNORECASE)
COMM_CALL = re.compile(r"^(?:c10d::|nccl:|record_param_comms$)")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "hip_runtime", "runtime")


def load(path: str | Path) -> list[dict]:
    path = Path(path)
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    # Timestamps are µs with up to 3 decimals (ns resolution) on a ~1.7e15 µs clock: more digits than a float holds,
    # so they are read exactly and kept as integer nanoseconds.
    data = json.loads(raw, parse_float=Decimal)
    events = data["traceEvents"] if isinstance(data, dict) else data
    for e in events:
        for k in ("ts", "dur"):
            if k in e:
                e[k] = int(Decimal(e[k]) * 1000)
    return events


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def clip(intervals, lo: float, hi: float):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def minus(a, b):
    """The parts of union(a) not covered by union(b)."""
    out, b = [], union(b)
    for s, e in union(a):
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def inside(t: float, spans: list[tuple[float, float]]) -> bool:
    return any(s <= t < e for s, e in spans)


def shares(path: str | Path) -> dict[int, dict]:
    """Per ProfilerStep number: its duration (``dur_ns``) and the shares above, plus per-stream busy ns."""
    events = [e for e in load(path) if e.get("ph") == "X"]
    steps = {}
    for e in events:
        m = re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", "")))
        if m and e.get("cat") not in ("gpu_user_annotation",):
            steps[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    if not steps:  # no ProfilerStep: the whole trace is one step, numbered -1 (from its first event to its last end)
        steps[-1] = (min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events))
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and (e.get("args") or {}).get("correlation"):
            launches.setdefault(e["args"]["correlation"], (e["ts"], e.get("pid"), e.get("tid")))
    comm_calls, optimizer = defaultdict(list), []
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and COMM_CALL.match(str(e.get("name", ""))):
            comm_calls[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("Optimizer.step#"):
            optimizer.append((e["ts"], e["ts"] + e["dur"]))
    work = []  # (start, end, stream, is_comm, in_optimizer)
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        args = e.get("args") or {}
        launch = launches.get(args.get("correlation"))
        comm = e["cat"] == "kernel" and bool(COMM_KERNEL.search(e["name"]))
        if launch is not None and not comm:
            comm = inside(launch[0], comm_calls.get((launch[1], launch[2]), []))
        opt = launch is not None and inside(launch[0], optimizer)
        work.append((e["ts"], e["ts"] + e["dur"], args.get("stream"), comm, opt))
    out = {}
    for n, (lo, hi) in sorted(steps.items()):
        dur = hi - lo
        compute = clip([(s, e) for s, e, _, c, _ in work if not c], lo, hi)
        comm = clip([(s, e) for s, e, _, c, _ in work if c], lo, hi)
        opt = clip([(s, e) for s, e, _, c, o in work if o and not c], lo, hi)
        busy = compute + comm
        streams = defaultdict(list)
        for s, e, st, _, _ in work:
            streams[st].extend(clip([(s, e)], lo, hi))
        out[n] = {
            "dur_ns": dur,
            "compute": length(compute) / dur,
            "optimizer": length(opt) / dur,
            "communication_exposed": length(minus(comm, compute)) / dur,
            "idle": 1 - length(busy) / dur,
            "streams_ns": {st: length(iv) for st, iv in streams.items() if iv},
        }
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        for n, s in shares(p).items():
            print(p, n, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()})
