"""Inputs met in the hardening sweep (docs/reliability.md): what each case showed wrong, checked against values
worked out by hand from the synthetic traces built here."""

from __future__ import annotations

import warnings

import polars as pl
import pytest
from tracebuilder import TraceBuilder

from traceana.cli import main


def _data_parallel_run(directory, all_reduce_us=(30.0, 45.0)):
    """Two ranks of a plain data-parallel step (no P2P: no stage can be told) of 100 µs: compute, then a gloo
    all-reduce whose span lasts ``all_reduce_us[r]`` on rank r, nothing else on the thread."""
    for r, ar in enumerate(all_reduce_us):
        tb = TraceBuilder(rank=r, world_size=2, pid=10 + r, tid=10 + r)
        for n, t0 in enumerate((0, 200)):
            tb.step(n, t0, t0 + 100)
            tb.cpu_op("aten::mm", t0 + 1, 100 - ar - 2)
            tb.cpu_op("c10d::allreduce_", t0 + 100 - ar, ar)
        tb.write(directory / f"rank{r}.pt.trace.json.gz")
    return directory


def test_ranks_of_an_unknown_stage_show_their_collective_time(tmp_path, capsys):
    """Two data-parallel ranks whose stage cannot be told: each rank's exposed all-reduce (30 and 45 µs by
    construction) is in its stage table, with no polars "Comparisons with None" warning (a null stage compared
    with ``==``, which matches nothing, once left the figures empty). Such a run is no pipeline (issue 26): analyze
    says so in one line, and no replicas are formed (``summary.replicas`` is None: which ranks hold the same model
    is not something a trace without stages tells)."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    run = _data_parallel_run(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Comparisons with None")  # polars' warning was the symptom
        rc = main(["analyze", str(run), "--no-cache", "--quiet"])
        a = analyze(load_run(run, cache=False))
    out = capsys.readouterr().out
    assert rc == 0
    got = [round(ms, 2) for ms in a.stages.sort("rank")["collective_ms"].to_list()]
    assert got[0] == 0.03 and got[1] in (0.04, 0.05), a.stages
    assert a.summary.replicas is None and a.summary.per_stage["replicas"].to_list() == [None]
    assert "no pipeline found" in out and "Data-parallel replicas" not in out


def test_an_empty_last_profiler_step_is_not_the_measured_step(tmp_path):
    """A trace without pipeline names whose last ProfilerStep is an empty stub (as torch.profiler leaves when the
    loop ends: HTA's amd_trace has a 9.3 ms step and then a 49 µs one holding no event). The stub is not a training
    step: by hand the measured step is the 100 µs one, not the 5 µs stub that dropping the first step would leave."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(1, 0, 100)
    tb.cpu_op("aten::mm", 2, 90)
    tb.step(2, 100, 105)
    run = load_run(tb.write(tmp_path / "rank0.pt.trace.json.gz"), cache=False)
    s = analyze(run).summary
    assert s.steps == (1,)
    assert s.step_ms == pytest.approx(0.100)


@pytest.mark.parametrize("flags, says", [
    (["--schedule", "dualpipev", "--microbatches", "3"], "at least 4 micro-batches"),  # torch: m >= 4 stages
    (["--schedule", "zero-bubble", "--microbatches", "5"], "multiple of"),  # torch: m % max(1, m // 2) == 0
    (["--schedule", "zbv", "--profile-steps", "0"], "--profile-steps"),
    (["--schedule", "zbv", "--steps", "0"], "--profile-steps"),  # (the old spelling)
    (["--schedule", "zbv", "--microbatches", "0"], "--microbatches"),
    (["--schedule", "zbv", "--microbatch-size", "0"], "--microbatch-size"),
    (["--schedule", "zbv", "--warmup-steps", "-1"], "--warmup-steps"),
    (["--schedule", "zbv", "--recompute", "full"], "--recompute"),  # the pipelining example has no recompute
    (["--schedule", "zbv", "--dp", "2"], "--dp"),  # ... nor data parallelism
    (["--schedule", "zbv", "--bpipe-inflight", "2"], "--bpipe-inflight"),
])
def test_collect_refuses_what_torch_pipelining_cannot_run_before_any_process_starts(flags, says, tmp_path, capsys):
    """The multi-stage schedules run torch.distributed.pipelining in spawned ranks: a configuration torch refuses
    (or a flag the example would ignore) ended as 'internal error: ProcessRaisedException' (exit 1) after the
    processes started; it must be one line, exit 2, with nothing written."""
    out = tmp_path / "run"
    assert main(["collect", "--pp", "4", *flags, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("traceana: error:") and "\n" not in err and says in err, err
    assert not out.exists()


def _skewed_two_stage_run(directory, skew_us):
    """tracebuilder.write_two_stage_run's step with rank 1's clock ``skew_us`` ahead, and allocator samples on
    rank 1 inside its step: +4096 B at 27 µs (block 0xA, never freed), +8192 B at 41 µs and −8192 B at 59 µs (block
    0xB), on its own clock."""
    from tracebuilder import BASE_US, write_two_stage_run

    write_two_stage_run(directory)
    import gzip
    import json

    path = directory / "rank1.pt.trace.json.gz"
    trace = json.loads(gzip.decompress(path.read_bytes()))
    r1 = TraceBuilder(rank=1, world_size=2, pid=11, tid=11, base_us=BASE_US + skew_us)
    r1.memory(27, 4096, 4096, addr=0xA)
    r1.memory(41, 12288, 8192, addr=0xB)
    r1.memory(59, 4096, -8192, addr=0xB)
    for e in trace["traceEvents"]:
        e["ts"] += skew_us
    trace["traceEvents"] += r1.events
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    return directory


def test_memory_follows_the_clock_correction(tmp_path):
    """When a rank's clock is corrected (here rank 1 runs 1 s ahead: its gradient would arrive before it was
    sent), its allocator samples move with its steps. By hand, rank 1's step starts at 0 B and peaks at 12288 B; of
    that, the 8192 B allocated and freed inside the step are its activation peak (the 4096 B block outlives the
    step), whatever the skew; before, the samples stayed on the uncorrected clock and fell outside every step (no
    row, or another step's)."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    run = load_run(_skewed_two_stage_run(tmp_path, 1_000_000), cache=False)
    a = analyze(run)
    assert a.clock_offsets.filter(pl.col("rank") == 1)["offset_ns"][0] < -900_000_000  # corrected by ~-1 s
    got = a.stage_memory.filter(pl.col("rank") == 1).select("step", "baseline_bytes", "peak_bytes",
                                                          "activation_peak_bytes").rows()
    assert got == [(5, 0, 12288, 8192)]


def test_validate_names_the_rank_whose_trace_is_missing(tmp_path, capsys):
    """run.json places stage 1 on rank 1 and rank 1's trace is not in the folder: validate's refusal says that
    (the stage's rank and its absent trace), not 'check stage_of_rank or the P2P chain', which are both right."""
    import dataclasses

    import test_validate_roundtrip as rt
    from tracebuilder import write_two_stage_run

    from traceana.core.manifest import Manifest

    run = write_two_stage_run(tmp_path)
    manifest = Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), schedule="1f1b", microbatch_size=1,
                        num_microbatches=1, model=dataclasses.replace(rt.TINY, layers=2), dtype="float32",
                        attention="sdpa", recompute="none")
    (run / "run.json").write_text(manifest.to_json())
    (run / "rank1.pt.trace.json.gz").unlink()
    assert main(["validate", str(run), "--no-cache", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("traceana: error:") and "rank 1" in err and "trace" in err, err


@pytest.mark.parametrize("flags, says", [
    (["--p2p-gbps", "0"], "--p2p-gbps"),  # was ZeroDivisionError (internal error, exit 1)
    (["--bpipe-gbps", "nan"], "--bpipe-gbps"),  # was accepted: NaN transfer times
    (["--device-memory-gib", "-1"], "--device-memory-gib"),  # was accepted: 'fits: NO' on a -1 GiB device
    (["--reserve-gib", "nan"], "--reserve-gib"),
    (["--microbatch-size", "100000000000"], "years"),  # was ComputeError: an i128 step in nanoseconds
    (["--microbatches", "0"], "--microbatches"),  # named the hidden old spelling --num-microbatches
])
def test_estimate_refuses_impossible_numbers_in_one_line(flags, says, capsys):
    assert main(["estimate", "--model", "llama-65b", "--pp", "8", "--no-verdict", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("traceana: error:") and "\n" not in err and says in err, err
    assert "--num-microbatches" not in err


def test_p2p_peers_recorded_as_group_ranks_are_not_paired_with_the_rank_itself(tmp_path):
    """gloo's c10d::send/recv_ record the peer as a rank *within the process group* and not the group. Ranks 1 and 2
    of a 3-rank job form a pipeline group [1, 2]: rank 1 (group rank 0) sends to group rank 1 — global rank 2 — and
    the trace says peer 1, its own rank. By hand no message here names a global rank that can be checked: none may
    be paired (rank 1 'with itself' made a one-rank ring, read as a looped placement holding several stages), and
    a note must say why."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    for r in range(3):
        tb = TraceBuilder(rank=r, world_size=3, pid=10 + r, tid=10 + r)
        tb.step(0, 0, 100)
        tb.step(1, 100, 200)
        for t0 in (0, 100):
            tb.cpu_op("aten::mm", t0 + 1, 20)
            if r == 1:  # stage 0 of the group: activation out, gradient back (both to group rank 1)
                tb.send(peer=1, ts=t0 + 25, dur=5)
                tb.recv(peer=1, ts=t0 + 35, dur=30)
                tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", t0 + 70, 20)
            if r == 2:  # stage 1: from and to group rank 0 (global 1)
                tb.recv(peer=0, ts=t0 + 22, dur=10)
                tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", t0 + 40, 20)
                tb.send(peer=0, ts=t0 + 62, dur=3)
        tb.write(tmp_path / f"rank{r}.pt.trace.json.gz")
    a = analyze(load_run(tmp_path, cache=False))
    assert a.p2p.filter(pl.col("src") == pl.col("dst")).height == 0
    assert not a.stages["stage_source"].str.starts_with("inferred from P2P pattern").any(), a.stages
    assert any("name their own rank as the peer" in n for n in a.notes), a.notes


def test_watch_says_why_a_run_with_a_broken_run_json_never_shows(tmp_path, capsys):
    """A run folder whose run.json is not JSON and no longer changing: watch --once printed only 'no complete
    window' (waiting for ever without --once), where analyze says what is wrong; it must say it too."""
    from tracebuilder import write_two_stage_run

    (tmp_path / "run").mkdir()
    run = write_two_stage_run(tmp_path / "run")
    (run / "run.json").write_text('{"pp": 2, ')
    assert main(["watch", str(run), "--once", "--settle", "0"]) == 0
    out = capsys.readouterr()
    assert "not valid JSON" in " ".join((out.out + out.err).split()), out  # wrapped where the (tmp) path ends


def test_the_noise_floor_is_only_taken_from_two_runs_of_one_configuration(tmp_path, capsys):
    """--repeat holds more collections of the two configurations compared; two of one configuration also give the
    noise floor. One folder given twice (or a copy: the same measured steps) measured a noise floor of exactly 0; a
    run of a third configuration gave its difference as 'noise'; and without --baseline the option was dropped
    silently. Each is refused in one line."""
    from test_validate import StageTimes, fake_analysis

    from traceana.core.errors import AnalysisError
    from traceana.validation import cross_run

    times = StageTimes.uniform(2, forward=100e3, backward=200e3)
    a = fake_analysis(tmp_path / "a", schedule="1f1b", pp=2, m=4, times=times)
    again = fake_analysis(tmp_path / "again", schedule="1f1b", pp=2, m=4,
                          times=StageTimes.uniform(2, forward=101e3, backward=202e3))
    gpipe = fake_analysis(tmp_path / "g", schedule="gpipe", pp=2, m=4, times=times)
    copy = fake_analysis(tmp_path / "copy", schedule="1f1b", pp=2, m=4, times=times)  # a's steps exactly
    assert cross_run(a, gpipe, repeat=(a, again))["noise_floor"] == pytest.approx(0.01 / 1.005)  # 1 % apart
    with pytest.raises(AnalysisError, match="same run twice"):
        cross_run(a, gpipe, repeat=(a, a))
    with pytest.raises(AnalysisError, match="same run twice"):
        cross_run(a, gpipe, repeat=(a, copy))
    zb = fake_analysis(tmp_path / "zb", schedule="gpipe", pp=2, m=8, times=times)
    with pytest.raises(AnalysisError, match="neither the baseline's nor the target's"):
        cross_run(a, gpipe, repeat=(zb,))
    assert main(["validate", str(tmp_path), "--repeat", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "--baseline" in capsys.readouterr().err


def test_mfu_above_the_peak_is_not_shown(tmp_path):
    """run.json with the global batch written as the micro-batch size (10^6 sequences): the step (100 µs on each
    rank, tracebuilder.write_two_stage_run) would have done far more FLOPs than 1 TFLOP/s × 100 µs = 1e8 — an MFU
    of ~1e20 %, which was printed. No MFU above 100 % is shown; a note says which inputs cannot be right."""
    import dataclasses

    import test_validate_roundtrip as rt
    from tracebuilder import write_two_stage_run

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run
    from traceana.core.manifest import Manifest

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(Manifest(
        world_size=2, pp=2, stage_of_rank=(0, 1), schedule="1f1b", microbatch_size=10**6, num_microbatches=1,
        model=dataclasses.replace(rt.TINY, layers=2), dtype="float32", attention="sdpa", recompute="none",
        peak_flops=1e12).to_json())
    a = analyze(load_run(run, cache=False))
    assert a.stages["mfu"].null_count() == a.stages.height, a.stages
    assert any(n.startswith("MFU not shown") and "peak FLOP/s" in n for n in a.notes), a.notes


@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}])
def test_run_json_with_more_stages_x_replicas_x_tp_ranks_than_the_run_is_refused(tmp_path, capsys, layout):
    """A 1F1B run.json on 2 ranks saying pp 2 and dp 2 (or tp 2) describes 4 ranks: analyze and validate used it
    silently (dp and tp enter the model's memory and FLOPs); both refuse it in one line, naming run.json."""
    import json

    from tracebuilder import write_two_stage_run

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(json.dumps({"world_size": 2, "schedule": "1f1b", **layout}))
    for command in ("analyze", "validate"):
        assert main([command, str(run), "--no-cache", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "more than world_size 2" in err and "run.json" in err and err.count("\n") == 1, err


def test_validate_says_when_run_json_claims_bpipe_the_traces_do_not_show(tmp_path):
    """run.json with a BPipe pair on a run whose traces hold no BPipe transfer: the note read 'BPipe from the trace:
    0.000 ms per transfer in flight (median),  per step in BPipe work' — a figure from nothing. It says instead
    that no transfer is in the traces and that they are simulated as free."""
    import dataclasses

    from test_validate import StageTimes, fake_analysis

    from traceana.validation import validate

    a = fake_analysis(tmp_path, schedule="1f1b", pp=4, m=8, times=StageTimes.uniform(4, forward=1e5, backward=2e5))
    claimed = dataclasses.replace(a, run=dataclasses.replace(
        a.run, manifest=dataclasses.replace(a.run.manifest, bpipe=((0, 3),))))
    notes = validate(claimed).notes
    assert any("hold no BPipe transfer" in n for n in notes), notes
    assert not any("BPipe from the trace" in n for n in notes), notes


@pytest.mark.slow
def test_validate_header_gives_the_stages_of_a_multi_stage_run(collected_run, capsys):
    """torch.distributed.pipelining's ZBV on 2 ranks × 2 stages (run.json: pp 4): the header said 'pp 2' alone,
    against run.json's 4; it gives the 4 stages, 2 a rank (collectors.pipelining_example's layout)."""
    run = collected_run("pipelining-zbv")
    assert main(["validate", str(run), "--no-cache", "--quiet"]) == 0
    assert "pp 2 (4 stages, 2 a rank)" in " ".join(capsys.readouterr().out.split())  # wrapped where the path ends


def test_a_trace_without_profiler_steps_is_said_to_be_measured_whole(tmp_path, capsys):
    """No ProfilerStep span: the headline says the step is the whole trace, not 'over steps -1' (an internal id),
    and the ranks table names what it counts (ProfilerStep spans: none here) apart from the stage table's step."""
    tb = TraceBuilder(rank=0, world_size=1)
    tb.cpu_op("aten::mm", 0, 90)
    tb.write(tmp_path / "rank0.pt.trace.json.gz")
    rc = main(["analyze", str(tmp_path), "--no-cache", "--quiet"])
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert rc == 0
    assert "over the whole trace (no ProfilerStep spans)" in out and "over steps -1" not in out, out
    assert "their mean" in out and "mean step" not in out, out


def test_a_folder_of_run_folders_names_them(tmp_path, capsys):
    """A folder whose traces are one level down (HTA's trace_compare: base/ and test/) is refused in one line
    that names the subfolders holding traces, so the user knows which path was meant."""
    for sub in ("base", "test"):
        (tmp_path / sub).mkdir()
        TraceBuilder(rank=0, world_size=1).write(tmp_path / sub / "rank0.pt.trace.json.gz")
    (tmp_path / "notes").mkdir()  # a subfolder without traces is not named
    rc = main(["analyze", str(tmp_path), "--no-cache"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "base/, test/ hold traces" in err and "notes" not in err, err


@pytest.mark.parametrize("argv", [
    ["analyze", "RUN", "--workers", "0"], ["analyze", "RUN", "--workers", "-1"],
    ["watch", "RUN", "--count", "0"], ["watch", "RUN", "--interval", "0"], ["watch", "RUN", "--settle", "nan"],
    ["watch", "RUN", "--timeout", "-5"],
])
def test_counts_and_durations_that_mean_nothing_are_refused(argv, tmp_path, capsys):
    """0 or -1 workers, 0 windows, a poll interval of 0 or a NaN settle time were accepted and meant something
    else (one worker, a busy loop, a file never settling): refused by argparse with exit code 2."""
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path) if a == "RUN" else a for a in argv])
    assert e.value.code == 2
    assert "expected" in capsys.readouterr().err


@pytest.mark.parametrize("schedule, extra, says", [
    ("zbv", {}, "places 2 stages on each rank, but the traces' annotations give each rank 1"),
    ("interleaved-1f1b", {"virtual_stages": 2}, "places 2 stages on each rank"),
    ("looped-bfs", {}, "places several stages on each rank"),
])
def test_run_json_placing_another_stage_count_per_rank_than_the_traces_hold(tmp_path, capsys, schedule, extra,
                                                                              says):
    """Two ranks whose annotations name one stage each (PP:0…, PP:1…): a run.json naming a schedule that holds two
    stages a rank (or several) contradicts them. analyze says so in a note; validate, which would simulate a
    schedule the run did not have (or say 'use 2 virtual stages', as it did), refuses naming run.json."""
    import json

    from tracebuilder import write_two_stage_run

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, "schedule": schedule,
                                              "model": {"family": "gpt", "heads": 4, "hidden": 64, "layers": 8,
                                                        "seq": 64, "vocab": 256},
                                              "microbatch_size": 1, "num_microbatches": 1, **extra}))
    assert main(["analyze", str(run), "--no-cache", "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert says in out, out
    assert main(["validate", str(run), "--no-cache", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert says in err and "run.json" in err and err.count("\n") == 1, err


def test_run_json_agreeing_with_the_traces_stage_count_gets_no_placement_note(tmp_path, capsys):
    import json

    from tracebuilder import write_two_stage_run

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, "schedule": "1f1b"}))
    assert main(["analyze", str(run), "--no-cache", "--quiet"]) == 0
    assert "places" not in capsys.readouterr().out
