"""``traceana watch``: windows of traces landing in a folder (attach's steps*/ directories, tensorboard_trace_handler
files, fed live) and the per-stage tables it prints.

The synthetic windows are built by hand (tests/tracebuilder.py): two ranks (stages 0 and 1), no communication.
Window A: steps of 100 ms, each a forward of 40 ms then a backward of 40 ms → compute 80 ms = 80 % of the step.
Window B: steps of 80 ms, forward 30 ms, backward 30 ms → compute 60 ms (75 %); its step is 20 ms = 20 % shorter.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from child_wait import wait_unless_hung
from tracebuilder import TraceBuilder
from traceana.core.manifest import Manifest

MS = 1000.0  # µs per ms: traces are in µs
WINDOW_A = {"steps": (10, 11), "step": 100, "fwd": 40, "bwd": 40}
WINDOW_B = {"steps": (20, 21), "step": 80, "fwd": 30, "bwd": 30}


def _rank_trace(rank: int, window: dict, *, t0_ms: float = 0.0) -> TraceBuilder:
    tb = TraceBuilder(rank=rank, world_size=2, pid=100 + rank, tid=100 + rank, meta={"stage": rank, "rank": rank})
    t = t0_ms
    for n in window["steps"]:
        tb.step(n, t * MS, (t + window["step"]) * MS)
        fwd, bwd = window["fwd"], window["bwd"]
        tb.annotation(f"PP:{rank}F0", t * MS, fwd * MS)
        tb.cpu_op("aten::mm", t * MS, fwd * MS)
        start_b = t + fwd + 10
        tb.annotation(f"PP:{rank}B0", start_b * MS, bwd * MS)
        tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", start_b * MS, bwd * MS)
        t += window["step"]
    return tb


def _write_atomic(tb: TraceBuilder, path: Path) -> None:
    data = tb.to_bytes()
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    os.replace(tmp, path)


def write_attach_window(root: Path, window: dict) -> Path:
    """What traceana attach leaves for one of several windows: steps{A}-{B}/ with rank traces and run.json."""
    first, last = window["steps"]
    d = root / f"steps{first}-{last}"
    d.mkdir(parents=True)
    for r in (0, 1):
        _write_atomic(_rank_trace(r, window), d / f"rank{r}.pt.trace.json.gz")
    extra = {"attach": {"window": [first, last + 1], "steps": f"{first}–{last}", "job": None}}
    (d / "run.json").write_text(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), extra=extra).to_json())
    return d


def write_tensorboard_cycle(root: Path, window: dict, cycle: int) -> None:
    """tensorboard_trace_handler's names: {worker}.{time_ns}.pt.trace.json, one file per worker per cycle."""
    root.mkdir(parents=True, exist_ok=True)
    for r in (0, 1):
        _write_atomic(_rank_trace(r, window, t0_ms=1000.0 * cycle),
                      root / f"node-1.example_{4000 + r}.{1_700_000_000_000_000_000 + cycle}.pt.trace.json")


def _watch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traceana", "watch", *args], capture_output=True, text=True,
                          timeout=300)


def _check_two_windows(out: str) -> None:
    a, b = out.index("window 1"), out.index("window 2")
    first, second = out[a:b], out[b:]
    step_a = next(line for line in first.splitlines() if "step ms" in line)
    assert step_a.count("100.00") == 2  # both stages
    compute_a = next(line for line in first.splitlines() if "compute" in line)
    assert compute_a.count("80.00 (80%)") == 2
    compute_b = next(line for line in second.splitlines() if "compute" in line)
    assert compute_b.count("60.00 (75%)") == 2
    # the running comparison: window 2's step against window 1's, per stage
    row = next(line for line in second.splitlines() if line.lstrip("│ ").startswith("2:"))
    assert row.count("80.00 (-20.00, -20.0%)") == 2
    for label in ("P2P (exposed)", "BPipe transfer (exposed)", "bubble: warm-up", "bubble: cool-down", "bubble: stall"):
        assert label in first


def test_window_directories_of_attach(tmp_path):
    write_attach_window(tmp_path, WINDOW_B)  # written in any order: shown in step order
    write_attach_window(tmp_path, WINDOW_A)
    r = _watch(str(tmp_path), "--once", "--settle", "0")
    assert r.returncode == 0, r.stderr
    assert "steps 10–11" in r.stdout and "steps 20–21" in r.stdout
    _check_two_windows(r.stdout)
    # one measured step a window (the first is dropped): the 20 % shorter step is not claimed as a speed-up
    words = " ".join(r.stdout.split())
    assert "window 2 against window 1: pipeline step -20.0%, which cannot be told from noise" in words


def test_each_window_against_the_first_carries_its_noise():
    from traceana.commands.watch import _against_first

    assert _against_first([(100.0, 101.0)]) is None  # nothing to compare yet
    steady = _against_first([(100.0, 101.0, 99.0), (90.0, 150.0, 60.0)])
    assert steady.within_noise is True  # the same mean, a wider spread
    faster = _against_first([(100.0, 101.0, 99.0), (80.0, 81.0, 79.0)])
    assert faster.within_noise is False and faster.change == pytest.approx(-0.2)


def test_tensorboard_trace_handler_folder(tmp_path):
    write_tensorboard_cycle(tmp_path, WINDOW_A, 1)
    write_tensorboard_cycle(tmp_path, WINDOW_B, 2)
    r = _watch(str(tmp_path), "--once", "--settle", "0")
    assert r.returncode == 0, r.stderr
    assert "cycle 1" in r.stdout and "cycle 2" in r.stdout
    _check_two_windows(r.stdout)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".pt.trace.json")) == []  # untouched


def test_windows_fed_live_then_ctrl_c(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "traceana", "watch", str(tmp_path), "--interval", "0.2",
                             "--settle", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def wait_for(text: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in lines):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"{text!r} not printed; got {''.join(lines)!r}"
            time.sleep(0.1)

    try:
        write_attach_window(tmp_path, WINDOW_A)
        wait_for("window 1")
        assert not any("window 2" in line for line in lines)
        write_attach_window(tmp_path, WINDOW_B)
        wait_for("2: steps 20–21")  # the comparison row comes last
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        # it ends by itself: a hang guard in the child's own CPU and blocked time, not the wall clock, which a loaded
        # machine stretches (tests/child_wait.py)
        code = wait_unless_hung(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    err = proc.stderr.read()
    assert code in (0, 130) and "Traceback" not in err, err
    _check_two_windows("".join(lines))


def test_bad_arguments_are_one_line(tmp_path):
    r = _watch(str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a directory" in r.stderr
    r = _watch(str(tmp_path), "--once")
    assert r.returncode == 0 and "no complete window" in r.stderr


def test_tables_are_pure_functions_of_the_stage_table():
    import polars as pl

    from traceana.commands.watch import running_comparison, window_table
    from traceana.core.schema import CATEGORIES

    base = {"rank": [0], "stage": [0], "steps": [2], "step_ms": [10.0]}
    # 1 ms in every category: seven compute ones (forward, backward, its I and W halves, recompute, optimizer, other)
    ms = {f"{c}_ms": [1.0] for c in CATEGORIES}
    t = window_table(pl.DataFrame({**base, **ms}))
    assert t["compute_ms"].to_list() == [7.0] and t["bubble_ms"].to_list() == [3.0]
    hist = pl.concat([t.select("rank", "stage", "step_ms", "compute_ms", "bubble_ms")
                      .with_columns(window=pl.lit(i), label=pl.lit(str(i)), step_ms=pl.lit(s))
                      for i, s in enumerate((10.0, 12.5))])
    c = running_comparison(hist)
    assert c["d_step_ms"].to_list() == [0.0, 2.5] and c["d_step_pct"].to_list() == [0.0, 25.0]


@pytest.mark.parametrize("name", ["rank0.pt.trace.json.gz", "host_12.pt.trace.json"])
def test_names_that_are_not_tensorboard_cycles(name):
    from traceana.commands.watch import TB_NAME

    assert TB_NAME.match(name) is None
    assert TB_NAME.match("node-1.example_4000.1700000000000000001.pt.trace.json.gz").group("worker") == \
        "node-1.example_4000"


REAL_HANDLER = """
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

out, truth = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
x, ends = torch.randn(128, 128), []
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=2),
             on_trace_ready=tensorboard_trace_handler(out, worker_name="worker0")) as prof:
    for step in range(6):
        for _ in range(10):
            x = torch.tanh(x @ x)
        time.sleep(0.03 if step < 3 else 0.06)  # the second cycle's steps are 30 ms longer
        ends.append(time.perf_counter_ns())  # outside the trace: when each step handed over to prof.step()
        prof.step()
json.dump(ends, open(truth, "w"))
"""


@pytest.mark.multiprocess
def test_a_real_tensorboard_trace_handler_job(tmp_path):
    """torch.profiler's own tensorboard_trace_handler, two cycles of two active steps: watch shows both cycles, and
    each one's step time is the one measured outside the trace (perf_counter between the prof.step() calls that
    bound the cycle's measured step: its second active step, the first being dropped as warm-up)."""
    pytest.importorskip("torch")
    import json

    logs, truth = tmp_path / "tb", tmp_path / "truth.json"
    job = subprocess.run([sys.executable, "-c", REAL_HANDLER, str(logs), str(truth)], capture_output=True, text=True,
                         timeout=300)
    assert job.returncode == 0, job.stderr[-2000:]
    assert len(list(logs.glob("worker0.*.pt.trace.json"))) == 2
    ends = json.loads(truth.read_text())
    r = _watch(str(logs), "--once", "--settle", "0", "--json")
    assert r.returncode == 0, r.stderr
    windows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [w["label"] for w in windows] == ["cycle 1", "cycle 2"]
    for w, step in zip(windows, (2, 5)):  # cycle 1 records steps 1-2, cycle 2 steps 4-5
        (stage,) = w["stages"]
        assert stage["step_ms"] == pytest.approx((ends[step] - ends[step - 1]) / 1e6, rel=0.1, abs=3.0)
    assert sorted(p.name for p in logs.iterdir() if not p.name.endswith(".pt.trace.json")) == []  # untouched
