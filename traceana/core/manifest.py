"""The run manifest (``run.json``): every fact about a run that the analysis must not guess.

Written by collectors (rank 0), read by ``traceana.ingest.run_dir``. Frozen dataclasses validated on
construction; ``Manifest.from_json`` turns any malformed file into one clear BadInputError line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceana.core.errors import BadInputError
from traceana.core.files import open_regular
from traceana.core.flags import flag
from traceana.core.limits import check_ranks
from traceana.core.schedule_names import MULTI_STAGE_SCHEDULES, ONE_STAGE_SCHEDULES, RUN_JSON_SCHEDULES  # noqa: F401

SCHEMA_VERSION = 1
MANIFEST_NAME = "run.json"
FAMILIES = ("gpt", "llama")
ATTENTIONS = ("naive", "sdpa")  # sdpa = flash-style: does not keep the s×s scores
RECOMPUTES = ("none", "selective", "full")
# zero-bubble: ZB-1P with I/W split on a looped placement (torch's ScheduleInterleavedZeroBubble); zbv and dualpipev
# put each rank's two stages in a V (rank r holds r and 2p−1−r); looped-bfs runs every forward of a stage first.
# The names are listed once, in traceana.core.schedule_names; SCHEDULES here is what run.json may say (with "unknown").
SCHEDULES = RUN_JSON_SCHEDULES
MAX_MANIFEST_BYTES = 16 << 20  # run.json is a few KB; a bigger one is not a manifest (and is not read whole)
MAX_NESTING = 32  # levels of JSON nesting in run.json (``extra`` included): the collector writes at most 3
# A device's peak FLOP/s: finite, and between 1 MFLOP/s and 1 EFLOP/s (1e6..1e18) — outside that it is a unit
# mistake (TFLOP/s given as FLOP/s, or the reverse), and MFU computed from it would be meaningless (or not JSON).
PEAK_FLOPS_RANGE = (1e6, 1e18)


def check_peak_flops(value: object, *, source: str = "--peak-flops", path: str | Path | None = None) -> float | None:
    """``value`` as a peak FLOP/s (None stays None), or one BadInputError line naming ``source``."""
    if value is None:
        return None
    lo, hi = PEAK_FLOPS_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise BadInputError(f"{source} must be a number of FLOP/s between {lo:.0e} and {hi:.0e}, got {value!r}",
                            path=path, fix="give the device's peak FLOP/s, e.g. 9.89e14 for an H100's dense BF16")
    return float(value)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping at ``limit`` + 1 (no recursion)."""
    depth, level = 0, [value]
    while level and depth <= limit:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
                 if isinstance(v, (dict, list))]
    return depth


# Fields of run.json by kind, checked on construction (Python callers and run.json alike).
_POSITIVE_INTS = ("world_size", "dp", "tp")
_OPTIONAL_POSITIVE_INTS = ("pp", "microbatch_size", "num_microbatches", "global_batch", "host_cpus", "ranks_per_host")
_OPTIONAL_TEXT = ("dtype", "attention", "recompute", "device", "torch_version")
# Facts with a field of their own that older run.json files (and collectors) wrote under "extra": read from there too.
LIFTED = ("stages_of_rank", "virtual_stages", "layers_per_stage", "bpipe_inflight", "hosts", "nnodes", "trainer",
           "dropout", "eager", "grads_in_step", "attach", "collector", "names", "link_bytes_per_s", "p2p_latency_ns")


@dataclass(frozen=True)
class ModelShape:
    """A Transformer's shape: enough to count its FLOPs, parameters and activation bytes."""

    family: str  # "gpt" (LayerNorm, GELU MLP) or "llama" (RMSNorm, SwiGLU, RoPE)
    layers: int  # Transformer blocks
    hidden: int  # model width h
    heads: int  # attention heads a
    kv_heads: int | None = None  # grouped-query attention; None = heads (multi-head attention)
    ffn: int | None = None  # MLP inner width; None = 4h (gpt) or the LLaMA rule 2/3·4h rounded to 256
    vocab: int = 50257
    seq: int = 2048  # sequence length s
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise BadInputError(f"unknown model family {self.family!r}", fix=f"use one of {', '.join(FAMILIES)}")
        for f in ("layers", "hidden", "heads", "vocab", "seq", "kv_heads", "ffn"):
            v = getattr(self, f)
            if v is None and f in ("kv_heads", "ffn"):
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInputError(f"model {f} must be an integer, got {v!r}", fix=f"set an integer {f}")
            if f == "kv_heads":  # (checked against heads below)
                continue
            if getattr(self, f) <= 0:
                raise BadInputError(f"model {f} must be positive, got {getattr(self, f)}", fix=f"set a positive {f}")
        if self.hidden % self.heads:
            raise BadInputError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}", fix="choose heads dividing hidden"
            )
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            raise BadInputError(
                f"kv_heads {self.kv_heads} must divide heads {self.heads}", fix="choose kv_heads dividing heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn:
            return self.ffn
        if self.family == "gpt":
            return 4 * self.hidden
        # LLaMA (Touvron et al. 2023, §2): SwiGLU with 2/3·4h, rounded up to a multiple of 256.
        return 256 * -(-(8 * self.hidden // 3) // 256)


WORK_KINDS = ("sleep",)  # run.json's workload.kind: every pass held for a stated time instead of computing
# run.json's workload.layer_holds (Workload.layer_holds; collect --layer-holds): how a pass's hold maps to blocks
LAYER_HOLDS = (None, "even", "per-layer")
WORKLOAD_SPANS = "workload"  # the run folder's subfolder of the held passes' perf_counter spans, one file a rank


@dataclass(frozen=True)
class Workload:
    """A known workload (``traceana collect --work sleep``, docs/known-workload.md): each pass held for its stated
    time instead of computing. A forward holds ``forward_ms``, an input-gradient backward (I) ``backward_ms``, a
    weight-gradient pass (W) ``weight_ms``, a full backward (B) ``backward_ms + weight_ms``; each times the factor of
    its stage in ``slow_stages`` and of its rank in ``slow_ranks`` (1 where not named). The passes' own perf_counter
    spans are in ``spans``/rank{R}.json (``WORKLOAD_SPANS``), outside the trace."""

    # The fields with a Flag are collect's known-workload flags, in this order (collectors.command.add_arguments):
    # --work compute is no workload (None), whose flags given alone are refused (collectors.command.workload_from_args)
    kind: str = field(metadata=flag(
        spellings=("--work",), own=False, dest="work", default="compute", choices=("compute", *WORK_KINDS),
        metavar=None, help="compute: train the model; sleep: hold each forward/backward for --forward-ms/--backward-ms"))
    forward_ms: float = field(metadata=flag(default=None, metavar="F",
                                            help="with --work sleep: what each forward holds, in ms (required)"))
    backward_ms: float = field(metadata=flag(
        default=None, metavar="B", help="with --work sleep: what each backward holds (the input-gradient pass I of "
                                        "zero-bubble schedules), in ms (required)"))
    weight_ms: float = field(default=0.0, metadata=flag(
        default=None, metavar="W", help="with --work sleep: the weights' gradient pass (W of zero-bubble schedules); "
                                        "a full backward holds B + W (default: 0)"))
    slow_stages: tuple[tuple[int, float], ...] = field(default=(), metadata=flag(  # (stage, factor)
        spellings=("--slow-stage",), own=False, dest="slow_stage", action="append", default=None, metavar="S:FACTOR",
        help="with --work sleep: every pass of stage S holds FACTOR times as long (repeatable) (default: none)"))
    slow_ranks: tuple[tuple[int, float], ...] = field(default=(), metadata=flag(  # (global rank, factor)
        spellings=("--slow-rank",), own=False, dest="slow_rank", action="append", default=None, metavar="R:FACTOR",
        help="with --work sleep: every pass of global rank R holds FACTOR times as long (repeatable) "
             "(default: none)"))
    slow_layers: tuple[tuple[int, float], ...] = field(default=(), metadata=flag(  # (block, factor): per-layer only
        spellings=("--slow-layer",), own=False, dest="slow_layer", action="append", default=None, metavar="L:FACTOR",
        help="with --layer-holds per-layer: transformer block L (its index in the model) holds FACTOR times the "
             "stated times, on whichever stage holds it (repeatable) (default: none)"))
    # How a pass's hold maps to the stage's transformer blocks: "even" (the reference trainer's default: the pass
    # holds the stated time, split evenly over its blocks, held one after another, each block's share a
    # ``PP:1F0/L5`` span in the trace); "per-layer": the stated times are each BLOCK's, so a pass of a stage of n
    # blocks holds n × them (each block its own span): moving blocks between stages moves their work; None: one
    # hold a pass, no layer spans (torch.distributed.pipelining's stages, runs collected before layer spans)
    layer_holds: str | None = field(default=None, metadata=flag(
        default=None, choices=("even", "per-layer"), metavar=None,
        help="with --work sleep and the gpipe/1f1b schedules: even: each pass holds the stated times, split evenly "
             "over its stage's blocks; per-layer: the stated times are each block's, so a stage of n blocks holds "
             "n times them (moving layers with --layers-per-stage moves work) (default: even)"))
    spans: str = WORKLOAD_SPANS

    def __post_init__(self) -> None:
        def bad(what: str) -> BadInputError:
            return BadInputError(f"workload {what}"[:200], fix="fix run.json's workload")

        if self.kind not in WORK_KINDS:
            raise bad(f"kind must be one of {', '.join(WORK_KINDS)}, got {self.kind!r}")
        for name in ("forward_ms", "backward_ms", "weight_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise bad(f"{name} must be a number of milliseconds, 0 or more, got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("slow_stages", "slow_ranks", "slow_layers"):
            pairs = getattr(self, name)
            try:
                pairs = tuple((_strict_int(a, name), b) for a, b in pairs)
            except (TypeError, ValueError):
                raise bad(f"{name} must be a list of [index, factor] pairs, got {pairs!r}") from None
            for index, factor in pairs:
                if index < 0 or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                        or not math.isfinite(factor) or factor <= 0:
                    raise bad(f"{name} needs an index >= 0 and a factor > 0, got [{index!r}, {factor!r}]")
            if len({index for index, _ in pairs}) != len(pairs):
                raise bad(f"{name} names an index twice: {[list(p) for p in pairs]}")
            object.__setattr__(self, name, tuple((index, float(factor)) for index, factor in pairs))
        if not isinstance(self.spans, str) or not self.spans:
            raise bad(f"spans must be a folder name, got {self.spans!r}")
        if self.layer_holds not in LAYER_HOLDS:
            raise bad(f"layer_holds must be one of {', '.join(map(str, LAYER_HOLDS))} or null, got "
                      f"{self.layer_holds!r}")
        if self.slow_layers and self.layer_holds != "per-layer":
            raise bad(f"slow_layers needs layer_holds \"per-layer\", got {self.layer_holds!r}")

    def factor(self, *, stage: int, rank: int) -> float:
        """How much longer than stated every pass of this stage on this rank holds."""
        return dict(self.slow_stages).get(stage, 1.0) * dict(self.slow_ranks).get(rank, 1.0)

    def layer_weights(self, layers) -> tuple[float, ...]:
        """Each block's share of its pass's hold, relative (the blocks' global indices, in any order): its factor
        in ``slow_layers`` (1 where not named); with ``layer_holds`` "per-layer" a block holds its weight × the
        stated times, with "even" the shares are equal (weights of 1: no slow layers there)."""
        slow = dict(self.slow_layers)
        return tuple(slow.get(k, 1.0) for k in layers)

    def held_ms(self, action: str, *, stage: int, rank: int, layers=None) -> float:
        """The time one pass (``F``, ``B``, ``I`` or ``W``) of ``stage`` on ``rank`` holds; with ``layer_holds``
        "per-layer" the stated times are a block's, and ``layers`` (the stage's blocks, global indices) is needed:
        the pass holds Σ of their ``layer_weights`` × the stated times."""
        base = {"F": self.forward_ms, "B": self.backward_ms + self.weight_ms, "I": self.backward_ms,
                "W": self.weight_ms}[action]
        if self.layer_holds == "per-layer":
            if layers is None:
                raise ValueError("a per-layer workload's pass holds its stage's blocks × the stated time: give layers")
            base *= sum(self.layer_weights(layers))
        return base * self.factor(stage=stage, rank=rank)


def _strict_int(x: Any, field_name: str) -> int:
    """An integer as JSON writes it (1, not 1.5, "1" or true)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{field_name} holds {x!r}, not an integer")
    return x


# What each run.json key means, in a few words: the messages that name a missing fact and the template
# `traceana describe` writes say it with the key.
KEY_MEANINGS = {
    "world_size": "ranks in the job (every rank, traced or not)",
    "pp": "pipeline stages (all of them: virtual stages count)",
    "dp": "data-parallel replicas of the pipeline",
    "tp": "tensor-parallel ranks of one stage",
    "stage_of_rank": "the (first) stage of each rank, index = global rank",
    "stages_of_rank": "every stage each rank holds, index = global rank, e.g. [[0, 2], [1, 3]]",
    "virtual_stages": "model chunks a rank (interleaved schedules)",
    "schedule": f"the pipeline schedule: one of {', '.join(SCHEDULES)}",
    "microbatch_size": "sequences in one micro-batch",
    "num_microbatches": "micro-batches a step",
    "global_batch": "sequences a step (micro-batch size × micro-batches × dp)",
    "model": 'the model shape, {"family": "gpt" or "llama", "layers", "hidden", "heads", "seq", "vocab", ...}',
    "dtype": "the parameters' dtype, e.g. bf16",
    "attention": f"attention kernel: one of {', '.join(ATTENTIONS)}",
    "recompute": f"activation recomputation: one of {', '.join(RECOMPUTES)}",
    "device": "the accelerator, e.g. h100-80gb (traceana estimate lists the presets)",
    "peak_flops": "the device's peak FLOP/s, for MFU (or --peak-flops)",
    "trainer": "the training code, e.g. megatron-core, deepspeed, torch.distributed.pipelining",
}


@dataclass(frozen=True)
class Manifest:
    """Contents of run.json. Only ``world_size`` is required; unknown facts stay None and are inferred."""

    world_size: int
    pp: int | None = None
    dp: int = 1
    tp: int = 1
    stage_of_rank: tuple[int, ...] | None = None  # index = rank
    schedule: str = "unknown"
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    global_batch: int | None = None
    model: ModelShape | None = None
    dtype: str | None = None
    attention: str | None = None
    recompute: str | None = None
    bpipe: tuple[tuple[int, int], ...] | None = None  # (evictor stage, acceptor stage) pairs; None = off
    device: str | None = None
    peak_flops: float | None = None  # per device, FLOP/s, for MFU
    profiler: dict[str, int] = field(default_factory=dict)  # wait / warmup / active / repeat
    torch_version: str | None = None
    ranks_written: tuple[int, ...] | None = None  # ranks whose trace was written completely
    host_cpus: int | None = None  # logical CPUs the ranks of one host could run on (their affinity mask)
    ranks_per_host: int | None = None  # ranks sharing those CPUs (torchrun's LOCAL_WORLD_SIZE)
    # Facts older run.json files kept under "extra" (read from there too, ``LIFTED``):
    stages_of_rank: tuple[tuple[int, ...], ...] | None = None  # every stage each rank holds (index = rank), sorted
    virtual_stages: int | None = None  # stages a rank (multi-stage schedules), when stages_of_rank does not say
    layers_per_stage: tuple[int, ...] | None = None  # Transformer blocks per device; None = the rules' even split
    bpipe_inflight: int | None = None  # micro-batches a BPipe evictor keeps (collect --bpipe-inflight)
    hosts: tuple[str, ...] | None = None  # host name of each rank
    nnodes: int | None = None  # hosts the run spanned
    trainer: str | None = None  # the training code; "traceana" (the reference trainer) unless it says otherwise
    dropout: bool | None = None  # None: the family's default (GPT has dropout, LLaMA not)
    eager: bool | None = None  # activations as plain PyTorch saves them (the model's eager terms)
    grads_in_step: bool | None = None  # gradients allocated and freed inside the profiled step (zero_grad late)
    attach: dict[str, Any] | None = None  # what `traceana attach` detected and did not (collectors.attach.facts)
    collector: str | None = None  # which collector wrote the run
    names: str | dict[str, Any] | None = None  # name rules (docs/naming.md): a file next to run.json, or inline
    link_bytes_per_s: float | None = None  # the P2P link's bandwidth the transfer floor assumes (traceana.measure.p2p)
    # a CPU-rank P2P message's latency the transfer ceiling allows (traceana.measure.p2p)
    p2p_latency_ns: float | None = None
    workload: Workload | None = None  # a known workload's stated durations (collect --work sleep); None = real compute
    extra: dict[str, Any] = field(default_factory=dict)  # keys traceana does not know, kept as they were
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.extra, dict):
            raise BadInputError(f"extra must be an object, got {type(self.extra).__name__}", fix="fix run.json")
        lifted = {k: v for k, v in self.extra.items() if k in LIFTED and getattr(self, k) is None}
        if lifted:  # a fact older files (and callers) put under extra: its own field; extra keeps the unknown keys
            for k, v in lifted.items():
                object.__setattr__(self, k, v)
            object.__setattr__(self, "extra", {k: v for k, v in self.extra.items() if k not in lifted})
        self._check_lifted()

        for f in (*_POSITIVE_INTS, *_OPTIONAL_POSITIVE_INTS):
            v = getattr(self, f)
            if v is None and f in _OPTIONAL_POSITIVE_INTS:
                continue
            if not is_int(v) or v <= 0:
                raise BadInputError(f"{f} must be a positive integer, got {v!r}", fix="fix run.json")
        for f in ("schedule", *_OPTIONAL_TEXT):
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise BadInputError(f"{f} must be text, got {v!r}", fix="fix run.json")

        check_ranks(self.world_size, "run.json's world_size")
        object.__setattr__(self, "peak_flops", check_peak_flops(self.peak_flops, source="peak_flops"))
        if not isinstance(self.profiler, dict) or not all(isinstance(k, str) and is_int(v)
                                                          for k, v in self.profiler.items()):
            raise BadInputError(f"profiler must map names to integers, got {self.profiler!r}"[:200], fix="fix run.json")
        if self.pp is not None and self.pp > self.world_size and self.schedule in ONE_STAGE_SCHEDULES:
            # (interleaved schedules place several virtual stages on a rank: there pp may exceed the ranks)
            raise BadInputError(f"pp {self.pp} is larger than world_size {self.world_size} for schedule "
                                f"{self.schedule} (one stage per rank)", fix="fix run.json")
        if (self.pp is not None and self.schedule in ONE_STAGE_SCHEDULES and is_int(self.tp) and is_int(self.dp)
                and self.pp * self.tp * self.dp > self.world_size):
            # every (stage, tensor-parallel rank, replica) is a rank of its own
            raise BadInputError(f"pp {self.pp} × tp {self.tp} × dp {self.dp} = {self.pp * self.tp * self.dp} ranks, "
                                f"more than world_size {self.world_size}", fix="fix pp, tp or dp in run.json")
        if self.bpipe is not None and self.pp is not None:
            bad = [pair for pair in self.bpipe if not all(0 <= s < self.pp for s in pair)]
            if bad:
                raise BadInputError(f"bpipe pair {list(bad[0])} names a stage outside 0..{self.pp - 1}",
                                    fix="fix run.json (pairs are evictor and acceptor stages)")
        if isinstance(self.workload, Workload):
            for name, pairs, count in (("slow_stages", self.workload.slow_stages, self.pp),
                                       ("slow_ranks", self.workload.slow_ranks, self.world_size),
                                       ("slow_layers", self.workload.slow_layers,
                                        self.model.layers if self.model is not None else None)):
                if count is not None and any(index >= count for index, _ in pairs):
                    raise BadInputError(f"workload {name} names {max(i for i, _ in pairs)}, outside 0..{count - 1}",
                                        fix="fix run.json's workload")
        if self.schedule not in SCHEDULES:
            raise BadInputError(f"unknown schedule {self.schedule!r}", fix=f"use one of {', '.join(SCHEDULES)}")
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise BadInputError(f"unknown attention {self.attention!r}", fix=f"use one of {', '.join(ATTENTIONS)}")
        if self.recompute is not None and self.recompute not in RECOMPUTES:
            raise BadInputError(f"unknown recompute {self.recompute!r}", fix=f"use one of {', '.join(RECOMPUTES)}")
        if self.stage_of_rank is not None:
            if len(self.stage_of_rank) != self.world_size:
                raise BadInputError(
                    f"stage_of_rank has {len(self.stage_of_rank)} entries for world_size {self.world_size}",
                    fix="give one stage per rank",
                )
            if self.pp is not None and any(not 0 <= s < self.pp for s in self.stage_of_rank):
                raise BadInputError(f"stage_of_rank has a stage outside 0..{self.pp - 1}", fix="fix run.json")

    def _check_lifted(self) -> None:
        """The typed facts older files kept under extra: each of its type, or one BadInputError line."""
        def ints(v: Any) -> bool:
            return isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

        def bad(name: str, what: str) -> BadInputError:
            return BadInputError(f"{name} must be {what}, got {getattr(self, name)!r}"[:200], fix="fix run.json")

        if self.stages_of_rank is not None:
            if not isinstance(self.stages_of_rank, (list, tuple)) or not all(
                    ints(st) and all(x >= 0 for x in st) for st in self.stages_of_rank):
                raise bad("stages_of_rank", "one list of stage numbers per rank")
            object.__setattr__(self, "stages_of_rank", tuple(tuple(sorted(st)) for st in self.stages_of_rank) or None)
        for name in ("virtual_stages", "bpipe_inflight", "nnodes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(name, "a positive integer")
        if self.layers_per_stage is not None:
            if not ints(self.layers_per_stage) or not self.layers_per_stage or min(self.layers_per_stage) < 0:
                raise bad("layers_per_stage", "a list of layer counts, one per device")
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        if self.hosts is not None:
            if not isinstance(self.hosts, (list, tuple)) or not all(isinstance(h, str) for h in self.hosts):
                raise bad("hosts", "a list of host names")
            object.__setattr__(self, "hosts", tuple(self.hosts))
        for name in ("dropout", "eager", "grads_in_step"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        for name in ("trainer", "collector"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "text")
        if self.attach is not None and not isinstance(self.attach, dict):
            raise bad("attach", "an object")
        v = self.link_bytes_per_s
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise bad("link_bytes_per_s", "a positive number of bytes per second")
        v = self.p2p_latency_ns
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise bad("p2p_latency_ns", "a number of nanoseconds, 0 or more")
        if self.names is not None and not isinstance(self.names, (str, dict)):
            raise bad("names", "a rules file's path or the rules themselves")
        if self.workload is not None and not isinstance(self.workload, Workload):
            raise bad("workload", "an object (kind, forward_ms, backward_ms, …)")

    @property
    def bpipe_on(self) -> bool:
        return bool(self.bpipe)

    @property
    def stages_a_rank(self) -> int | None:
        """How many stages each rank holds, as run.json says it: the size of ``stages_of_rank``' lists when they
        are all one size, else ``virtual_stages``; None when it says neither (the schedule's placement then tells)."""
        sizes = {len(st) for st in self.stages_of_rank or ()}
        if len(sizes) == 1 and sizes != {0}:
            return sizes.pop()
        return self.virtual_stages

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str | Path | None = None) -> Manifest:
        try:
            if not isinstance(data, dict):
                raise TypeError("top level is not an object")
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - known)
            kwargs = {k: v for k, v in data.items() if k in known}
            if "world_size" not in kwargs:
                raise KeyError("world_size")
            if kwargs.get("model") is not None and not isinstance(kwargs["model"], dict):
                raise TypeError(f"model must be an object, got {kwargs['model']!r}"[:200])
            if kwargs.get("model") is not None:
                kwargs["model"] = ModelShape(**kwargs["model"])
            if kwargs.get("workload") is not None:
                if not isinstance(kwargs["workload"], dict):
                    raise TypeError(f"workload must be an object, got {kwargs['workload']!r}"[:200])
                kwargs["workload"] = Workload(**kwargs["workload"])
            if _depth(data, MAX_NESTING) > MAX_NESTING:
                raise ValueError(f"nested more than {MAX_NESTING} levels deep")
            for k in ("stage_of_rank", "ranks_written"):
                if kwargs.get(k) is not None:
                    kwargs[k] = tuple(_strict_int(x, k) for x in kwargs[k])
            if kwargs.get("bpipe"):
                kwargs["bpipe"] = tuple((_strict_int(a, "bpipe"), _strict_int(b, "bpipe")) for a, b in kwargs["bpipe"])
            else:
                kwargs["bpipe"] = None
            if unknown:
                kwargs["extra"] = {**kwargs.get("extra", {}), **{k: data[k] for k in unknown}}
            return cls(**kwargs)
        except BadInputError as e:
            raise BadInputError(e.what, path=path, fix=e.fix or "fix or delete run.json") from None
        except (TypeError, ValueError, KeyError) as e:
            raise BadInputError(
                f"run.json is malformed ({type(e).__name__}: {e})",
                path=path,
                fix="fix it, or delete it to let traceana infer the run from the traces",
            ) from None

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        path = Path(path)
        try:
            with open_regular(path) as fh:
                raw = fh.read(MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise BadInputError(f"cannot read run.json ({e.strerror})", path=path, fix="check its permissions") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BadInputError(f"run.json is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a run manifest",
                                path=path, fix="fix it, or delete it to let traceana infer the run") from None
        try:
            data = json.loads(raw)
        except RecursionError:
            raise BadInputError(f"run.json is nested more than {MAX_NESTING} levels deep", path=path,
                                fix="fix it, or delete it to let traceana infer the run") from None
        except (ValueError, UnicodeDecodeError):
            raise BadInputError(
                "run.json is not valid JSON", path=path, fix="fix it, or delete it to let traceana infer the run"
            ) from None
        return cls.from_dict(data, path=path)
