"""The annotation contract between collectors and analysers: the only module that spells these names.

We follow PyTorch's own pipelining convention ``PP:{stage}{ACTION}{microbatch}`` (torch.distributed.pipelining's
runtime schedules emit e.g. ``PP:1F0``, ``PP:1RECV_F0``, ``PP:5SEND_B2``, ``PP:4W3``) and add our own actions for
recompute, blocking waits and BPipe transfers. PyTorch's GPipe schedule emits ``Forward {i}`` / ``Backward {i}``.
"""

from __future__ import annotations

import re

import polars as pl

# --- PyTorch's actions -------------------------------------------------------------------------------------------
FORWARD = "F"
BACKWARD = "B"  # full backward (input + weight gradients)
BACKWARD_INPUT = "I"  # zero-bubble schedules split B into I and W
BACKWARD_WEIGHT = "W"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"
OVERLAP_F_B = "OVERLAP_F_B"  # DualPipeV: one span running a forward and a backward, ``PP:(0F7;7B3)OVERLAP_F_B``
UNSHARD = "UNSHARD"  # FSDP inside the pipeline: gather / free a stage's parameters, reduce its gradients
RESHARD = "RESHARD"
REDUCE_GRAD = "REDUCE_GRAD"
# --- ours -------------------------------------------------------------------------------------------------------
RECOMPUTE = "RECOMPUTE"  # nested inside B
WAIT_F = "WAIT_F"  # blocked waiting for an incoming activation
WAIT_B = "WAIT_B"  # blocked waiting for an incoming gradient
EVICT = "EVICT"  # BPipe evictor sends a micro-batch's saved activations to its partner
LOAD = "LOAD"  # BPipe evictor gets them back before the backward
ACCEPT = "ACCEPT"  # BPipe acceptor receives and stores a partner's activations
RETURN = "RETURN"  # BPipe acceptor sends them back
OPTIMIZER = "OPT"  # optimizer step (no micro-batch)

ACTIONS = (
    FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_F, RECV_F, SEND_B, RECV_B,
    OVERLAP_F_B, UNSHARD, RESHARD, REDUCE_GRAD, RECOMPUTE, WAIT_F, WAIT_B, EVICT, LOAD, ACCEPT, RETURN, OPTIMIZER,
)
COMPUTE_ACTIONS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE, OPTIMIZER)
BPIPE_ACTIONS = (EVICT, LOAD, ACCEPT, RETURN)

# Phase names used in tables (schedule.phase, attribution categories): one per compute action. Zero-bubble
# schedules split the backward into its input-gradient (I) and weight-gradient (W) halves (Qi et al. 2023, §2):
# each keeps its own phase, so a (stage, micro-batch) has one backward, or one I and one W, never two backwards.
PHASE_OF_ACTION = {
    FORWARD: "forward",
    BACKWARD: "backward",
    BACKWARD_INPUT: "backward_input",
    BACKWARD_WEIGHT: "backward_weight",
    RECOMPUTE: "recompute",
    OPTIMIZER: "optimizer",
}
# The phases of a micro-batch's passes through a stage (what "the schedule" of a rank is made of).
PASS_PHASES = ("forward", "backward", "backward_input", "backward_weight")
BACKWARD_PHASES = PASS_PHASES[1:]

PP_PATTERN = r"^PP:(\d+)([A-Z_]+)(\d*)$"
_PP_RE = re.compile(PP_PATTERN)
# torch writes an overlapped action as its sub-actions in run order: ``PP:({stage}{F|B|I}{mb};…)OVERLAP_F_B``.
OVERLAP_PATTERN = r"^PP:\((\d+)([FBIW])(\d+);(\d+)([FBIW])(\d+)\)OVERLAP_F_B$"
GPIPE_PATTERN = r"^(Forward|Backward) (\d+)$"  # torch.distributed.pipelining ScheduleGPipe
STEP_PATTERN = r"^ProfilerStep#(\d+)$"

# Communication op names seen in Kineto traces (docs/field-notes.md).
GLOO_SEND = "gloo:send"
GLOO_RECV = "gloo:recv"
C10D_SEND = "c10d::send"
C10D_RECV = "c10d::recv_"
RECORD_PARAM_COMMS = "record_param_comms"
NCCL_KERNEL_PREFIXES = ("ncclDevKernel", "ncclKernel")
NCCL_P2P_KERNEL_MARKER = "SendRecv"

NCCL_SEND = "nccl:send"
NCCL_RECV = "nccl:recv"
GLOO_PREFIX = "gloo:"  # every gloo collective/P2P span (gloo:all_reduce, gloo:broadcast, …)
C10D_PREFIX = "c10d::"  # c10d dispatcher ops (c10d::allreduce_, c10d::barrier, …)
NCCL_OP_PREFIX = "nccl:"  # NCCL's own cpu-side record_function names (nccl:all_reduce, …)
P2P_COLL_NAMES = ("send", "recv", "isend", "irecv")  # record_param_comms "Collective name" of P2P ops
# Names PyTorch itself records without any annotation from us (torch.optim wraps step/zero_grad in
# record_function("Optimizer.step#{cls}.step"); autograd records one op per backward node).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
OPTIMIZER_ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"

# Process-group descriptions our collector gives to BPipe's own group, so its traffic is told apart from P2P.
BPIPE_GROUP_DESC = "traceana_bpipe"


def pp_label(stage: int, action: str, microbatch: int | None = None) -> str:
    """The annotation name for one pipeline action, e.g. ``pp_label(1, "F", 0) == "PP:1F0"``."""
    if action not in ACTIONS:
        raise ValueError(f"unknown pipeline action {action!r}; known: {', '.join(ACTIONS)}")
    return f"PP:{stage}{action}{'' if microbatch is None else microbatch}"


def parse_pp_label(name: str) -> tuple[int, str, int | None] | None:
    """``"PP:1F0" -> (1, "F", 0)``; None when the name is not a pipeline annotation."""
    m = _PP_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None


def pp_columns(name: pl.Expr) -> dict[str, pl.Expr]:
    """Vectorised parse of PP: and GPipe names: expressions for ``pp_stage``, ``pp_action``, ``pp_microbatch``.

    GPipe's ``Forward {i}`` / ``Backward {i}`` carry no stage (null) and map to actions F / B. An overlapped span
    gets action ``OVERLAP_F_B`` and no stage or micro-batch: ``overlap_columns`` parses its two sub-actions.
    """
    gp_kind = name.str.extract(GPIPE_PATTERN, 1)
    gp_mb = name.str.extract(GPIPE_PATTERN, 2)
    stage_text = name.str.extract(PP_PATTERN, 1)
    mb_text = pl.coalesce(name.str.extract(PP_PATTERN, 3).replace("", None), gp_mb)
    stage, mb = stage_text.cast(pl.Int32, strict=False), mb_text.cast(pl.Int32, strict=False)
    # A number too large for int32 (PP:1F99999999999999999999999) is no stage or micro-batch: not an annotation.
    fits = (stage_text.is_null() | stage.is_not_null()) & (mb_text.is_null() | mb.is_not_null())
    action = pl.coalesce(
        name.str.extract(PP_PATTERN, 2),
        pl.when(gp_kind == "Forward").then(pl.lit(FORWARD)).when(gp_kind == "Backward").then(pl.lit(BACKWARD)),
    )
    return {
        "pp_stage": pl.when(fits).then(stage),
        "pp_action": pl.coalesce(pl.when(fits).then(action),
                                 pl.when(name.str.contains(OVERLAP_PATTERN)).then(pl.lit(OVERLAP_F_B))),
        "pp_microbatch": pl.when(fits).then(mb),
    }


def overlap_columns(name: pl.Expr) -> dict[str, pl.Expr]:
    """The two sub-actions of ``PP:(0F7;7B3)OVERLAP_F_B``, in run order: ``first_stage, first_action, first_mb,
    second_stage, second_action, second_mb`` (null for other names)."""
    out = {}
    for i, which in enumerate(("first", "second")):
        out[f"{which}_stage"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 1).cast(pl.Int32, strict=False)
        out[f"{which}_action"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 2)
        out[f"{which}_mb"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 3).cast(pl.Int32, strict=False)
    return out
