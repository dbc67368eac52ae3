"""The second hardening sweep: configurations the rest of the suite does not use, where a figure came out
confidently wrong. Each expected value is worked out by hand from the synthetic trace built here, or from a
published formula, never from the code under test."""

from __future__ import annotations

import polars as pl
import pytest
from tracebuilder import TraceBuilder

from traceana.cli import main
from traceana.core.errors import BadInputError
from traceana.core.manifest import Manifest, ModelShape

# A GPT of 4 layers, h 32, s 16, V 64: with Narayanan et al. 2021 §5.1, one layer's forward is
# 24·b·s·h² + 4·b·s²·h FLOPs and the logit projection's 2·b·s·h·V; training is 3x the forward.
SHAPE = ModelShape("gpt", layers=4, hidden=32, heads=4, vocab=64, seq=16, name="hand")


def _hand_train_flops(*, layers: int, last: bool, b: int) -> float:
    h, s, v = SHAPE.hidden, SHAPE.seq, SHAPE.vocab
    fwd = layers * (24 * b * s * h * h + 4 * b * s * s * h) + (2 * b * s * h * v if last else 0)
    return 3.0 * fwd


def _two_annotated_ranks(directory, order: dict, *, step_us: float = 1000.0, meta=None) -> None:
    """Ranks 0 and 1, one step of ``step_us`` each, holding ``order[rank]``'s annotated spans (label, start µs,
    duration; none for a zero duration), each over an ``aten::mm`` of its length less 2 µs."""
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2, pid=10 + r, tid=10 + r, **({"meta": meta(r)} if meta else {}))
        tb.step(1, 0, step_us)
        for name, t0, dur in order[r]:
            if dur:
                tb.annotation(f"PP:{name}", t0, dur)
                tb.cpu_op("aten::mm", t0 + 1, dur - 2)
        tb.write(directory / f"rank{r}.pt.trace.json.gz")


def _v_run(directory, step_us: float = 1000.0):
    """ZB-V on 2 ranks × 2 stages (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; docs/schedules.md), one
    micro-batch, one step of ``step_us`` on each rank, annotated as torch's runtime schedule names its actions."""
    order = {0: [("0F0", 0, 100), ("3F0", 300, 100), ("3I0", 400, 100), ("3W0", 500, 100), ("0I0", 800, 100),
                 ("0W0", 900, 90)],
             1: [("1F0", 110, 90), ("2F0", 200, 90), ("2I0", 610, 90), ("2W0", 700, 90), ("1I0", 710, 0),
                 ("1W0", 720, 0)]}
    _two_annotated_ranks(directory, order, step_us=step_us,
                         meta=lambda r: {"rank": r, "stage": r, "stages": [r, 3 - r], "schedule": "zbv"})
    (directory / "run.json").write_text(Manifest(
        world_size=2, pp=4, stage_of_rank=(0, 1), schedule="zbv", microbatch_size=2, num_microbatches=1,
        model=SHAPE, dtype="float32", attention="sdpa", recompute="none", peak_flops=1e12,
        extra={"stages_of_rank": [[0, 3], [1, 2]]}).to_json())
    return directory


def test_mfu_of_a_rank_holding_two_stages_counts_both(tmp_path):
    """ZB-V, 4 stages of one layer each on 2 ranks: rank 0 runs stages 0 and 3 (the last, with the logits), rank 1
    stages 1 and 2, each in a 1 ms step at a peak of 1 TFLOP/s. By hand rank 0 does 2 layers + the logits, rank 1
    2 layers; MFU counted only each rank's first stage (one layer): about half of the truth."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    a = analyze(load_run(_v_run(tmp_path), cache=False))
    mfu = dict(a.stages.select("rank", "mfu").rows())
    step_flops = 1e12 * 1e-3
    assert mfu[0] == pytest.approx(_hand_train_flops(layers=2, last=True, b=2) / step_flops, rel=1e-9)
    assert mfu[1] == pytest.approx(_hand_train_flops(layers=2, last=False, b=2) / step_flops, rel=1e-9)


def test_stages_a_rank_holds_are_read_from_its_trace_metadata(capsys):
    """Megatron-LM's interleaved 1F1B (tests/data/megatron_pipe/interleaved: 2 ranks × 2 model chunks, Megatron's
    placement rank r holds r and r+2, recorded by the script in each trace's metadata as ``stages``). Megatron's names
    carry no stage number, so the only source is that metadata; the per-rank table said rank 0 holds stage 0 alone
    (while a note said it holds several), which also makes its MFU count one chunk of two."""
    from pathlib import Path

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    run = Path(__file__).parents[1] / "data" / "megatron_pipe" / "interleaved" / "run"
    a = analyze(load_run(run, cache=False))
    assert dict(a.stages.select("rank", "stages").rows()) == {0: "0,2", 1: "1,3"}
    assert main(["analyze", str(run), "--no-cache", "--quiet"]) == 0
    assert "stages 0+2" in capsys.readouterr().out


@pytest.mark.parametrize("renamed", [
    {},  # today's Kineto
    {"kernel": "Kernel", "cuda_runtime": "Runtime", "cpu_op": "Operator", "gpu_memcpy": "Memcpy"},  # torch 1.8-1.9
])
def test_older_kinetos_capitalised_categories_are_read_alike(tmp_path, renamed, decoder):
    """Older Kineto (torch 1.8/1.9) wrote its categories capitalised — Kernel, Runtime, Operator, Memcpy (TensorBoard's
    profiler plugin reads both spellings, lower-casing them). One GPU rank, two 1 ms steps, each with a 600 µs
    GEMM kernel and a 100 µs device copy launched from the CPU: by hand 0.7 ms of each step is GPU work (kernel
    compute, copy memcpy), the rest of the step idle host time — in either spelling. The capitalised trace was
    read as 2 ms of host and no compute at all."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    tb = TraceBuilder(rank=0, world_size=1, backend="nccl")
    for n, t0 in ((1, 0), (2, 1000)):
        tb.step(n, t0, t0 + 1000)
        tb.cpu_op("aten::mm", t0 + 10, 50)
        tb.launch(t0 + 20, 10, correlation=n * 10)
        tb.kernel("ampere_sgemm_128x64_nn", t0 + 100, 600, correlation=n * 10)
        tb.launch(t0 + 40, 10, correlation=n * 10 + 1)
        tb.event(ph="X", cat="gpu_memcpy", name="Memcpy HtoD (Pageable -> Device)", pid=0, tid="stream 7",
                 ts=tb.base_us + t0 + 750, dur=100,
                 args={"device": 0, "stream": 7, "correlation": n * 10 + 1, "External id": 0})
    for e in tb.events:
        e["cat"] = renamed.get(e["cat"], e["cat"])
    a = analyze(load_run(tb.write(tmp_path / "rank0.pt.trace.json.gz"), cache=False))
    got = {c: n for c, n in a.attribution.group_by("category").agg(pl.col("ns").sum()).rows() if n}
    gpu = sum(n for c, n in got.items() if c not in ("host",))
    assert gpu == 2 * 700_000, got
    assert got.get("host") == 2 * 300_000, got


def _dp_ranks_numbering_steps_apart(directory, *, apart_us: float = 0):
    """Two data-parallel ranks whose profilers number three steps differently (rank 0: 1, 2, 3; rank 1: 11, 12,
    13), each 100, 200 and 200 µs long; rank 1's ``apart_us`` later (0: the same steps, run together)."""
    for r, first in ((0, 1), (1, 11)):
        tb = TraceBuilder(rank=r, world_size=2, pid=10 + r, tid=10 + r)
        t = apart_us * r
        for i, dur in enumerate((100, 200, 200)):
            tb.step(first + i, t, t + dur)
            tb.cpu_op("aten::mm", t + 1, dur - 30)
            tb.cpu_op("c10d::allreduce_", t + dur - 25, 20)
            t += dur
        tb.write(directory / f"rank{r}.pt.trace.json.gz")
    return directory


@pytest.mark.parametrize("apart_us, steps", [
    (10_000, {2, 3, 12, 13}),  # run at other times: nothing says which steps are the same
    (0, {2, 3}),  # run together: the same steps (renumbered to rank 0's, test_hardening_third)
])
def test_step_time_when_no_step_number_is_common_to_every_rank(tmp_path, apart_us, steps):
    """No step number is common to both ranks: the headline was the mean over all six (rank, step) pairs, first
    steps included, 0.167 ms — neither rank's steady step. Each rank's first step is left out as when the numbers
    match, and the slowest rank's mean is 0.2 ms by construction."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    s = analyze(load_run(_dp_ranks_numbering_steps_apart(tmp_path, apart_us=apart_us), cache=False)).summary
    assert s.step_ms == pytest.approx(0.200)
    assert set(s.steps) == steps


def test_step_time_when_one_rank_has_no_profiler_steps(tmp_path):
    """tracebuilder.write_two_stage_run (a 100 µs step on each rank) with rank 1's ProfilerStep span removed: rank
    1 is one 'step' of its whole trace (60 µs of events), rank 0 has its 100 µs step. The headline, 'slowest rank',
    averaged the two into 0.08 ms; the slowest rank's step is 0.1 ms."""
    import gzip
    import json

    from tracebuilder import write_two_stage_run

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    write_two_stage_run(tmp_path)
    p = tmp_path / "rank1.pt.trace.json.gz"
    t = json.loads(gzip.decompress(p.read_bytes()))
    t["traceEvents"] = [e for e in t["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    p.write_bytes(gzip.compress(json.dumps(t).encode()))
    a = analyze(load_run(tmp_path, cache=False))
    assert a.summary.step_ms == pytest.approx(0.100)
    # the messages are in both traces, under other step numbers: the note says so, not that a trace lacks them
    assert any("no counterpart in the peer's trace in the same ProfilerStep" in n for n in a.notes), a.notes


@pytest.mark.parametrize("flags, says", [
    (["--ffn", "-5"], "ffn"),  # a negative MLP width gave 792 M parameters a stage, fewer than with no MLP at all
    (["--ffn", "0"], "ffn"),  # no MLP: not a GPT; 0 read as a width, where None means the family's default
    (["--reserve-gib", "100"], "--reserve-gib"),  # more than the A100's 80 GB kept free: "-20 GiB usable"
])
def test_estimate_refuses_shapes_and_reserves_that_cannot_be(flags, says, capsys):
    """Each was estimated as given and printed (parameters from a negative width; 'device memory -20 GiB usable'
    and 'does not fit either way'): one line, exit 2, naming the flag."""
    assert main(["estimate", "--model", "gpt3-13b", "--pp", "8", "--device", "a100-80gb", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("traceana: error:") and "\n" not in err and says in err, err


def test_run_json_with_a_negative_ffn_is_refused(tmp_path, capsys):
    """run.json's model shape goes through the same check as --ffn (the ModelShape): analyze refuses it in one
    line naming ffn, as for any other impossible shape."""
    import json

    from tracebuilder import write_two_stage_run

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, "schedule": "1f1b", "model": {
        "family": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "ffn": -5}}))
    assert main(["analyze", str(run), "--no-cache", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "ffn" in err and err.count("\n") == 1, err


def test_estimate_names_the_stages_each_device_of_a_v_schedule_holds(capsys):
    """ZB-V on 4 devices: device d holds stages d and 7 − d (docs/schedules.md), 5 of GPT-3 13B's 40 layers each.
    The memory table's rows read 'stage 0' … 'stage 3' with 10 layers: a device's two stages under the name of
    one."""
    assert main(["estimate", "--model", "gpt3-13b", "--pp", "4", "--schedule", "zbv", "--microbatches", "8",
                 "--no-verdict"]) == 0
    out = capsys.readouterr().out
    assert all(f"{d}+{7 - d}" in out for d in range(4)), out


def test_per_stage_deltas_only_between_runs_of_the_same_stages(tmp_path):
    """An A/B of a 2-stage run (tracebuilder.write_two_stage_run) against one of a single stage (the same
    rank-0 trace, run.json pp 1): stage 0 of the one holds half the model, stage 0 of the other all of it, so
    their difference is no change of anything. The report's per-stage Δ columns compared them anyway; the
    run-level step change stays (both runs' step times are 0.1 ms by construction: 0 change)."""
    from tracebuilder import write_two_stage_run

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run
    from traceana.measure.summary import compare_runs

    (tmp_path / "two").mkdir()
    two = write_two_stage_run(tmp_path / "two")
    one = tmp_path / "one"
    one.mkdir()
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(5, 0, 100)
    tb.annotation("PP:0F0", 0, 40)
    tb.cpu_op("aten::mm", 2, 36)
    tb.annotation("PP:0B0", 40, 50)
    tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", 42, 46)
    tb.write(one / "rank0.pt.trace.json.gz")
    (one / "run.json").write_text(Manifest(world_size=1, pp=1, stage_of_rank=(0,), schedule="1f1b").to_json())
    runs = [(p.name, analyze(load_run(p, cache=False)).summary) for p in (two, one)]
    overview, per_stage = compare_runs(runs)
    assert overview["step_change"].to_list() == [0.0, 0.0]
    other = per_stage.filter(pl.col("run") == "one")
    assert other.height == 1
    for c in ("step_change_ms", "bubble_change_ms", "bpipe_change_ms", "peak_change_mib", "activation_peak_change_mib"):
        assert other[c].to_list() == [None], (c, other)


def _zb_h1_run(directory):
    """ZB-H1 on 2 ranks, one stage each, one micro-batch: F, I and W spans of 100 µs each on every rank."""
    order = {0: [("0F0", 0, 100), ("0I0", 500, 100), ("0W0", 600, 100)],
             1: [("1F0", 150, 100), ("1I0", 250, 100), ("1W0", 360, 100)]}
    _two_annotated_ranks(directory, order)
    (directory / "run.json").write_text(Manifest(
        world_size=2, pp=2, stage_of_rank=(0, 1), schedule="zero-bubble", microbatch_size=2, num_microbatches=1,
        model=SHAPE, dtype="float32", attention="sdpa", recompute="none", peak_flops=1e12,
        extra={"stages_of_rank": [[0], [1]]}).to_json())
    return directory


def test_zero_bubble_with_one_stage_a_rank_is_no_contradiction(tmp_path):
    """ZB-H1: torch's ScheduleInterleavedZeroBubble given one stage per rank (docs/schedules.md: 'ZB-H1 (torch's
    ZB-1P with one chunk)'; the simulator and estimate take zero-bubble with one virtual stage). Two ranks, one
    micro-batch, F, I and W annotated on stage 0 and 1. analyze said run.json's zero-bubble 'places several stages
    on each rank' against the traces' one, and validate refused to simulate it."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    a = analyze(load_run(_zb_h1_run(tmp_path), cache=False))
    assert not any("places" in n and "on each rank" in n for n in a.notes), a.notes
    cfg = a.config.training_config()
    assert (cfg.schedule, cfg.pp, cfg.virtual_stages) == ("zero-bubble", 2, 1)


def test_report_refuses_two_runs_under_one_label(tmp_path, capsys):
    """`report A B --name x --name x`: the A/B tables key each run by its label, so the first run's rows were
    compared with both runs' (every stage row doubled, and run A against itself showed a change). One line, exit
    2, before any trace is read."""
    from tracebuilder import write_two_stage_run

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = write_two_stage_run(tmp_path / "a"), write_two_stage_run(tmp_path / "b")
    out = tmp_path / "r.html"
    assert main(["report", str(a), str(b), "--name", "x", "--name", "x", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("traceana: error:") and "\n" not in err and "--name" in err, err
    assert not out.exists()


def test_run_json_virtual_stages_with_pp_counting_stages(tmp_path):
    """run.json's pp counts stages (docs/reliability.md: with virtual stages pp may exceed the ranks), as with
    stages_of_rank: interleaved 1F1B on 2 ranks holding stages 0, 2 and 1, 3 says pp 4 and virtual_stages 2. The
    model took pp 4 as devices, 4 × 2 = 8 chunks of a 4-layer model ('4 layers cannot fill 8 pipeline chunks'; a
    larger model would have been simulated on 4 devices). By the annotations: 2 devices of 2 stages each."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    order = {0: [("0F0", 0, 100), ("2F0", 300, 100), ("2B0", 400, 100), ("0B0", 800, 100)],
             1: [("1F0", 110, 90), ("3F0", 200, 90), ("3B0", 290, 90), ("1B0", 610, 90)]}
    _two_annotated_ranks(tmp_path, order)
    (tmp_path / "run.json").write_text(Manifest(
        world_size=2, pp=4, stage_of_rank=(0, 1), schedule="interleaved-1f1b", microbatch_size=2, num_microbatches=1,
        model=SHAPE, dtype="float32", attention="sdpa", recompute="none", extra={"virtual_stages": 2}).to_json())
    cfg = analyze(load_run(tmp_path, cache=False)).config.training_config()
    assert (cfg.pp, cfg.virtual_stages) == (2, 2)


def test_run_json_stages_a_rank_is_read_once_for_the_model_and_the_placement_check():
    """run.json says how many stages a rank holds in two ways: virtual_stages, or stages_of_rank's lists (collect
    for torch.distributed.pipelining). The model read both, the placement check only virtual_stages; both now read
    Manifest.stages_a_rank. By hand: lists [[0, 3], [1, 2]] hold 2 a rank; uneven lists say no one count, which
    the model refuses rather than simulate 4 stages as 4 devices."""
    from traceana.core.errors import ConfigError
    from traceana.core.run_config import RunConfig

    def config_from_manifest(m):
        return RunConfig.from_manifest(m).training_config()

    def manifest(extra):
        return Manifest(world_size=2, pp=4, schedule="interleaved-1f1b", microbatch_size=1, num_microbatches=4,
                        model=SHAPE, dtype="float32", attention="sdpa", recompute="none", extra=extra)

    assert manifest({"stages_of_rank": [[3, 0], [1, 2]]}).stages_of_rank == ((0, 3), (1, 2))
    assert manifest({"stages_of_rank": [[0, 3], [1, 2]]}).stages_a_rank == 2
    assert manifest({"virtual_stages": 2}).stages_a_rank == 2
    assert manifest({}).stages_a_rank is None
    with pytest.raises(BadInputError, match="stages_of_rank must be one list of stage numbers per rank"):
        manifest({"stages_of_rank": [[0], "x"]})  # (was silently ignored)
    assert config_from_manifest(manifest({"stages_of_rank": [[0, 3], [1, 2]]})).pp == 2
    uneven = manifest({"stages_of_rank": [[0, 2, 3], [1]]})
    assert uneven.stages_a_rank is None
    with pytest.raises(ConfigError, match="different numbers of stages"):
        config_from_manifest(uneven)


@pytest.mark.parametrize("build", ["zb_h1", "v"])
def test_measured_efficiency_counts_split_backwards_and_every_stage_of_a_rank(tmp_path, build):
    """E(b) (estimate --efficiency-from) is the run's FLOPs over its compute time × peak. On ZB-H1 (one stage a
    rank, F, I and W of 100 µs each on both ranks) the compute time is 600 µs, by hand; the I and W halves were
    left out of it (200 µs: E three times too high). On ZB-V (2 ranks × 2 stages, _v_run) the run was refused:
    'found 2 of 4 stages' (it counted ranks' first stages); its compute is 0.95 ms by hand (the annotated F, I, W
    spans, 590 and 360 µs). FLOPs: the 4 layers and the logits of one micro-batch of 2 sequences."""
    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run
    from traceana.validation import measured_efficiency

    run, compute_s = (_zb_h1_run(tmp_path), 600e-6) if build == "zb_h1" else (_v_run(tmp_path), 950e-6)
    flops = _hand_train_flops(layers=4, last=True, b=2)
    b, _, e = measured_efficiency(analyze(load_run(run, cache=False)))
    assert b == 2
    assert e == pytest.approx(flops / (compute_s * 1e12), rel=1e-6)


def test_run_json_stage_of_rank_against_the_annotations(tmp_path):
    """tracebuilder.write_two_stage_run (rank 0 runs PP:0F0/0B0, rank 1 PP:1F0/1B0) with a run.json whose
    stage_of_rank is swapped (1, 0), and no trace metadata to compare it with: the stage table called rank 0 stage
    1 while its schedule rows said stage 0, with no note. A note names the contradiction."""
    from tracebuilder import write_two_stage_run

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    run = write_two_stage_run(tmp_path)
    (run / "run.json").write_text(Manifest(world_size=2, pp=2, stage_of_rank=(1, 0), schedule="1f1b").to_json())
    a = analyze(load_run(run, cache=False))
    assert any("stage_of_rank puts rank 0 on stage 1, but its annotations name stage 0" in n for n in a.notes), \
        a.notes
    ok = tmp_path / "ok"
    ok.mkdir()
    write_two_stage_run(ok)
    (ok / "run.json").write_text(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), schedule="1f1b").to_json())
    assert not any("stage_of_rank puts" in n for n in analyze(load_run(ok, cache=False)).notes)
