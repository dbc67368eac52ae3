"""Phases and streams that run at once on a GPU (traceana/measure/gpu.py, issue 26 items 1, 2 and 4): each phase's own
GPU time beside the per-instant partition, the time per stream, the note on unexplained concurrent kernels, and the
one line a trace that is not a pipeline gets. Every expected figure is summed by hand from the kernel times the
builder writes (µs)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import polars as pl
import pytest
from tracebuilder import TraceBuilder

import traceana
from traceana.cli import main
from traceana.measure import gpu
from traceana.measure.analysis import analyze

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def _trace(path, kernels, *, step_us=1000.0):
    """One GPU rank, one step; ``kernels``: (annotation or None, kernel name, start, duration, stream). Each
    annotation's CPU range launches its kernel (by correlation id); the CPU runs ahead of the GPU."""
    tb = TraceBuilder(rank=0, world_size=1, backend="nccl", pid=7, tid=7)
    tb.step(0, 0, step_us)
    for corr, (ann, name, start, dur, stream) in enumerate(kernels, 1):
        cpu = 10.0 * corr
        if ann is not None:
            tb.annotation(ann, cpu, 8)
        tb.launch(cpu + 2, 4, correlation=corr)
        tb.kernel(name, start, dur, stream=stream, correlation=corr)
    run = path / "run"
    run.mkdir()
    tb.write(run / "rank0.pt.trace.json.gz")
    return run


def test_overlapping_forward_and_backward_get_their_own_gpu_time_beside_the_partition(tmp_path):
    """Forward 100–500 on stream 7 and backward 300–700 on stream 8: each ran 400 µs, 200 of them together (20 %
    of the 1,000 µs step). The partition gives the shared 200 to the backward (COMPUTE_ORDER): backward 400,
    forward 200."""
    run = _trace(tmp_path, [("PP:0F0", GEMM, 100, 400, 7), ("PP:0B0", GEMM, 300, 400, 8)])
    a = analyze(traceana.load_run(run, cache=False))
    got = {r["phase"]: r for r in gpu.phase_means(a.phase_time, a.attribution, a.summary.steps).iter_rows(named=True)}
    assert {p: tuple(round(r[c], 6) for c in ("own_ms", "overlapped_ms", "partition_ms")) for p, r in got.items()} == {
        "forward": (0.4, 0.2, 0.2), "backward": (0.4, 0.2, 0.4)}
    assert got["forward"]["shared_fraction"] == pytest.approx(0.2)
    streams = gpu.stream_means(a.stream_time, a.summary.steps)
    rounded = (pl.col(c).round(6) for c in ("compute_ms", "idle_ms", "overlapped_ms"))
    assert streams.select("stream", *rounded).rows() == [
        (7, 0.4, 0.6, 0.2), (8, 0.4, 0.6, 0.2)]
    # (the backward's stream ran 200 µs beside the forward's: 20 % of the step, above the note's 5 % — noted, as
    # nothing says whether a second stream of compute is meant; the note names the stream and asks)
    assert any("stream 8" in n for n in a.notes)
    # the CLI shows the overlap table, --json the same means
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["analyze", str(run), "--no-cache"]) == 0
    assert "Phases running at once on the GPU" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["analyze", str(run), "--no-cache", "--json"]) == 0
    phases = {r["phase"]: r for r in json.loads(out.getvalue())["gpu"]["phases"]}
    assert phases["forward"]["own_ms"] == pytest.approx(0.4) and phases["forward"]["partition_ms"] == pytest.approx(0.2)


def test_an_unexplained_kernel_beside_compute_on_another_stream_is_noted(tmp_path):
    """A kernel no rule knows (``void mylib::a2a_kernel``), on stream 27 from 100 to 700 µs, under compute on
    stream 7 (0–900): 600 µs, 60 % of the step, counted as compute and noted with its stream and size."""
    run = _trace(tmp_path, [("PP:0F0", GEMM, 0, 900, 7), (None, "void mylib::a2a_kernel<8>(int4*)", 100, 600, 27)])
    a = analyze(traceana.load_run(run, cache=False))
    notes = [n for n in a.notes if "stream 27" in n]
    assert len(notes) == 1 and "0.6 ms of kernels on stream 27 (60% of its step time)" in notes[0]
    assert "mylib::a2a_kernel" in notes[0] and "add a name rule" in notes[0]


def test_a_known_communication_kernel_beside_compute_is_not_noted_and_is_communication(tmp_path):
    """The same kernel named as an expert-parallel dispatch in a namespace DeepEP's built-in rule never spelled
    (``my_ep::intranode::dispatch``): communication by family, hidden under compute, so no note and no compute."""
    run = _trace(tmp_path, [("PP:0F0", GEMM, 0, 900, 7),
                            (None, "void my_ep::intranode::dispatch<8>(int4*)", 100, 600, 27)])
    a = analyze(traceana.load_run(run, cache=False))
    assert not any("stream 27" in n for n in a.notes)
    streams = gpu.stream_means(a.stream_time, a.summary.steps)
    assert streams.filter(pl.col("stream") == 27).select("compute_ms", pl.col("communication_ms").round(6)).row(0) == (
        0.0, 0.6)


def test_a_trace_that_is_not_a_pipeline_says_so_and_shows_its_streams(tmp_path, capsys, third_party):
    """HTA's trace_filter (2 of 128 ranks of an all-to-all job): one line saying no pipeline was found, no bubble
    line, no data-parallel replicas, and the time per stream."""
    run = tmp_path / "tf"
    shutil.copytree(third_party / "hta" / "trace_filter", run)
    assert main(["analyze", str(run), "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "no pipeline found" in out and "Time per GPU stream" in out
    assert "bubble (warm-up" not in out and "Data-parallel replicas" not in out
    # --json says the same: no bubble (null with the reason, not 0.0) and no replicas invented (issue 26 item 4)
    assert main(["analyze", str(run), "--no-cache", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    s = d["summary"]
    assert d["gpu"]["pipeline_found"] is False and s["pipeline_found"] is False
    assert s["no_pipeline"].startswith("no pipeline found") and s["bubble_fraction"] is None
    assert s["replicas"] == [] and [r["replicas"] for r in s["per_stage"]] == [None]
    assert {r["bubble_ms"] for r in s["per_stage"]} == {None}
    assert {v for r in d["stages"] for k, v in r.items() if k.startswith("bubble")} == {None}
    assert s["step_ms"] > 0 and {r["rank"] for r in d["stages"]} == {0, 1}  # (what still holds is still there)


def test_the_report_writes_a_sentence_not_an_empty_chart_for_a_trace_that_is_not_a_pipeline(third_party, tmp_path):
    """The report's "time per step by category" for HTA's trace_filter was a chart with an x label "nan" (the
    unknown stage) and an empty axis: it is a sentence and tables now, and no figure is drawn."""
    from reports import sections

    class Page:
        def __init__(self):
            self.html, self.figures = [], []

        def add(self, html):
            self.html.append(html)

        def figure(self, fig):
            self.figures.append(fig)

    run = tmp_path / "tf"
    shutil.copytree(third_party / "hta" / "trace_filter", run)
    a = analyze(traceana.load_run(run, cache=False))
    page = Page()
    sections.attribution(page, [("tf", a)], G=None)  # (no figure module: none may be drawn)
    html = "".join(page.html)
    assert page.figures == [] and "no pipeline found" in html and "communication (ms)" in html


def test_a_rank_without_a_stage_is_labelled_no_stage_in_the_bars():
    from reports.frames import stage_label

    frame = pl.DataFrame({"stage": [0, None]}, schema={"stage": pl.Int32})
    assert frame.select(stage_label())["stage"].to_list() == ["stage 0", "no stage"]


def test_dualpipe_with_all_to_all_kernels_in_a_namespace_no_rule_spells(tmp_path):
    """The issue's H800 case in small: tests/measure/test_name_rules.py's DualPipe step with its DeepEP kernels renamed
    as another build spells them (``deepep_v2::internode::dispatch``, ``…::combine``). They are communication by
    family, so the phases are those summed by hand there (forward 220, input gradients 280, weight gradients 180 µs
    a layer, 60 µs of exposed dispatch), and each phase's own GPU time equals its partition (compute runs on one
    stream here: nothing overlaps)."""
    from test_name_rules import LAYER, STEP_US, TRUTH_FRACTION

    tb = TraceBuilder(rank=0, world_size=64, backend="nccl", pid=7, tid=7)
    tb.step(0, 0, STEP_US)
    corr = 0
    for layer in range(4):
        base = layer * 740.0
        for k, (ann, kernel, start, dur, stream) in enumerate(LAYER):
            corr += 1
            kernel = kernel.replace("deep_ep::intranode", "deepep_v2::internode")
            tb.annotation(ann, base + 10 * k + 1, 8)
            tb.launch(base + 10 * k + 3, 4, correlation=corr)
            tb.kernel(kernel, base + start, dur, stream=stream, correlation=corr)
    run = tmp_path / "dualpipe"
    run.mkdir()
    tb.write(run / "rank0.pt.trace.json.gz")
    a = analyze(traceana.load_run(run, cache=False))
    att = a.attribution
    got = {c: att.filter(pl.col("category") == c)["fraction"].sum() for c in TRUTH_FRACTION}
    assert got == pytest.approx(TRUTH_FRACTION, abs=1e-6)
    own = {r["phase"]: r["own_ms"] for r in gpu.phase_means(a.phase_time, att, a.summary.steps).iter_rows(named=True)}
    assert own == pytest.approx({"forward": 0.88, "backward_input": 1.12, "backward_weight": 0.72}, abs=1e-6)


def test_coverage_by_hand():
    """Rank 0: a = [0,4) ∪ [5,10) (9), b = [3,8) (5), c = [20,25) (5); a and b share [3,4) and [5,8): 4 each, and
    4 of the group's 15 covered. Rank 1: a alone. Nothing shared when items only follow one another."""
    from traceana.core import intervals as iv

    f = pl.DataFrame({"rank": [0, 0, 0, 0, 1], "ph": ["a", "a", "b", "c", "a"], "start": [0, 5, 3, 20, 0],
                      "end": [4, 10, 8, 25, 10]})
    per_item, per_group = iv.coverage(f, ["rank"], "ph")
    assert per_item.rows() == [(0, "a", 9, 4), (0, "b", 5, 4), (0, "c", 5, 0), (1, "a", 10, 0)]
    assert per_group.rows() == [(0, 15, 4), (1, 10, 0)]
    per_item, per_group = iv.coverage(f.filter(pl.col("ph") != "b"), ["rank"], "ph")
    assert per_item["overlapped_ns"].to_list() == [0, 0, 0] and per_group["overlapped_ns"].to_list() == [0, 0]


def test_the_same_stream_on_many_ranks_is_one_note(tmp_path):
    """Two ranks, each with the unexplained kernel on stream 27 beside compute (600 and 300 µs of 1,000): one note
    naming both ranks, the larger figure and the range of shares."""
    run = tmp_path / "run"
    run.mkdir()
    for rank, dur in ((0, 600), (1, 300)):
        tb = TraceBuilder(rank=rank, world_size=2, backend="nccl", pid=7 + rank, tid=7)
        tb.step(0, 0, 1000)
        for corr, (name, start, d, stream) in enumerate([(GEMM, 0, 900, 7), ("void mylib::a2a(int)", 100, dur, 27)], 1):
            tb.launch(10.0 * corr, 4, correlation=corr)
            tb.kernel(name, start, d, stream=stream, correlation=corr)
        tb.write(run / f"rank{rank}.pt.trace.json.gz")
    a = analyze(traceana.load_run(run, cache=False))
    notes = [n for n in a.notes if "stream 27" in n]
    assert len(notes) == 1 and notes[0].startswith("ranks 0, 1 (2 ranks): up to 0.6 ms")
    assert "(30%–60% of their" in notes[0]


def test_the_report_shows_each_phase_s_own_gpu_time_where_phases_overlapped(tmp_path):
    from reports import sections

    run = _trace(tmp_path, [("PP:0F0", GEMM, 100, 400, 7), ("PP:0B0", GEMM, 300, 400, 8)])
    a = analyze(traceana.load_run(run, cache=False))
    html = []

    class Page:
        add = html.append

    sections.overlapped_phases(Page(), "run", a)
    text = "".join(html)
    assert "phases running at once on the GPU" in text and "own GPU time (ms)" in text and "20" in text


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=12))
def test_coverage_invariants(rows):
    """Each item's own time is the length of its union; its overlapped part is within it; the group's covered time
    is the union of all, and what two or more cover is counted at least twice in the items' own times; an item
    overlaps exactly where another covers it too (brute force over integer instants)."""
    from traceana.core import intervals as iv

    f = pl.DataFrame({"g": [0] * len(rows), "item": [r[0] for r in rows], "start": [r[1] for r in rows],
                      "end": [r[1] + r[2] for r in rows]})
    per_item, per_group = iv.coverage(f, ["g"], "item")
    cover = {}
    for item, s, d in rows:
        for t in range(s, s + d):
            cover.setdefault(t, set()).add(item)
    for item, own, over in per_item.select("item", "own_ns", "overlapped_ns").rows():
        assert own == sum(1 for c in cover.values() if item in c)
        assert over == sum(1 for c in cover.values() if item in c and len(c) > 1)
    any_ns, shared = per_group.select("any_ns", "overlapped_ns").row(0)
    assert any_ns == len(cover) and shared == sum(1 for c in cover.values() if len(c) > 1)
    assert per_item["own_ns"].sum() >= any_ns + shared or shared == 0
