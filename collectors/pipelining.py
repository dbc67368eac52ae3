"""Per-micro-batch annotations for ``torch.distributed.pipelining`` schedules, with one call.

``Schedule1F1B`` emits no forward/backward annotations at all and ``ScheduleGPipe`` emits stage-less
``Forward {i}`` / ``Backward {i}`` spans that also cover its P2P waits (docs/field-notes.md). ``annotate(schedule)`` wraps
each of the schedule's ``PipelineStage`` objects so that every ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` runs inside ``PP:{stage}F{mb}`` / ``PP:{stage}B{mb}`` (``I`` for an input-only
backward of zero-bubble schedules) / ``PP:{stage}W{mb}``. The user's model is untouched: only the stage objects'
methods are wrapped, on the instance.

Runtime schedules (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, …; subclasses of
``_PipelineScheduleRuntime``) already wrap every action in ``PP:{stage}{action}{mb}``; ``annotate`` leaves them alone
so no span is doubled.

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    collectors.pipelining.annotate(schedule)
"""

from __future__ import annotations

import functools
from typing import Any

from collectors.annotations import annotate as pp_span
from traceana.core import names

_MARK = "_traceana_annotated"


def stages_of(schedule: Any) -> list[Any]:
    """The PipelineStage objects a schedule drives (single-stage schedules keep one in ``_stage``)."""
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    if hasattr(schedule, "_stage"):
        return [schedule._stage]
    raise TypeError(f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule")


def emits_pp_annotations(schedule: Any) -> bool:
    """True for runtime schedules, which already annotate every action with ``PP:{stage}{action}{mb}``."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(schedule, _PipelineScheduleRuntime)


def annotate(schedule: Any) -> Any:
    """Annotate a schedule's stages in place (idempotent); returns the schedule."""
    if not emits_pp_annotations(schedule):
        for stage in stages_of(schedule):
            annotate_stage(stage)
    return schedule


def annotate_stage(stage: Any) -> Any:
    """Wrap one PipelineStage's compute methods in PP: spans (idempotent)."""
    if getattr(stage, _MARK, False):
        return stage
    index = stage.stage_index

    forward = stage.forward_one_chunk

    @functools.wraps(forward)
    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with pp_span(index, names.FORWARD, fwd_chunk_id):
            return forward(fwd_chunk_id, *args, **kwargs)

    backward = stage.backward_one_chunk

    @functools.wraps(backward)
    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        action = names.BACKWARD if full else names.BACKWARD_INPUT
        with pp_span(index, action, bwd_chunk_id):
            return backward(bwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    if hasattr(stage, "backward_weight_one_chunk"):
        weight = stage.backward_weight_one_chunk

        @functools.wraps(weight)
        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            with pp_span(index, names.BACKWARD_WEIGHT, bwd_chunk_id):
                return weight(bwd_chunk_id, *args, **kwargs)

        stage.backward_weight_one_chunk = backward_weight_one_chunk
    setattr(stage, _MARK, True)
    return stage
