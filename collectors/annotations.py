"""Annotations for the ``PP:{stage}{ACTION}{microbatch}`` contract (docs/architecture.md).

Names come from ``traceana.core.names`` only; collectors spell no annotation themselves. Each helper returns a
``torch.profiler.record_function`` context manager, which costs next to nothing when no profiler is running.
"""

from __future__ import annotations

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
