"""The independent wall-clock truth of a torch.distributed.pipelining run (collectors.pipelining_example --truth):
per rank, the share of each profiled step spent in compute calls and in blocking P2P waits, from
``time.perf_counter_ns()`` spans recorded outside the profiler. Nothing here reads a trace or calls traceana.
"""

from __future__ import annotations

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
        lo, hi = doc["steps"][step]
        compute = _union([(s, e) for k, s, e in doc["spans"] if k == "compute"], lo, hi)
        blocked = _union([(s, e) for k, s, e in doc["spans"] if k == "blocked"], lo, hi)
        total["compute"] += _length(compute) - _overlap(compute, blocked)
        total["blocked"] += _length(blocked)
        total["step"] += hi - lo
    return {"compute": total["compute"] / total["step"], "blocked": total["blocked"] / total["step"]}
