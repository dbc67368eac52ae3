"""The activation peak is transient memory: allocated in the step and freed in the same step (traceana.measure.memory).

Each case is a short allocator story whose expected figures are worked out by hand in its docstring: what is alive
at each moment, which blocks outlive the step or existed before it, and so which bytes are activations. Times are
µs from the step's start; a step is [0, 100) unless said otherwise; CPU (device −1) unless said otherwise.
"""

from __future__ import annotations

import polars as pl
import pytest
from tracebuilder import TraceBuilder

from traceana.core.schema import MEMORY, STEPS, conform
from traceana.measure import memory

US = 1000


def _memory(rank: int, events: list[tuple], *, start_total: int = 0, device: int = -1) -> list[dict]:
    """Rows of schema.MEMORY from (µs, ±bytes, address[, device]) in trace order; Total Allocated follows per
    device from ``start_total``."""
    rows, total = [], {}
    for e in events:
        ts, delta, addr = e[:3]
        dev = e[3] if len(e) > 3 else device
        total[dev] = total.get(dev, start_total) + delta
        rows.append({"rank": rank, "ts_ns": int(ts * US), "device": dev, "allocated_bytes": total[dev],
                     "delta_bytes": delta, "addr": addr})
    return rows


def _windows(windows) -> tuple[pl.DataFrame, pl.DataFrame]:
    """schema.STEPS from (rank, step, start µs, end µs), and each rank its own stage."""
    steps = conform(pl.DataFrame([{"rank": r, "step": s, "start_ns": a * US, "end_ns": b * US, "dur_ns": (b - a) * US}
                                  for r, s, a, b in windows]), STEPS)
    stages = pl.DataFrame({"rank": sorted({r for r, *_ in windows}), "stage": sorted({r for r, *_ in windows})},
                          schema={"rank": pl.Int32, "stage": pl.Int32})
    return steps, stages


def _stage_memory(rows: list[dict], windows=((0, 1, 0, 100),)) -> pl.DataFrame:
    mem = pl.DataFrame(rows, schema=MEMORY)
    return memory.stage_memory(mem.sort("rank", "ts_ns", maintain_order=True), *_windows(windows))


def _figures(out: pl.DataFrame) -> list[tuple]:
    return out.select("rank", "step", "baseline_bytes", "peak_bytes", "activation_peak_bytes").rows()


# zero_grad(set_to_none=True) frees last step's 1000 B of gradients (G) at 5; forwards save a1, a2 (300 B each);
# the first backward needs 200 B of working memory (w, 30–32), then allocates this step's gradients (G2, 1000 B, at
# 35, kept past the step) and frees a2, a1.
ZERO_GRAD_STEP = [(-10, 1000, 0x10), (5, -1000, 0x10), (10, 300, 0xA1), (20, 300, 0xA2), (30, 200, 0xB0),
                  (32, -200, 0xB0), (35, 1000, 0x20), (50, -300, 0xA2), (60, -300, 0xA1)]


def test_gradients_freed_by_zero_grad_and_allocated_again_are_not_activations():
    """Alive at once, by hand: a1 + a2 + w = 800 B at 30 — the activation peak. The allocator's total is 1000 B at
    the step's start (the old gradients), 800 B at 30 and 1600 B at 35 (a1 + a2 + G2): peak − baseline would say
    600 B, low by the 200 B the peak reached before the new gradients exist."""
    assert _figures(_stage_memory(_memory(0, ZERO_GRAD_STEP))) == [(0, 1, 1000, 1600, 800)]


def test_gradients_allocated_in_backward_that_outlive_the_step_are_not_activations():
    """No gradients at the step's start (freed before it: baseline 0, the first sample's total minus its delta);
    a1 (500 B) saved at 10, this step's gradients (1000 B) at 20, a1 freed at 30. Peak − baseline: 1500 B, high by the
    gradients; activations: 500 B."""
    got = _stage_memory(_memory(0, [(10, 500, 0xA1), (20, 1000, 0x20), (30, -500, 0xA1)]))
    assert _figures(got) == [(0, 1, 0, 1500, 500)]


def test_a_bpipe_eviction_is_transient_on_both_ranks():
    """Evictor (rank 0) keeps 2: a0, a1 saved (600 B), a1 evicted and freed at 25 (300 B), a2 saved (600 B), its
    backward's 100 B working memory (700 B at 40), a2 freed; a1 loaded back at 60 into the same address it left
    (600 B), freed at 70, a0 at 80. Peak alive: 700 B (a0 + a2 + w). Acceptor (rank 1): its own 300 B at 10, the
    accepted buffer's 300 B from 26 until it is returned at 58: 600 B. The eviction's free and the accepted buffer
    both count as the step's transient memory."""
    evictor = [(10, 300, 0xA0), (20, 300, 0xA1), (25, -300, 0xA1), (30, 300, 0xA2), (40, 100, 0xB0),
               (45, -100, 0xB0), (50, -300, 0xA2), (60, 300, 0xA1), (70, -300, 0xA1), (80, -300, 0xA0)]
    acceptor = [(10, 300, 0xC0), (26, 300, 0xC1), (58, -300, 0xC1), (65, -300, 0xC0)]
    got = _stage_memory(_memory(0, evictor) + _memory(1, acceptor), windows=((0, 1, 0, 100), (1, 1, 0, 100)))
    assert [(r, a) for r, _, _, _, a in _figures(got)] == [(0, 700), (1, 600)]


def test_what_is_never_freed_freed_after_the_step_or_allocated_before_profiling_is_not_counted():
    """x (400 B, 10) is never freed; y (200 B, 20–30) is; z (300 B, 50) is freed at 150, after the step; the free
    at 5 is of a block allocated before profiling began (no allocation in the trace: ignored); at 0x51 an
    allocation at 60 is followed by another at 70 (its free is not in the trace: not paired) whose free comes at 80
    (100 B, paired). Alive at once among what the step allocated and freed: y's 200 B."""
    events = [(5, -700, 0x99), (10, 400, 0x11), (20, 200, 0x22), (30, -200, 0x22), (50, 300, 0x33),
              (60, 100, 0x51), (70, 100, 0x51), (80, -100, 0x51), (150, -300, 0x33)]
    got = _stage_memory(_memory(0, events, start_total=700))
    assert [a for *_, a in _figures(got)] == [200]


def test_a_steps_boundaries_split_what_is_transient():
    """Steps [0, 100) and [100, 200): p (100 B) lives 10–20 in step 1; q (400 B) is allocated at 90 and freed at
    110, across the boundary (in neither); r (250 B) is allocated exactly at 100 and freed at 150 (step 2)."""
    events = [(10, 100, 0x1), (20, -100, 0x1), (90, 400, 0x2), (100, 250, 0x3), (110, -400, 0x2), (150, -250, 0x3)]
    got = _stage_memory(_memory(0, events), windows=((0, 1, 0, 100), (0, 2, 100, 200)))
    assert [(s, a) for _, s, _, _, a in _figures(got)] == [(1, 100), (2, 250)]


def test_a_rank_with_a_gpu_is_measured_on_it_alone():
    """The GPU (device 0) holds g (300 B, 10–40); the CPU allocator a staging buffer of 5000 B (20–30) at the same
    address the GPU used: the rank is measured on its GPU, 300 B."""
    events = [(10, 300, 0x7, 0), (20, 5000, 0x7, -1), (30, -5000, 0x7, -1), (40, -300, 0x7, 0), (50, 10, 0x8, 0),
              (55, -10, 0x8, 0)]
    assert [a for *_, a in _figures(_stage_memory(_memory(0, events)))] == [300]


def test_ranks_interleaved_in_time_and_events_at_one_timestamp_keep_the_traces_order():
    """The BPipe story's two ranks as one table ordered by time alone (not rank by rank): the same 700 and 600 B.
    And one timestamp holding a block's allocation then its free (in that order in the trace), between two others:
    d (100 B) alive 10–30, e (50 B) allocated and freed at 20: 150 B at once."""
    evictor = [(10, 300, 0xA0), (20, 300, 0xA1), (25, -300, 0xA1), (30, 300, 0xA2), (40, 100, 0xB0),
               (45, -100, 0xB0), (50, -300, 0xA2), (60, 300, 0xA1), (70, -300, 0xA1), (80, -300, 0xA0)]
    acceptor = [(10, 300, 0xC0), (26, 300, 0xC1), (58, -300, 0xC1), (65, -300, 0xC0)]
    rows = sorted(_memory(0, evictor) + _memory(1, acceptor), key=lambda r: r["ts_ns"])
    got = memory.stage_memory(pl.DataFrame(rows, schema=MEMORY), *_windows(((0, 1, 0, 100), (1, 1, 0, 100))))
    assert [(r, a) for r, _, _, _, a in _figures(got)] == [(0, 700), (1, 600)]
    tie = _memory(0, [(10, 100, 0xD), (20, 50, 0xE), (20, -50, 0xE), (30, -100, 0xD)])
    assert [a for *_, a in _figures(_stage_memory(tie))] == [150]


def test_a_step_whose_allocations_all_outlive_it_has_no_activations():
    assert [a for *_, a in _figures(_stage_memory(_memory(0, [(10, 1000, 0x20)])))] == [0]


def test_without_addresses_the_old_rule_and_its_ranks_are_named():
    """The zero-grad story without addresses (older torch): peak − baseline, 1600 − 1000 = 600 B, on that rank
    only; the rank with addresses keeps the transient 800 B."""
    bare = [dict(r, addr=None) for r in _memory(1, ZERO_GRAD_STEP)]
    rows = _memory(0, ZERO_GRAD_STEP) + bare
    got = _stage_memory(rows, windows=((0, 1, 0, 100), (1, 1, 0, 100)))
    assert [(r, a) for r, _, _, _, a in _figures(got)] == [(0, 800), (1, 600)]
    assert memory.ranks_without_addresses(pl.DataFrame(rows, schema=MEMORY)) == [1]


@pytest.mark.usefixtures("decoder")
def test_a_written_trace_gives_the_same_figures_through_the_analysis(tmp_path):
    """The zero-grad story as a Kineto trace (both decoders, the whole analysis): 800 B, and no note; the same
    trace without "Addr" gives 600 B and a note naming the rank."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    for with_addr, expected in ((True, 800), (False, 600)):
        d = tmp_path / str(with_addr)
        d.mkdir()
        tb = TraceBuilder()
        tb.step(1, 0, 100)
        tb.cpu_op("aten::mm", 1, 90)
        total = 0
        for ts, delta, addr in ZERO_GRAD_STEP:
            total += delta
            tb.memory(ts, total, delta, addr=addr if with_addr else None)
        tb.write(d / "rank0.pt.trace.json.gz")
        a = analyze(load_run(d, cache=False))
        assert a.stage_memory["activation_peak_bytes"].to_list() == [expected]
        named = [n for n in a.notes if "no block address" in n]
        assert named == ([] if with_addr else [named[0]]) and (with_addr or named[0].startswith("rank 0:"))
