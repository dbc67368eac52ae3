"""The diagnosis is asked for, not paid for by every summary (issue 34, Build 1): ``traceana.diagnose`` fills the
measured summary's what-if fields and keeps the result as the analysis' summary; ``analyze --no-whatif`` imports
none of the what-if; the analysis cache holds the diagnosis where it was asked for.

The run is tests/tracebuilder.py's two-stage step (by hand: rank 0 F0 0–20 µs, send, waits, B0 70–90 µs; rank 1
receives at 26 µs, F0, B0, sends the gradient at 60 µs): its critical path exists, its figures are the same with
and without the diagnosis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tracebuilder import write_two_stage_run
from traceana.causal import diagnosis
from traceana.causal.diagnosis import diagnose
from traceana.measure.analysis_cache import load_and_analyze
from traceana.measure.summary import WHATIF_COLUMNS

LOADED = """
import json, sys
from traceana.cli import main
rc = main({argv!r})
print(json.dumps({{"rc": rc, "what_if": "traceana.causal.whatif" in sys.modules}}), file=sys.stderr)
"""


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run").mkdir()
    return write_two_stage_run(tmp_path / "run")


def test_the_summary_holds_figures_and_diagnose_adds_the_what_if_to_them(run_dir):
    a = load_and_analyze(run_dir, cache=False)
    plain = a.summary
    assert not plain.diagnosed and plain.diagnosis is None and plain.critical_path is None
    assert plain.per_stage.select(list(WHATIF_COLUMNS)).null_count().sum_horizontal().item() == 2 * len(WHATIF_COLUMNS)
    s = diagnose(a)
    assert s.diagnosed and s.diagnosis is not None and s.critical_path is not None and s.path is not None
    assert a.summary is s and diagnose(a) is s  # kept: every later reader sees the same, asked once
    # the figures are the measured summary's, untouched
    assert (s.steps, s.step_ms, s.bubble_fraction, s.step_times_ms) == (plain.steps, plain.step_ms,
                                                                         plain.bubble_fraction, plain.step_times_ms)
    assert s.per_stage.drop(list(WHATIF_COLUMNS)).equals(plain.per_stage.drop(list(WHATIF_COLUMNS)))


def test_a_cache_hit_holds_the_diagnosis_it_was_stored_with(run_dir, monkeypatch):
    first = load_and_analyze(run_dir, diagnose=diagnose)
    assert first.summary.diagnosed

    def no_second_what_if(*args, **kwargs):
        raise AssertionError("the what-if ran again on a cache hit")

    monkeypatch.setattr(diagnosis, "named_by_whatif", no_second_what_if)
    hit = load_and_analyze(run_dir, diagnose=diagnose)
    assert hit.summary.diagnosed and hit.summary.diagnosis == first.summary.diagnosis
    assert not load_and_analyze(run_dir).summary.diagnosed  # an entry without it is its own


@pytest.mark.parametrize("argv, what_if", [
    (["analyze", "--quiet", "--no-cache"], True),
    (["analyze", "--quiet", "--no-cache", "--no-whatif"], False),
])
def test_analyze_without_the_whatif_imports_none_of_it(run_dir, argv, what_if):
    code = LOADED.format(argv=[*argv, str(run_dir)])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    got = json.loads(out.stderr.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["what_if"] == what_if, (got, out.stdout[-500:])
    assert ("Critical path of the replayed step" in out.stdout) == what_if, out.stdout
