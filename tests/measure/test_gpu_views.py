"""HTA's GPU views (issue 36 Build 3) against HTA's own numbers on the same traces.

The expected figures are HolisticTraceAnalysis 0.5.0's output (``TraceAnalysis(trace_dir).get_comm_comp_overlap()``,
``get_idle_time_breakdown(ranks=…)``, ``get_gpu_kernel_breakdown()``, run in a separate virtual environment on copies
of tests/data/third_party/hta/{trace_filter,nccl_parser_config}; HTA leaves out each trace's last ProfilerStep by
default, include_last_profiler_step=False, so the same steps are cut here). Times in µs, as HTA gives them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

import traceana
from traceana.cli import main
from traceana.measure import gpu

DATA = Path(__file__).parents[1] / "data" / "third_party" / "hta"

# HTA 0.5.0 on trace_filter (2 of 128 ranks, integer-µs timestamps): comp_comm_overlap_pctg, and the idle time
# breakdown (rank, stream) -> (host_wait, kernel_wait, other) µs
HTA_TRACE_FILTER_OVERLAP = {0: 11.81, 1: 20.05}
HTA_TRACE_FILTER_IDLE = {
    (0, 7): (213825, 1985, 261740), (0, 23): (596037, 70, 34), (0, 25): (0, 9, 47865), (0, 84): (148934, 6, 0),
    (1, 7): (156827, 1816, 281064), (1, 23): (596313, 100, 0), (1, 25): (0, 9, 53028), (1, 84): (251860, 0, 23247),
}
# its kernel type breakdown, summed over both ranks and split into exclusive combinations: the communication
# kernels' time is COMMUNICATION + each combination holding COMMUNICATION
HTA_TRACE_FILTER_COMMUNICATION_US = 305584 + 56747 + 1011 + 12
# nccl_parser_config (1 rank, sub-µs timestamps, which HTA reads as whole µs: within half a point and 1 %)
HTA_NCCL_OVERLAP = 14.31
HTA_NCCL_IDLE = {(0, 7): (357247, 2155, 0), (0, 40): (381499, 0, 0)}


def _kernels(name: str):
    a = traceana.load_and_analyze(str(DATA / name), cache=False)
    kept = a.steps.filter(pl.col("step") < pl.col("step").max().over("rank"))  # HTA's steps: all but the last
    return a, gpu.gpu_kernels(a.events, kept)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trace_filter_matches_hta():
    _, k = _kernels("trace_filter")
    ov = {r: p for r, p in gpu.comm_comp_overlap(k).select("rank", "overlap_pct").rows()}
    assert ov == pytest.approx(HTA_TRACE_FILTER_OVERLAP, abs=0.005)
    idle = {(r, s): (h / 1000, kw / 1000, o / 1000) for r, s, h, kw, o, _ in gpu.idle_breakdown(k).rows()}
    for key, want in HTA_TRACE_FILTER_IDLE.items():
        assert idle[key] == pytest.approx(want, abs=0.5), key
    comm = gpu.kernel_type_breakdown(k).filter(pl.col("type") == "communication")["ns"].sum() / 1000
    assert comm == pytest.approx(HTA_TRACE_FILTER_COMMUNICATION_US, abs=0.5)


def test_nccl_parser_config_matches_hta_to_its_rounding():
    _, k = _kernels("nccl_parser_config")
    assert gpu.comm_comp_overlap(k)["overlap_pct"][0] == pytest.approx(HTA_NCCL_OVERLAP, abs=0.5)
    idle = {(r, s): h / 1000 for r, s, h, *_ in gpu.idle_breakdown(k).rows()}
    for key, (host, _, _) in HTA_NCCL_IDLE.items():
        assert idle[key] == pytest.approx(host, rel=0.01), key


def test_overlap_by_stream_adds_up_to_the_rank_and_top_kernels_are_by_phase():
    _, k = _kernels("trace_filter")
    per_stream = gpu.comm_comp_overlap(k, ["rank", "stream"])
    rank = gpu.comm_comp_overlap(k)
    # one communication stream a rank here: its figures are the rank's
    assert per_stream.group_by("rank").agg(pl.col("communication_ns").sum()).sort("rank")["communication_ns"] \
        .to_list() == rank["communication_ns"].to_list()
    top = gpu.top_kernels(k, pl.DataFrame(schema=traceana.measure.analysis.SCHEDULE))
    assert set(top["phase"]) == {"communication", "other"}  # no schedule: every compute kernel is "other"
    assert (top.group_by("rank", "phase").len()["len"] <= gpu.TOP_KERNELS).all()
    assert top.filter(pl.col("phase") == "communication")["name"].str.starts_with("ncclKernel").all()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_analyze_json_carries_the_views(tmp_path, capsys):
    run = tmp_path / "nccl"
    shutil.copytree(DATA / "nccl_parser_config", run)
    assert main(["analyze", str(run), "--no-cache", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["gpu"]["views"]
    assert {"kernel_types", "overlap", "overlap_by_stream", "overlap_by_stage", "idle", "top_kernels"} <= set(v)
    assert 0 <= v["overlap"][0]["overlap_fraction"] <= 1  # (over the measured steps, not HTA's)
    assert {r["type"] for r in v["kernel_types"]} == {"computation", "communication", "memory"}
    assert all(r["host_wait_ms"] + r["kernel_wait_ms"] + r["other_ms"] == pytest.approx(r["idle_ms"])
               for r in v["idle"])
