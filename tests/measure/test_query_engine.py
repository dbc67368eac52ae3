"""Every lazy query of ``traceana analyze`` (the analysis, its summary and the what-if it runs) runs on the analysis'
engine, ``intervals.COLLECT``: polars' default engine (streaming) cost the tiny run's what-if ~3x the CPU of its
one large query and paged in the streaming engine's own code and threads (docs/performance.md "Fixed cost")."""

from __future__ import annotations

import polars as pl

from tracebuilder import write_two_stage_run
from traceana.causal.diagnosis import diagnose
from traceana.core import intervals as iv


def test_analyze_runs_every_lazy_query_in_memory(tmp_path, monkeypatch):
    import traceana
    from traceana.measure.analysis import analyze

    seen: list[object] = []
    collect, collect_all = pl.LazyFrame.collect, pl.collect_all

    def one(self, *args, **kwargs):
        seen.append(kwargs.get("engine"))
        return collect(self, *args, **kwargs)

    def many(frames, *args, **kwargs):
        seen.append(kwargs.get("engine"))
        return collect_all(frames, *args, **kwargs)

    monkeypatch.setattr(pl.LazyFrame, "collect", one)
    monkeypatch.setattr(pl, "collect_all", many)
    (tmp_path / "run").mkdir()
    a = analyze(traceana.load_run(write_two_stage_run(tmp_path / "run")))
    s = diagnose(a)
    assert s.diagnosis is not None  # the what-if ran (its queries are among those counted)
    assert seen, "no lazy query counted: the check no longer sees them"
    assert set(seen) == {iv.ENGINE}, f"{sum(e != iv.ENGINE for e in seen)} of {len(seen)} queries on {set(seen)}"
