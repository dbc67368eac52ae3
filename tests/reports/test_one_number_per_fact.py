"""One number per fact: the CLI table, ``--json`` and the HTML report show the same step time, bubble, exposed BPipe
transfer and activation peak for one real run (the reference trainer's 1F1B + BPipe), and the step time is the one
the traces' own ProfilerStep spans give, read here straight from the JSON."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import warnings

import pytest

pytestmark = pytest.mark.slow


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "traceana", *args], capture_output=True, text=True, timeout=600,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not found"
    return float(m.group(1).replace(",", ""))


def _profiler_step_ms(run_dir, steps) -> float:
    """Per measured step, the slowest rank's ProfilerStep span, averaged: read from the trace files themselves."""
    per_step: dict[int, float] = {}
    for trace in sorted(run_dir.glob("rank*.pt.trace.json.gz")):
        with gzip.open(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
        for e in events:
            m = re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))
            if m and e.get("ph") == "X" and int(m.group(1)) in steps:
                per_step[int(m.group(1))] = max(per_step.get(int(m.group(1)), 0.0), e["dur"] / 1e3)
    return sum(per_step.values()) / len(per_step)


def test_every_surface_shows_the_same_figures(collected_run, tmp_path):
    from reports.build import write_report
    from traceana.measure.analysis_cache import load_and_analyze

    run_dir = collected_run("1f1b_bpipe")
    js = json.loads(_cli("analyze", str(run_dir), "--json", "--no-cache"))["summary"]
    text = _cli("analyze", str(run_dir), "--no-cache")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = load_and_analyze(str(run_dir), cache=False)
    html = write_report(tmp_path / "r.html", [a], validation=None, cross_run=None).read_text()

    assert js["bpipe_ms"] and js["bpipe_ms"] > 0  # the run moved activations: its exposed cost is measured
    # step time: JSON, CLI and report agree, and equal the traces' own ProfilerStep spans (to rounding: the spans'
    # float microseconds against the analysis' integer nanoseconds)
    steps = js["measured_steps"]
    assert js["step_ms"] == pytest.approx(_profiler_step_ms(run_dir, steps), rel=1e-3)
    assert _num(r"step time \(slowest rank, mean over measured steps\): ([\d,.]+) ms", text) == \
        pytest.approx(js["step_ms"], abs=0.006)
    assert _num(r"<b>([\d,.]+) ms</b><span>step time", html) == pytest.approx(js["step_ms"], rel=0.005)
    # bubble share
    assert _num(r"bubble \(warm-up \+ stall \+ cool-down, all ranks\): ([\d.]+) %", text) == \
        pytest.approx(100 * js["bubble_fraction"], abs=0.06)
    assert _num(r"<b>([\d,.]+) %</b><span>bubble", html) == pytest.approx(100 * js["bubble_fraction"], rel=0.01)
    # exposed BPipe transfer
    assert _num(r"exposed BPipe transfer \(largest stage\): ([\d,.]+) ms", text) == \
        pytest.approx(js["bpipe_ms"], abs=0.006)
    assert _num(r"<b>([\d,.]+) ms</b><span>exposed BPipe", html) == pytest.approx(js["bpipe_ms"], rel=0.01)
    # the largest stage's activation peak
    stage = js["largest_activation_stage"]
    assert _num(rf"largest activation peak: ([\d,.]+) MiB on stage {stage}", text) == \
        pytest.approx(js["largest_activation_peak_bytes"] / 2**20, abs=0.006)
    assert _num(rf"<b>([\d,.]+) MiB \(stage {stage}\)</b><span>largest activation peak", html) == \
        pytest.approx(js["largest_activation_peak_bytes"] / 2**20, rel=0.01)
    # ... and the stage table's row shows it digit for digit (it rounded to one decimal: 0.0 next to 0.01)
    headline = re.search(r"largest activation peak: ([\d,.]+) MiB", text).group(1)
    rows = [line for line in text.splitlines() if "activation peak MiB" in line]
    assert rows and any(headline in re.findall(r"[\d,.]+", line) for line in rows)
    # per stage: the per-rank table (one rank per stage here) and the summary's per-stage rows are the same figures
    by_stage = {row["stage"]: row for row in js["per_stage"]}
    for row in json.loads(_cli("analyze", str(run_dir), "--json", "--no-cache"))["stages"]:
        assert row["step_ms"] == pytest.approx(by_stage[row["stage"]]["step_ms"], rel=1e-9)
        # (memory in JSON is in bytes everywhere: issue 36 item 5)
        assert row["activation_peak_bytes"] == \
            pytest.approx(by_stage[row["stage"]]["activation_peak_bytes"], abs=1)


def test_verdict_states_the_models_activation_peak_validate_prints(collected_run):
    """The BPipe verdict's "Model: largest stage's activation peak" is the memory model's per-stage estimate that
    validate's table prints next to the measured peak (it used to quote saved activations only, 5.1 against 5.4)."""
    d = json.loads(_cli("validate", str(collected_run("1f1b")), "--json", "--no-cache"))
    largest = max(row["estimated_activation_bytes"] for row in d["per_stage"]) / 2**20
    assert _num(r"Model: largest stage's activation peak ([\d.]+) MiB", d["bpipe"]["sentence"]) == \
        pytest.approx(largest, abs=0.006)


def test_sizes_and_durations_are_written_in_a_readable_unit():
    from traceana.core.units import bytes_text, seconds_text

    assert bytes_text(3 * 2**30) == "3.0 GiB"
    assert bytes_text(5.4 * 2**20) == "5.4 MiB"
    assert bytes_text(512 * 2**10) == "512.0 KiB"  # never "0.0 GiB" or "0 MiB" for a tiny model
    assert seconds_text(2.5) == "2.50 s"
    assert seconds_text(0.1368) == "136.8 ms"
    assert seconds_text(16.4e-6) == "16.4 µs"


def _rows(text: str) -> dict[str, list[str]]:
    """A table's rows by label: the label's cells across every split of the table, in order."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("│"):
            label, *cells = [c.strip() for c in line.strip("│").split("│")]
            rows.setdefault(label, []).extend(cells)
    return rows


def test_watch_and_analyze_name_and_show_each_category_alike(collected_run):
    """watch prints the same attribution as analyze: a category has one name (it was "p2p (exposed)" and
    "bubble warm-up" in watch, "p2p" and "bubble warmup" in analyze) and, for the same window, the same cells."""
    run_dir = collected_run("1f1b_bpipe")
    analyzed = _rows(_cli("analyze", str(run_dir), "--no-cache"))
    watched = _rows(_cli("watch", str(run_dir), "--once", "--settle", "0"))
    categories = [label for label in watched if label not in ("", "steps", "step ms", "compute")
                  and not label.startswith("1:")]
    assert "P2P (exposed)" in categories and "bubble: stall" in categories
    for label in ["step ms", *categories]:
        if any(c != "·" for c in watched[label]):  # analyze leaves out a category no stage has
            assert analyzed[label] == watched[label], label
