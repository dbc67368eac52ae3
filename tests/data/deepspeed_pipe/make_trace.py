"""Make the DeepSpeed pipeline trace in this folder: DeepSpeed's own PipelineEngine (deepspeed.pipe.PipelineModule,
``train_batch``) on 2 CPU processes over gloo, a tiny MLP split in 2 stages, 4 micro-batches, under
collectors.profiler.PipelineProfiler with ``with_stack=True`` (DeepSpeed writes no record_function of its own: its
pipe instructions appear only as the Python frames ``engine.py(N): _exec_forward_pass`` etc.).

The truth is recorded outside the trace: every pipe instruction the engine executes is timed with
``time.perf_counter_ns()`` (a wrapper around each entry of ``PipelineEngine._INSTRUCTION_MAP``), and so is each
``train_batch`` call; ``truth.json`` holds, per rank and step, the ``train_batch`` wall time and the summed time of
each instruction class (the trace's ProfilerStep#N spans the same call, from one ``prof.step()`` to the next).

    DS_ACCELERATOR=cpu python tests/data/deepspeed_pipe/make_trace.py OUT_DIR   # truth.rank{R}.json next to OUT_DIR
        [--defaults] [--port N] [--slow-stage S --slow-ms X [--slow-kind sleep|compute]] [--dp D [--slow-rank R]]
        [--steps N]

``--slow-stage S --slow-ms X``: stage S's module (the ``PipelineModule``'s forward, the job's own code) spends X ms
more in each forward of a micro-batch: ``time.sleep`` (``--slow-kind sleep``, the default) or torch matmuls until X ms
have passed (``compute``: CPU ops inside the forward). ``--defaults`` profiles with torch.profiler's defaults (no
``with_stack``, no ``record_shapes``) instead of with both. ``--dp D``: D data-parallel replicas of the 2 stages (2·D
processes, ``PipeDataParallelTopology``: the engine all-reduces each stage's gradients over its replicas);
``--slow-rank R`` slows rank R alone (one replica of one stage) instead of a stage. (tests/benchmarks/whatif_foreign.py
makes its runs so.)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MICROBATCHES, STEPS, HIDDEN, MB_SIZE = 4, 3, 64, 8


def slow_down(ms: float, kind: str) -> None:
    """Spend ``ms`` more: asleep (``sleep``) or running torch matmuls on this CPU (``compute``)."""
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    a = torch.full((96, 96), 0.01)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def slowed(forward, ms: float, kind: str):
    def slow(*a, **kw):
        slow_down(ms, kind)
        return forward(*a, **kw)
    return slow


def worker(rank: int, world: int, out: str, port: int, defaults: bool = False,
           slow: tuple[int, float, str] | None = None, dp: int = 1, slow_rank: int | None = None,
           n_steps: int = STEPS) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from collectors.profiler import PipelineProfiler

    deepspeed.init_distributed(dist_backend="gloo")
    layers = [torch.nn.Linear(HIDDEN, HIDDEN) if i % 2 == 0 else torch.nn.ReLU() for i in range(8)]
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    pp = world // dp  # DeepSpeed's topology: rank = stage * dp + replica; gradients all-reduced over each stage's dp
    net = PipelineModule(layers=layers, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                         loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MB_SIZE, "gradient_accumulation_steps": MICROBATCHES,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)

    spans: list[tuple[int, str, int]] = []  # (step, instruction, ns)
    comms: list[tuple[int, str, str | None, int]] = []  # (step, torch.distributed call, instruction running, ns)
    current = {"step": -1, "instr": None, "depth": 0}
    for cls, fn in list(PipelineEngine._INSTRUCTION_MAP.items()):
        def timed(self, *a, _fn=fn, _name=cls.__name__, **kw):
            t0 = time.perf_counter_ns()
            current["instr"] = _name
            try:
                return _fn(self, *a, **kw)
            finally:
                current["instr"] = None
                spans.append((current["step"], _name, time.perf_counter_ns() - t0))
        PipelineEngine._INSTRUCTION_MAP[cls] = timed
    # Every torch.distributed call DeepSpeed makes (its p2p module calls dist.send / dist.recv; deepspeed.comm calls
    # all_reduce, broadcast, …, synchronously: the call returns after its wait), outermost calls only.
    for op in ("send", "recv", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "barrier"):
        orig = getattr(torch.distributed, op)

        def timed_comm(*a, _orig=orig, _op=op, **kw):
            current["depth"] += 1
            t0 = time.perf_counter_ns()
            try:
                return _orig(*a, **kw)
            finally:
                current["depth"] -= 1
                if current["depth"] == 0:
                    comms.append((current["step"], _op, current["instr"], time.perf_counter_ns() - t0))
        setattr(torch.distributed, op, timed_comm)
    aggregate = PipelineEngine._aggregate_total_loss  # the loss broadcast from the last stage, outside instructions

    def timed_aggregate(self, *a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return aggregate(self, *a, **kw)
        finally:
            spans.append((current["step"], "AggregateTotalLoss", time.perf_counter_ns() - t0))
    PipelineEngine._aggregate_total_loss = timed_aggregate

    def data():
        g = torch.Generator().manual_seed(1)
        while True:
            x = torch.randn(MB_SIZE, HIDDEN, generator=g)
            yield x, x.flip(-1)

    # (nn.Module.__call__ looks forward up on the instance)
    if slow is not None and (slow[0] == engine.stage_id if slow_rank is None else slow_rank == rank):
        net.forward = slowed(net.forward, slow[1], slow[2])
    it = data()
    steps: list[tuple[int, int]] = []
    stage = engine.stage_id
    with PipelineProfiler(out, rank=rank, stage=stage, world_size=world, pp=pp, schedule="1f1b",
                          warmup=1, active=n_steps - 1, with_stack=not defaults, record_shapes=not defaults,
                          profile_memory=False,
                          metadata={"framework": f"deepspeed {deepspeed.__version__}",
                                    "slow": list(slow) if slow else None, "slow_rank": slow_rank,
                                    "dp": dp}) as prof:
        for s in range(n_steps):
            current["step"] = s
            t0 = time.perf_counter_ns()
            engine.train_batch(data_iter=it)
            steps.append((s, time.perf_counter_ns() - t0))
            prof.step()
    truth = {"rank": rank, "stage": stage, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
             "profiler": "defaults" if defaults else "with_stack, record_shapes", "slow": list(slow) if slow else None,
             "steps": {}}
    for s, dur in steps:
        per = {}
        for st, name, ns in spans:
            if st == s:
                per[name] = per.get(name, 0) + ns
        comm = {}
        for st, op, instr, ns in comms:
            if st == s:
                key = f"{op} in {instr or 'train_batch'}"
                comm[key] = comm.get(key, 0) + ns
        truth["steps"][s] = {"train_batch_ns": dur, "instructions_ns": per, "comm_calls_ns": comm,
                             "forward_passes": sum(1 for st, n, _ in spans if st == s and n == "ForwardPass")}
    Path(out).parent.joinpath(f"truth.rank{rank}.json").write_text(json.dumps(truth, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--defaults", action="store_true", help="torch.profiler's defaults: no stack, no shapes")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--slow-stage", type=int)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--slow-kind", choices=("sleep", "compute"), default="sleep")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (2 stages each; 2 x DP processes)")
    parser.add_argument("--slow-rank", type=int, help="slow this rank (one replica of one stage) instead of a stage")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps run: 1 warm-up, the rest profiled")
    args = parser.parse_args()
    target = args.slow_stage if args.slow_rank is None else args.slow_rank
    slow = (target, args.slow_ms, args.slow_kind) if target is not None and args.slow_ms else None
    mp.spawn(worker, args=(2 * args.dp, args.out, args.port, args.defaults, slow, args.dp, args.slow_rank, args.steps),
             nprocs=2 * args.dp, join=True)
