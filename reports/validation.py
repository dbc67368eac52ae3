"""Estimate vs measured for the report: calls ``traceana.validate`` when it exists, and never lets it fail the report.

``traceana.validate.validate(analysis)`` returns a ``Validation`` (per-stage frame, summary dict, notes); here it
becomes one long table (item, unit, measured, estimated, error_pct). ``cross_run(baseline, target)`` predicts a run
from another's measurements, for the A/B section. Any exception becomes one line in the report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import polars as pl

from reports import frames as F
from traceana.analysis import Analysis


@dataclass
class Validated:
    """What ``traceana.validate`` said about one run, for the report.

    ``table``: one row per compared quantity — item, unit, measured, estimated, error_pct — or None with ``message``
    saying why there is no comparison. ``notes``: how the estimate was made, in the model's own words. ``verdict``:
    for a plain 1F1B run, the model's answer to "would BPipe help this run?".
    """

    table: pl.DataFrame | None = None
    message: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    verdict: str | None = None


def _one_line(e: Exception) -> str:
    return e.line() if hasattr(e, "line") else f"{type(e).__name__}: {e}"


def default_validation(a: Analysis) -> Validated:
    """Ask ``traceana.validate`` for estimate vs measured; any failure becomes one line in the report, not a crash."""
    try:
        from traceana import validate as v
    except ImportError:
        return Validated(message="estimate vs measured: traceana.validate is not available in this installation")
    try:
        validated = coerce_validation(v.validate(a))
    except Exception as e:  # noqa: BLE001 — a failure of the model must not cost the user the rest of the report
        return Validated(message=f"estimate vs measured could not be computed: {_one_line(e)}")
    return dataclasses.replace(validated, verdict=bpipe_verdict(a))


def bpipe_verdict(a: Analysis) -> str | None:
    """``traceana.validate.bpipe_verdict_from_run``'s sentence for a plain 1F1B run; None where it does not apply."""
    m = a.run.manifest
    if m is None or m.schedule != "1f1b" or m.bpipe_on or (m.pp or 0) < 2:
        return None
    try:
        from traceana.validate import bpipe_verdict_from_run
    except ImportError:
        return None
    try:
        return bpipe_verdict_from_run(a).sentence
    except Exception as e:  # noqa: BLE001 — as above
        return f"BPipe verdict could not be computed: {_one_line(e)}"


def coerce_validation(result: object) -> Validated:
    """Turn ``traceana.validate.Validation`` (per_stage frame + summary dict + notes) into the report's table."""
    if isinstance(result, Validated):
        return result
    per_stage = getattr(result, "per_stage", None)
    if not isinstance(per_stage, pl.DataFrame):
        raise TypeError(f"validate() returned {type(result).__name__} without a per_stage table")
    table = F.validation_items(per_stage, getattr(result, "summary", None) or {})
    return Validated(table=table, notes=tuple(getattr(result, "notes", ()) or ()))


def default_cross_run(baseline: Analysis, target: Analysis) -> dict | str:
    """``traceana.validate.cross_run``: predict the target from the baseline's measurements; a string if it fails."""
    try:
        from traceana.validate import cross_run
    except ImportError:
        return "the cross-run prediction is not available in this installation"
    try:
        return cross_run(baseline, target)
    except Exception as e:  # noqa: BLE001 — as above: one line in the report
        return f"could not predict this run from {baseline.run.path.name}: {_one_line(e)}"
