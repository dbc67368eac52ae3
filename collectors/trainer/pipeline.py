"""Runs one stage's share of a training step: its forwards and backwards in schedule order, over P2P.

Each phase is annotated (``PP:{stage}{ACTION}{mb}``): ``RECV_F``/``RECV_B`` post a receive, ``WAIT_F``/``WAIT_B`` block
on it, ``F``/``B`` compute (``RECOMPUTE`` nests inside ``B``; each block's share of F, B and RECOMPUTE is a span
``PP:{stage}F{mb}/L{layer}`` inside it), ``SEND_F``/``SEND_B`` post a send. Sends are never waited
for in line (isend); their completion is collected at the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from collectors import annotations as ann
from collectors.bpipe import Acceptor, Evictor
from collectors.trainer.comm import Transport, Waiter
from collectors.trainer.model import Recompute, Stage
from collectors.trainer.workload import Clock
from traceana.core import names
from traceana.core.pipeline_rules import FORWARD, Op


@dataclass
class StageRunner:
    stage_module: Stage
    stage: int
    stages: int
    actions: list[Op]
    num_microbatches: int
    activation_shape: tuple[int, ...]  # (microbatch_size, seq, hidden): what flows between stages
    transport: Transport
    rank_of_stage: list[int]
    evictor: Evictor | None = None
    acceptor: Acceptor | None = None
    clock: Clock | None = None  # the known workload's record (collect --work sleep): told each forward's micro-batch
    _held: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # mb -> (input, output)
    _sends: list = field(default_factory=list)  # (done event, work, tensor being sent)
    waiter: Waiter = field(default_factory=Waiter)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One training step's forwards and backwards (gradients accumulate in ``.grad``). Returns the mean
        micro-batch loss on the last stage, None elsewhere."""
        losses = []
        if self.acceptor:
            self.acceptor.start_step()
        for index, action in enumerate(self.actions):
            self._prune_sends()
            if self.acceptor:
                self.acceptor.progress()  # a return that completed frees its buffers now, not after our next backward
            if (action.action == FORWARD and self.first) or (action.action != FORWARD and self.last):
                self.transport.flush()  # this action receives nothing: post held sends (NCCL batching)
            if self.evictor:
                for victim in self.evictor.plan.evict_before.get(index, ()):
                    x, y = self._held[victim]
                    self.evictor.evict(victim, held=(x, y, inputs, targets))
                # Post a load's receive as soon as the plan has room for it: before the forward that precedes its
                # backward (the plan's keep counts that load during the forward), else before the backward. The
                # acceptor's return then completes early and frees its buffer before it accepts the next.
                load = self.evictor.plan.load_before.get(index + 1) if action.action == FORWARD else None
                if load is not None:
                    self.evictor.prefetch(load)
                if index in self.evictor.plan.load_before and not self.evictor.bundles[action.microbatch].loads:
                    self.evictor.prefetch(action.microbatch)  # overlaps the wait for the incoming gradient
            if action.action == FORWARD:
                loss = self.forward(action.microbatch, inputs, targets, capture=self._captures(action.microbatch))
                if loss is not None:
                    losses.append(loss)
            else:
                self.backward(action.microbatch)
                if self.acceptor:  # after our gradient is on its way: the evictor needs it before it needs the load
                    self.acceptor.after_backward(index, action.microbatch)
        self.transport.flush()
        for done, _, _ in self._sends:
            done.wait()
        self._sends.clear()
        if self.evictor:
            self.evictor.finish_step()
        if self.acceptor:
            self.acceptor.finish_step()
        return sum(losses) / len(losses) if losses else None

    def _captures(self, mb: int) -> bool:
        return self.evictor is not None and mb in self.evictor.plan.order

    def forward(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor, *, capture: bool) -> float | None:
        s = self.stage
        if self.first:
            x = inputs[mb].to(self.transport.device)
        else:
            with ann.annotate(s, names.RECV_F, mb):
                transfer = self.transport.irecv(self.activation_shape, torch.float32, self.rank_of_stage[s - 1])
            with ann.annotate(s, names.WAIT_F, mb):
                x = transfer.wait().requires_grad_()
        target = targets[mb].to(self.transport.device) if self.last else None
        hooks = self.evictor.capture(mb) if capture else None
        if self.clock is not None:
            self.clock.microbatch = mb
        with ann.forward(s, mb), ann.running(s, names.FORWARD, mb):  # (the blocks' spans: PP:{s}F{mb}/L{layer})
            if hooks is not None:
                with hooks:
                    y = self.stage_module(x, target)
            else:
                y = self.stage_module(x, target)
        self._held[mb] = (x, y)
        if not self.last:
            with ann.annotate(s, names.SEND_F, mb):
                self._send(y, self.rank_of_stage[s + 1])
        return float(y.detach()) if self.last else None

    def backward(self, mb: int) -> None:
        s = self.stage
        x, y = self._held.pop(mb)
        grad = None
        if not self.last:
            with ann.annotate(s, names.RECV_B, mb):
                transfer = self.transport.irecv(self.activation_shape, torch.float32, self.rank_of_stage[s + 1])
            with ann.annotate(s, names.WAIT_B, mb):
                grad = transfer.wait()
        if self.evictor and mb in self.evictor.bundles and self.evictor.bundles[mb].loads:
            self.evictor.load(mb)
        Recompute.label_during_backward = lambda: ann.recompute(s, mb)
        try:
            with ann.backward(s, mb), ann.running(s, names.BACKWARD, mb):
                if self.last:
                    (y / self.num_microbatches).backward()  # mean over micro-batches = the full batch's mean loss
                else:
                    torch.autograd.backward(y, grad)
        finally:
            Recompute.label_during_backward = None
        if self.evictor:
            self.evictor.release(mb)
        if not self.first:
            with ann.annotate(s, names.SEND_B, mb):
                self._send(x.grad, self.rank_of_stage[s - 1])
        del x, y

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        work, sent = self.transport.isend(tensor, dst)
        self._sends.append((self.waiter.watch([work]), work, sent))

    def _prune_sends(self) -> None:
        """Drop completed sends so their tensors (e.g. input gradients) are freed when they would be in a real run."""
        self._sends = [entry for entry in self._sends if not entry[0].is_set()]
