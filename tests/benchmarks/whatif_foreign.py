"""Slowed foreign runs (issue 32, Show): megatron-core, DeepSpeed and torch.distributed.pipelining pipelines with one
stage slowed inside the job's own module, each beside an unslowed twin collected interleaved with it, profiled with
torch.profiler's defaults (no stack, no shapes) and with stack and shapes; then ``traceana whatif`` on each.

    python tests/benchmarks/whatif_foreign.py OUT [--python VENV_PYTHON] [--frameworks megatron,deepspeed,pipelining]
        [--modes defaults,stack] [--kinds sleep,compute] [--slow-stage 1] [--slow-ms 20] [--repeats 2] [--analyze-only]
        [--dp 2 [--slow-rank 1]]

Runs (2 stages, 4 micro-batches, 1 warm-up and 2 profiled steps each), per framework and profile mode, interleaved:
slowed (each kind), twin, slowed, twin, … (``--repeats`` of each). megatron-core and DeepSpeed run their generators
``tests/data/{megatron,deepspeed}_pipe/make_trace.py`` (``--slow-stage/--slow-ms/--slow-kind``, ``--defaults``) with
``--python`` (a venv holding megatron-core 0.16.1 and deepspeed 0.19.8); torch.distributed.pipelining runs
``collectors.pipelining_example``'s ranks (Schedule1F1B on 2 ranks, tiny-gpt, micro-batch size 1) with stage S's
``Part.forward`` slowed the same way (``--pipelining-child``, below).

Per run: ``traceana whatif RUN --json --set 'stage=S:peers'`` (ours: the stage at the other stages' speed, what names
it) and, for the study's ideal beside it, the same JSON's ``by_stage[S].if_ideal_step_ms`` (the stage at the mean of
its kind across stages, its own slow forwards included: not expected to reach the twin); and the zeroed replay
(``--set forward=0 --set backward=0 --set p2p=0 --set host=0 --set collective=0 --set optimizer=0``) over the measured
step. The table: framework, profile mode, slowdown, the groups named (stage/rank/replica ``named``), the what-if
(median over the slowed runs, and their range), the twins' measured step (median, range), whether every slowed run's
what-if lies within the twins' noise (their range widened by traceana's noise on each side, ``noise_ms``: the spread
over a run's steps, at least 5 % of its step), and the largest zeroed replay share. ``OUT/results.json`` keeps every
run's figures.

``--dp 2``: pp 2 × dp 2 (4 processes; rank = stage · dp + replica) with rank ``--slow-rank`` alone slowed instead of a
stage: megatron-core and DeepSpeed through the same generators' ``--dp/--slow-rank``, torch.distributed.pipelining in
``_pipelining_dp_rank`` below (per-replica ``PipelineStage`` groups, the gradients all-reduced over each stage's
replicas in the script); the what-if is ``rank=R:peers`` (rank R at its peers' speed: the same stage in the other
replica), the study's ideal ``by_rank[R]``, the runs ``FW-dp2-PROFILE-KIND-I``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZEROED = ["forward=0", "backward=0", "p2p=0", "host=0", "collective=0", "optimizer=0"]
GENERATORS = {"megatron": ROOT / "tests/data/megatron_pipe/make_trace.py",
              "deepspeed": ROOT / "tests/data/deepspeed_pipe/make_trace.py"}
MICROBATCHES = 4


# -- torch.distributed.pipelining, in the child: collectors.pipelining_example's ranks with a slowed Part.forward --

def slow_down(ms: float, kind: str) -> None:
    """Spend ``ms`` more: asleep (``sleep``) or running torch matmuls on this CPU (``compute``)."""
    import torch

    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    a = torch.full((96, 96), 0.01)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _pipelining_rank(rank: int, world: int, init: str, out: str, defaults: bool, slow) -> None:
    import functools

    import collectors.pipelining_example as ex
    from collectors.profiler import PipelineProfiler

    if slow is not None and slow[0] in ex.stages_of_ranks("1f1b", world)[rank]:
        forward = ex.Part.forward

        def slowed(self, x):
            slow_down(slow[1], slow[2])
            return forward(self, x)
        ex.Part.forward = slowed
    ex.PipelineProfiler = functools.partial(PipelineProfiler, record_shapes=not defaults, with_stack=not defaults,
                                            profile_memory=not defaults)  # torch.profiler's defaults: none of them
    ex.run_rank(rank, world, init, "1f1b", Path(out), "tiny-gpt", MICROBATCHES, 1, 2)


def _pipelining_dp_rank(rank: int, world: int, init: str, out: str, defaults: bool, slow, dp: int) -> None:
    """pp 2 × dp ``dp`` as a user writes it with torch.distributed.pipelining: rank = stage · dp + replica; each
    replica's two stages talk over their own process group (``PipelineStage(group=…)``), and after each schedule step
    the gradients of each stage are all-reduced over its replicas (one flat bucket, as DDP) before the optimizer.
    ``slow``: (rank, ms, kind): that rank's ``Part.forward`` spends ms more in each forward."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    import collectors.pipelining_example as ex
    from collectors.pipelining import annotate
    from collectors.profiler import PipelineProfiler
    from collectors.trainer import data
    from collectors.trainer.config import PRESETS
    from collectors.trainer.model import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pp = world // dp
    stage, replica = divmod(rank, dp)
    pipes = [dist.new_group([s * dp + r for s in range(pp)]) for r in range(dp)]  # every rank makes every group
    replicas = [dist.new_group([s * dp + r for r in range(dp)]) for s in range(pp)]
    shape = PRESETS["tiny-gpt"]
    torch.manual_seed(1234)
    part = ex.Part(GPT(shape), stage=stage, stages=pp)
    if slow is not None and slow[0] == rank:
        forward = part.forward

        def slowed(x):
            slow_down(slow[1], slow[2])
            return forward(x)
        part.forward = slowed
    st = pipelining.PipelineStage(part, stage, pp, torch.device("cpu"), group=pipes[replica])
    params = list(part.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    schedule = pipelining.schedules.Schedule1F1B(st, n_microbatches=MICROBATCHES, loss_fn=ex.loss_fn)
    annotate(schedule)
    steps = 3  # 1 warm-up, 2 profiled
    batches = [data.batch(seed=1234 + replica, step=s, num_microbatches=1, microbatch_size=MICROBATCHES,
                          seq=shape.seq, vocab=shape.vocab) for s in range(steps)]
    with PipelineProfiler(out, rank=rank, stage=stage, world_size=world, pp=pp, schedule="1f1b", warmup=1,
                          active=steps - 1, record_shapes=not defaults, with_stack=not defaults,
                          profile_memory=not defaults,
                          metadata={"stages": [stage], "collector": "torch.distributed.pipelining",
                                    "slow_rank": slow[0] if slow else None}) as prof:
        for inputs, targets in batches:
            opt.zero_grad(set_to_none=True)
            if stage == 0:
                schedule.step(inputs[0])
            else:
                schedule.step(target=targets[0], losses=[])
            grads = [q.grad for q in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=replicas[stage])
            flat /= dp
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)
            opt.step()
            prof.step()
    dist.destroy_process_group()


def pipelining_child(out: str, defaults: bool, slow, dp: int = 1) -> None:
    import dataclasses

    import torch.multiprocessing as mp

    from collectors.launch import free_port
    from collectors.manifest import finalize_manifest
    from collectors.pipelining_example import manifest

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    Path(out).mkdir(parents=True, exist_ok=True)
    started = time.time()
    init = f"tcp://127.0.0.1:{free_port()}"
    if dp == 1:
        mp.start_processes(_pipelining_rank, args=(2, init, out, defaults, slow), nprocs=2, join=True,
                           start_method="spawn")
        finalize_manifest(Path(out), manifest("1f1b", 2, 2, MICROBATCHES, 1, "tiny-gpt", 2), since=started)
        return
    world = 2 * dp
    mp.start_processes(_pipelining_dp_rank, args=(world, init, out, defaults, slow, dp), nprocs=world, join=True,
                       start_method="spawn")
    m = manifest("1f1b", 2, 2, MICROBATCHES, 1, "tiny-gpt", 2)
    finalize_manifest(Path(out), dataclasses.replace(
        m, world_size=world, dp=dp, stage_of_rank=tuple(r // dp for r in range(world)),
        stages_of_rank=tuple((r // dp,) for r in range(world)), global_batch=MICROBATCHES * dp, ranks_per_host=world,
        extra={"slow_rank": slow[0] if slow else None}), since=started)


# -- the parent: make the runs, read them --

def collect(framework: str, out: Path, python: str, defaults: bool, slow, port: int, dp: int = 1) -> float:
    """One run into ``out``. ``slow``: (stage, ms, kind), or with ``dp`` > 1 (rank, ms, kind): that rank alone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if framework == "pipelining":
        cmd = [python, __file__, "--pipelining-child", str(out)]
    else:
        cmd = [python, str(GENERATORS[framework]), str(out), "--port", str(port)]
    if defaults:
        cmd.append("--defaults")
    if dp > 1:
        cmd += ["--dp", str(dp)]
    if slow is not None:
        cmd += ["--slow-rank" if dp > 1 else "--slow-stage", str(slow[0]), "--slow-ms", str(slow[1]),
                "--slow-kind", slow[2]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr.strip().splitlines()[-3:]}")
    return time.perf_counter() - t0


def whatif(run: Path, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "traceana", "whatif", str(run), "--json", "--quiet", "--no-cache"]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    if res.returncode != 0:
        return {"error": (res.stderr or res.stdout).strip().splitlines()[-1:]}
    return json.loads(res.stdout)


def read(run: Path, stage: int, group: str = "stage") -> dict:
    """``group`` ``stage``: the what-if ``stage=S:peers`` and the study's ideal of that stage; ``rank``: the same of
    rank S (at its peers' speed: the same stage in the other replicas)."""
    w = whatif(run, [f"{group}={stage}:peers"])
    if "error" in w:
        return {"run": str(run), "error": w["error"]}
    z = whatif(run, ZEROED)
    named = [f"{g} {e['id']}" for g in ("stage", "rank", "replica") for e in w.get(f"by_{g}", []) if e.get("named")]
    ideal = next((e["if_ideal_step_ms"] for e in w[f"by_{group}"] if str(e["id"]) == str(stage)), None)
    return {"run": str(run), "measured_ms": w["measured_step_ms"], "noise_ms": w["noise_ms"],
            "peers_ms": w["changed_step_ms"], "ideal_ms": ideal, "named": named, "diagnosis": w["diagnosis"],
            "consistent": [w["consistent_operations"], w["operations"]],
            "zeroed_ms": z.get("changed_step_ms"), "zeroed_share": (z["changed_step_ms"] / z["measured_step_ms"])
            if "changed_step_ms" in z else None, "notes": w.get("notes", [])}


def rows(results: list[dict], stage: int, group: str = "stage") -> list[dict]:
    out = []
    for fw, mode in dict.fromkeys((r["framework"], r["mode"]) for r in results):
        twins = [r for r in results if (r["framework"], r["mode"], r["kind"]) == (fw, mode, "none") and "error" not in r]
        for kind in dict.fromkeys(r["kind"] for r in results if (r["framework"], r["mode"]) == (fw, mode)):
            group = [r for r in results if (r["framework"], r["mode"], r["kind"]) == (fw, mode, kind)]
            ok = [r for r in group if "error" not in r]
            row = {"framework": fw, "mode": mode, "kind": kind, "runs": len(group),
                   "errors": [r["error"] for r in group if "error" in r]}
            if ok:
                row["named"] = sorted({n for r in ok for n in r["named"]})
                row["named_each"] = [r["named"] for r in ok]
                row["measured_ms"] = [r["measured_ms"] for r in ok]
                row["peers_ms"] = [r["peers_ms"] for r in ok]
                row["ideal_ms"] = [r["ideal_ms"] for r in ok]
                row["zeroed_max"] = max(r["zeroed_share"] for r in ok)
            if twins and ok:
                lo = min(t["measured_ms"] for t in twins)
                hi = max(t["measured_ms"] for t in twins)
                noise = max(t["noise_ms"] for t in twins)
                row["twin"] = {"median": statistics.median(t["measured_ms"] for t in twins), "min": lo, "max": hi,
                               "noise": noise, "peers_min": min(t["peers_ms"] for t in twins),
                               "peers_max": max(t["peers_ms"] for t in twins)}
                row["within"] = all(lo - noise <= p <= hi + noise for p in row["peers_ms"])
                # within the run (no machine change between the figures, as tests/causal/test_whatif_runs.py): every
                # slowed forward is on the path, so the step at the other stage's speed is the measured step less the
                # injected MICROBATCHES x X ms, within the run's noise and the stages' own imbalance (the twins' gain)
                natural = max(t["measured_ms"] - t["peers_ms"] for t in twins)
                ms = next((r["slow"][1] for r in ok if r.get("slow")), None)
                row["in_run"] = [p - (m - MICROBATCHES * ms) for p, m in zip(row["peers_ms"], row["measured_ms"])] \
                    if ms else None
                row["in_run_ok"] = all(abs(d) <= r_["noise_ms"] + natural for d, r_ in zip(row["in_run"], ok)) \
                    if ms else None
                row["within_twin_whatif"] = all(row["twin"]["peers_min"] - noise <= p <= row["twin"]["peers_max"] + noise
                                                for p in row["peers_ms"])
            row["expected"] = [] if kind == "none" else [f"{group} {stage}"]
            out.append(row)
    return out


def table(rs: list[dict]) -> str:
    lines = ["| framework | profile | slowdown | runs | named | what-if: stage S at the others' speed (with --dp: rank R "
             "at its peers'), ms (range); the "
             "study's ideal; measured | twin measured ms, median (range) ± noise | within it | the twin's own what-if "
             "(the same --set) | within it | what-if − (measured − injected), ms | within the run's noise + the twins' "
             "imbalance | zeroed replay, largest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        if "measured_ms" not in r:
            lines.append(f"| {r['framework']} | {r['mode']} | {r['kind']} | {r['runs']} | error: {r['errors']} |"
                         " | | | | | | | |")
            continue
        named = " / ".join(", ".join(n) or "nothing" for n in r["named_each"])  # each run's
        if r["kind"] == "none":
            wi = f"measured {statistics.median(r['measured_ms']):.1f} ({min(r['measured_ms']):.1f}–{max(r['measured_ms']):.1f})"
            tw, within, tp, within2, ir, irok = "–", "–", "–", "–", "–", "–"
        else:
            wi = (f"{statistics.median(r['peers_ms']):.1f} ({min(r['peers_ms']):.1f}–{max(r['peers_ms']):.1f}); "
                  f"ideal {statistics.median(r['ideal_ms']):.1f}; measured {statistics.median(r['measured_ms']):.1f}")
            t = r.get("twin")
            tw = f"{t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) ± {t['noise']:.1f}" if t else "no twin"
            within = ("yes" if r["within"] else "no") if t else "–"
            tp = f"{t['peers_min']:.1f}–{t['peers_max']:.1f}" if t else "–"
            within2 = ("yes" if r["within_twin_whatif"] else "no") if t else "–"
            ir = (f"{min(r['in_run']):+.1f} to {max(r['in_run']):+.1f}" if r.get("in_run") else "–")
            irok = ("yes" if r["in_run_ok"] else "no") if r.get("in_run") else "–"
        lines.append(f"| {r['framework']} | {r['mode']} | {r['kind']} | {r['runs']} | {named} | {wi} | {tw} | "
                     f"{within} | {tp} | {within2} | {ir} | {irok} | {100 * r['zeroed_max']:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--python", default=sys.executable, help="the interpreter with megatron-core and deepspeed")
    p.add_argument("--frameworks", default="megatron,deepspeed,pipelining")
    p.add_argument("--modes", default="defaults,stack")
    p.add_argument("--kinds", default="sleep", help="slowdowns, comma-separated: sleep, compute")
    p.add_argument("--slow-stage", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the 2 stages (2 x DP processes)")
    p.add_argument("--slow-rank", type=int, default=1,
                   help="with --dp > 1: the rank slowed (one replica of one stage; rank = stage * dp + replica)")
    p.add_argument("--analyze-only", action="store_true", help="read the runs already in OUT")
    p.add_argument("--table", nargs="+", type=Path, metavar="RESULTS_JSON",
                   help="only print the table of earlier runs' results.json files, together")
    p.add_argument("--pipelining-child", metavar="RUN", help=argparse.SUPPRESS)
    p.add_argument("--defaults", action="store_true", help=argparse.SUPPRESS)
    # the child is slowed only when told how (--slow-kind): a twin's command names no slowdown (until 07:20 on
    # 2026-12-07 the child fell back to --slow-ms's default, 20 ms, and every pipelining twin was slowed too)
    p.add_argument("--slow-kind", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.pipelining_child:
        target = a.slow_rank if a.dp > 1 else a.slow_stage
        pipelining_child(a.pipelining_child, a.defaults,
                         (target, a.slow_ms, a.slow_kind) if a.slow_kind and a.slow_ms else None, a.dp)
        return
    group, target = ("rank", a.slow_rank) if a.dp > 1 else ("stage", a.slow_stage)
    if a.table:
        runs = [r for f in a.table for r in json.loads(f.read_text())["runs"]]
        print(table(rows(runs, target, group)))
        loads = [r["load"][0] for r in runs if r.get("load")]
        print(f"load average (1 min) over the runs: {min(loads):.1f}–{max(loads):.1f}")
        return
    results = []
    port = 29600
    for fw in a.frameworks.split(","):
        for mode in a.modes.split(","):
            order = [k for _ in range(a.repeats) for k in a.kinds.split(",") + ["none"]]
            seen: dict[str, int] = {}
            for kind in order:
                i = seen[kind] = seen.get(kind, -1) + 1
                run = a.out / (f"{fw}-{mode}-{kind}-{i}" if a.dp == 1 else f"{fw}-dp{a.dp}-{mode}-{kind}-{i}") / "run"
                slow = None if kind == "none" else (target, a.slow_ms, kind)
                wall = None
                try:
                    if not a.analyze_only:
                        port += 1
                        wall = collect(fw, run, a.python, mode == "defaults", slow, port, a.dp)
                    # what was done to the run, beside it (tests/causal/test_whatif_foreign.py reads it: the
                    # expectation)
                    run.parent.joinpath("slow.json").write_text(json.dumps(
                        {"framework": fw, "profile": mode, "slow": list(slow) if slow else None,
                         "microbatches": MICROBATCHES, "dp": a.dp, "group": group}))
                    r = read(run, target, group)
                except RuntimeError as e:
                    r = {"run": str(run), "error": [str(e)]}
                r.update(framework=fw, mode=mode, kind=kind, repeat=i, wall_s=wall, load=os.getloadavg(),
                         slow=list(slow) if slow else None)
                print(json.dumps({k: r.get(k) for k in ("run", "named", "measured_ms", "peers_ms", "ideal_ms",
                                                       "zeroed_share", "error", "load")}), flush=True)
                results.append(r)
    rs = rows(results, target, group)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps({"runs": results, "rows": rs}, indent=1))
    print(table(rs))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
