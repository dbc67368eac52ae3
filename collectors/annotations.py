"""Annotations for the ``PP:{stage}{ACTION}{microbatch}`` contract (docs/architecture.md).

Names come from ``traceana.core.names`` only; collectors spell no annotation themselves. Each helper returns a
``torch.profiler.record_function`` context manager, which costs next to nothing when no profiler is running.
Inside a pass, each transformer block's share is a span of its own (``PP:1F0/L5``: ``layer``, ``LayerBackward``;
docs/naming.md "Layer spans").
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
# Recorded only while a profiler records (torch.autograd._profiler_enabled(): a flag read, ~30 ns), so unprofiled
# steps run as before; while it records, a block adds two spans and two tensor hooks (about 20 µs a block's F + B).
class Pass:
    """The pass the stage runner runs now, ``(stage, action, micro-batch)``: set around each forward and backward
    (``running``) so that the blocks inside it name their share; None elsewhere (the single-process reference, a
    shape or layout measurement, torch.distributed.pipelining's stages): no layer spans there. ``backward``: the
    forward pass's ``LayerBackward`` (its blocks' backward spans, one open at a time)."""

    current: tuple[int, str, int] | None = None
    backward: "LayerBackward | None" = None


class running:
    """``with running(1, names.FORWARD, 0): ...``: the blocks run inside are the pass ``PP:1F0``'s."""

    def __init__(self, stage: int, action: str, microbatch: int) -> None:
        self.now = (stage, action, microbatch)

    def __enter__(self) -> None:
        self.was = Pass.current, Pass.backward
        Pass.current = self.now
        Pass.backward = LayerBackward() if self.now[1] == names.FORWARD else None

    def __exit__(self, *exc) -> None:
        Pass.current, Pass.backward = self.was


def recording() -> bool:
    """Whether layer spans are recorded now: inside a runner's pass, with a profiler recording."""
    return Pass.current is not None and torch.autograd._profiler_enabled()


def layer(index: int, action: str | None = None) -> record_function | None:
    """The span of block ``index``'s share of the current pass (its action, or ``action``: RECOMPUTE), or None
    where none is recorded (``recording``)."""
    if not recording():
        return None
    now = Pass.current
    return record_function(names.layer_label(now[0], action or now[1], now[2], index))


class LayerBackward:
    """The backward spans of one forward pass's blocks: autograd runs a later-recorded node first, so a block's
    backward is what runs from the gradient's arrival at its output to its arrival at its input. A hook on each
    block's output opens its span (closing the one open: the next block's, whose input this output is) and a hook
    on its input closes it if it is still the open one (on a tensor that is one block's input and the previous
    one's output the opening hook, registered first, runs first)."""

    def __init__(self) -> None:
        self.open_layer, self.span = None, None

    def opened(self, index: int):
        def hook(grad):
            self._close()
            span = layer(index)
            if span is not None:
                span.__enter__()
                self.open_layer, self.span = index, span
        return hook

    def closed(self, index: int):
        def hook(grad):
            if self.open_layer == index:
                self._close()
        return hook

    def _close(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.open_layer, self.span = None, None


def block_input(x: torch.Tensor, index: int) -> None:
    """Mark ``x``, block ``index``'s input: its gradient's arrival closes the block's backward span."""
    if Pass.backward is not None and x.requires_grad and recording():
        x.register_hook(Pass.backward.closed(index))


def block_output(y: torch.Tensor, index: int) -> torch.Tensor:
    """Mark ``y``, block ``index``'s output: its gradient's arrival opens the block's backward span."""
    if Pass.backward is not None and y.requires_grad and recording():
        y.register_hook(Pass.backward.opened(index))
    return y
