"""Annotations for the ``PP:{stage}{ACTION}{microbatch}`` contract (docs/architecture.md).

Names come from ``traceana.core.names`` only; collectors spell no annotation themselves. Each helper returns a
``torch.profiler.record_function`` context manager, which costs next to nothing when no profiler is running.
Inside a pass, each transformer block's share is a span of its own (``PP:1F0/L5``: ``layer``, ``LayerBackward``;
docs/schedules.md "Layer spans").
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from traceana.core import names


def annotate(stage: int, action: str, microbatch: int | None = None) -> record_function:
    """``with annotate(1, names.FORWARD, 0): ...`` records a span named ``PP:1F0``."""
    return record_function(names.pp_label(stage, action, microbatch))


def forward(stage: int, microbatch: int) -> record_function:
    return annotate(stage, names.FORWARD, microbatch)


def backward(stage: int, microbatch: int) -> record_function:
    return annotate(stage, names.BACKWARD, microbatch)


def recompute(stage: int, microbatch: int) -> record_function:
    return annotate(stage, names.RECOMPUTE, microbatch)


def optimizer(stage: int) -> record_function:
    return annotate(stage, names.OPTIMIZER)


# --- layer spans: each transformer block's share of a pass (names.layer_label: ``PP:1F0/L5``) -------------------
class Pass:
    """The pass the stage runner runs now, ``(stage, action, micro-batch)``: set around each forward and backward
    (``running``) so that the blocks inside it name their share; None elsewhere (the single-process reference, a
    shape or layout measurement, torch.distributed.pipelining's stages): no layer spans there."""

    current: tuple[int, str, int] | None = None


class running:
    """``with running(1, names.FORWARD, 0): ...``: the blocks run inside are the pass ``PP:1F0``'s."""

    def __init__(self, stage: int, action: str, microbatch: int) -> None:
        self.now = (stage, action, microbatch)

    def __enter__(self) -> None:
        self.was, Pass.current = Pass.current, self.now

    def __exit__(self, *exc) -> None:
        Pass.current = self.was


def layer(index: int, action: str | None = None) -> record_function | None:
    """The span of block ``index``'s share of the current pass (its action, or ``action``: RECOMPUTE), or None
    outside a pass."""
    now = Pass.current
    if now is None:
        return None
    return record_function(names.layer_label(now[0], action or now[1], now[2], index))


class LayerBackward:
    """One block's backward span, opened when the gradient reaches the block's output and closed when it has
    reached the block's input (two identity autograd nodes, ``edges``): what autograd ran in between is that
    block's backward (its nodes were recorded between the two, and the engine runs a later-recorded node first)."""

    def __init__(self, index: int) -> None:
        self.index, self.span = index, None

    def open(self) -> None:
        span = layer(self.index)
        if span is not None:
            span.__enter__()
            self.span = span

    def close(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None


class _Edge(torch.autograd.Function):
    """Identity; its backward opens (at a block's output) or closes (at its input) the block's backward span."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, span: LayerBackward, opens: bool) -> torch.Tensor:
        ctx.span, ctx.opens = span, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.span.open() if ctx.opens else ctx.span.close()
        return grad, None, None


def block_input(x: torch.Tensor, span: LayerBackward) -> torch.Tensor:
    """``x`` (a block's input) whose gradient's arrival closes the block's backward span."""
    return _Edge.apply(x, span, False) if x.requires_grad and torch.is_grad_enabled() else x


def block_output(y: torch.Tensor, span: LayerBackward) -> torch.Tensor:
    """``y`` (a block's output) whose gradient's arrival opens the block's backward span."""
    return _Edge.apply(y, span, True) if y.requires_grad and torch.is_grad_enabled() else y
