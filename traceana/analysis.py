"""The result of analysing one run: every derived table, plus what could and could not be determined."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from traceana.ingest import Run


@dataclass(frozen=True)
class Analysis:
    run: Run
    steps: pl.DataFrame  # schema.STEPS
    p2p: pl.DataFrame  # schema.P2P
    schedule: pl.DataFrame  # schema.SCHEDULE
    attribution: pl.DataFrame  # schema.ATTRIBUTION
    stage_memory: pl.DataFrame  # schema.STAGE_MEMORY
    stages: pl.DataFrame  # one row per rank: rank, stage, stage_source, step time, category ms/%, peak memory, MFU
    clock_offsets: pl.DataFrame  # rank, offset_ns, source
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was inferred, what could not be determined
