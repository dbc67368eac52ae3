"""``PipelineProfiler``: torch.profiler around pipeline training, one self-describing trace per rank.

    with PipelineProfiler("runs/x", rank=rank, stage=stage, world_size=ws, pp=pp, schedule="1f1b") as prof:
        for step in range(steps):
            train_step()
            prof.step()

- Schedule ``wait``/``warmup``/``active``/``repeat`` as in ``torch.profiler.schedule``. With ``repeat`` > 1 every
  cycle replaces the previous one's file: the directory holds the *last* completed cycle (one trace per rank, as
  the run directory layout requires); ``traceana.cycle`` in the trace says which.
- ``record_shapes`` and ``profile_memory`` are on by default: gloo peers and tags are only visible with shapes
  (docs/field-notes.md), memory per stage needs the allocator instants.
- The trace carries a top-level ``"traceana"`` object (rank, stage, pp, world size, schedule, BPipe pairs, …) so a
  loose file describes itself; rank 0 writes ``run.json`` with ``ranks_written`` listing the ranks whose trace is on disk.
- Writing is atomic (``traceana.core.files.atomic_path``: a temporary, gzip, renamed into place): a trace that exists is
  complete. Any failure — unwritable directory, full disk, a profiler error — is logged as a warning and training
  goes on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from collectors.attach import ENV as ATTACH_ENV
from collectors.manifest import finalize_manifest, trace_path, wait_for_ranks
from traceana.core.files import atomic_path
from traceana.core.manifest import Manifest

log = logging.getLogger("traceana.collectors")

from isal import igzip as _gzip  # ~3x faster than zlib (docs/field-notes.md); a core dependency of traceana


def default_activities() -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


class PipelineProfiler:
    """Context manager: ``step()`` after every training step. Never raises because of profiling."""

    # Under ``traceana attach`` its window profiler is in charge: a second torch profiler started in the same process
    # silently takes the first one's events, so a PipelineProfiler in the job's own script does nothing there.
    stands_down_under_attach = True

    def __init__(
        self,
        out_dir: str | Path,
        *,
        rank: int,
        stage: int,
        world_size: int,
        pp: int,
        schedule: str = "unknown",
        bpipe: Iterable[tuple[int, int]] | None = None,
        manifest: Manifest | None = None,
        wait: int = 0,
        warmup: int = 1,
        active: int = 2,
        repeat: int = 1,
        record_shapes: bool = True,
        profile_memory: bool = True,
        with_stack: bool = False,
        activities: list[ProfilerActivity] | None = None,
        metadata: dict[str, Any] | None = None,
        manifest_timeout_s: float = 30.0,
        enabled: bool = True,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.rank, self.stage, self.world_size, self.pp = rank, stage, world_size, pp
        self.manifest = manifest
        self.manifest_timeout_s = manifest_timeout_s
        self.schedule_args = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat}
        self.metadata = {
            "rank": rank, "stage": stage, "pp": pp, "world_size": world_size, "schedule": schedule,
            "bpipe": [list(p) for p in bpipe] if bpipe else None, "profiler": self.schedule_args,
            "torch": torch.__version__, **(metadata or {}),
        }
        if enabled and self.stands_down_under_attach and os.environ.get(ATTACH_ENV):
            log.warning("traceana: rank %d: running under traceana attach, whose profiler is in charge: this "
                        "PipelineProfiler records nothing", rank)
            enabled = False
        self.enabled = enabled
        self.cycle = 0
        self.written: Path | None = None
        self.warnings: list[str] = []
        self._started_at = time.time()
        self._prof: profile | None = None
        self._options = dict(
            activities=activities or default_activities(),
            schedule=schedule_fn(**self.schedule_args),
            on_trace_ready=self._on_trace_ready,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )

    # ---- context manager --------------------------------------------------------------------------------------
    def __enter__(self) -> PipelineProfiler:
        if not self.enabled:
            return self
        self._started_at = time.time()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            trace_path(self.out_dir, self.rank).unlink(missing_ok=True)  # a stale trace must not pass for ours
        except OSError as e:
            self._warn(f"cannot prepare {self.out_dir} ({e.strerror or e}); the trace will probably not be written")
        try:
            self._prof = profile(**self._options)
            self._prof.__enter__()
            self._tag()
        except Exception as e:  # profiling must never break training
            self._warn(f"the profiler did not start ({type(e).__name__}: {e}); training goes on unprofiled")
            self._prof = None
        return self

    def step(self) -> None:
        if self._prof is None:
            return
        try:
            self._prof.step()
            self._tag()
        except Exception as e:
            self._warn(f"profiler step failed ({type(e).__name__}: {e}); profiling stops, training goes on")
            self._abandon()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._prof is not None:
            if exc_type is not None:
                self.metadata["interrupted"] = f"{exc_type.__name__}: {exc}"
                self._tag()
            try:
                self._prof.__exit__(None, None, None)  # stops; a partly recorded cycle is written too
            except Exception as e:
                self._warn(f"stopping the profiler failed ({type(e).__name__}: {e})")
            self._prof = None
        if self.enabled and self.rank == 0 and self.manifest is not None:
            written = wait_for_ranks(self.out_dir, self.world_size, since=self._started_at,
                                     timeout_s=self.manifest_timeout_s)
            if len(written) < self.world_size:
                self._warn(f"only ranks {list(written)} of {self.world_size} wrote a trace; run.json says so")
            if finalize_manifest(self.out_dir, self.manifest, since=self._started_at) is None:
                self.warnings.append("run.json not written")

    # ---- internals --------------------------------------------------------------------------------------------
    def _tag(self) -> None:
        """(Re)attach our metadata while a cycle records: Kineto keeps it for the trace it is building."""
        if self._prof is None:
            return
        try:
            self._prof.add_metadata_json("traceana", json.dumps({**self.metadata, "cycle": self.cycle}))
        except Exception:  # no cycle recording right now
            pass

    def _on_trace_ready(self, prof: profile) -> None:
        self.cycle += 1
        final = trace_path(self.out_dir, self.rank)
        tmp_json = self.out_dir / f".rank{self.rank}.{os.getpid()}.json.partial"
        try:
            prof.export_chrome_trace(str(tmp_json))
            with atomic_path(final) as tmp_gz:  # traceana's one writer (a symlink's target, never a device)
                with open(tmp_json, "rb") as src, _gzip.open(tmp_gz, "wb", compresslevel=3) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            self.written = final
        except Exception as e:  # OSError (permissions, ENOSPC), BadInputError, or a profiler export error
            self._warn(f"could not write {final} ({type(e).__name__}: {e}); training goes on")
        finally:
            try:
                tmp_json.unlink(missing_ok=True)
            except OSError:
                pass

    def _abandon(self) -> None:
        try:
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
        except Exception:
            pass
        self._prof = None

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning("traceana: rank %d: %s", self.rank, message)


def schedule_fn(*, wait: int, warmup: int, active: int, repeat: int):
    return schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)

