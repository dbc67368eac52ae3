"""Hand-made ``Analysis`` objects in the declared schemas, for report tests that must not wait on a real run.

A tiny 1F1B simulator (plain Python, fine for a fixture) lays out forward/backward spans per stage; attribution,
steps, P2P pairs and memory follow from it, so every table is consistent with the others the way analyze() makes them.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from traceana.core import schema
from traceana.core.manifest import Manifest, ModelShape
from traceana.ingest import Run
from traceana.measure.analysis import Analysis

MS = 1_000_000  # ns
T0 = 1_700_000_000_000_000_000  # an absolute wall clock in ns


def _one_f_one_b(pp: int, nmb: int, f_ns: int, b_ns: int, hop_ns: int) -> list[tuple[int, int, str, int, int]]:
    """(stage, microbatch, phase, start, end) of a synchronous 1F1B, relative to the step start."""
    order: list[list[tuple[str, int]]] = []
    for s in range(pp):
        warm = min(pp - 1 - s, nmb)
        ops = [("forward", m) for m in range(warm)]
        f, b = warm, 0
        while f < nmb:
            ops += [("forward", f), ("backward", b)]
            f, b = f + 1, b + 1
        ops += [("backward", m) for m in range(b, nmb)]
        order.append(ops)
    done: dict[tuple[int, str, int], int] = {}
    clock = [0] * pp
    idx = [0] * pp
    spans = []
    while any(idx[s] < len(order[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if idx[s] >= len(order[s]):
                continue
            phase, m = order[s][idx[s]]
            dep = (s - 1, "forward", m) if phase == "forward" else (s + 1, "backward", m)
            if phase == "backward" and s == pp - 1:
                dep = (s, "forward", m)
            if phase == "forward" and s == 0:
                ready = 0
            elif dep in done:
                ready = done[dep] + (hop_ns if dep[0] != s else 0)
            else:
                continue
            start = max(clock[s], ready)
            end = start + (f_ns if phase == "forward" else b_ns)
            spans.append((s, m, phase, start, end))
            done[(s, phase, m)] = end
            clock[s] = end
            idx[s] += 1
            progressed = True
        assert progressed
    return spans


def make_analysis(
    *,
    pp: int = 4,
    nmb: int = 4,
    steps: int = 2,
    bpipe: bool = False,
    path: str | Path = "/runs/fixture",
    event_name: str = "aten::mm",
    notes: tuple[str, ...] = ("stage of each rank inferred from the P2P chain",),
    with_manifest: bool = True,
) -> Analysis:
    f_ns, b_ns, hop = 3 * MS, 6 * MS, MS // 2
    spans = _one_f_one_b(pp, nmb, f_ns, b_ns, hop)
    step_len = max(e for *_, e in spans) + 2 * MS  # optimizer at the end
    sched, attr, step_rows, mem_rows, stage_mem, p2p_rows = [], [], [], [], [], []
    for step in range(steps):
        base = T0 + step * (step_len + MS)
        for r in range(pp):
            mine = sorted((st, en, ph, m) for s, m, ph, st, en in spans if s == r)
            for st, en, ph, m in mine:
                sched.append((r, step, r, m, ph, base + st, base + en, "annotated"))
            last = max(en for _, en, _, _ in mine)
            sched.append((r, step, r, None, "optimizer", base + last, base + last + MS, "annotated"))
            step_rows.append((r, step, base, base + step_len, step_len))
            first_f = min(st for st, _, _, _ in mine)
            busy = {"forward": nmb * f_ns, "backward": nmb * b_ns, "optimizer": MS}
            warm = first_f
            cool = step_len - last - MS
            # the rest of the gaps: mostly stalls, a bit of exposed P2P and (with BPipe) transfers
            rest = step_len - sum(busy.values()) - warm - cool
            p2p_ns = min(rest, nmb * hop // 4)
            bp_ns = min(rest - p2p_ns, MS) if bpipe and r in (0, pp - 1) else 0
            stall = rest - p2p_ns - bp_ns
            cats = {**busy, "p2p": p2p_ns, "bpipe": bp_ns, "bubble_warmup": warm, "bubble_cooldown": cool,
                    "bubble_stall": stall}
            for c, ns in cats.items():
                attr.append((r, step, r, c, ns, ns / step_len))
            act = 40 * 2**20 * (pp - r if not bpipe else (pp + 1) / 2)
            peak = int(100 * 2**20 + act)
            stage_mem.append((r, r, step, 100 * 2**20, peak, peak - 100 * 2**20))
            for t in range(0, step_len, MS):
                frac = 1 - abs(2 * t / step_len - 1)
                mem_rows.append((r, base + t, -1, int(100 * 2**20 + act * frac), 0, None))  # a curve, no blocks
        for s, m, ph, _start, en in spans:
            dst = s + 1 if ph == "forward" else s - 1
            if 0 <= dst < pp:
                ready = base + en
                p2p_rows.append((s, dst, 0, m, step, "p2p", 4096, ready, ready - MS, ready, ready + hop))
        if bpipe:
            for m in range(nmb):
                t = base + spans[0][4] + m * MS
                p2p_rows.append((0, pp - 1, 7, m, step, "bpipe", 1 << 20, t, t, t, t + MS // 2))

    schedule_df = pl.DataFrame(sched, schema=list(schema.SCHEDULE), orient="row").pipe(schema.conform, schema.SCHEDULE)
    attribution = pl.DataFrame(attr, schema=list(schema.ATTRIBUTION), orient="row").pipe(
        schema.conform, schema.ATTRIBUTION
    )
    steps_df = pl.DataFrame(step_rows, schema=list(schema.STEPS), orient="row").pipe(schema.conform, schema.STEPS)
    memory = pl.DataFrame(mem_rows, schema=list(schema.MEMORY), orient="row").pipe(schema.conform, schema.MEMORY)
    stage_memory = pl.DataFrame(stage_mem, schema=list(schema.STAGE_MEMORY), orient="row").pipe(
        schema.conform, schema.STAGE_MEMORY
    )
    p2p = (
        pl.DataFrame(
            p2p_rows,
            schema=["src", "dst", "tag", "seq", "step", "channel", "nbytes", "send_start_ns", "recv_post_ns",
                    "data_ready_ns", "recv_end_ns"],
            orient="row",
        )
        .with_columns(
            wait_ns=pl.col("data_ready_ns") - pl.col("recv_post_ns"), transfer_ns=pl.col("recv_end_ns") - pl.col("data_ready_ns")
        )
        .pipe(schema.conform, schema.P2P)
    )
    traces = pl.DataFrame(
        {"rank": list(range(pp)), "path": [f"{path}/rank{r}.pt.trace.json.gz" for r in range(pp)],
         "world_size": [pp] * pp, "stage": list(range(pp))}
    ).pipe(schema.conform, schema.TRACES)
    events = pl.DataFrame(
        {"rank": [0], "name": [event_name], "cat": ["cpu_op"], "ts_ns": [T0], "dur_ns": [MS]}
    ).pipe(schema.conform, schema.EVENTS)
    manifest = None
    if with_manifest:
        manifest = Manifest(
            world_size=pp, pp=pp, stage_of_rank=tuple(range(pp)), schedule="1f1b", microbatch_size=2,
            num_microbatches=nmb, model=ModelShape(family="gpt", layers=8, hidden=64, heads=4, vocab=128, seq=32,
                                                   name="tiny-gpt"),
            dtype="float32", attention="sdpa", recompute="none", bpipe=((0, pp - 1),) if bpipe else None,
            device="cpu", torch_version="2.13.0",
        )
    run = Run(path=Path(path), events=events, memory=memory, traces=traces, manifest=manifest)
    stages = (
        steps_df.group_by("rank").agg(step_ms=pl.col("dur_ns").mean() / MS).with_columns(stage=pl.col("rank"))
        .sort("rank")
    )
    offsets = pl.DataFrame({"rank": list(range(pp)), "offset_ns": [0] * pp, "source": ["same_host"] * pp})
    return Analysis(
        run=run, steps=steps_df, p2p=p2p, schedule=schedule_df, attribution=attribution, stage_memory=stage_memory,
        stages=stages, clock_offsets=offsets, notes=notes,
    )
