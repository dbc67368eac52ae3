"""One training configuration: the model's shape and how it is split, batched, stored and scheduled.

Shared by the memory model, the simulator, the BPipe estimate and the CLI, so each of them is told the same facts once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from traceana.core.errors import ConfigError
from traceana.core.limits import schedule_slots_error
from traceana.core.manifest import ATTENTIONS, RECOMPUTES, ModelShape
from traceana.core.pipeline_rules import SCHEDULES, check_bpipe, check_virtual_stages, device_of_stage, stage_layers

MODEL_SCHEDULES = SCHEDULES  # the model knows every schedule the pipeline rules know (core.schedule_names)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and optimizer state, and bytes per activation element.

    The ZeRO paper's convention (Rajbhandari et al. 2020, §3.1): mixed-precision Adam keeps 16-bit weights and
    gradients (2 + 2 bytes) and an fp32 master copy plus Adam's momentum and variance (4 + 4 + 4 = 12 bytes): 16 bytes
    per parameter. Megatron-LM accumulates gradients in fp32 ("main_grad"), which makes it 18 (its distributed-optimizer
    guide counts 18 bytes per parameter without sharding).
    """

    name: str
    weight_bytes: int  # the weights the forward uses
    grad_bytes: int
    optimizer_bytes: int  # master weights + optimizer state
    activation_bytes: int  # bytes per saved activation element (2 for fp16/bf16, 4 for fp32)

    @property
    def bytes_per_param(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


MIXED_ADAM = Precision("bf16 mixed-precision Adam (16 B/param, ZeRO §3.1)", 2, 2, 12, 2)
MIXED_ADAM_FP32_GRAD = Precision("bf16 Adam with fp32 gradients (18 B/param, Megatron-LM)", 2, 4, 12, 2)
FP32_ADAM = Precision("fp32 Adam (16 B/param)", 4, 4, 8, 4)
FP32_SGD = Precision("fp32 SGD without momentum (8 B/param)", 4, 4, 0, 4)
FP32_SGD_MOMENTUM = Precision("fp32 SGD with momentum (12 B/param)", 4, 4, 4, 4)
PRECISIONS = {
    "mixed-adam": MIXED_ADAM,
    "mixed-adam-fp32-grad": MIXED_ADAM_FP32_GRAD,
    "fp32-adam": FP32_ADAM,
    "fp32-sgd": FP32_SGD,
    "fp32-sgd-momentum": FP32_SGD_MOMENTUM,
}


@dataclass(frozen=True)
class TrainingConfig:
    """How a model is trained: parallel degrees, batching, attention kernel, recompute, schedule, BPipe."""

    model: ModelShape
    # DEVICES in the pipeline, not stages: run.json's and RunConfig's pp count every stage, pp × virtual_stages of
    # them here (RunConfig.training_config divides); estimate's --pp and its JSON's config.pp are this count too
    pp: int = 1
    tp: int = 1
    dp: int = 1
    microbatch_size: int = 1
    num_microbatches: int = 1  # per pipeline per iteration
    schedule: str = "1f1b"
    attention: str = "sdpa"  # naive keeps the s×s scores for the backward; sdpa/flash does not
    recompute: str = "none"
    bpipe: bool = False  # pair stage s with p−1−s and balance their activations (Kim et al. 2023)
    # micro-batches an evictor keeps (run.json's bpipe_inflight); None = the rules' (pipeline_rules.bpipe_inflight)
    bpipe_inflight: int | None = None
    virtual_stages: int = 1  # model chunks per device (multi-stage schedules; exactly 2 for zbv and dualpipev)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # shard master weights + optimizer state over dp (ZeRO stage 1)
    precision: Precision = MIXED_ADAM
    dropout: bool | None = None  # None: GPT has dropout, LLaMA does not
    layers_per_stage: tuple[int, ...] | None = None  # per device; None = as even as possible, the rest to the front
    eager: bool = False  # activations as the reference trainer's plain PyTorch saves them (see layer_activation_terms)

    def __post_init__(self) -> None:
        for f in ("pp", "tp", "dp", "microbatch_size", "num_microbatches", "virtual_stages"):
            if getattr(self, f) <= 0:
                flag = {"num_microbatches": "microbatches"}.get(f, f).replace("_", "-")  # the CLI's spelling
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}", fix=f"set --{flag} ≥ 1")
        if self.schedule not in MODEL_SCHEDULES:
            raise ConfigError(
                f"the model does not know schedule {self.schedule!r}", fix=f"use one of {', '.join(MODEL_SCHEDULES)}"
            )
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"unknown attention {self.attention!r}", fix=f"use one of {', '.join(ATTENTIONS)}")
        if self.recompute not in RECOMPUTES:
            raise ConfigError(f"unknown recompute {self.recompute!r}", fix=f"use one of {', '.join(RECOMPUTES)}")
        check_virtual_stages(self.schedule, self.virtual_stages)
        too_big = schedule_slots_error(self.pp, self.virtual_stages, self.num_microbatches)
        if too_big:
            raise ConfigError(too_big, fix="estimate a smaller pipeline of the same shape (the bubble depends on "
                                           "(pp - 1) / micro-batches), or fewer --pp / --microbatches")
        keep = self.bpipe_inflight
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"the BPipe keep must be a positive number of micro-batches, got {keep!r}",
                              fix="check run.json's bpipe_inflight")
        if self.bpipe:
            check_bpipe(self.schedule, virtual_stages=self.virtual_stages)
        if self.model.heads % self.tp or self.model.hidden % self.tp:
            raise ConfigError(f"tp={self.tp} does not divide the model's heads and hidden size", fix="choose another tp")
        chunks = self.pp * self.virtual_stages
        if self.layers_per_stage is None:
            if self.model.layers < chunks:
                raise ConfigError(
                    f"{self.model.layers} layers cannot fill {chunks} pipeline chunks (stages × virtual stages)",
                    fix=f"use at most {self.model.layers} chunks"
                )
        else:
            if len(self.layers_per_stage) != self.pp or sum(self.layers_per_stage) != self.model.layers:
                raise ConfigError(
                    f"layers_per_stage {self.layers_per_stage} must have {self.pp} entries summing to "
                    f"{self.model.layers}",
                    fix="give one layer count per stage",
                )

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.num_microbatches * self.dp

    @property
    def has_dropout(self) -> bool:
        return self.model.family == "gpt" if self.dropout is None else self.dropout

    def stage_layers(self) -> tuple[int, ...]:
        """Layers held by each device (all its virtual chunks together)."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return stage_layers(self.model.layers, self.pp)

    @property
    def last_device(self) -> int:
        """The device holding the model's last stage (the logits): p−1, or device 0 on a V placement."""
        return device_of_stage(self.schedule, self.pp * self.virtual_stages - 1, pp=self.pp)

    def replace(self, **changes) -> TrainingConfig:
        return dataclasses.replace(self, **changes)
