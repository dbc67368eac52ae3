"""Estimate vs measured for the report: calls ``traceana.validation``; a run it cannot validate is one line in the report.

``traceana.validation.validate(analysis)`` returns a ``Validation`` (per-stage frame, summary dict, notes); here it
becomes one long table (item, unit, measured, estimated, error_pct). ``cross_run(baseline, target)`` predicts a run
from another's measurements, for the A/B section. What the model refuses (a ``TraceanaError``: no run.json, no
complete step, …) becomes one line in the report; anything else is a bug and fails the report like any other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import polars as pl

from reports import frames as F
from traceana.core.errors import TraceanaError
from traceana.core.pipeline_rules import bpipe_applies
from traceana.measure.analysis import Analysis


@dataclass
class Validated:
    """What ``traceana.validation`` said about one run, for the report.

    ``table``: one row per compared quantity — item, unit, measured, estimated, error_pct — or None with ``message``
    saying why there is no comparison. ``notes``: how the estimate was made, in the model's own words. ``verdict``:
    for a plain 1F1B run, the model's answer to "would BPipe help this run?".
    """

    table: pl.DataFrame | None = None
    message: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    verdict: str | None = None


def default_validation(a: Analysis) -> Validated:
    """Ask ``traceana.validation`` for estimate vs measured; any failure becomes one line in the report, not a crash."""
    from traceana import validation as v

    try:
        validated = coerce_validation(v.validate(a))
    except TraceanaError as e:
        return Validated(message=f"estimate vs measured could not be computed: {e.line()}")
    return dataclasses.replace(validated, verdict=bpipe_verdict(a))


def bpipe_verdict(a: Analysis) -> str | None:
    """``traceana.validation.bpipe_verdict_from_run``'s sentence for a plain 1F1B run; None where it does not apply."""
    c = a.config
    if c.manifest is None or c.bpipe or not bpipe_applies(c.schedule, pp=c.pp, virtual_stages=c.virtual_stages or 1):
        return None
    from traceana.validation import bpipe_verdict_from_run

    try:
        return bpipe_verdict_from_run(a).sentence
    except TraceanaError as e:
        return f"BPipe verdict could not be computed: {e.line()}"


def coerce_validation(result: object) -> Validated:
    """Turn ``traceana.validation.Validation`` (per_stage frame + summary dict + notes) into the report's table."""
    if isinstance(result, Validated):
        return result
    per_stage = getattr(result, "per_stage", None)
    if not isinstance(per_stage, pl.DataFrame):
        raise TypeError(f"validate() returned {type(result).__name__} without a per_stage table")
    table = F.validation_items(per_stage, getattr(result, "summary", None) or {})
    return Validated(table=table, notes=tuple(getattr(result, "notes", ()) or ()))


def default_cross_run(baseline: Analysis, target: Analysis, repeat: tuple[Analysis, ...] = ()) -> dict | str:
    """``traceana.validation.cross_run``: predict the target from the baseline's measurements, against the measured
    change over both sides' runs (``repeat``: their other collections); a string if it fails."""
    from traceana.validation import cross_run

    try:
        return cross_run(baseline, target, repeat=repeat or None)
    except TraceanaError as e:
        return f"could not predict this run from {baseline.run.path.name}: {e.line()}"
