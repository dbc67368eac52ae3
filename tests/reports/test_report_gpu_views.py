"""The report draws the GPU views traceana computes (traceana.measure.gpu.gpu_views; their figures are checked
against HTA's own output in tests/measure/test_gpu_views.py): one table each for overlap, idle, kernel types and the
top kernels, on a real GPU trace; none on a CPU run."""

from __future__ import annotations

import warnings
from pathlib import Path

import traceana
from reports.build import build_report
from traceana.measure.gpu import gpu_views

DATA = Path(__file__).parent.parent / "data"


def _analysed(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traceana.load_and_analyze(str(path), cache=False)


def test_a_gpu_run_has_its_gpu_views_drawn_with_traceanas_figures():
    a = _analysed(DATA / "third_party/hta/trace_filter")
    html = build_report([a])
    assert "GPU views (as Holistic Trace Analysis defines them" in html
    for header in ("of it beside computation (ms)", "waiting on the host (ms)", "kernel type", "launches"):
        assert header in html, header
    for row in gpu_views(a)["overlap"]:  # each rank's overlap, as the table's percentage cell writes it
        assert f"{100 * row['overlap_fraction']:.0f} %" in html, row


def test_a_cpu_run_has_no_gpu_views():
    html = build_report([_analysed(DATA / "megatron_pipe/1f1b/run")])
    assert "GPU views" not in html
