"""``traceana attach``: unmodified jobs (a torchrun data-parallel script, the repo's pipelining example) profiled in a
window of steps; the run directory, run.json's facts, steps outside the window, and a profiler that fails to start.

Expected values come from the scripts themselves: the MLP of tests/attach_dp_script.py has 16·32+32 + 32·1+1 = 577
parameters; the example's interleaved run puts stages 0, 2 on rank 0 and 1, 3 on rank 1 (looped placement) and
splits its batch of micro-batch size × micro-batches = 2 × 4 sequences into 4 micro-batches of 2.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collectors.attach import FAIL_ENV, Config, parse_window_dir, window_dir_name, windows_at
from collectors.attach.command import parse_windows
from collectors.attach.facts import window_manifest
from traceana.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DP_SCRIPT = ROOT / "tests" / "attach_dp_script.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEANA_ATTACH")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _attach(out: Path, steps: str, command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "traceana", "attach", "-o", str(out), "--steps", steps, "--", *command],
                cwd, **env)


def _trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _steps_recorded(path: Path) -> set[int]:
    return {int(m.group(1)) for e in _trace_events(path) if (m := STEP_RE.match(str(e.get("name", ""))))}


# --- pure parts --------------------------------------------------------------------------------------------------
def test_windows_parse_and_name():
    assert parse_windows("10:12") == ((10, 12),)
    assert parse_windows("2:4, 8:9") == ((2, 4), (8, 9))
    for bad in ("0:2", "5:5", "4:2", "x:3", "3", "2:6,5:8"):
        with pytest.raises(ConfigError):
            parse_windows(bad)
    assert window_dir_name(10, 12) == "steps10-11" and parse_window_dir("steps10-11") == (10, 12)
    repeating = windows_at(Config(out="x", windows=((3, 5),), every=10))
    assert [next(repeating) for _ in range(3)] == [(3, 5), (13, 15), (23, 25)]


def _facts(rank: int, stages: list[int] | None, **kw) -> dict:
    f = {"rank": rank, "world_size": 4, "window": [3, 5], "warmup": 1, "torch_version": "2.x", "step_source": "s"}
    if stages is not None:
        f.update(stages=stages, num_stages=4, schedule_class="Schedule1F1B", schedule="1f1b", num_microbatches=8,
                 parameters=100 + rank)
    return {**f, **kw}


def test_manifest_says_which_ranks_left_no_trace():
    facts = {r: _facts(r, [r]) for r in range(4)}
    facts[0]["microbatch_size"] = 2
    m = window_manifest(facts, (0, 1, 3), job={"exit_code": -9})
    assert m.world_size == 4 and m.pp == 4 and m.stage_of_rank == (0, 1, 2, 3) and m.schedule == "1f1b"
    assert m.num_microbatches == 8 and m.microbatch_size == 2 and m.global_batch == 16 and m.dp == 1
    a = m.attach
    assert m.ranks_written == (0, 1, 3) and a["ranks_without_trace"] == [2] and "-9" in a["ranks_without_trace_why"]
    assert a["parameters"] == 100 + 101 + 102 + 103  # four distinct stages: their parameters add up
    # A rank that died before the window wrote no facts either: its stage stays unknown, not guessed.
    del facts[2]
    m = window_manifest(facts, (0, 1, 3))
    assert m.stage_of_rank is None and m.attach["ranks_without_facts"] == [2]
    assert m.attach["parameters"] is None and "parameters (whole model)" in m.attach["not_detected"]


def test_manifest_of_a_data_parallel_job_does_not_invent_stages():
    m = window_manifest({r: _facts(r, None, parameters=577) for r in range(2)} | {}, (0, 1))
    assert m.pp is None and m.stage_of_rank is None and m.schedule == "unknown"
    assert m.attach["parameters"] == 577  # replicas, not 2 × 577
    assert "pipeline stages (pp, stage_of_rank)" in m.attach["not_detected"]


# --- real jobs ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The DP script under torchrun (2 ranks, 6 steps): plain, under attach, and under attach with a failing profiler."""
    pytest.importorskip("torch")
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not next to this interpreter")
    base = tmp_path_factory.mktemp("attach_dp")
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(DP_SCRIPT), "--steps", "6"]
    plain = _run(command, base)
    attached = _attach(base / "run", "3:5", command, base)
    failing = _attach(base / "failing", "3:5", command, base, **{FAIL_ENV: "start"})
    return base, plain, attached, failing


@pytest.mark.multiprocess
def test_dp_job_under_torchrun(dp_runs):
    import torch

    base, plain, attached, _ = dp_runs
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert attached.returncode == 0, attached.stderr[-3000:]
    assert attached.stdout == plain.stdout and plain.stdout.count("loss") == 6  # the job's output passes through
    run = base / "run"
    assert sorted(p.name for p in run.glob("*.json.gz")) == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    assert not list(run.glob("*.partial")) and not list(run.glob(".*.partial"))
    for r in (0, 1):
        trace = run / f"rank{r}.pt.trace.json.gz"
        assert _steps_recorded(trace) == {3, 4}  # steps 0–2 and 5 ran but were not recorded
        optimizer_steps = [e for e in _trace_events(trace) if str(e.get("name", "")).startswith("Optimizer.step#")]
        assert len(optimizer_steps) == 2
    m = json.loads((run / "run.json").read_text())
    a = m["attach"]
    assert m["world_size"] == 2 and m["ranks_written"] == [0, 1] and m["torch_version"] == torch.__version__
    assert a["parameters"] == 577 and a["step_source"].startswith("torch.optim")
    assert a["window"] == [3, 5] and a["ranks_without_trace"] == [] and a["problems"] == {}
    assert m["pp"] is None and "schedule" in a["not_detected"] and a["job"]["exit_code"] == 0


@pytest.mark.multiprocess
def test_profiler_failure_leaves_training_output_identical(dp_runs):
    base, plain, _, failing = dp_runs
    assert failing.returncode == 0, failing.stderr[-3000:]
    assert failing.stdout == plain.stdout
    out = base / "failing"
    assert not list(out.glob("*.json.gz"))
    a = json.loads((out / "run.json").read_text())["attach"]
    assert a["ranks_without_trace"] == [0, 1]
    assert set(a["problems"]) == {"0", "1"} and all("injected" in p for p in a["problems"].values())
    assert "injected" in failing.stderr


@pytest.mark.multiprocess
def test_pipelining_example_unmodified(tmp_path):
    pytest.importorskip("torch")
    import polars as pl

    import traceana

    example_out = tmp_path / "example_own_dir"
    result = _attach(tmp_path / "run", "2:4",
                     [sys.executable, "-m", "collectors.pipelining_example", "--schedule", "interleaved-1f1b",
                      "-o", str(example_out), "--steps", "4", "--microbatches", "4"], ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    m = json.loads((run / "run.json").read_text())
    a = m["attach"]
    assert (m["world_size"], m["pp"], m["stage_of_rank"], m["schedule"]) == (2, 4, [0, 1], "interleaved-1f1b")
    assert a["schedule_class"] == "ScheduleInterleaved1F1B" and a["stages_of_rank"] == {"0": [0, 2], "1": [1, 3]}
    assert (m["num_microbatches"], m["microbatch_size"], m["global_batch"]) == (4, 2, 8)
    assert a["step_source"] == "torch.distributed.pipelining schedule.step"
    from collectors.trainer.config import PRESETS
    from collectors.trainer.model import GPT

    assert a["parameters"] == sum(p.numel() for p in GPT(PRESETS["tiny-gpt"], attention="naive").parameters())
    for r in (0, 1):
        assert _steps_recorded(run / f"rank{r}.pt.trace.json.gz") == {2, 3}
    assert not list(example_out.glob("*.json.gz"))  # the script's own PipelineProfiler stood down

    analysis = traceana.analyze(traceana.load_run(run, cache=False))
    sched = analysis.schedule
    assert set(sched["source"].unique()) == {"annotated"} and sorted(sched["step"].unique()) == [2, 3]
    per = sched.group_by("rank", "step", "stage", "phase").agg(mbs=pl.col("microbatch").sort())
    fb = per.filter(pl.col("phase").is_in(["forward", "backward"]))
    assert fb.height == 2 * 2 * 2 * 2  # ranks × steps × stages per rank × {forward, backward}
    assert all(mbs == [0, 1, 2, 3] for mbs in fb["mbs"].to_list())
    assert {(r, s) for r, s in per.select("rank", "stage").unique().rows()} == {(0, 0), (0, 2), (1, 1), (1, 3)}


@pytest.mark.multiprocess
def test_a_rank_that_dies_leaves_the_finished_window_intact(tmp_path):
    """Rank 1 crashes at the start of step 4: window 2 (done by then) keeps both traces; window 5 (its warm-up had
    begun at step 4's boundary) has none, and its run.json says which ranks left no trace and how the job ended.
    With --live, the finished window's table is printed as well."""
    pytest.importorskip("torch")
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not next to this interpreter")
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(DP_SCRIPT), "--steps", "8",
               "--die", "1", "4"]
    result = _run([sys.executable, "-m", "traceana", "attach", "-o", str(tmp_path / "run"), "--steps", "2:3,5:6",
                   "--live", "--", *command], tmp_path)
    assert result.returncode != 0
    # --live printed the finished window's table (and nothing for the window without traces)
    assert "window 1: steps 2 " in result.stdout and "window 2" not in result.stdout
    done, cut = tmp_path / "run" / "steps2-2", tmp_path / "run" / "steps5-5"
    for r in (0, 1):
        assert _steps_recorded(done / f"rank{r}.pt.trace.json.gz") == {2}
    m = json.loads((done / "run.json").read_text())
    assert m["ranks_written"] == [0, 1] and m["attach"]["ranks_without_trace"] == []
    m = json.loads((cut / "run.json").read_text())
    a = m["attach"]
    assert m["ranks_written"] == [] and a["ranks_without_trace"] == [0, 1]
    assert a["job"]["exit_code"] == result.returncode and "ranks_without_trace_why" in a
    assert "no trace from ranks [0, 1]" in result.stderr


@pytest.mark.multiprocess
def test_step_fn_names_the_step(tmp_path):
    """Each train_step call holds two optimizer steps: with --step-fn, steps 2 and 3 hold four of them."""
    pytest.importorskip("torch")
    result = _run([sys.executable, "-m", "traceana", "attach", "-o", str(tmp_path / "run"), "--steps", "2:4",
                   "--step-fn", "attach_stepfn_lib:train_step", "--",
                   sys.executable, str(ROOT / "tests" / "attach_stepfn_script.py"), "5"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("loss") == 5
    trace = tmp_path / "run" / "rank0.pt.trace.json.gz"
    assert _steps_recorded(trace) == {2, 3}
    assert len([e for e in _trace_events(trace) if str(e.get("name", "")).startswith("Optimizer.step#")]) == 4
    m = json.loads((tmp_path / "run" / "run.json").read_text())
    assert m["world_size"] == 1 and m["attach"]["step_source"] == "--step-fn"
    assert m["attach"]["parameters"] == 8 * 4 + 4


def test_a_failing_hook_stops_profiling_never_training(monkeypatch, capsys):
    from collectors.attach import runtime

    monkeypatch.setenv(FAIL_ENV, "hook")
    state = runtime._State(Config(out="unused", windows=((3, 5),)))
    for _ in range(10):
        state.boundary("step_fn")  # the failure is injected at the window's first boundary (step 2)
    assert state.window is None and state.trigger == float("inf") and state.count["step_fn"] == 10
    assert capsys.readouterr().err.count("profiling stops, training goes on") == 1


@pytest.mark.multiprocess
def test_ctrl_c_while_polling_still_waits_for_the_job(tmp_path, monkeypatch, capfd):
    """A Ctrl-C that lands while attach is writing a window's run.json (not while it waits) is the same Ctrl-C: attach
    passes it on to the job's process group, lets the job end, finishes the run directory and exits 130, instead of
    a traceback that leaves the job behind."""
    import argparse
    import time

    from collectors.attach import command

    polls = []
    ready = tmp_path / "job-ready"  # the job is inside its try: (on a loaded machine its start-up takes seconds)

    def poll(self) -> None:
        polls.append(1)
        if len(polls) == 1:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise KeyboardInterrupt

    monkeypatch.setattr(command._Finisher, "poll", poll)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["-o", str(tmp_path / "run"), "--", sys.executable, "-c",
                              f"import time\ntry:\n    open({str(ready)!r}, 'w').close()\n    time.sleep(5)\n"
                              "except KeyboardInterrupt:\n    print('job done', flush=True)"])
    assert command.run(args) == 130
    out, err = capfd.readouterr()
    assert "job done" in out and "no process reached the window" in err
