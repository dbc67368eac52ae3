"""A megatron-core pipeline job as its user writes it, with nothing of traceana in it: megatron-core's own 1F1B (or,
with ``--interleaved``, interleaved 1F1B with 2 model chunks a rank) from ``get_forward_backward_func``, 4
micro-batches of (seq 16, batch 2, hidden 64), a 2-Linear MLP per stage, SGD, on the CPU over gloo, one rank per
pipeline stage. Used by tests/collectors/test_attach_frameworks.py under ``traceana attach`` (needs megatron-core):

    torchrun --standalone --nproc-per-node 2 tests/attach_megatron_script.py [--interleaved] [--steps N]

megatron-core is written for CUDA; three shims retarget its device calls to the CPU (as tests/data/megatron_pipe/
make_trace.py does) and change nothing in the schedule.
"""

from __future__ import annotations

import argparse

import torch

MICROBATCHES, HIDDEN, SEQ, MB_SIZE = 4, 64, 16, 2


def _cpu_shims() -> None:
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    zeros = torch.zeros

    def zeros_on_cpu(*a, **kw):
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = cpu
        return zeros(*a, **kw)
    torch.zeros = zeros_on_cpu


class Stage(torch.nn.Module):
    def __init__(self, config, first: bool) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        self.config, self.first, self.input_tensor = config, first, None
        self.model_type = ModelType.encoder_or_decoder
        self.net = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, HIDDEN))

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        return self.net(x if self.first else self.input_tensor)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    _cpu_shims()
    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    chunks = 2 if args.interleaved else 1
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world,
                                             virtual_pipeline_model_parallel_size=chunks if args.interleaved else None)
    config = TransformerConfig(num_layers=2 * world * chunks, hidden_size=HIDDEN, num_attention_heads=4,
                               pipeline_model_parallel_size=world, pipeline_dtype=torch.float32,
                               use_cpu_initialization=True,
                               virtual_pipeline_model_parallel_size=chunks if args.interleaved else None)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    models = [Stage(config, first=(stage == 0 and c == 0)) for c in range(chunks)]
    opt = torch.optim.SGD([q for m in models for q in m.parameters()], lr=1e-3)

    def forward_step(data_iterator, model):
        out = model(next(data_iterator))

        def loss_func(output):
            loss = output.float().pow(2).mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    def data():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(SEQ, MB_SIZE, HIDDEN, generator=g)

    for _ in range(args.steps):
        its = [data() for _ in range(chunks)]
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=its if args.interleaved else its[0],
                                    model=models if args.interleaved else models[0], num_microbatches=MICROBATCHES,
                                    seq_length=SEQ, micro_batch_size=MB_SIZE)
        opt.step()
        opt.zero_grad()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
