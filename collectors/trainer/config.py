"""What to train and how: presets and one validated, frozen configuration.

Impossible configurations raise ``ConfigError`` here, in the launching process, before any worker starts.
``traceana collect``'s flags are generated from ``CollectConfig``'s fields (collectors.command.add_arguments): a
field with a ``Flag`` in its metadata is a flag named after it, its help the field's own description; the flags
collect shares with ``estimate`` (``Flag.shared``) keep their one definition in traceana/commands/options.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from traceana.core.errors import ConfigError
from traceana.core.flags import flag as _flag
from traceana.core.manifest import ModelShape, Workload
from traceana.core.pipeline_rules import bpipe_pairs as all_bpipe_pairs
from traceana.core.pipeline_rules import bpipe_plan, layers_refusal, plan_refusal, stage_layer_ranges
from traceana.core.schedule_names import TRAINER_SCHEDULES
from traceana.core.training_config import TrainingConfig
from traceana.model.presets import TINY_MODELS

# Tiny shapes for CPU runs and tests (seconds per step under the profiler on 2 cores), plus a small one for
# benchmarks: the model's own table, so estimate and validate know exactly what was trained.
PRESETS: dict[str, ModelShape] = TINY_MODELS
SCHEDULES = TRAINER_SCHEDULES  # the one-stage schedules (traceana.core.schedule_names); collect runs the rest elsewhere


@dataclass(frozen=True)
class CollectConfig:
    """One reference-trainer run. The fields with a ``Flag`` are ``traceana collect``'s flags, in this order."""

    preset: str = field(default="tiny-gpt", metadata=_flag(shared="model", dest="model", spellings=("--model",)))
    pp: int = field(default=4, metadata=_flag(shared="pp"))  # pipeline stages = processes (one stage per rank)
    # Transformer blocks per stage (one count a stage, summing to the model's layers; None: the rules' even split,
    # pipeline_rules.stage_layer_ranges); in run.json as layers_per_stage. Parsed by pipeline_rules.parse_layers.
    layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=_flag(
        metavar="N,N,...", help="transformer blocks of each stage, one count a stage summing to the model's layers, "
                                "e.g. 3,2,2,1 (the gpipe/1f1b schedules; in run.json) (default: as even as possible, "
                                "the rest to the front)"))
    # data-parallel replicas of the pipeline (global rank = stage · dp + replica, as Megatron-LM orders)
    dp: int = field(default=1, metadata=_flag(shared="dp"))
    # micro-batches per step (run.json's name; the flag --microbatches, --num-microbatches accepted)
    num_microbatches: int = field(default=8, metadata=_flag(shared="microbatches", dest="microbatches",
                                                               spellings=("--microbatches", "--num-microbatches")))
    microbatch_size: int = field(default=2, metadata=_flag(shared="microbatch_size"))  # sequences per micro-batch
    schedule: str = field(default="1f1b", metadata=_flag(shared="schedule"))  # TRAINER_SCHEDULES here
    # evict activations from stage s to stage p-1-s (Kim et al. 2023, BPipe)
    bpipe: bool = field(default=False, metadata=_flag(shared="bpipe"))
    bpipe_inflight: int | None = field(default=None, metadata=_flag(
        help="micro-batches a BPipe evictor keeps (default: the pair's balanced level)"))
    attention: str = field(default="naive", metadata=_flag(shared="attention"))  # naive (keeps s×s scores) | sdpa
    recompute: str = field(default="none", metadata=_flag(shared="recompute"))  # none | selective | full
    # A count of steps (attach's --window is a range of step numbers): --profile-steps; --steps, the field's name,
    # is the old spelling, kept hidden.
    steps: int = field(default=2, metadata=_flag(spellings=("--profile-steps", "--steps"),
                                                 help="how many training steps are profiled, after the --warmup-steps"))
    warmup_steps: int = field(default=1, metadata=_flag(
        help="steps run before them, the profiler warming up (nothing kept)"))
    lr: float = 1e-3  # AdamW learning rate
    seed: int = field(default=1234, metadata=_flag(help="random seed of the weights and the data", metavar="SEED"))
    profile: bool = True  # False: train without the profiler (tests, overhead benchmark)
    batch_p2p: bool | None = None  # post each send with the next receive (batch_isend_irecv); None = on NCCL only
    # A straggler for tests: (rank, ms) sleeps that long inside each of that rank's forward passes. Not in run.json
    # or the trace: the test that sets it holds the truth.
    slow_rank: tuple[int, float] | None = None
    # The known workload (collect --work sleep, docs/known-workload.md): every pass held for a stated time instead of
    # computing; None = real compute. In run.json as ``workload``.
    workload: Workload | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}", fix=f"use one of {', '.join(PRESETS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}", fix=f"use one of {', '.join(SCHEDULES)}")
        for name in ("pp", "dp", "num_microbatches", "microbatch_size", "steps"):
            if getattr(self, name) < 1:
                flag = flag_of(name)
                raise ConfigError(f"{flag} must be at least 1, got {getattr(self, name)}", fix=f"pass a positive {flag}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}", fix="pass 0 or more")
        if self.workload is not None:
            check_workload_layout(self.workload, stages=self.pp, ranks=self.world_size, layers=self.shape.layers)
        if self.layers_per_stage is not None:  # the rules' one refusal of a split (layers_refusal), as whatif's
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
            refused = layers_refusal(self.layers_per_stage, layers=self.shape.layers, pp=self.pp)
            if refused is not None:
                raise ConfigError(refused[0], fix=refused[1])
        self.training_config()  # the model's own checks of the shape and layout (attention, recompute, layers)
        if self.bpipe_inflight is not None and self.bpipe_inflight < 1:
            raise ConfigError(f"--bpipe-inflight must be at least 1, got {self.bpipe_inflight}", fix="pass 1 or more")
        # the rules' one refusal of a plan (pipeline_rules.plan_refusal), which a plan what-if asks too
        refused = plan_refusal(self.schedule, pp=self.pp, num_microbatches=self.num_microbatches, bpipe=self.bpipe,
                               bpipe_inflight=self.bpipe_inflight, layers_per_stage=self.layers_per_stage,
                               layers=self.shape.layers)
        if refused is not None:
            raise ConfigError(refused[0], fix=refused[1])

    def training_config(self) -> TrainingConfig:
        """The model's description of this run (traceana.core.training_config), which also validates it."""
        return TrainingConfig(model=self.shape, pp=self.pp, microbatch_size=self.microbatch_size,
                              num_microbatches=self.num_microbatches, schedule=self.schedule, attention=self.attention,
                              recompute=self.recompute, eager=True, dropout=False,
                              layers_per_stage=self.layers_per_stage)

    @property
    def shape(self) -> ModelShape:
        return PRESETS[self.preset]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def stage_layer_ranges(self) -> list[range]:
        """The blocks (global indices) of each stage: ``layers_per_stage``, else the rules' even split."""
        return stage_layer_ranges(self.shape.layers, self.pp, self.layers_per_stage)

    def stage_of(self, rank: int) -> int:
        """The stage a global rank runs (rank = stage · dp + replica)."""
        return rank // self.dp

    def rank_of(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def bpipe_pairs(self) -> tuple[tuple[int, int], ...]:
        """(evictor, acceptor) stage pairs whose BPipe plan evicts something (pipeline_rules.bpipe_plan)."""
        if not self.bpipe:
            return ()
        return tuple((e, a) for e, a in all_bpipe_pairs(self.pp)
                     if bpipe_plan(self.schedule, pp=self.pp, num_microbatches=self.num_microbatches, evictor=e,
                                   keep=self.bpipe_inflight).evicted)

    def replace(self, **changes: object) -> CollectConfig:
        return dataclasses.replace(self, **changes)


def flag_of(name: str) -> str:
    """The flag of ``CollectConfig`` field ``name`` as the help shows it (``--profile-steps`` for ``steps``)."""
    meta = next(f.metadata for f in dataclasses.fields(CollectConfig) if f.name == name)
    return meta["flag"].names(name)[0]


def check_workload_layout(workload: Workload, *, stages: int, ranks: int, layers: int | None = None) -> None:
    """A slowed stage, rank or block of the known workload must exist in the run (ConfigError, before anything
    starts)."""
    for flag, pairs, count, what in (("--slow-stage", workload.slow_stages, stages, "stages"),
                                     ("--slow-rank", workload.slow_ranks, ranks, "ranks"),
                                     ("--slow-layer", workload.slow_layers if layers else (), layers, "layers")):
        for index, _ in pairs:
            if index >= count:
                raise ConfigError(f"{flag} {index} names no {what[:-1]}: this run has {count} {what} "
                                  f"(0..{count - 1})", fix=f"give {flag} a {what[:-1]} between 0 and {count - 1}")
