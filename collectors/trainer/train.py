"""The reference pipeline trainer: one process per stage. Reads top to bottom: set up → build → train → close.

``train(config, dist=...)`` runs in each rank's process (spawned by ``collectors.launch`` or started by torchrun).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from collectors import annotations as ann
from collectors.bpipe import Acceptor, Evictor, new_groups
from collectors.manifest import host_facts
from collectors.profiler import PipelineProfiler
from collectors.trainer import data
from collectors.trainer.comm import Transport
from collectors.trainer.config import CollectConfig
from collectors.trainer.model import GPT, Stage
from collectors.trainer.pipeline import StageRunner
from collectors.trainer.workload import Clock, make_sleeping, run_delay_ns
from traceana.core.manifest import Manifest
from traceana.core.pipeline_rules import bpipe_plan, device_order


@dataclass
class DistSetup:
    """How this process talks to the others."""

    rank: int
    world_size: int
    device: torch.device
    backend: str  # gloo | nccl
    host_staged: bool  # GPU tensors sent over gloo through host memory (several stages on one GPU)


@dataclass
class RankResult:
    """What one rank hands back (tests compare it with single-process training)."""

    rank: int
    stage: int
    losses: list[float] = field(default_factory=list)  # per step, last stage only
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # last step's gradients, global parameter names
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters after the last step
    warnings: list[str] = field(default_factory=list)  # profiler warnings


def choose_device(rank: int, world_size: int, local_rank: int | None = None) -> DistSetup:
    """gloo on CPU; NCCL when each rank has its own GPU; gloo with host staging when ranks share GPUs."""
    if not torch.cuda.is_available():
        return DistSetup(rank, world_size, torch.device("cpu"), "gloo", host_staged=False)
    n = torch.cuda.device_count()
    local = rank if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local_world <= n:
        return DistSetup(rank, world_size, torch.device("cuda", local), "nccl", host_staged=False)
    return DistSetup(rank, world_size, torch.device("cuda", local % n), "gloo", host_staged=True)


def manifest_for(config: CollectConfig, setup: DistSetup) -> Manifest:
    device_name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else platform.processor() or "cpu"
    return Manifest(
        world_size=setup.world_size,
        pp=config.pp,
        dp=config.dp,
        stage_of_rank=tuple(config.stage_of(r) for r in range(config.world_size)),
        schedule=config.schedule,
        microbatch_size=config.microbatch_size,
        num_microbatches=config.num_microbatches,
        global_batch=config.microbatch_size * config.num_microbatches * config.dp,
        model=config.shape,
        dtype="float32",
        attention=config.attention,
        recompute=config.recompute,
        bpipe=config.bpipe_pairs or None,
        device=device_name,
        profiler={"wait": 0, "warmup": min(config.warmup_steps, 1), "active": config.steps, "repeat": 1},
        torch_version=torch.__version__,
        **host_facts(setup.world_size),
        collector="collectors.trainer", bpipe_inflight=config.bpipe_inflight,
        layers_per_stage=config.layers_per_stage,  # None: the rules' even split
        # how the runner's passes map each hold to the stage's blocks (collectors.trainer.workload): "even" unless
        # collect --layer-holds per-layer said each block holds the stated times
        workload=None if config.workload is None else dataclasses.replace(
            config.workload, layer_holds=config.workload.layer_holds or "even"),
        extra={"backend": setup.backend, "host_staged": setup.host_staged, "preset": config.preset},
    )


def build_runner(config: CollectConfig, setup: DistSetup, groups: dict) -> StageRunner:
    stage, stages, shape = config.stage_of(setup.rank), config.pp, config.shape
    torch.manual_seed(config.seed)  # the whole model on every rank from one seed: identical weights everywhere
    model = GPT(shape, attention=config.attention, recompute_mode=config.recompute)
    module = Stage(model, stage=stage, stages=stages, layers_per_stage=config.layers_per_stage).to(setup.device)
    clock = None
    if config.workload is not None:  # the known workload: the stage's passes hold instead of computing
        clock = Clock(rank=setup.rank)
        make_sleeping(module, config.workload, stage=stage, rank=setup.rank, clock=clock,
                      example=_example_microbatch(config, stage, setup.device))
    if config.slow_rank is not None and config.slow_rank[0] == setup.rank:
        module.forward = _slowed(module.forward, config.slow_rank[1] / 1e3)
    rank_of_stage = [config.rank_of(s, setup.rank % config.dp) for s in range(stages)]
    actions = device_order(config.schedule, pp=stages, num_microbatches=config.num_microbatches, device=stage)
    batch = setup.backend == "nccl" if config.batch_p2p is None else config.batch_p2p
    transport = Transport(setup.device, setup.host_staged, batch_sends=batch)
    act_shape = (config.microbatch_size, shape.seq, shape.hidden)
    runner = StageRunner(module, stage, stages, actions, config.num_microbatches, act_shape, transport, rank_of_stage,
                         clock=clock)
    pair = next((pair for pair in config.bpipe_pairs if stage in pair), None)
    if pair is not None:
        evictor, acceptor = pair
        plan = bpipe_plan(config.schedule, pp=stages, num_microbatches=config.num_microbatches, evictor=evictor,
                          keep=config.bpipe_inflight)
        # On NCCL the BPipe group is gloo through host memory (see new_groups): staged like several-stages-per-GPU.
        bp = Transport(setup.device, setup.host_staged or setup.backend == "nccl", group=groups[pair])
        if stage == evictor:
            runner.evictor = Evictor(stage=stage, acceptor_rank=rank_of_stage[acceptor], plan=plan, module=module,
                                     transport=bp)
            layout = _measure_layout(runner, config)
            _send_layout(layout, rank_of_stage[acceptor], bp)
        else:
            layout = _recv_layout(rank_of_stage[evictor], bp)
            runner.acceptor = Acceptor(stage=stage, evictor_rank=rank_of_stage[evictor], plan=plan, layout=layout,
                                       transport=bp)
    return runner


def _example_microbatch(config: CollectConfig, stage: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One micro-batch's inputs of ``stage`` as the pipeline hands them over (token ids on the first stage, an
    activation requiring its gradient elsewhere; the targets on the last)."""
    b, shape = config.microbatch_size, config.shape
    if stage == 0:
        x = torch.zeros(b, shape.seq, dtype=torch.int64, device=device)
    else:
        x = torch.zeros(b, shape.seq, shape.hidden, device=device, requires_grad=True)
    if stage == config.pp - 1:
        return x, torch.zeros(b, shape.seq, dtype=torch.int64, device=device)
    return (x,)


def _slowed(forward, seconds: float):
    """``forward`` that first sleeps ``seconds`` (inside the forward's annotation: a slow replica's stage)."""
    import time

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    return slow


def _bpipe_groups(config: CollectConfig, rank: int) -> dict:
    """The BPipe pairs' groups of this rank's replica: each replica's stage s and p−1−s pair up within it (every rank
    creates every replica's groups, in one order: ``new_group`` is collective)."""
    if not config.bpipe:
        return {}
    per_replica = [new_groups(config.pp, [config.rank_of(s, r) for s in range(config.pp)], backend="gloo")
                   for r in range(config.dp)]
    return per_replica[rank % config.dp]


def _dp_group(config: CollectConfig, rank: int):
    """The gloo group of this rank's stage across the replicas (every rank creates every group, in one order)."""
    if config.dp == 1:
        return None
    groups = [dist.new_group([config.rank_of(s, r) for r in range(config.dp)]) for s in range(config.pp)]
    return groups[config.stage_of(rank)]


def _all_reduce_grads(module, group, dp: int) -> None:
    """Average the stage's gradients over its replicas: one all-reduce of one flat buffer, as DDP's buckets do."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _measure_layout(runner: StageRunner, config: CollectConfig) -> list[int]:
    """One throw-away forward under the capture hooks tells the storage sizes every eviction will send."""
    shape, dev = config.shape, runner.transport.device
    if runner.first:
        x = torch.zeros(config.microbatch_size, shape.seq, dtype=torch.int64, device=dev)
    else:
        x = torch.zeros(runner.activation_shape, device=dev, requires_grad=True)
    with runner.evictor.capture(-1):
        y = runner.stage_module(x)
    return runner.evictor.measure_layout(-1, held=(x, y))


def _send_layout(layout: list[int], dst: int, transport: Transport) -> None:
    header = torch.tensor([len(layout), *layout], dtype=torch.int64)
    for t in (header[:1].clone(), header[1:].clone()):
        work, _ = transport.isend(t, dst)
        work.wait()


def _recv_layout(src: int, transport: Transport) -> list[int]:
    n = int(transport.irecv((1,), torch.int64, src).wait().cpu()[0])
    return [int(v) for v in transport.irecv((n,), torch.int64, src).wait().cpu()] if n else []


def train(config: CollectConfig, setup: DistSetup, out_dir: Path | None, *, progress=None) -> RankResult:
    """Train ``config.total_steps`` steps on this rank's stage; profile the last ``config.steps`` into ``out_dir``."""
    torch.set_num_threads(1)  # one stage per process; on a small CPU more threads only fight each other
    groups = _bpipe_groups(config, setup.rank)
    dp_group = _dp_group(config, setup.rank)
    runner = build_runner(config, setup, groups)
    module, stage = runner.stage_module, runner.stage
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr)
    result = RankResult(rank=setup.rank, stage=stage)
    profiler = PipelineProfiler(
        out_dir or ".", rank=setup.rank, stage=stage, world_size=setup.world_size, pp=config.pp,
        schedule=config.schedule, bpipe=config.bpipe_pairs,
        manifest=manifest_for(config, setup) if setup.rank == 0 else None,
        wait=0, warmup=min(config.warmup_steps, 1), active=config.steps, repeat=1,
        metadata={"microbatches": config.num_microbatches, "microbatch_size": config.microbatch_size,
                  "preset": config.preset, "attention": config.attention, "recompute": config.recompute},
        enabled=config.profile and out_dir is not None,
    )
    # The profiler's warm-up starts at the last unprofiled step; earlier warm-up steps run before it.
    for step in range(config.warmup_steps - 1):
        _train_step(config, runner, optimizer, step, result, dp_group)
    with profiler:
        for step in range(max(config.warmup_steps - 1, 0), config.total_steps):
            _train_step(config, runner, optimizer, step, result, dp_group)
            profiler.step()
            if progress is not None:
                progress(step + 1, config.total_steps)
    result.warnings = profiler.warnings
    if runner.clock is not None and out_dir is not None:
        runner.clock.write(out_dir, config.workload)
    result.grads = {n: p.grad.detach().cpu().clone() for n, p in module.named_parameters() if p.grad is not None}
    result.params = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
    return result


def _train_step(config: CollectConfig, runner: StageRunner, optimizer, step: int, result: RankResult,
                dp_group=None) -> None:
    begun, delay = time.perf_counter_ns(), run_delay_ns()
    if runner.clock is not None:
        runner.clock.step = step
    optimizer.zero_grad(set_to_none=True)
    replica = runner.rank_of_stage[0] % config.dp
    # each replica trains on its own share of the batch (replica 0's is the single-pipeline run's)
    inputs, targets = data.batch(seed=config.seed + 1000 * replica, step=step, num_microbatches=config.num_microbatches,
                                 microbatch_size=config.microbatch_size, seq=config.shape.seq,
                                 vocab=config.shape.vocab)
    loss = runner.step(inputs, targets)
    if dp_group is not None:
        _all_reduce_grads(runner.stage_module, dp_group, config.dp)
    with ann.optimizer(runner.stage):
        optimizer.step()
    if loss is not None:
        result.losses.append(loss)
    if runner.clock is not None:
        runner.clock.steps.append((step, begun, time.perf_counter_ns(), run_delay_ns() - delay))


def init_process_group(setup: DistSetup, init_method: str | None) -> None:
    kwargs = {}
    if setup.backend == "nccl":
        torch.cuda.set_device(setup.device)
        kwargs["device_id"] = setup.device
    dist.init_process_group(setup.backend, init_method=init_method, rank=setup.rank, world_size=setup.world_size,
                            **kwargs)
    if setup.backend == "nccl":
        dist.barrier()  # batch_isend_irecv wants the group's communicator created by a collective of all ranks
