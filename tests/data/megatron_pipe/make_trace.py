"""Make the Megatron-LM pipeline trace in this folder: megatron-core's own 1F1B schedule
(``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving``, its P2PCommunicator)
on 2 CPU processes over gloo, a tiny MLP stage per rank, 4 micro-batches, under collectors.profiler.PipelineProfiler
with ``with_stack=True`` (Megatron's own ranges are NVTX, which Kineto does not record: its forward_step and
backward_step appear as the Python frames ``schedules.py(N): forward_step``).

megatron-core targets CUDA; three shims retarget its device strings to the CPU and change nothing else:
``torch.cuda.current_device()`` returns the CPU device, ``torch.zeros(..., device="cuda")`` (the token counter the
schedule makes) is made on the CPU, ``torch.cuda.synchronize()`` does nothing.

The truth is recorded outside the trace with ``time.perf_counter_ns()``: every forward_step / backward_step call of the
schedule, every P2P helper call (the P2PCommunicator's send_forward, recv_forward, send_backward, recv_backward,
send_forward_recv_backward, send_backward_recv_forward: each returns after its wait; "p2p"), the time inside
torch.distributed's P2P calls and their requests' wait() ("p2p_torch"), the optimizer step, and the whole step (the
schedule call plus the optimizer step); ``truth.rank{R}.json`` next to OUT_DIR.

    python tests/data/megatron_pipe/make_trace.py OUT_DIR [--interleaved] [--defaults] [--port N]
                                                  [--slow-stage S --slow-ms X [--slow-kind sleep|compute]]
                                                  [--dp D [--slow-rank R --slow-ms X]] [--steps N]

``--slow-stage S --slow-ms X``: stage S's module (``Stage.forward``, the job's own code) spends X ms more in each
forward of a micro-batch: ``time.sleep`` (``--slow-kind sleep``, the default) or torch matmuls until X ms have passed
(``compute``: CPU ops inside the forward). ``--defaults`` profiles with torch.profiler's defaults (no ``with_stack``,
no ``record_shapes``) instead of with both. ``--dp D``: D data-parallel replicas of the 2 stages (2·D processes,
megatron-core's groups; the gradients all-reduced over its data-parallel group after the schedule, one flat bucket as
DDP does; "dp_allreduce" in the truth); ``--slow-rank R`` slows rank R alone (one replica of one stage) instead of a
stage. (tests/benchmarks/whatif_foreign.py makes its runs so.)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MICROBATCHES, STEPS, HIDDEN, SEQ, MB_SIZE = 4, 3, 64, 16, 2


def slow_down(ms: float, kind: str) -> None:
    """Spend ``ms`` more: asleep (``sleep``) or running torch matmuls on this CPU (``compute``)."""
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    a = torch.full((96, 96), 0.01)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


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
        self.net = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
        self.slow: tuple[float, str] | None = None  # (ms, kind): --slow-stage's extra time in each forward

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        if self.slow:
            slow_down(*self.slow)
        return self.net(x if self.first else self.input_tensor)


def worker(rank: int, world: int, out: str, port: int, interleaved: bool, defaults: bool = False,
           slow: tuple[int, float, str] | None = None, dp: int = 1, slow_rank: int | None = None,
           n_steps: int = STEPS) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    _cpu_shims()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.transformer import TransformerConfig

    from collectors.profiler import PipelineProfiler

    chunks = 2 if interleaved else 1
    pp = world // dp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=chunks if interleaved else None)
    config = TransformerConfig(num_layers=2 * pp * chunks, hidden_size=HIDDEN, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               use_cpu_initialization=True, virtual_pipeline_model_parallel_size=chunks
                               if interleaved else None)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    models = [Stage(config, first=(stage == 0 and c == 0)) for c in range(chunks)]
    for c, m in enumerate(models):
        if slow is not None and (slow[0] == stage + c * pp if slow_rank is None else slow_rank == rank):
            m.slow = (slow[1], slow[2])
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=1e-3)

    calls: list[tuple[int, str, int]] = []
    current = {"step": -1}

    def timed(fn, name):
        def wrapper(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                calls.append((current["step"], name, time.perf_counter_ns() - t0))
        return wrapper
    schedules.forward_step = timed(schedules.forward_step, "forward_step")
    schedules.backward_step = timed(schedules.backward_step, "backward_step")
    for m in ("send_forward", "recv_forward", "send_backward", "recv_backward", "send_forward_recv_backward",
              "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
              "send_forward_backward_recv_forward_backward"):
        if hasattr(p2p_communication.P2PCommunicator, m):
            setattr(p2p_communication.P2PCommunicator, m, timed(getattr(p2p_communication.P2PCommunicator, m), "p2p"))

    # The time the rank spends inside torch.distributed's P2P calls and in the wait() of the requests they return
    # (Megatron posts with batch_isend_irecv, or isend/irecv, and waits on every request in _communicate).
    class TimedWork:
        def __init__(self, work) -> None:
            self._work = work

        def wait(self, *a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return self._work.wait(*a, **kw)
            finally:
                calls.append((current["step"], "p2p_torch", time.perf_counter_ns() - t0))

        def __getattr__(self, name):
            return getattr(self._work, name)

    # (isend/irecv themselves stay unwrapped: P2POp accepts only the real functions; batch_isend_irecv calls them.)
    for op in ("batch_isend_irecv", "send", "recv"):
        orig = getattr(torch.distributed, op)

        def timed_p2p(*a, _orig=orig, **kw):
            t0 = time.perf_counter_ns()
            try:
                out = _orig(*a, **kw)
            finally:
                calls.append((current["step"], "p2p_torch", time.perf_counter_ns() - t0))
            if isinstance(out, list):
                return [TimedWork(w) for w in out]
            return TimedWork(out) if out is not None else out
        setattr(torch.distributed, op, timed_p2p)

    def forward_step_func(data_iterator, model):
        x = next(data_iterator)
        out = model(x)

        def loss_func(output):
            loss = output.float().pow(2).mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    def data():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(SEQ, MB_SIZE, HIDDEN, generator=g)

    run = (schedules.forward_backward_pipelining_with_interleaving if interleaved
           else schedules.forward_backward_pipelining_without_interleaving)
    steps = []
    stages = [stage + c * pp for c in range(chunks)]
    params = [p for m in models for p in m.parameters()]
    with PipelineProfiler(out, rank=rank, stage=stage, world_size=world, pp=pp * chunks,
                          schedule="interleaved-1f1b" if interleaved else "1f1b", warmup=1, active=n_steps - 1,
                          with_stack=not defaults, record_shapes=not defaults, profile_memory=False,
                          metadata={"framework": f"megatron-core {megatron.core.__version__}", "stages": stages,
                                    "slow": list(slow) if slow else None, "slow_rank": slow_rank,
                                    "dp": dp}) as prof:
        for s in range(n_steps):
            current["step"] = s
            its = [data() for _ in range(chunks)]
            t0 = time.perf_counter_ns()
            run(forward_step_func=forward_step_func, data_iterator=its if interleaved else its[0],
                model=models if interleaved else models[0], num_microbatches=MICROBATCHES, seq_length=SEQ,
                micro_batch_size=MB_SIZE)
            if dp > 1:  # the gradients' all-reduce over megatron-core's data-parallel group (one bucket, as DDP)
                t_ar = time.perf_counter_ns()
                flat = torch._utils._flatten_dense_tensors([p.grad for p in params])
                torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
                flat /= dp
                for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
                    p.grad.copy_(g)
                calls.append((s, "dp_allreduce", time.perf_counter_ns() - t_ar))
            t1 = time.perf_counter_ns()
            with torch.profiler.record_function("Optimizer.step#SGD.step"):  # as torch.optim itself records it
                opt.step()
                opt.zero_grad()
            t2 = time.perf_counter_ns()
            calls.append((s, "optimizer", t2 - t1))
            steps.append((s, t2 - t0))
            prof.step()
    truth = {"rank": rank, "stage": stage, "stages": stages, "megatron_core": megatron.core.__version__,
             "torch": torch.__version__, "profiler": "defaults" if defaults else "with_stack, record_shapes",
             "slow": list(slow) if slow else None, "steps": {}}
    for s, dur in steps:
        per: dict[str, int] = {}
        counts: dict[str, int] = {}
        for st, name, ns in calls:
            if st == s:
                per[name] = per.get(name, 0) + ns
                counts[name] = counts.get(name, 0) + 1
        truth["steps"][s] = {"step_ns": dur, "calls_ns": per, "calls": counts}
    Path(out).parent.joinpath(f"truth.rank{rank}.json").write_text(json.dumps(truth, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--interleaved", action="store_true")
    parser.add_argument("--defaults", action="store_true", help="torch.profiler's defaults: no stack, no shapes")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--slow-stage", type=int)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--slow-kind", choices=("sleep", "compute"), default="sleep")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (2 stages each; 2 x DP processes)")
    parser.add_argument("--slow-rank", type=int, help="slow this rank (one replica of one stage) instead of a stage")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps run: 1 warm-up, the rest profiled")
    args = parser.parse_args()
    target = args.slow_stage if args.slow_rank is None else args.slow_rank
    slow = (target, args.slow_ms, args.slow_kind) if target is not None and args.slow_ms else None
    mp.spawn(worker, args=(2 * args.dp, args.out, args.port, args.interleaved, args.defaults, slow, args.dp,
                           args.slow_rank, args.steps), nprocs=2 * args.dp, join=True)
