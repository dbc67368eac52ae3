"""Ingest: Kineto JSON → schema-checked polars tables. Knows JSON, nothing of pipelines.

Importing the package imports no polars: ``traceana.ingest.reading`` (the native scanner's reader) runs before
polars is imported (docs/performance.md "Fixed cost")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from traceana.core.manifest import Manifest

if TYPE_CHECKING:
    import polars as pl


@dataclass(frozen=True)
class Run:
    """Everything read from one run directory (or a single trace file)."""

    path: Path
    events: pl.DataFrame  # schema.EVENTS, all ranks
    memory: pl.DataFrame  # schema.MEMORY, all ranks
    traces: pl.DataFrame  # schema.TRACES, one row per rank
    manifest: Manifest | None = None  # run.json when present
    warnings: tuple[str, ...] = field(default_factory=tuple)  # e.g. truncated traces, facts inferred

    @property
    def ranks(self) -> list[int]:
        return self.traces["rank"].sort().to_list()

    @property
    def world_size(self) -> int:
        if self.manifest is not None:
            return self.manifest.world_size
        ws = self.traces["world_size"].drop_nulls()
        return int(ws.max()) if len(ws) else len(self.traces)
