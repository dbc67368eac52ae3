"""The run's configuration, reconciled once: what run.json says and what the traces show, each fact with where it
came from (``RUN_JSON``, ``TRACE``, ``INFERRED``, ``DEFAULT``, ``OPTION``) and the conflicts between the two noted.

``Analysis.config`` is one (built by ``reconcile.run_config``, in two steps: ``reconcile.run_facts`` before the
schedule is known — run.json's facts and what the traces' metadata says of the hosts, which the P2P pairing, the clock
alignment and the stage map read — then the schedule's facts on top of that same configuration);
``RunConfig.from_manifest`` is run.json alone (what ``estimate --from-run`` reads). Everything downstream reads it,
not run.json (``Manifest``): the stage map, MFU, the summary, validation, the verdict, the reports.
``training_config`` is the model's view of it (``traceana.core.training_config.TrainingConfig``). Each fact has the
name of its run.json key (docs/architecture.md, "One configuration").

No polars here: ``estimate`` imports this module without analysing anything.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from traceana.core.errors import ConfigError, shown
from traceana.core.manifest import KEY_MEANINGS, MANIFEST_NAME, Manifest, ModelShape

if TYPE_CHECKING:
    from traceana.core.training_config import Precision, TrainingConfig

RUN_JSON, TRACE, INFERRED, DEFAULT, OPTION = "run.json", "trace", "inferred", "default", "option"
RUN_JSON_KEYS = KEY_MEANINGS  # (manifest.KEY_MEANINGS: what each run.json key means)
SOURCES = (RUN_JSON, TRACE, INFERRED, DEFAULT, OPTION)

# run.json's facts the configuration carries as they are (their source is run.json when given, else default).
_FROM_MANIFEST = ("world_size", "pp", "tp", "dp", "stage_of_rank", "schedule", "microbatch_size", "num_microbatches",
                  "model", "dtype",
                  "attention", "recompute", "device", "peak_flops", "bpipe", "bpipe_inflight", "layers_per_stage",
                  "host_cpus", "ranks_per_host", "hosts", "nnodes", "trainer", "dropout", "eager", "grads_in_step",
                  "link_bytes_per_s", "p2p_latency_ns")


@dataclass(frozen=True)
class RunConfig:
    """One run's configuration. ``pp`` counts stages (all virtual stages); ``virtual_stages`` how many a rank holds.
    ``sources[name]`` says where each fact came from; ``conflicts`` where run.json and the traces disagree (the
    traces' value is the one kept); ``refusal`` why no schedule could be simulated faithfully (or None)."""

    world_size: int | None = None
    pp: int | None = None
    tp: int = 1
    dp: int = 1
    schedule: str = "unknown"
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    model: ModelShape | None = None
    dtype: str | None = None
    attention: str | None = None
    recompute: str | None = None
    device: str | None = None
    peak_flops: float | None = None
    bpipe: tuple[tuple[int, int], ...] | None = None  #: (evictor, acceptor) stage pairs; None = off
    bpipe_inflight: int | None = None
    layers_per_stage: tuple[int, ...] | None = None  #: per device, as run.json gives it
    #: the (first) stage of each rank, index = rank: run.json's stage_of_rank (None: it gives none)
    stage_of_rank: tuple[int, ...] | None = None
    #: rank -> every stage it holds (run.json's stages_of_rank, else stage_of_rank, else the stage map)
    stages_of_rank: Mapping[int, tuple[int, ...]] | None = None
    virtual_stages: int | None = None
    host_cpus: int | None = None
    ranks_per_host: int | None = None
    hosts: tuple[str, ...] | None = None
    nnodes: int | None = None
    trainer: str | None = None
    dropout: bool | None = None
    eager: bool | None = None
    grads_in_step: bool = False
    link_bytes_per_s: float | None = None  #: the P2P link's bandwidth; None: traceana.measure.p2p's assumed one
    p2p_latency_ns: float | None = None  #: a CPU-rank P2P message's latency; None: traceana.measure.p2p's assumed one
    #: every rank on one host (run.json's hosts or nnodes, else the traces' host metadata: reconcile.run_facts);
    #: None = not told. The clock alignment trusts one host's clock (traceana.measure.timeline.clock_offsets).
    same_host: bool | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    conflicts: tuple[str, ...] = ()
    refusal: str | None = None
    #: run.json's value of each fact the traces' value replaced (source trace where run.json said otherwise)
    overruled: Mapping[str, object] = field(default_factory=dict)
    manifest: Manifest | None = field(default=None, compare=False, repr=False)  #: run.json as written

    @property
    def has_run_json(self) -> bool:
        """Whether the run has a run.json (the facts sourced ``run.json`` came from it)."""
        return self.manifest is not None

    def run_json_lists_stages(self) -> bool:
        """Whether run.json's ``stages_of_rank`` lists every stage of each rank (not only ``stage_of_rank``'s first
        one, which ``stages_of_rank`` holds alone when that is all run.json gives)."""
        if not self.stages_of_rank or self.source("stages_of_rank") != RUN_JSON:
            return False
        return self.stage_of_rank is None or any(st != (s,) for (_, st), s in
                                                 zip(sorted(self.stages_of_rank.items()), self.stage_of_rank))

    def source(self, name: str) -> str:
        """Where fact ``name`` came from (one of SOURCES)."""
        return self.sources.get(name, DEFAULT)

    @classmethod
    def from_manifest(cls, manifest: Manifest | None, *, peak_flops: float | None = None) -> RunConfig:
        """run.json alone: its facts (source run.json), the rest defaults; ``peak_flops`` (an option) overrides."""
        if manifest is None:
            return cls(peak_flops=peak_flops, sources={"peak_flops": OPTION} if peak_flops else {})
        given = {f: getattr(manifest, f) for f in _FROM_MANIFEST}
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in given}
        sources = {f: RUN_JSON for f, v in given.items() if v is not None and v != defaults.get(f)}
        if manifest.stages_of_rank:
            stages = {r: tuple(st) for r, st in enumerate(manifest.stages_of_rank)}
        elif manifest.stage_of_rank:
            stages = {r: (s,) for r, s in enumerate(manifest.stage_of_rank)}
        else:
            stages = None
        if stages is not None:
            sources["stages_of_rank"] = RUN_JSON
        virtual = manifest.stages_a_rank
        if virtual is not None:
            sources["virtual_stages"] = RUN_JSON
        if peak_flops:
            given["peak_flops"], sources["peak_flops"] = peak_flops, OPTION
        given = {k: v for k, v in given.items() if v is not None}
        given["grads_in_step"] = bool(given.get("grads_in_step", False))
        return cls(**given, stages_of_rank=stages, virtual_stages=virtual, sources=sources, manifest=manifest)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def stage_layers(self) -> tuple[int, ...] | None:
        """Transformer blocks of each stage (index = stage, ``pp`` of them): run.json's ``layers_per_stage`` (per
        device: per stage when a device holds one), else the rules' even split; None without a model or pp, or
        with ``layers_per_stage`` on several stages a device (it does not say how a device's layers divide)."""
        from traceana.core.pipeline_rules import stage_layers

        if self.model is None or not self.pp:
            return None
        if self.layers_per_stage is not None:
            return self.layers_per_stage if len(self.layers_per_stage) == self.pp else None
        return stage_layers(self.model.layers, self.pp)

    @property
    def from_reference_trainer(self) -> bool:
        """The reference trainer (collectors/trainer): eager PyTorch without dropout, on CPU."""
        return (self.trainer or "traceana") == "traceana" and self.device in (None, "cpu")

    def training_config(self, *, precision: Precision | None = None,
                        path: str | Path | None = None) -> TrainingConfig:
        """The model's view of this run; a ConfigError names what is missing or refused and what to fix in run.json
        (``path``: the run folder or run.json), not an option of another command."""
        where = None if path is None else Path(path) if Path(path).name == MANIFEST_NAME else \
            Path(path) / MANIFEST_NAME if Path(path).is_dir() else Path(path).parent / MANIFEST_NAME
        if self.refusal:  # run.json's schedule places other stages than the traces hold: nothing simulates it
            raise ConfigError(self.refusal, path=None if where is None else shown(where),
                              fix="fix schedule (or virtual_stages) in run.json")
        try:
            return self._training_config(precision)
        except ConfigError as e:
            if where is None:
                raise
            fix = _FLAG.sub(lambda m: _RUN_JSON_KEY.get(m.group(1), m.group(1).replace("-", "_")), e.fix or "")
            raise ConfigError(e.what, path=shown(where), fix=fix if "run.json" in fix else
                              f"{fix} in run.json" if fix else "fix run.json") from None

    def _training_config(self, precision: Precision | None) -> TrainingConfig:
        from traceana.core.training_config import FP32_ADAM, MIXED_ADAM, MODEL_SCHEDULES, TrainingConfig

        missing = [f for f in ("model", "pp", "microbatch_size", "num_microbatches") if getattr(self, f) is None]
        if missing:
            keys = ", ".join(f"{f} ({RUN_JSON_KEYS[f]})" for f in missing)
            # (every missing fact named by its run.json key; `traceana describe` writes the rest from the traces)
            what = ("there is no run.json and the traces do not show " if self.manifest is None else "run.json lacks ")
            raise ConfigError(f"{what}{', '.join(missing)}, which the model needs",
                              fix=f"write run.json with {keys}: `traceana describe RUN -o run.json` writes one with "
                                  "what the traces show and names the rest, to put in the run folder")
        if self.schedule not in MODEL_SCHEDULES:
            raise ConfigError(f"the model cannot simulate schedule {self.schedule!r}",
                              fix=f"use one of {', '.join(MODEL_SCHEDULES)}")
        if self.stages_of_rank and self.source("stages_of_rank") == RUN_JSON \
                and len({len(st) for st in self.stages_of_rank.values()}) > 1:
            raise ConfigError("run.json's stages_of_rank gives the ranks different numbers of stages; the model "
                              "simulates the same number on every device",
                              fix="estimate it with `traceana estimate --virtual-stages N` for an even placement")
        virtual = self.virtual_stages or 1
        # pp counts stages (virtual_stages of them a rank); the model's pp counts devices
        if virtual > 1 and self.pp % virtual:
            raise ConfigError(f"pp {self.pp} (the stages) is not a multiple of {virtual} virtual stages a rank",
                              fix="give pp as all the stages, virtual_stages of them on each rank")
        if precision is None:
            precision = MIXED_ADAM if self.dtype in ("bfloat16", "float16", "bf16", "fp16") else FP32_ADAM
        # The reference trainer is eager PyTorch without dropout; run.json's dropout / eager say otherwise.
        trainer = self.from_reference_trainer
        return TrainingConfig(
            model=self.model, pp=self.pp // virtual, tp=self.tp, dp=self.dp, microbatch_size=self.microbatch_size,
            num_microbatches=self.num_microbatches, schedule=self.schedule, attention=self.attention or "sdpa",
            recompute=self.recompute or "none", bpipe=bool(self.bpipe), bpipe_inflight=self.bpipe_inflight,
            virtual_stages=virtual, precision=precision, layers_per_stage=self.layers_per_stage,
            dropout=self.dropout if self.dropout is not None else (False if trainer else None),
            eager=self.eager if self.eager is not None else trainer,
        )

    def _repr_html_(self) -> str:
        """Each known fact with where it came from, and the conflicts, for Jupyter."""
        from html import escape

        rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(f['value']))}</td><td>{escape(str(f['source']))}"
                       "</td></tr>" for k, f in self.as_dict()["facts"].items() if f["value"] not in (None, {}, []))
        conflicts = "".join(f"<li>{escape(c)}</li>" for c in self.conflicts)
        return ("<div><p><b>traceana.RunConfig</b></p><table><thead><tr><th>fact</th><th>value</th><th>from</th>"
                f"</tr></thead><tbody>{rows}</tbody></table>"
                + (f"<p>conflicts:</p><ul>{conflicts}</ul>" if conflicts else "") + "</div>")

    def as_dict(self) -> dict:
        """JSON-ready: every fact with its source, and the conflicts."""
        facts = {}
        for f in dataclasses.fields(self):
            if f.name in ("sources", "conflicts", "refusal", "overruled", "manifest"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, ModelShape):
                v = dataclasses.asdict(v)
            elif isinstance(v, Mapping):
                v = {str(k): list(x) for k, x in v.items()}
            elif isinstance(v, tuple):
                v = [list(x) if isinstance(x, tuple) else x for x in v]
            facts[f.name] = {"value": v, "source": self.source(f.name)}
        return {"facts": facts, "conflicts": list(self.conflicts), "refusal": self.refusal}


# TrainingConfig's messages name the flags of `estimate`/`collect`; from run.json they name its keys instead.
_FLAG = re.compile(r"--([a-z][a-z-]*)")
_RUN_JSON_KEY = {"microbatches": "num_microbatches", "microbatch-size": "microbatch_size", "bpipe": "bpipe",
                 "schedule": "schedule", "pp": "pp", "tp": "tp", "dp": "dp", "bpipe-inflight": "bpipe_inflight"}
