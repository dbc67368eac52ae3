"""A DeepSpeed pipeline job as its user writes it, with nothing of traceana in it: DeepSpeed's own PipelineEngine
(``deepspeed.pipe.PipelineModule``, ``train_batch``: its 1F1B TrainSchedule), an 8-layer Linear/ReLU MLP cut into
one stage a rank, 4 micro-batches of 8 × 64, SGD, on the CPU over gloo. Used by
tests/collectors/test_attach_frameworks.py under ``traceana attach`` (needs deepspeed):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tests/attach_deepspeed_script.py [--steps N]
"""

from __future__ import annotations

import argparse
import os

import torch

MICROBATCHES, HIDDEN, MB_SIZE = 4, 64, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    layers = [torch.nn.Linear(HIDDEN, HIDDEN) if i % 2 == 0 else torch.nn.ReLU() for i in range(8)]
    net = PipelineModule(layers=layers, num_stages=world, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MB_SIZE, "gradient_accumulation_steps": MICROBATCHES,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)

    def data():
        g = torch.Generator().manual_seed(1)
        while True:
            x = torch.randn(MB_SIZE, HIDDEN, generator=g)
            yield x, x.flip(-1)

    it = data()
    for _ in range(args.steps):
        engine.train_batch(data_iter=it)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
