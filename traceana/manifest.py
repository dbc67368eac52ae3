"""The run manifest (``run.json``): every fact about a run that the analysis must not guess.

Written by collectors (rank 0), read by ``traceana.ingest.run_dir``. Frozen dataclasses validated on
construction; ``Manifest.from_json`` turns any malformed file into one clear BadInputError line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceana.errors import BadInputError

SCHEMA_VERSION = 1
MANIFEST_NAME = "run.json"
FAMILIES = ("gpt", "llama")
ATTENTIONS = ("naive", "sdpa")  # sdpa = flash-style: does not keep the s×s scores
RECOMPUTES = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "unknown")


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
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
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
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise BadInputError(f"world_size must be positive, got {self.world_size}", fix="fix run.json")
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

    @property
    def bpipe_on(self) -> bool:
        return bool(self.bpipe)

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
            if kwargs.get("model") is not None:
                kwargs["model"] = ModelShape(**kwargs["model"])
            for k in ("stage_of_rank", "ranks_written"):
                if kwargs.get(k) is not None:
                    kwargs[k] = tuple(int(x) for x in kwargs[k])
            if kwargs.get("bpipe"):
                kwargs["bpipe"] = tuple((int(a), int(b)) for a, b in kwargs["bpipe"])
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
            data = json.loads(path.read_bytes())
        except OSError as e:
            raise BadInputError(f"cannot read run.json ({e.strerror})", path=path, fix="check its permissions") from None
        except (ValueError, UnicodeDecodeError):
            raise BadInputError(
                "run.json is not valid JSON", path=path, fix="fix it, or delete it to let traceana infer the run"
            ) from None
        return cls.from_dict(data, path=path)
