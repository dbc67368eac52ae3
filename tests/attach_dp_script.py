"""A plain data-parallel training script with no traceana in it: what ``traceana attach`` must profile unmodified.

    torchrun --nproc-per-node 2 tests/attach_dp_script.py --steps 6     # one rank per process
    python tests/attach_dp_script.py --steps 6 --ranks 2                  # spawns its own ranks

A tiny MLP (16 → 32 → 1: 577 parameters) under DistributedDataParallel on gloo, SGD; rank 0 prints each step's
loss, so two runs can be compared line by line. ``--die RANK STEP`` makes that rank crash (``os._exit``) there.

Before it returns, each rank waits for its gloo worker threads to go idle (``_gloo_workers_idle``): with torch 2.13 a
gloo job otherwise aborts now and then as it exits, traceana or not (docs/field-notes.md), and a fixture that can
abort by itself proves nothing about ``traceana attach``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def train(rank: int, world: int, steps: int, init_method: str, die: tuple[int, int] | None = None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        if die is not None and (rank, step) == die:
            os._exit(3)  # a crash: no Python clean-up, no exit handlers
        x = torch.randn(8, 16, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()
    _gloo_workers_idle()


def _gloo_workers_idle(timeout_s: float = 30.0) -> None:
    """Return once every ``pt_gloo_runloop`` thread sleeps in its work queue (Linux; elsewhere at once).

    A gloo worker drops its last reference to a finished Work after the rank has moved on; that can take the GIL
    (DDP's Work keeps a Python object from backward), and when the interpreter is already finalizing CPython ends the
    thread inside a noexcept destructor: std::terminate. An idle worker waits for work in
    futex(FUTEX_WAIT_BITSET, no timeout); one waiting for the GIL waits with a timeout; a running one shows "running".
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return
        busy = False
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    call = f.read().split()
            except OSError:
                continue  # the thread has ended
            idle = len(call) > 4 and call[0] == "202" and int(call[2], 16) & 0x7F == 9 and int(call[4], 16) == 0
            busy = busy or not idle
        if not busy:
            return
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--die", type=int, nargs=2, metavar=("RANK", "STEP"), help="that rank crashes at that step")
    args = parser.parse_args()
    die = tuple(args.die) if args.die else None
    if "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.steps, "env://", die)
    else:
        mp.spawn(train, args=(args.ranks, args.steps, f"tcp://127.0.0.1:{_free_port()}", die), nprocs=args.ranks)


if __name__ == "__main__":
    main()
