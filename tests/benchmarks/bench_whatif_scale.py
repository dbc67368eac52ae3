"""The what-if at scale: a synthetic measured step of pp × dp ranks (default pp=8 × dp=128 = 1,024 ranks, 1F1B,
m=32) as traceana.causal.graph's frames, replayed on the scheduler's engine, its critical path, and the summary's
what-if (everything ideal, the 8 candidate ranks and replicas and every stage made ideal). Prints wall time and peak
memory of each part; the what-if both batched (replay.replay_variants) and, as the baseline measured in the same run,
with one engine replay per variant (as before it), each in a child process (its own peak RSS), with their ratios and
whether their results are identical. Asserts nothing (benchmarks are not tests).

    .venv/bin/python tests/benchmarks/bench_whatif_scale.py
    .venv/bin/python tests/benchmarks/bench_whatif_scale.py --pp 4 --dp 8 --microbatches 8

The graph: every rank runs the rules' 1F1B order (pipeline_rules.device_order) with forward 1 ms and backward 2 ms
(± 5 %, seeded), 50 µs of host before each operation, one slowed rank (stage 0 of replica 1: forwards 2×), a
message per activation and gradient (100 µs in flight, the receive posted after the receiver's previous
operation), then a gradient all-reduce per stage across its replicas (all join) and the optimizer.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from traceana.causal import critical_path, graph, replay  # noqa: E402
from traceana.causal.whatif import whatif  # noqa: E402
from traceana.core.pipeline_rules import device_order  # noqa: E402

MS = 1_000_000


def synthetic(pp: int, dp: int, m: int, seed: int = 0) -> graph.StepGraph:
    rng = random.Random(seed)
    ops, edges = [], []
    seq_of: dict[tuple[int, str, int], int] = {}
    for s in range(pp):
        order = device_order("1f1b", pp=pp, num_microbatches=m, device=s)
        for k in range(dp):
            rank = s * dp + k
            slow = 2.0 if (s, k) == (0, 1) else 1.0
            for q, op in enumerate(order):
                base = (1.0 * slow if op.action == "F" else 2.0) * MS
                ops.append((rank, 0, q, op.action, "forward" if op.action == "F" else "backward", s, op.microbatch,
                            0, 0, round(base * rng.uniform(0.95, 1.05)), 50_000, None, None, "synthetic", False))
                seq_of[(rank, op.action, op.microbatch)] = q
            n = len(order)
            ops.append((rank, 0, n, "C", "collective", s, None, 0, 0, 500_000, 50_000, f"ar{s}", dp, "synthetic",
                        False))
            ops.append((rank, 0, n + 1, "O", "optimizer", s, None, 0, 0, 1 * MS, 50_000, None, None, "synthetic",
                        False))
    for s in range(pp - 1):
        for k in range(dp):
            a, b = s * dp + k, (s + 1) * dp + k
            for mb in range(m):
                for src, dst, act in ((a, b, "F"), (b, a, "B")):
                    c = seq_of[(dst, act, mb)]
                    edges.append((0, "p2p", src, seq_of[(src, act, mb)], dst, c, c - 1 if c else None, 0, 0,
                                  100_000))
    o = pl.DataFrame(ops, schema=graph.OPS, orient="row")
    e = pl.DataFrame(edges, schema=graph.EDGES, orient="row")
    ranks = pl.DataFrame([(s * dp + k, 0, 0, 0, 0, s, k) for s in range(pp) for k in range(dp)],
                         schema=graph.RANK_STEPS, orient="row")
    return graph.StepGraph(ops=o, edges=e, ranks=ranks, steps=(0,))


def with_windows(g: graph.StepGraph) -> graph.StepGraph:
    """The "measured" step windows: where the replay ends each rank (a measured graph has them from the trace)."""
    ends = replay.replay(g, 0).ranks.select("rank", pl.col("end_ns").alias("_e"))
    ranks = g.ranks.join(ends, on="rank").with_columns(pl.col("_e").alias("end_ns")).drop("_e")
    return graph.StepGraph(ops=g.ops, edges=g.edges, ranks=ranks, steps=(0,))


def _engine_per_variant(g, ops, edges, variants, **_):
    """The baseline: every variant on the engine itself, one replay each (what the what-if did before
    replay.replay_variants)."""
    from traceana.causal.whatif import materialize

    return [replay.replay_steps_ns(g, ops=o, edges=e) for o, e in (materialize(ops, edges, v) for v in variants)]


PARTS = ("batched", "baseline", "full")


def part(args) -> None:
    """One what-if in this process (started by main as a child, so that its peak RSS is its own): prints a JSON line."""
    import json

    import traceana.causal.whatif as wi

    g = with_windows(synthetic(args.pp, args.dp, args.microbatches))
    run = SimpleNamespace(run=SimpleNamespace(path="synthetic"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.part == "baseline":
        wi.replay_variants = _engine_per_variant
    t, cpu = time.perf_counter(), time.process_time()
    w = whatif(run, graph=g, full=args.part == "full", candidates=None if args.part == "full" else 8)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "graph_mib": before,
                      "diagnosis": w.summary["diagnosis"], "groups": w.groups.height, "rows": w.groups.rows()}))


def _child(args, name: str) -> dict:
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--pp", str(args.pp), "--dp", str(args.dp), "--microbatches",
                          str(args.microbatches), "--part", name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the baseline (one engine replay per variant: ~2 min at the default size)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        return part(args)

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t = time.perf_counter()
    g = synthetic(args.pp, args.dp, args.microbatches)
    t_build = time.perf_counter() - t
    print(f"graph: {args.pp * args.dp:,} ranks, {g.ops.height:,} operations, {g.edges.height:,} messages, built in "
          f"{t_build:.2f} s; peak RSS {peak_mib():,.0f} MiB")
    t = time.perf_counter()
    r = replay.replay(g, 0)
    t_replay = time.perf_counter() - t
    g = with_windows(g)
    print(f"replay: step {r.step_ns / MS:,.1f} ms in {t_replay:.2f} s wall; peak RSS {peak_mib():,.0f} MiB")
    t = time.perf_counter()
    path, slack = critical_path.critical_path(g, r)
    print(f"critical path: {path.height} pieces, {path['ms'].sum():,.1f} ms, in {time.perf_counter() - t:.2f} s; "
          f"peak RSS {peak_mib():,.0f} MiB")
    print("what-ifs, each in a child process (peak RSS: the child's, its graph built before the what-if included):")
    label = f"summary's what-if (everything ideal, 8 ranks, 8 replicas, {args.pp} stages made ideal)"
    b = _child(args, "batched")
    print(f"{label}, batched: {b['wall_s']:.1f} s wall ({b['cpu_s']:.1f} s CPU), peak RSS {b['peak_mib']:,.0f} MiB "
          f"({b['graph_mib']:,.0f} before it)")
    print(f"  diagnosis: {b['diagnosis']}")
    if not args.no_baseline:
        e = _child(args, "baseline")
        print(f"{label}, baseline (one engine replay per variant): {e['wall_s']:.1f} s wall ({e['cpu_s']:.1f} s "
              f"CPU), peak RSS {e['peak_mib']:,.0f} MiB ({e['graph_mib']:,.0f} before it)")
        print(f"  batched / baseline: wall {b['wall_s'] / e['wall_s']:.3f} (×{e['wall_s'] / b['wall_s']:.0f} faster), "
              f"CPU {b['cpu_s'] / e['cpu_s']:.3f}, peak RSS {b['peak_mib'] / e['peak_mib']:.2f}; results identical: "
              f"{b['rows'] == e['rows'] and b['diagnosis'] == e['diagnosis']}")
    f = _child(args, "full")
    n = f["groups"]
    print(f"traceana whatif's what-if (every rank, replica, stage and kind made ideal, and kept as measured: {n:,} "
          f"groups, {2 * n + 1:,} replays), batched: {f['wall_s']:.1f} s wall ({f['cpu_s']:.1f} s CPU), peak RSS "
          f"{f['peak_mib']:,.0f} MiB (no baseline: that is {2 * n + 1:,} engine replays)")


if __name__ == "__main__":
    main()
