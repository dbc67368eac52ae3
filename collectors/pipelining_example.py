"""Profile torch.distributed.pipelining's own schedules with traceana: a runnable example.

    python -m collectors.pipelining_example --schedule 1f1b -o runs/pipelining_1f1b
    python -m collectors.pipelining_example --schedule gpipe -o runs/pipelining_gpipe
    python -m collectors.pipelining_example --schedule interleaved-1f1b -o runs/pipelining_interleaved

The model is the reference trainer's GPT cut into ``PipelineStage``s (interleaved: 2 ranks × 2 virtual stages); the
only traceana lines in ``run_rank`` are ``annotate(schedule)`` and the ``PipelineProfiler`` block.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from collectors.launch import _start_method, free_port
from collectors.manifest import finalize_manifest
from collectors.pipelining import annotate
from collectors.profiler import PipelineProfiler
from collectors.trainer import data
from collectors.trainer.config import PRESETS
from collectors.trainer.model import GPT
from traceana.pipeline_rules import stage_layer_ranges
from traceana.manifest import Manifest

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


class Part(nn.Module):
    """A contiguous slice of the GPT as a plain module (PipelineStage wants ``forward(x) -> y``)."""

    def __init__(self, model: GPT, *, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        self.layers = nn.ModuleList(model.blocks[i] for i in stage_layer_ranges(model.shape.layers, stages)[stage])
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        if self.last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.embed(x)
            x = h + self.pos(torch.arange(x.shape[1])) if self.pos is not None else h
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def manifest(schedule: str, world: int, stages: int, microbatches: int, microbatch_size: int, preset: str,
             steps: int) -> Manifest:
    per_rank = [[s for s in range(stages) if s % world == r] for r in range(world)]
    return Manifest(
        world_size=world, pp=stages, stage_of_rank=tuple(p[0] for p in per_rank), schedule=schedule,
        microbatch_size=microbatch_size, num_microbatches=microbatches, global_batch=microbatch_size * microbatches,
        model=PRESETS[preset], dtype="float32", attention="naive", recompute="none", device="cpu",
        profiler={"wait": 0, "warmup": 1, "active": steps, "repeat": 1}, torch_version=torch.__version__,
        extra={"collector": "torch.distributed.pipelining", "stages_of_rank": per_rank},
    )


def run_rank(rank: int, world: int, init_method: str, schedule_name: str, out_dir: Path, preset: str,
             microbatches: int, microbatch_size: int, steps: int) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    shape = PRESETS[preset]
    virtual = 2 if schedule_name == "interleaved-1f1b" else 1
    stages = world * virtual
    torch.manual_seed(1234)
    model = GPT(shape, attention="naive")
    my_stages = [s for s in range(stages) if s % world == rank]  # looped placement: rank r holds r, r+world, …
    pipe = [PipelineStage(Part(model, stage=s, stages=stages), s, stages, torch.device("cpu")) for s in my_stages]
    params = [p for st in pipe for p in st.submod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    if schedule_name == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(pipe, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        cls = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
        schedule = cls(pipe[0], n_microbatches=microbatches, loss_fn=loss_fn)
    annotate(schedule)  # <- traceana: per-micro-batch PP:{stage}F{mb} / B spans
    with PipelineProfiler(out_dir, rank=rank, stage=my_stages[0], world_size=world, pp=stages,
                          schedule=schedule_name, active=steps,
                          manifest=manifest(schedule_name, world, stages, microbatches, microbatch_size, preset, steps)
                          if rank == 0 else None,
                          metadata={"stages": my_stages, "collector": "torch.distributed.pipelining"}) as prof:
        for step in range(1 + steps):
            inputs, targets = data.batch(seed=1234, step=step, microbatches=1,
                                         microbatch_size=microbatch_size * microbatches, seq=shape.seq,
                                         vocab=shape.vocab)
            optimizer.zero_grad(set_to_none=True)
            args = (inputs[0],) if 0 in my_stages else ()  # the whole batch; the schedule splits it
            kwargs = {"target": targets[0], "losses": []} if stages - 1 in my_stages else {}
            schedule.step(*args, **kwargs)
            optimizer.step()
            prof.step()
    dist.destroy_process_group()


def collect(schedule: str, out_dir: str | Path, *, preset: str = "tiny-gpt", microbatches: int = 8,
            microbatch_size: int = 2, steps: int = 2, ranks: int | None = None) -> Path:
    """Collect one run of a pipelining schedule: 4 ranks × 1 stage (interleaved: 2 ranks × 2 stages)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = ranks or (2 if schedule == "interleaved-1f1b" else 4)
    started = time.time()
    method = _start_method()
    mp.start_processes(run_rank, args=(world, f"tcp://127.0.0.1:{free_port()}", schedule, out_dir, preset,
                                       microbatches, microbatch_size, steps),
                       nprocs=world, join=True, start_method=method)
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    finalize_manifest(out_dir, manifest(schedule, world, world * virtual, microbatches, microbatch_size, preset, steps),
                      since=started)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--preset", default="tiny-gpt", choices=sorted(PRESETS))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(collect(args.schedule, args.out, preset=args.preset, microbatches=args.microbatches,
                  microbatch_size=args.microbatch_size, steps=args.steps))


if __name__ == "__main__":
    main()
