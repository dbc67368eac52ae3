"""What the command line prints, as small objects for a notebook (issue 36 item 4): ``what_if`` (``traceana whatif``:
the measured step replayed with ``--set`` changes, and the run's durations under another ``--schedule``,
``--microbatches`` or ``--bpipe``), ``compare`` (``compare_runs``: the report's side-by-side comparison of runs) and
``validate`` (``traceana validate``'s model replay). Each result keeps the tables and dicts the library computes
(traceana.causal.whatif, traceana.measure.summary.compare_runs, traceana.validation.replay), adds nothing to them, and
shows itself in a few lines (``repr``) or as HTML in Jupyter (``_repr_html_``); ``as_dict()`` is the command's
``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any, Iterable, Iterator

import polars as pl

MAX_REPR_LINE = 180


def _short(lines: Iterable[str]) -> str:
    return "\n".join(x if len(x) <= MAX_REPR_LINE else x[:MAX_REPR_LINE - 1] + "…" for x in lines)


def _html(title: str, lines: Iterable[str], tables: Iterable[tuple[str, pl.DataFrame]] = ()) -> str:
    items = "".join(f"<li>{escape(x)}</li>" for x in lines)
    body = "".join(f"<p>{escape(name)}:</p>{frame.with_columns(pl.selectors.float().round(3))._repr_html_()}"
                   for name, frame in tables if frame is not None and frame.height)
    return f"<div><p><b>{escape(title)}</b></p><ul>{items}</ul>{body}</div>"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.2f}"


@dataclass(frozen=True)
class WhatIfResult:
    """``traceana whatif``'s answer: ``replay`` (traceana.causal.whatif.WhatIf: the replayed step, every group made
    ideal, the critical path, the diagnosis) and ``plan`` (traceana.validation.plan.plan_whatif's dict, or None when no
    schedule, micro-batch count or BPipe was asked for)."""

    replay: Any
    plan: dict | None = None

    @property
    def summary(self) -> dict:
        return self.replay.summary

    @property
    def groups(self) -> pl.DataFrame:
        return self.replay.groups

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(self.replay.notes)

    def as_dict(self) -> dict:
        """What ``traceana whatif --json`` prints."""
        return {**self.replay.as_dict(), "plan": self.plan}

    def lines(self) -> list[str]:
        from traceana.measure.summary import steps_label

        s = self.summary
        out = [f"measured step {_ms(s['measured_step_ms'])} ms over {steps_label(s['measured_steps'])}; replayed "
               f"{_ms(s['replayed_step_ms'])} ms; everything ideal {_ms(s['ideal_step_ms'])} ms; noise "
               f"{_ms(s['noise_ms'])} ms"]
        if s.get("changes"):
            out.append(f"with {', '.join(s['changes'])}: the step would be {_ms(s['changed_step_ms'])} ms")
        if self.plan is not None:
            p, was = self.plan["plan"], self.plan["as_run"]
            out.append(f"as {p['schedule']}, {p['microbatches']} micro-batches, BPipe {'on' if p['bpipe'] else 'off'} "
                       f"(ran as {was['schedule']}, {was['microbatches']}): predicted step "
                       f"{_ms(self.plan['predicted_step_ms'])} ms against the measured "
                       f"{_ms(self.plan['measured_step_ms'])}")
        out.append(f"diagnosis: {s['diagnosis']}")
        return out

    def __repr__(self) -> str:
        return _short(["<traceana what-if>", *(f"  {x}" for x in self.lines()),
                       f"  {self.groups.height} groups (.groups), {len(self.notes)} notes (.notes)"])

    def _repr_html_(self) -> str:
        return _html("traceana what-if", self.lines(), [("each group made ideal (the rest as measured)", self.groups)])


def what_if(analysis, set: str | Iterable[str] = (), *, schedule: str | None = None,  # noqa: A002 (--set)
            microbatches: int | None = None, bpipe: bool | None = None,
            virtual_stages: int | None = None) -> WhatIfResult:
    """``traceana whatif`` from Python: ``set`` the ``--set`` changes (``"stage=1:forward*0.5"``, ``"p2p=0"``, …;
    one text or several), ``schedule``, ``microbatches``, ``bpipe`` (True/False) and ``virtual_stages`` the plan
    what-if (needs run.json's model and pipeline, as the command does). A bad change raises the command's one-line
    error (traceana.causal.whatif.SetError) before any replay."""
    from traceana.causal.whatif import parse_set, whatif
    from traceana.validation.plan import plan_whatif

    texts = [set] if isinstance(set, str) else list(set)
    changes = [parse_set(t) for t in texts]
    replay = whatif(analysis, changes)
    plan = None
    if schedule is not None or microbatches is not None or bpipe is not None or virtual_stages is not None:
        plan = plan_whatif(analysis, schedule=schedule, microbatches=microbatches, bpipe=bpipe,
                           virtual_stages=virtual_stages)
    return WhatIfResult(replay, plan)


@dataclass(frozen=True)
class Comparison:
    """Runs side by side (traceana.measure.summary.compare_runs): ``overview`` (one row per run: its step, the change
    against the first with its noise interval) and ``per_stage``. Unpacks as the old ``(overview, per_stage)``."""

    overview: pl.DataFrame
    per_stage: pl.DataFrame

    def __iter__(self) -> Iterator[pl.DataFrame]:
        return iter((self.overview, self.per_stage))

    def lines(self) -> list[str]:
        rows = self.overview.select("run", "step_ms", "step_change_words").rows()
        return [f"{run}: step {_ms(step)} ms" + (f" — {words}" if words else "") for run, step, words in rows]

    def __repr__(self) -> str:
        return _short([f"<traceana comparison of {self.overview.height} runs>", *(f"  {x}" for x in self.lines()),
                       "  tables: .overview, .per_stage"])

    def _repr_html_(self) -> str:
        return _html(f"traceana comparison of {self.overview.height} runs", self.lines(),
                     [("per stage", self.per_stage)])


def compare(runs, *, repeats: dict[str, list] | None = None) -> Comparison:
    """Every run against the first: ``runs`` is ``[(name, analysis or summary), …]`` or ``{name: …}``;
    ``repeats``: more runs of a named run's configuration (their analyses or summaries), as ``compare_runs``."""
    from traceana.measure.summary import compare_runs

    def summary(x):
        return getattr(x, "summary", x)

    pairs = list(runs.items()) if isinstance(runs, dict) else list(runs)
    more = {k: [summary(x) for x in v] for k, v in (repeats or {}).items()}
    overview, per_stage = compare_runs([(name, summary(x)) for name, x in pairs], repeats=more)
    return Comparison(overview, per_stage)


@dataclass(frozen=True)
class ValidationResult:
    """``traceana validate``'s replay (traceana.validation.replay.Validation) with a short repr and HTML: its
    ``summary`` dict and ``per_stage`` table (measured against modelled)."""

    validation: Any

    def __getattr__(self, name: str):  # (every other field of the Validation: .simulation, …)
        if name == "validation":
            raise AttributeError(name)
        return getattr(self.validation, name)

    @property
    def summary(self) -> dict:
        return self.validation.summary

    @property
    def per_stage(self) -> pl.DataFrame:
        return self.validation.per_stage

    def lines(self) -> list[str]:
        s = self.summary
        err = s.get("replay_error")
        return [f"{s.get('kind', 'replay')}: measured step {_ms(s.get('measured_step_ms'))} ms, modelled "
                f"{_ms(s.get('replay_step_ms'))} ms" + ("" if err is None else f" ({err:+.1%})")]

    def __repr__(self) -> str:
        return _short(["<traceana validation>", *(f"  {x}" for x in self.lines()),
                       f"  per stage: {self.per_stage.height} rows (.per_stage)"])

    def _repr_html_(self) -> str:
        return _html("traceana validation", self.lines(), [("per stage", self.per_stage)])


def validate(analysis, **keywords) -> ValidationResult:
    """traceana.validation.replay.validate (``traceana validate``'s replay) as a ValidationResult."""
    from traceana.validation.replay import validate as replayed

    return ValidationResult(replayed(analysis, **keywords))


compare_runs = compare  # traceana.compare_runs: the public name, now a Comparison (it unpacks as the old tuple)
