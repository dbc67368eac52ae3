"""Profiling overhead of the reference trainer: profiled vs unprofiled step time, in the same processes.

    .venv/bin/python tests/benchmarks/bench_profiler_overhead.py [--preset tiny-gpt] [--pp 4] [--microbatches 8] [--steps 3]

Each rank runs warm-up steps, then ``--steps`` unprofiled steps, then ``--steps`` steps under torch.profiler with
traceana's defaults (record_shapes + profile_memory), then writes the trace; the same weights, data and schedule.
Prints per-stage medians and the overhead, plus the time to export and gzip the trace. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from collectors.launch import _start_method, free_port
from collectors.profiler import PipelineProfiler
from collectors.trainer import data
from collectors.trainer.config import CollectConfig
from collectors.trainer.train import build_runner, choose_device, init_process_group


def _step(config, runner, optimizer, step) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    inputs, targets = data.batch(seed=config.seed, step=step, num_microbatches=config.num_microbatches,
                                 microbatch_size=config.microbatch_size, seq=config.shape.seq, vocab=config.shape.vocab)
    runner.step(inputs, targets)
    optimizer.step()
    return time.perf_counter() - start


def _rank(rank: int, config: CollectConfig, init_method: str, out_dir: str, results) -> None:
    torch.set_num_threads(1)
    setup = choose_device(rank, config.pp)
    init_process_group(setup, init_method)
    from collectors.bpipe import new_groups

    groups = new_groups(config.pp, list(range(config.pp)), backend="gloo") if config.bpipe else {}
    runner = build_runner(config, setup, groups)
    optimizer = torch.optim.AdamW(runner.stage_module.parameters(), lr=config.lr)
    step = 0
    for _ in range(2):  # warm-up: allocator, first-call costs
        _step(config, runner, optimizer, step)
        step += 1
    plain = []
    for _ in range(config.steps):
        dist.barrier()
        plain.append(_step(config, runner, optimizer, step))
        step += 1
    profiled = []
    prof = PipelineProfiler(out_dir, rank=rank, stage=rank, world_size=config.pp, pp=config.pp, wait=0, warmup=1,
                            active=config.steps)
    with prof:
        _step(config, runner, optimizer, step)  # the profiler's own warm-up step
        step += 1
        prof.step()
        for i in range(config.steps):
            dist.barrier()
            if i == config.steps - 1:  # the last step's prof.step() also exports: time it separately
                profiled.append(_step(config, runner, optimizer, step))
                t = time.perf_counter()
                prof.step()
                export = time.perf_counter() - t
            else:
                profiled.append(_step(config, runner, optimizer, step))
                prof.step()
            step += 1
    results.put((rank, statistics.median(plain), statistics.median(profiled), export))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-gpt")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", dest="num_microbatches", type=int, default=8,
                        metavar="MICROBATCHES")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bpipe", action="store_true")
    args = parser.parse_args()
    config = CollectConfig(preset=args.preset, pp=args.pp, num_microbatches=args.num_microbatches, steps=args.steps,
                           bpipe=args.bpipe)
    method = _start_method()
    ctx = mp.get_context(method)
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(config, f"tcp://127.0.0.1:{free_port()}", out, results), nprocs=config.pp,
                           start_method=method)
        rows = sorted(results.get() for _ in range(config.pp))
        sizes = {p.name: p.stat().st_size for p in Path(out).glob("rank*.pt.trace.json.gz")}
    print(f"profiler overhead, {config.preset} pp={config.pp} {config.schedule} m={config.num_microbatches}, "
          f"median of {config.steps} steps (record_shapes + profile_memory)")
    print(f"{'rank':>4} {'unprofiled':>11} {'profiled':>10} {'overhead':>9} {'export+gzip':>12} {'trace':>9}")
    for rank, plain, profiled, export in rows:
        size = sizes.get(f"rank{rank}.pt.trace.json.gz", 0)
        print(f"{rank:>4} {plain * 1e3:>9.1f}ms {profiled * 1e3:>8.1f}ms {profiled / plain - 1:>8.0%} "
              f"{export:>11.2f}s {size / 1e6:>7.2f}MB")


if __name__ == "__main__":
    main()
