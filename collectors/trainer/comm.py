"""Point-to-point transport for the pipeline and BPipe: isend/irecv, direct or staged through host memory.

- gloo on CPU, NCCL when every rank has its own GPU: tensors go as they are.
- Several stages sharing one GPU (NCCL refuses two ranks on one device): compute on the GPU, communicate over gloo
  through host memory ("host-staged"): copy to the CPU before sending, copy back after receiving.
- NCCL (``batch_sends``): a send is held back until the next receive is posted and both go in one
  ``batch_isend_irecv``, as Megatron's ``send_forward_recv_backward`` does. Two neighbours that each post a send
  before their receive on the pair's one NCCL stream would otherwise wait on each other for large messages.
  ``flush()`` posts held sends when no receive follows. (Written for GPUs, not run on one here: see the report.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

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


class _HeldSend:
    """A send waiting to be batched with the next receive; ``wait()`` works once it has been posted."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.posted = threading.Event()

    def wait(self) -> None:
        self.posted.wait()
        if self.work is not None:
            self.work.wait()


@dataclass
class Transport:
    device: torch.device
    host_staged: bool  # gloo between ranks whose tensors live on a GPU
    group: dist.ProcessGroup | None = None  # None: the default group
    batch_sends: bool = False  # NCCL: post each send together with the next receive
    _held: list = field(default_factory=list)  # (P2POp, _HeldSend)

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> tuple[dist.Work, torch.Tensor]:
        """Returns the work and the tensor actually sent, which must stay alive until the work completes."""
        sent = tensor.detach().to("cpu") if self.host_staged else tensor.detach()
        if not sent.is_contiguous():
            sent = sent.contiguous()
        if self.batch_sends:
            held = _HeldSend()
            self._held.append((dist.P2POp(dist.isend, sent, self.global_rank(dst), self.group, tag), held))
            return held, sent
        return dist.isend(sent, self.global_rank(dst), group=self.group, tag=tag), sent

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, *, tag: int = 0) -> Transfer:
        buffer = torch.empty(shape, dtype=dtype, device="cpu" if self.host_staged else self.device)
        if self.batch_sends:
            recv = dist.P2POp(dist.irecv, buffer, self.global_rank(src), self.group, tag)
            works = dist.batch_isend_irecv([op for op, _ in self._held] + [recv])
            self._release(works[:-1])
            return Transfer(buffer, works[-1], self.device)
        return Transfer(buffer, dist.irecv(buffer, self.global_rank(src), group=self.group, tag=tag), self.device)

    def flush(self) -> None:
        """Post held sends now (no receive follows them)."""
        if self._held:
            self._release(dist.batch_isend_irecv([op for op, _ in self._held]))

    def _release(self, works: list) -> None:
        for (_, held), work in zip(self._held, works):
            held.work = work
            held.posted.set()
        self._held.clear()

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
