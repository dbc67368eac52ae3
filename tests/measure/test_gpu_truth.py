"""Real GPU Kineto traces (tests/data/third_party: HTA's and PARAM's test data) against shares derived from the raw
JSON by tests/gpu_truth.py, a reader that shares no code with traceana (issue 26, item 5).

Per (rank, step): traceana's compute categories summed against the truth's compute (GPU work that is not
communication: the union of kernels, copies and memsets over the step), its optimizer against the work launched
inside ``Optimizer.step#``, its exposed collective against the truth's communication not under compute, and its
idle (host and bubbles) against the GPU's idle; per stream, its busy time against the union of the stream's work.

Where the two readings differ by design the tolerance says so: traceana also counts, on a GPU rank, the time the
CPU spends inside a collective call while the GPU is idle (the call's own cost: its CPU spans) as collective,
where the truth counts only GPU work, so its collective may exceed the truth's by that much (up to 0.005 of a step
on these traces) and its idle read low by the same."""

from __future__ import annotations

import shutil

import polars as pl
import pytest
from gpu_truth import shares

import traceana
from traceana.core.schema import BUBBLE_CATEGORIES, COMPUTE_CATEGORIES
from traceana.measure.analysis import analyze

# (folder under tests/data/third_party, what it is)
TRACES = {
    "hta/trace_filter": "2 of 128 ranks, NCCL all-to-all (SendRecv kernels on 2 streams) + all-reduce, 5 streams",
    "hta/nccl_parser_config": "1 of 2 ranks, DDP all-reduce and broadcast kernels on their own stream",
    "hta/ns_resolution_trace": "1 GPU, 5 steps, nanosecond timestamps, one stream",
    "hta/amd_trace": "AMD MI250, ROCm 6.2, 2 steps",
    "hta/critical_path/multi_stream": "3 kernels on 3 streams synchronised by CUDA events, no ProfilerStep",
    "hta/critical_path/alexnet": "AlexNet forward, 2 streams, no ProfilerStep",
    "param/linear": "PARAM et_replay's linear model, 130 ms slice, optimizer steps, no ProfilerStep",
}
EXACT = 0.002  # float µs of the JSON converted to ns once: shares agree to rounding
CPU_CALLS = 0.01  # the collective's CPU spans on an idle GPU (module doc)


def _truth(folder) -> dict[tuple[int, int], dict]:
    files = sorted(p for p in folder.rglob("*.json*") if p.is_file())
    return {(rank, step): s for rank, f in enumerate(files) for step, s in shares(f).items()}


@pytest.mark.parametrize("name", list(TRACES))
def test_gpu_shares_match_an_independent_reading_of_the_json(name, third_party, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(third_party / name, run)
    truth = _truth(run)
    a = analyze(traceana.load_run(run, cache=False))
    att = a.attribution.with_columns(pl.col("category").cast(pl.String))
    for (rank, step), t in truth.items():
        got = dict(att.filter((pl.col("rank") == rank) & (pl.col("step") == step)).select("category", "fraction")
                   .rows())
        assert got, (rank, step)
        where = f"{name} rank {rank} step {step}"
        compute = sum(got.get(c, 0) for c in COMPUTE_CATEGORIES)
        assert compute == pytest.approx(t["compute"], abs=EXACT), where
        assert got["optimizer"] == pytest.approx(t["optimizer"], abs=EXACT), where
        assert t["communication_exposed"] - EXACT <= got["collective"] <= t["communication_exposed"] + CPU_CALLS, where
        idle = got["host"] + sum(got.get(c, 0) for c in BUBBLE_CATEGORIES)
        assert t["idle"] - CPU_CALLS <= idle <= t["idle"] + EXACT, where
        assert got["p2p"] == 0 and got["bpipe"] == 0, where  # none of these is a pipeline
        streams = dict(a.stream_time.filter((pl.col("rank") == rank) & (pl.col("step") == step))
                       .select("stream", "busy_ns").rows())
        assert streams == t["streams_ns"], where
