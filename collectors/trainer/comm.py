"""Point-to-point transport for the pipeline and BPipe: isend/irecv, direct or staged through host memory.

- gloo on CPU, NCCL when every rank has its own GPU: tensors go as they are.
- Several stages sharing one GPU (NCCL refuses two ranks on one device): compute on the GPU, communicate over gloo
  through host memory ("host-staged"): copy to the CPU before sending, copy back after receiving.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    """An irecv in flight: ``wait()`` returns the received tensor on the compute device."""

    buffer: torch.Tensor
    work: dist.Work | None
    device: torch.device

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buffer if self.buffer.device == self.device else self.buffer.to(self.device)


@dataclass
class Transport:
    device: torch.device
    host_staged: bool  # gloo between ranks whose tensors live on a GPU
    group: dist.ProcessGroup | None = None  # None: the default group

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> tuple[dist.Work, torch.Tensor]:
        """Returns the work and the tensor actually sent, which must stay alive until the work completes."""
        sent = tensor.detach().to("cpu") if self.host_staged else tensor.detach()
        if not sent.is_contiguous():
            sent = sent.contiguous()
        return dist.isend(sent, self.global_rank(dst), group=self.group, tag=tag), sent

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, *, tag: int = 0) -> Transfer:
        buffer = torch.empty(shape, dtype=dtype, device="cpu" if self.host_staged else self.device)
        return Transfer(buffer, dist.irecv(buffer, self.global_rank(src), group=self.group, tag=tag), self.device)

    def global_rank(self, rank: int) -> int:
        return rank  # ranks are global in every group we create (new_group keeps global numbering for send/recv)


class Waiter:
    """Waits for works on a helper thread so the training thread can ask "done yet?" without blocking.

    gloo's ``Work.is_completed()`` stays False until someone calls ``wait()`` (measured on torch 2.13), so polling it
    never sees a completed transfer. One short-lived thread per batch of works avoids head-of-line blocking.
    """

    def watch(self, works: list[dist.Work]) -> threading.Event:
        done = threading.Event()

        def run() -> None:
            try:
                for w in works:
                    w.wait()
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="traceana-waiter").start()
        return done
