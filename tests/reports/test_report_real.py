"""Reports from real runs collected here (tiny CPU pipelines, with and without BPipe): content against the analysis
tables, self-containment, the `traceana report` and `traceana demo` commands."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import polars as pl
import pytest
from report_html import parse, table_with

from reports import html as H

pytest.importorskip("torch")
pytest.importorskip("collectors.launch")


@pytest.fixture(scope="module")
def runs(collected_run) -> dict[str, Path]:
    """The session's shared tiny runs (tests/collected_runs.py): 4-stage 1F1B, without and with BPipe."""
    return {"baseline": collected_run("1f1b"), "bpipe": collected_run("1f1b_bpipe")}


@pytest.mark.multiprocess
def test_demo_collects_through_the_collectors_api(tmp_path):
    """The demo's own collection call, on the smallest pipeline the trainer accepts."""
    from reports.demo_command import collect_run

    run_dir = collect_run(tmp_path / "run", bpipe=False, pp=2, num_microbatches=2, steps=1, warmup_steps=1,
                          microbatch_size=1)
    assert (run_dir / "run.json").is_file()
    assert sorted(p.name for p in run_dir.glob("rank*.pt.trace.json.gz")) == ["rank0.pt.trace.json.gz",
                                                                             "rank1.pt.trace.json.gz"]


@pytest.fixture(scope="module")
def analyses(runs):
    from reports.command import analyse_runs

    return analyse_runs([runs["baseline"], runs["bpipe"]], progress=False)


@pytest.fixture(scope="module")
def report(analyses, tmp_path_factory) -> tuple[Path, str]:
    from reports.build import write_report

    path = write_report(tmp_path_factory.mktemp("real_report") / "report.html", analyses)
    return path, path.read_text()


def test_sections_present(report):
    p = parse(report[1])
    assert p.section_ids == ["summary", "timeline", "attribution", "bubbles", "memory", "validation", "comparison"]
    assert p.network_refs == []
    assert "schedule" in report[1] and "1f1b" in report[1]


@pytest.mark.parametrize("which", [0, 1])
def test_stage_table_matches_analysis_tables(analyses, report, which):
    a = analyses[which]
    tables = [t for t in parse(report[1]).tables if t["section"] == "attribution" and "bubble (ms)" in t["header"]]
    table = tables[which]
    head = table["header"]
    rows = {int(r[0]): r for r in table["rows"]}
    # step time: the steps table, per rank; bubble: the attribution table's bubble categories; peak: stage_memory
    step = a.steps.group_by("rank").agg(ms=pl.col("dur_ns").mean() / 1e6)
    bubble = (
        a.attribution.filter(pl.col("category").cast(pl.String).str.starts_with("bubble"))
        .group_by("rank", "step").agg(pl.col("ns").sum())
        .group_by("rank").agg(ms=pl.col("ns").mean() / 1e6)
    )
    peak = a.stage_memory.group_by("rank").agg(mib=pl.col("peak_bytes").max() / 2**20)
    stage_of = dict(a.stages.select("rank", "stage").iter_rows())
    assert sorted(rows) == sorted(stage_of.values())
    for rank, ms in step.iter_rows():
        assert rows[stage_of[rank]][head.index("step (ms)")] == H.num(ms)
    for rank, ms in bubble.iter_rows():
        assert rows[stage_of[rank]][head.index("bubble (ms)")] == H.num(ms)
    for rank, mib in peak.iter_rows():
        assert rows[stage_of[rank]][head.index("peak memory (MiB)")] == H.num(mib)


def test_comparison_step_times_match(analyses, report):
    # one run a side: its side's step time (the geometric mean of its one run) is the run's own mean step
    header = "step time (ms, geometric mean of runs)"
    overview = table_with(parse(report[1]), "comparison", header)
    expected = [a.steps.group_by("step").agg(pl.col("dur_ns").max())["dur_ns"].mean() / 1e6 for a in analyses]
    col = overview["header"].index(header)
    assert [r[col] for r in overview["rows"]] == [H.num(x) for x in expected]


def test_validation_section_shows_the_model(analyses, report):
    from traceana.validation import validate

    v = validate(analyses[0])
    table = [t for t in parse(report[1]).tables if t["section"] == "validation" and "error (%)" in t["header"]][0]
    row = {r[0]: r for r in table["rows"]}["step time, whole pipeline"]
    assert row[2:4] == [H.num(v.summary["measured_step_ms"]), H.num(v.summary["simulated_step_ms"])]
    # the baseline is a plain 1F1B run: the model's BPipe verdict is there, once (not for the BPipe run)
    assert report[1].count("Would BPipe help this run?") == 1
    assert any(f'<p class="verdict">BPipe {verb}' in report[1]
               for verb in ("would help", "would not help", "would make no difference to"))


def test_report_command_writes_a_file(runs, tmp_path, capsys):
    from traceana.cli import main

    out = tmp_path / "r.html"
    assert main(["report", str(runs["baseline"]), "-o", str(out), "--quiet", "--no-validate"]) == 0
    assert f"report: {out}" in capsys.readouterr().out
    assert "timeline" in parse(out.read_text()).section_ids


def test_report_repeat_counts_each_run_once_and_refuses_other_configurations(runs, tmp_path, capsys):
    """A copy of a run, or the run named again, is one run: it adds no spread between runs, so --repeat refuses it
    in one line (issue 33: `report RUN --repeat RUN RUN` was accepted without a word); a run of another
    configuration is not a repeat either: its difference is not noise."""
    from traceana.cli import main

    again = tmp_path / "baseline-again"
    shutil.copytree(runs["baseline"], again, ignore=shutil.ignore_patterns(".traceana"))
    out = tmp_path / "r.html"
    base, bpipe = str(runs["baseline"]), str(runs["bpipe"])
    assert main(["report", base, bpipe, "--repeat", base, str(again), "-o", str(out), "--quiet", "--no-validate"]) == 2
    assert "is a copy of" in capsys.readouterr().err and not out.exists()
    assert main(["report", base, "--repeat", base, base, "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "given more than once" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["report", base, bpipe, "--repeat", base, bpipe, "-o", str(tmp_path / "x.html"), "--quiet"]) == 2
    assert "not a collection of" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_report_command_bad_input_is_one_line(tmp_path, capsys):
    from traceana.cli import main

    assert main(["report", str(tmp_path / "missing"), "-o", str(tmp_path / "r.html"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such run directory" in err[0]
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "r.html"), "--quiet"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_demo_writes_the_report_and_says_where(runs, tmp_path, monkeypatch, capsys):
    """The demo's own flow (progress, analysis, validation, report, clean-up) on the session's runs; its collection
    call is tested above."""
    import reports.demo_command as demo

    def copy_run(out: Path, *, bpipe: bool, progress=None, **_):
        if progress:
            progress("rank 0 finished step 0")
        # not the derived cache: another test worker may be writing it in the shared run right now
        shutil.copytree(runs["bpipe" if bpipe else "baseline"], out, ignore=shutil.ignore_patterns(".traceana"))
        return out

    monkeypatch.setattr(demo, "collect_run", copy_run)
    out = tmp_path / "demo"
    assert demo.run(argparse.Namespace(output=out, keep=False, quiet=True)) == 0
    said = capsys.readouterr().out.strip().splitlines()
    # the results on stdout, what holds first (memory), the report's path last
    assert said[-1] == f"report: {(out / 'report.html').resolve()}"
    assert said[0].startswith("BPipe: largest stage's activation peak")
    # the copies stand for one run a side: counted once, so the step time gets no verdict (repeat to tell)
    assert any("step time, geometric mean of runs" in line and "repeat to tell" in line for line in said), said
    assert any(line.startswith("note: ") and "counted once" in line for line in said)
    assert (out / "report.html").stat().st_size > 100_000
    assert not (out / "runs").exists()
    assert "comparison" in parse((out / "report.html").read_text()).section_ids


def test_real_report_renders_in_chromium(report, tmp_path):
    from test_report_browser import CHROMIUM, chromium, console_errors

    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed")
    path, text = report
    done = chromium(path, tmp_path / "profile", "--dump-dom")
    rendered = done.stdout.count('<div class="bk-Figure"')
    assert rendered == text.count('<div class="plot">') > 10
    assert console_errors(done.stderr) == []
