"""The annotation contract between collectors and analysers: the only module that spells these names.

We follow PyTorch's own pipelining convention ``PP:{stage}{ACTION}{microbatch}`` (torch.distributed.pipelining's
runtime schedules emit e.g. ``PP:1F0``, ``PP:1RECV_F0``, ``PP:5SEND_B2``, ``PP:4W3``) and add our own actions for
recompute, blocking waits and BPipe transfers. PyTorch's GPipe schedule emits ``Forward {i}`` / ``Backward {i}``.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from traceana.core.errors import BadInputError
from traceana.core.files import open_regular
from traceana.core.units import MIB

if TYPE_CHECKING:
    import polars as pl
# polars is imported by the functions that build expressions: the names themselves are read by the native scanner's
# reader before polars is imported (traceana.ingest.reading).

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

PP_PREFIX = "PP:"  # every name of the contract starts so (PP_PATTERN, OVERLAP_PATTERN)
PP_PATTERN = rf"^{PP_PREFIX}(\d+)([A-Z_]+)(\d*)$"
_PP_RE = re.compile(PP_PATTERN)
# torch writes an overlapped action as its sub-actions in run order: ``PP:({stage}{F|B|I}{mb};…)OVERLAP_F_B``.
OVERLAP_PATTERN = rf"^{PP_PREFIX}\((\d+)([FBIW])(\d+);(\d+)([FBIW])(\d+)\)OVERLAP_F_B$"
# One transformer block's share of a pass: the pass's name and ``/L{layer}`` (the block's index in the whole model),
# e.g. ``PP:1F0/L5``, ``PP:1B0/L5``, ``PP:1RECOMPUTE0/L5``: nested inside the pass's own span (the reference trainer,
# docs/naming.md "Layer spans"). Not an annotation of the contract (PP_PATTERN ends at the micro-batch): a span,
# not work, read by ``layer_columns`` only. A block's backward may be more than one span (the known workload holds
# a full backward's input and weight parts apart): its work is their sum.
LAYER_PATTERN = rf"^{PP_PREFIX}(\d+)([A-Z_]+)(\d+)/L(\d+)$"
LAYER_ACTIONS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE)
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
# Communication kernels, recognised by family and not by one library's spelling (a GPU kernel whose name matches
# is communication, whatever launched it; a user's name rule with another kind still wins, docs/naming.md):
# - NCCL and its ports and forks: ``ncclDevKernel_*`` / ``ncclKernel_*`` (NCCL), the same names or ``rccl*`` (RCCL
#   on ROCm), ``mscclKernel_*`` (MSCCL), ``ncclx`` builds — in any namespace;
# - expert-parallel all-to-all kernels in any namespace named ``ep``, ``…_ep``, ``deepep``, ``ep_…`` (DeepEP's
#   ``deep_ep::intranode::…``, a fork's ``my_ep::internode_ll::dispatch``, ``ep::combine``): the intranode/internode/
#   internode_ll families, and dispatch, combine and their notify steps in any namespace of such a library
#   (``…::layout::…`` stays compute);
# - the families every such library names alike: all-to-all (``all_to_all``, ``alltoall``), send/receive
#   (``SendRecv``, ``Sendrecv``) and the all-to-all's notify steps (``notify_dispatch``, ``cached_notify_combine``).
COMM_LIBRARY_KERNEL_PATTERN = r"(?i)^(?:void\s+)?(?:\w+::)*(?:nccl|rccl|msccl)"
EP_KERNEL_PATTERN = (r"(?:^|\W)(?:\w*_|deep)?ep(?:_\w+)?::(?:(?:intranode|internode|internode_ll)::"
                     r"|(?:\w+::)*(?:\w*notify\w*|dispatch|combine)\b)")
COMM_KERNEL_FAMILY_PATTERN = r"(?i)all_?to_?all|send_?recv|(?:cached_)?notify_(?:dispatch|combine)"
COMM_KERNEL_PATTERNS = (COMM_LIBRARY_KERNEL_PATTERN, EP_KERNEL_PATTERN, COMM_KERNEL_FAMILY_PATTERN)

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


def layer_label(stage: int, action: str, microbatch: int, layer: int) -> str:
    """The span of block ``layer``'s share of one pass, e.g. ``layer_label(1, "F", 0, 5) == "PP:1F0/L5"``."""
    if action not in LAYER_ACTIONS:
        raise ValueError(f"no layer span for action {action!r}; known: {', '.join(LAYER_ACTIONS)}")
    return f"{pp_label(stage, action, microbatch)}/L{layer}"


def layer_columns(name: pl.Expr) -> dict[str, pl.Expr]:
    """Vectorised parse of layer spans (``LAYER_PATTERN``): ``stage``, ``action``, ``microbatch``, ``layer`` (null
    for other names, and for numbers too large for int32)."""
    import polars as pl

    return {"stage": name.str.extract(LAYER_PATTERN, 1).cast(pl.Int32, strict=False),
            "action": name.str.extract(LAYER_PATTERN, 2),
            "microbatch": name.str.extract(LAYER_PATTERN, 3).cast(pl.Int32, strict=False),
            "layer": name.str.extract(LAYER_PATTERN, 4).cast(pl.Int32, strict=False)}


def parse_pp_label(name: str) -> tuple[int, str, int | None] | None:
    """``"PP:1F0" -> (1, "F", 0)``; None when the name is not a pipeline annotation."""
    m = _PP_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None


def text(name: pl.Expr) -> pl.Expr:
    """An events table's ``name`` as text, for ``.str`` functions: the column is categorical (schema.EVENTS), whose
    text costs a string per row, so use it on a few rows (a filtered frame); on many rows ``name_test``."""
    import polars as pl

    return name.cast(pl.String)


def name_test(name: pl.Expr, test: Callable[[pl.Expr], pl.Expr]) -> pl.Expr:
    """``test`` (an expression over text, e.g. ``lambda t: t.str.starts_with("PP:")``) of each row's name, evaluated
    once per distinct name and found by membership of the passing names (null for a null name, as ``.str`` gives):
    on the events table, where casting every name to text costs ~100 ns an event (docs/performance.md "Memory")."""
    # (In order of first appearance: polars finds a categorical column's distinct values in about half the time of
    # its unordered unique, and the expression is evaluated twice here, as a lean query plans it.)
    distinct = name.unique(maintain_order=True)
    return name.is_in(distinct.filter(test(text(distinct))).implode())


def backward_like(name: pl.Expr) -> pl.Expr:
    """Whether each name is backward work: one of autograd's per-node ops (``AUTOGRAD_PREFIX``) or a ``…Backward``
    node (``name_test``: once per distinct name)."""
    return name_test(name, lambda t: t.str.starts_with(AUTOGRAD_PREFIX) | t.str.contains(r"Backward\d*$"))


def pp_columns(name: pl.Expr) -> dict[str, pl.Expr]:
    """Vectorised parse of PP: and GPipe names: expressions for ``pp_stage``, ``pp_action``, ``pp_microbatch``.

    GPipe's ``Forward {i}`` / ``Backward {i}`` carry no stage (null) and map to actions F / B. An overlapped span
    gets action ``OVERLAP_F_B`` and no stage or micro-batch: ``overlap_columns`` parses its two sub-actions.
    """
    import polars as pl

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
    import polars as pl

    out = {}
    for i, which in enumerate(("first", "second")):
        out[f"{which}_stage"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 1).cast(pl.Int32, strict=False)
        out[f"{which}_action"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 2)
        out[f"{which}_mb"] = name.str.extract(OVERLAP_PATTERN, 3 * i + 3).cast(pl.Int32, strict=False)
    return out


# --- other frameworks' names: rules mapping a name to a phase or a kind ------------------------------------------
# The PP: contract above is always read. Other conventions are name rules: a regular expression on the event name,
# giving a phase (CPU-side spans: record_function annotations and, with ``with_stack=True``, the Python frames
# Kineto records as ``path.py(LINE): function``) or a kind (any event: a GPU kernel, a CPU op, a span). Built-in
# rules cover the public frameworks below; a rules file (docs/naming.md) adds a user's own, ahead of them.
PHASES = tuple(PHASE_OF_ACTION.values())
ACTION_OF_PHASE = {phase: action for action, phase in PHASE_OF_ACTION.items()}
# What a name can make an event. A P2P message needs a peer, so not by name; ``p2p_call`` marks the span of a
# framework's P2P helper (Megatron's send_forward, DeepSpeed's SendActivation, …): the host time inside it that no
# op covers and no wait explains is that helper's own cost (building the ops, allocating receive buffers), P2P's.
RULE_KINDS = ("compute", "collective", "other", "p2p_call")
ORDER = "order"  # ``microbatch = "order"``: numbered 0, 1, … in order of appearance per (rank, step, stage, phase)
RULE_KEYS = ("match", "phase", "kind", "channel", "microbatch")
EXPERT_PARALLEL = "ep"  # the channel of expert-parallel all-to-all communication (DeepEP)


@dataclass(frozen=True)
class NameRule:
    """One rule: events whose name matches ``match`` get ``phase`` (CPU spans) and/or ``kind`` (any event).

    ``match`` is a regular expression searched in the name (anchor it with ``^…$``; the syntax both Python's ``re``
    and polars' Rust engine accept: no look-around, no back-references). Named groups ``(?P<stage>\\d+)`` and
    ``(?P<microbatch>\\d+)`` give the stage and micro-batch; ``microbatch = "order"`` numbers the matches in order of
    appearance instead (right for schedules that run one stage per rank, whose forwards and backwards each go in
    micro-batch order: 1F1B, GPipe). ``channel`` labels a collective (``"ep"``: expert-parallel all-to-all)."""

    match: str
    phase: str | None = None
    kind: str | None = None
    channel: str | None = None
    microbatch: str | None = None  # None | "order"; a (?P<microbatch>…) group is read from ``match`` itself
    source: str = "rules"  # where the rule comes from, for notes: "built-in megatron", "rules.toml rule 2"

    def group(self, name: str) -> int | None:
        """The index of named group ``name`` in ``match`` (Python and Rust number groups alike), or None."""
        return re.compile(self.match).groupindex.get(name)


def _builtin(source: str, *rules: tuple[str, dict]) -> tuple[NameRule, ...]:
    return tuple(NameRule(match=m, source=f"built-in {source}", **kw) for m, kw in rules)


# Megatron-LM (megatron.core.pipeline_parallel.schedules) records no record_function of its own (its ranges are NVTX,
# which Kineto does not keep): its forward_step / backward_step appear as Python frames with ``with_stack=True``,
# e.g. ``megatron/core/pipeline_parallel/schedules.py(402): forward_step`` (older trees: ``megatron/schedules.py``).
# Its P2P helpers (p2p_communication's send_forward, recv_backward, send_forward_recv_backward, …) run c10d ops,
# which are read as P2P already; their frames are P2P calls (``p2p_call``): their own Python is P2P time too.
_MEGATRON = r"megatron/(?:core/pipeline_parallel/)?schedules\.py\(\d+\): "
_MEGATRON_P2P = (r"megatron/(?:core/pipeline_parallel/)?p2p_communication\.py\(\d+\): "
                 r"(?:send|recv)_(?:forward|backward)\w*$")
# DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/engine.py) runs its pipe instructions ForwardPass, BackwardPass,
# OptimizerStep, Send/RecvActivation, Send/RecvGrad through ``_exec_forward_pass`` etc., seen the same way.
_DEEPSPEED = r"deepspeed/runtime/pipe/engine\.py\(\d+\): "
BUILTIN_RULES: dict[str, tuple[NameRule, ...]] = {
    # torch.distributed's own collective functions, seen as Python frames: a synchronous call spans its wait(), for
    # which gloo records no span of its own (a CPU rank blocked in it would otherwise look idle, or busy in the
    # phase whose window holds it).
    "torch": _builtin(
        "torch",
        (r"torch/distributed/distributed_c10d\.py\(\d+\): (?:all_reduce|broadcast|all_gather|all_gather_into_tensor"
         r"|reduce_scatter|reduce_scatter_tensor|all_to_all|all_to_all_single|barrier|reduce|gather|scatter)$",
         dict(kind="collective")),
    ),
    "megatron": _builtin(
        "megatron",
        (rf"{_MEGATRON}forward_step$", dict(phase="forward", microbatch=ORDER)),
        (rf"{_MEGATRON}backward_step$", dict(phase="backward", microbatch=ORDER)),
        # The data-parallel gradient reduction after the last backward (all-reduce / reduce-scatter and its wait).
        (r"megatron/core/distributed/finalize_model_grads\.py\(\d+\): finalize_model_grads$",
         dict(kind="collective")),
        (_MEGATRON_P2P, dict(kind="p2p_call")),
    ),
    "deepspeed": _builtin(
        "deepspeed",
        (rf"{_DEEPSPEED}_exec_forward_pass$", dict(phase="forward", microbatch=ORDER)),
        (rf"{_DEEPSPEED}_exec_backward_pass$", dict(phase="backward", microbatch=ORDER)),
        (rf"{_DEEPSPEED}_exec_optimizer_step$", dict(phase="optimizer")),
        # ReduceGrads / ReduceTiedGrads (the data-parallel and tied-weight all-reduces) and the loss broadcast from
        # the last stage: collectives whose wait() gloo records no span for — only its Python frame shows it.
        (rf"{_DEEPSPEED}(?:_exec_reduce_grads|_exec_reduce_tied_grads|_aggregate_total_loss)$",
         dict(kind="collective")),
        # SendActivation / RecvActivation / SendGrad / RecvGrad: P2P calls (their own Python is P2P time too)
        (rf"{_DEEPSPEED}_exec_(?:send|recv)_(?:activations|grads)$", dict(kind="p2p_call")),
    ),
    # DualPipe (DeepSeek-V3 §3.2.1) annotates each chunk's pieces ``attn(F)``, ``mlp(B)``, ``mlp(W)``,
    # ``dispatch(F)``, ``combine(B)``: F forward, B the backward for inputs, W the backward for weights (split off
    # and deferred, as in zero-bubble). No stage or micro-batch is in the name.
    "dualpipe": _builtin(
        "dualpipe",
        (r"^(?:attn|mlp|dispatch|combine)\(F\)$", dict(phase="forward")),
        (r"^(?:attn|mlp|dispatch|combine)\(B\)$", dict(phase="backward_input")),
        (r"^(?:attn|mlp)\(W\)$", dict(phase="backward_weight")),
    ),
    # DeepEP's expert-parallel all-to-all kernels (csrc/kernels/intranode.cu, internode.cu, internode_ll.cu:
    # ``void deep_ep::intranode::dispatch<…>(…)``, ``…::combine``, ``notify_dispatch``, ``cached_notify_combine``),
    # in any namespace of that name (``…_ep``, ``deepep``: real builds differ: EP_KERNEL_PATTERN): communication, not NCCL (a kernel
    # of that family is communication even without this rule, COMM_KERNEL_PATTERNS; the rule labels its channel
    # "ep"). ``deep_ep::layout::…`` (the dispatch layout) is local work and stays compute.
    "deepep": _builtin(
        "deepep",
        (EP_KERNEL_PATTERN, dict(kind="collective", channel=EXPERT_PARALLEL)),
    ),
}
BUILTINS = tuple(BUILTIN_RULES)


@dataclass(frozen=True)
class NameRules:
    """The name rules of one analysis, in the order they are tried (the first match wins): a rules file's own,
    then the built-ins it keeps on (all by default)."""

    rules: tuple[NameRule, ...] = ()
    builtins: tuple[str, ...] = BUILTINS
    origin: str = "built-in"  # "built-in", a file's path, "run.json"

    @property
    def all(self) -> tuple[NameRule, ...]:
        return self.rules + tuple(r for b in self.builtins for r in BUILTIN_RULES[b])

    def key(self) -> str:
        """A text that changes whenever the rules do (for caches)."""
        return repr([(r.match, r.phase, r.kind, r.channel, r.microbatch) for r in self.all])


DEFAULT_RULES = NameRules()
NO_RULES = NameRules(builtins=(), origin="none")  # only the PP: contract (``--names none``)


def parse_rules(data: object, *, origin: str) -> NameRules:
    """A rules document (a decoded TOML/JSON object: ``builtins = [...]``, ``[[rules]]`` tables) as NameRules, or
    one BadInputError line naming ``origin`` and what to fix. Every regular expression is compiled here, by both
    engines, so a bad one is refused before any trace is read."""
    def bad(what: str) -> BadInputError:
        return BadInputError(what, path=origin, fix="see docs/naming.md for the rules file format")

    if not isinstance(data, dict):
        raise bad(f"a rules file holds a table (builtins, rules), got {type(data).__name__}")
    unknown = sorted(set(data) - {"builtins", "rules"})
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (known: builtins, rules)")
    builtins = data.get("builtins", list(BUILTINS))
    if not isinstance(builtins, list) or not all(isinstance(b, str) and b in BUILTIN_RULES for b in builtins):
        raise bad(f"builtins must be a list of {', '.join(BUILTINS)}, got {builtins!r}"[:300])
    raw = data.get("rules", [])
    if not isinstance(raw, list):
        raise bad(f"rules must be a list of tables, got {type(raw).__name__}")
    rules = []
    for i, r in enumerate(raw, 1):
        where = f"rule {i}"
        if not isinstance(r, dict):
            raise bad(f"{where} must be a table (match, phase or kind, …), got {type(r).__name__}")
        extra = sorted(set(r) - set(RULE_KEYS))
        if extra:
            raise bad(f"{where}: unknown key {extra[0]!r} (known: {', '.join(RULE_KEYS)})")
        match, phase, kind = r.get("match"), r.get("phase"), r.get("kind")
        channel, mb = r.get("channel"), r.get("microbatch")
        if not isinstance(match, str) or not match:
            raise bad(f"{where}: match must be a non-empty regular expression")
        if phase is None and kind is None:
            raise bad(f"{where} ({match!r}) gives neither a phase nor a kind")
        if phase is not None and phase not in PHASES:
            raise bad(f"{where}: unknown phase {phase!r} (known: {', '.join(PHASES)})")
        if kind is not None and kind not in RULE_KINDS:
            raise bad(f"{where}: kind {kind!r} cannot be given by a name (known: {', '.join(RULE_KINDS)})")
        if channel is not None and (kind != "collective" or not isinstance(channel, str) or not channel):
            raise bad(f"{where}: channel (a label such as \"ep\") is for kind = \"collective\" only")
        if mb is not None and (mb != ORDER or phase is None):
            raise bad(f"{where}: microbatch can only be \"order\", on a phase rule (or use a (?P<microbatch>…) group)")
        try:
            groups = re.compile(match).groupindex
            import polars as pl  # polars' regex dialect is not Python's: the rule must compile in both

            pl.Series([""]).str.contains(match)
        except Exception as e:  # re.error, polars' ComputeError: the message says where
            raise bad(f"{where}: bad regular expression {match!r} ({str(e).splitlines()[0][:120]})") from None
        if ("stage" in groups or "microbatch" in groups) and phase is None:
            raise bad(f"{where}: stage/microbatch groups only mean something on a phase rule")
        if "microbatch" in groups and mb == ORDER:
            raise bad(f"{where}: a (?P<microbatch>…) group and microbatch = \"order\" contradict each other")
        rules.append(NameRule(match=match, phase=phase, kind=kind, channel=channel, microbatch=mb,
                              source=f"{origin} rule {i}"))
    return NameRules(rules=tuple(rules), builtins=tuple(dict.fromkeys(builtins)), origin=origin)


def load_rules(path: str | Path) -> NameRules:
    """A rules file (``.toml``, or ``.json``) as NameRules; ``"none"`` is the PP: contract alone and ``"builtin"`` the
    default. One BadInputError line for a missing, unreadable or malformed file."""
    if str(path) in ("none", "builtin"):
        return NO_RULES if str(path) == "none" else DEFAULT_RULES
    p = Path(path)
    try:
        with open_regular(p) as f:
            raw = f.read(MIB + 1)
    except BadInputError:
        raise
    except OSError as e:
        raise BadInputError(f"cannot read the name rules file ({e.strerror or e})", path=p,
                            fix="check the path given to --names") from None
    if len(raw) > MIB:
        raise BadInputError("a name rules file is a few KB; this one is over 1 MiB", path=p,
                            fix="pass the rules file (docs/naming.md), not a trace")
    try:
        text = raw.decode("utf-8")
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except ImportError:
        raise BadInputError("TOML rules files need Python 3.11+", path=p, fix="write the rules as JSON") from None
    except (ValueError, UnicodeDecodeError) as e:
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise BadInputError(f"not valid {kind} ({str(e).splitlines()[0][:160]})", path=p,
                            fix="fix the file (docs/naming.md shows the format)") from None
    return parse_rules(data, origin=str(p))


def rules_for_run(run_dir: str | Path | None, spec: str | dict | None,
                  given: str | Path | NameRules | None) -> NameRules:
    """The rules an analysis uses: ``given`` (``--names``), else run.json's ``"names"`` (a path relative to the run
    directory, or the rules themselves inline: ``spec``, ``Manifest.names``), else the built-ins."""
    if isinstance(given, NameRules):
        return given
    if given is not None:
        return load_rules(given)
    if spec is None:
        return DEFAULT_RULES
    if isinstance(spec, str):
        base = Path(run_dir) if run_dir is not None else Path(".")
        base = base if base.is_dir() else base.parent
        return load_rules(spec if spec in ("none", "builtin") else base / spec)
    return parse_rules(spec, origin="run.json names")


# The name rules are one concept with one keyword wherever they are given: ``names=`` in Python, ``--names`` on the
# command line, ``"names"`` in run.json. These older keywords are still accepted, with a DeprecationWarning.
OLD_NAMES_KEYWORDS = ("name_rules", "names_from")


def names_keyword(given: str | Path | NameRules | None, old: dict, where: str) -> str | Path | NameRules | None:
    """The value of a function's ``names=`` keyword, or of an old spelling of it in ``old`` (the function's other
    keyword arguments: ``name_rules=``, ``names_from=``), which warns (DeprecationWarning). Any other keyword is
    the TypeError Python would raise for ``where()``."""
    for key in old:
        if key not in OLD_NAMES_KEYWORDS:
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
    for key, value in old.items():
        warnings.warn(f"{where}({key}=...) is now {where}(names=...), as the command line's --names",
                      DeprecationWarning, stacklevel=3)
        if given is not None and value is not given:
            raise TypeError(f"{where}() got both names= and its old spelling {key}=")
        given = value
    return given


def rule_columns(name: pl.Expr, rules: NameRules) -> dict[str, pl.Expr]:
    """Vectorised rules on a column of (distinct) names: ``_phase_rule`` / ``_kind_rule`` (index into
    ``rules.all`` of the first phase / kind rule that matches, else null), and from them ``_rule_action``,
    ``_rule_stage``, ``_rule_mb``, ``_rule_order``, ``_rule_kind``, ``_rule_channel``."""
    import polars as pl

    every = rules.all
    none_i = pl.lit(None, pl.Int32)

    def first(which: str) -> pl.Expr:
        hits = [pl.when(name.str.contains(r.match)).then(pl.lit(i, pl.Int32))
                for i, r in enumerate(every) if getattr(r, which) is not None]
        return pl.coalesce(*hits, none_i) if hits else none_i

    phase_i, kind_i = first("phase"), first("kind")

    def pick(i: pl.Expr, values: list, dtype) -> pl.Expr:
        return pl.lit(pl.Series(values, dtype=dtype)).gather(i) if every else pl.lit(None, dtype)

    def group(which: str) -> pl.Expr:
        out = [pl.when(phase_i == i).then(name.str.extract(r.match, g).cast(pl.Int32, strict=False))
               for i, r in enumerate(every) if r.phase is not None and (g := r.group(which)) is not None]
        return pl.coalesce(*out, pl.lit(None, pl.Int32)) if out else pl.lit(None, pl.Int32)

    return {
        "_phase_rule": phase_i, "_kind_rule": kind_i,
        "_rule_action": pick(phase_i, [ACTION_OF_PHASE.get(r.phase) for r in every], pl.String),
        "_rule_stage": group("stage"),
        "_rule_mb": group("microbatch"),
        "_rule_order": pick(phase_i, [r.microbatch == ORDER for r in every], pl.Boolean),
        "_rule_kind": pick(kind_i, [r.kind for r in every], pl.String),
        "_rule_channel": pick(kind_i, [r.channel for r in every], pl.String),
    }
