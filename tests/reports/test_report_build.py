"""The report built from hand-made analysis tables: sections, numbers, self-containment, escaping, errors."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest
from report_fixtures import make_analysis
from report_html import parse, table_in, table_with

from reports import html as H
from reports.build import build_report, write_report
from reports.validation import Validated, coerce_validation, default_validation
from traceana.core import schema
from traceana.core.errors import AnalysisError

EVIL = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def two_runs():
    return [make_analysis(path="/runs/baseline"), make_analysis(path="/runs/bpipe", bpipe=True)]


class FakeValidation:
    """Shaped like traceana.validation.Validation: a per-stage table, a summary and notes."""

    def __init__(self, a):
        step = a.steps["dur_ns"].mean() / 1e6
        stages = sorted(a.stage_memory["stage"].unique().to_list())
        self.per_stage = pl.DataFrame({
            "stage": stages, "measured_step_ms": [step] * len(stages), "simulated_step_ms": [step * 1.1] * len(stages),
            "measured_activation_bytes": [2.0**20] * len(stages), "estimated_activation_bytes": [2.0**19] * len(stages),
        })
        self.summary = {"measured_step_ms": step, "simulated_step_ms": step * 1.1}
        self.notes = ("simulator fed with <measured> busy time",)


@pytest.fixture(scope="module")
def ab_report(two_runs):
    def cross_run(base, target):
        return {"baseline_step_ms": 70.0, "predicted_step_ms": 66.0, "measured_step_ms": 60.0, "error": 0.1,
                "predicted_speedup": 70 / 66, "measured_speedup": 70 / 60}

    return build_report(two_runs, validation=lambda a: coerce_validation(FakeValidation(a)), cross_run=cross_run)


def test_report_has_every_section(ab_report):
    p = parse(ab_report)
    assert p.section_ids == ["summary", "timeline", "attribution", "bubbles", "memory", "validation", "comparison"]
    # timeline ×2, attribution ×2, bubbles ×2, memory peak + activation + 2 over time, validation ×2×2 (ms, MiB), A/B ×3
    assert p.plot_divs == 17


@pytest.fixture(scope="module")
def bare_report():
    """One run without run.json, whose validation fails."""
    return build_report(
        [make_analysis(with_manifest=False, notes=())],
        validation=lambda a: Validated(message="estimate vs measured could not be computed: boom"),
    )


def test_single_run_has_no_comparison(bare_report):
    assert "comparison" not in parse(bare_report).section_ids


def test_validation_failure_is_one_line_not_a_crash(bare_report):
    assert '<p class="warn">estimate vs measured could not be computed: boom</p>' in bare_report


def test_default_validation_refusal_is_one_line():
    # the real traceana.validation on a run it cannot use (no run.json): one line, no exception
    v = default_validation(make_analysis(with_manifest=False))
    assert v.table is None and v.message.startswith("estimate vs measured could not be computed")


def test_run_without_manifest_says_facts_were_inferred(bare_report):
    assert "every fact below was inferred from the traces" in bare_report


def test_stage_table_matches_attribution(two_runs, ab_report):
    a = two_runs[0]
    table = table_in(parse(ab_report), "attribution", "stage")
    col = table["header"].index("bubble (ms)")
    # independently from the attribution table: mean bubble ns per step, per stage
    expected = (
        a.attribution.filter(pl.col("category").cast(pl.String).str.starts_with("bubble"))
        .group_by("stage", "step").agg(pl.col("ns").sum())
        .group_by("stage").agg(ms=pl.col("ns").mean() / 1e6).sort("stage")
    )
    got = [row[col] for row in table["rows"]]
    assert got == [H.num(x) for x in expected["ms"]]
    step_col = table["header"].index("step (ms)")
    assert {row[step_col] for row in table["rows"]} == {H.num(a.steps["dur_ns"].mean() / 1e6)}


def test_bubble_table_matches_attribution(two_runs, ab_report):
    a = two_runs[1]
    table = table_in(parse(ab_report), "bubbles", "stage", index=1)
    col = table["header"].index("bubble: warm-up (ms)")
    warm = a.attribution.filter(pl.col("category") == "bubble_warmup").group_by("stage").agg(
        ms=pl.col("ns").mean() / 1e6).sort("stage")
    assert [r[col] for r in table["rows"]] == [H.num(x) for x in warm["ms"]]


def test_memory_and_comparison_numbers(two_runs, ab_report):
    p = parse(ab_report)
    overview = table_with(p, "comparison", "largest stage peak (MiB)")
    peaks = [a.stage_memory["peak_bytes"].max() / 2**20 for a in two_runs]
    col = overview["header"].index("largest stage peak (MiB)")
    assert [r[col] for r in overview["rows"]] == [H.num(x) for x in peaks]
    # the BPipe fixture balances memory: imbalance 1.00× against the baseline's 260/140
    bal = overview["header"].index("memory imbalance (max/min)")
    assert [r[bal] for r in overview["rows"]] == [H.num(260 / 140), "1.00"]


def test_validation_table_shows_error(ab_report):
    table = table_in(parse(ab_report), "validation", "what")
    rows = {r[0]: r for r in table["rows"]}
    assert rows["step time, whole pipeline"][1:] == ["ms", "70.0", "77.0", "+10 %"]
    assert rows["stage 2 · activation peak"][1:] == ["MiB", "1.00", "0.500", "-50 %"]
    assert "simulator fed with &lt;measured&gt; busy time" in ab_report


def test_cross_run_prediction_in_comparison(ab_report):
    table = table_with(parse(ab_report), "comparison", "predicted step (ms)")
    assert table["rows"][0][-4:-1] == ["+10 %", "1.06", "1.17"]
    # one column judges the prediction against the measured change and its between-run interval (the A/B table's
    # above: one measurement, issue 33), instead of a second "measured" column beside it
    assert table["header"][-1] == "the prediction against the measured interval"


def test_no_network_references(ab_report):
    p = parse(ab_report)
    assert p.network_refs == []
    assert "cdn.bokeh.org" not in ab_report
    # bokeh's inlined JavaScript still names a MathJax CDN as a fallback loader for LaTeX labels, which the report
    # never uses; what matters is that no element of the page points at the network.
    assert "<script src" not in ab_report and "<link" not in ab_report


def test_report_size_stays_small(ab_report):
    assert len(ab_report.encode()) < 4 * 2**20


def test_strings_from_traces_are_escaped(tmp_path):
    a = make_analysis(path=f"/runs/{EVIL}", notes=(f"inferred stage for {EVIL}",))
    m = dataclasses.replace(a.run.manifest, device=EVIL, extra={"note": EVIL},
                            model=dataclasses.replace(a.run.manifest.model, name=EVIL))
    run = dataclasses.replace(a.run, manifest=m, warnings=(f"trace truncated: {EVIL}",))
    a = dataclasses.replace(a, run=run)
    text = write_report(tmp_path / "evil.html", [a, make_analysis()], validation=None).read_text()
    assert "<script>document.title" not in text
    assert "<img src=x" not in text
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in text
    p = parse(text)
    assert not any("pwned" in s and "&lt;" not in s for s in p.scripts)


def test_braces_in_a_run_name_are_text_in_plot_titles(tmp_path):
    """holoviews formats a plot title with str.format: a run named ``{x} {label}`` (``--name '{x} {label}'``) was a
    KeyError, and ``{label}`` alone would have been replaced. The titles carry the name as written."""
    text = write_report(tmp_path / "braces.html", [make_analysis(path="/runs/{x} {label}")], validation=None).read_text()
    assert '"text":"{x} {label}: pipeline timeline"' in text


def test_run_with_nothing_to_report_is_a_clear_error():
    a = make_analysis(path="/runs/empty")
    empty = dataclasses.replace(
        a, steps=schema.empty(schema.STEPS), schedule=schema.empty(schema.SCHEDULE),
        attribution=schema.empty(schema.ATTRIBUTION),
    )
    with pytest.raises(AnalysisError, match="/runs/empty: no profiled training steps"):
        build_report([empty])


@pytest.mark.parametrize(
    ("x", "text"),
    [(0, "0"), (0.0004567, "0.0005"), (1.23456, "1.23"), (12.3456, "12.3"), (123.456, "123"), (123456.7, "123,457"),
     (-2.5, "-2.50"), (None, "–"), (float("nan"), "–")],
)
def test_numbers_are_rounded_for_people(x, text):
    assert H.num(x) == text


def test_evil_trace_end_to_end(tmp_path):
    """A real (synthetic) trace whose event names, thread and folder carry markup: read, analyse, report."""
    from tracebuilder import TraceBuilder

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    run_dir = tmp_path / "<svg onload=document.title='pwned'>"  # no "/" in a folder name
    run_dir.mkdir()
    for rank in (0, 1):
        tb = TraceBuilder(rank=rank, world_size=2, tid="<img src=x onerror=alert(1)>")
        tb.step(0, 0, 100)
        tb.annotation(f"PP:{rank}F0", 5, 20)
        tb.cpu_op(EVIL, 6, 10)
        if rank == 0:
            tb.send(peer=1, tag=0, ts=30, dur=2)
        else:
            tb.recv(peer=0, tag=0, ts=1, dur=31)
        tb.annotation(f"PP:{rank}B0", 40, 30)
        tb.cpu_op(EVIL, 41, 20)
        tb.memory(10, 1 << 20, 1 << 20)
        tb.write(run_dir / f"rank{rank}.pt.trace.json.gz")
    a = analyze(load_run(run_dir, cache=False))
    text = build_report([a], validation=None)
    assert "<svg onload" not in text and "<script>document.title" not in text and "<img src=x" not in text
    assert "&lt;svg onload=document.title=&#x27;pwned&#x27;&gt;" in text


def test_demo_without_torch_is_one_clear_error(monkeypatch, tmp_path):
    import sys

    from reports.demo_command import collect_run
    from traceana.core.errors import BadInputError

    monkeypatch.setitem(sys.modules, "collectors.launch", None)  # what a laptop without torch sees
    with pytest.raises(BadInputError, match="traceana demo needs the collectors and torch"):
        collect_run(tmp_path / "run", bpipe=False)


def test_mfu_is_a_headline_only_when_measured():
    from reports.summary import kpis

    a = make_analysis()
    assert "MFU" not in kpis(a)
    with_mfu = dataclasses.replace(a, stages=a.stages.with_columns(mfu=pl.Series([0.12, 0.13, 0.11, 0.12])))
    assert "<b>12 %</b><span>MFU (model FLOPs, recompute not counted), mean over stages</span>" in kpis(with_mfu)
