"""Small ranks finished together (kineto.finish_together) give each rank's tables exactly as finishing it alone
does (read_trace, one file at a time): the same events, memory and traces row. On GPU-style ranks made by
tests/benchmarks/gen_big_trace.py (NCCL record_param_comms with a pg_config, kernels, which go through the joined
path) mixed with the real runs in tests/data (gloo ranks with record_shapes facts: finished alone)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from polars.testing import assert_frame_equal

from traceana.ingest import kineto
from traceana.ingest.run_dir import find_traces

DATA = Path(__file__).resolve().parents[1] / "data"
RUNS = ["megatron_pipe/interleaved/run", "deepspeed_pipe/1f1b/run", "pipelining_memory/gpipe_m2", "osdi25",
        "whatif_foreign/megatron-defaults-sleep-1/run", "whatif_foreign/deepspeed-defaults-none-0/run"]


@pytest.mark.skipif(not kineto.native_available(), reason="the native scanner is not built")
def test_together_equals_alone(tmp_path):
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "tests" / "benchmarks" / "gen_big_trace.py"), str(tmp_path / "gen"),
                    "--ranks", "4", "--dp", "3", "--mb", "0.1", "--microbatches", "4", "--kernels", "1"],
                   check=True, capture_output=True, env={"PYTHONPATH": str(root), "PATH": ""})
    files, scans = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [DATA / RUNS[0], tmp_path / "gen", *(DATA / r for r in RUNS[1:])]
        for f in (f for run in runs for f in find_traces(run)):
            try:
                scans.append(kineto.scan_trace(f))
            except kineto.NotATraceError:  # (the runs' truth files beside their traces)
                continue
            files.append(f)
        together = sum(kineto.can_finish_together(s) for s in scans)
        got = kineto.finish_together(scans)
        alone = [kineto.read_trace(f) for f in files]
    assert together == 12  # (the generated ranks do go through the joined path)
    for f, g, a in zip(files, got, alone):
        assert not isinstance(g, Exception), f
        assert_frame_equal(g[0], a[0])
        assert_frame_equal(g[1], a[1])
        assert g[2] == a[2], f
