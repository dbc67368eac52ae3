"""The BPipe benefit estimate and the `traceana estimate` command."""

from __future__ import annotations

import json

import pytest

from traceana.cli import main
from traceana.core.training_config import TrainingConfig
from traceana.model.bpipe import EfficiencyCurve, Network, bpipe_verdict, candidates, estimate_step
from traceana.model.presets import DEVICES, MODELS, Device

GiB = 2**30
A100 = DEVICES["a100-80gb"]


def test_efficiency_curve_interpolates_in_log_b_and_clamps():
    c = EfficiencyCurve(points=((1, 0.4), (4, 0.6)), source="measured")
    assert c.at(2, seq=2048) == pytest.approx(0.5)
    assert c.at(0.5, seq=2048) == 0.4 and c.at(16, seq=2048) == 0.6
    assumed = EfficiencyCurve()
    assert assumed.at(1, seq=512) == pytest.approx(0.3)  # e_max · 512/(512+512)
    assert assumed.at(4, seq=2048) > assumed.at(1, seq=2048)


def test_estimate_step_with_uniform_efficiency_is_flops_over_rate_times_pipeline_length():
    model = MODELS["gpt3-13b"]
    cfg = TrainingConfig(model=model, pp=4, tp=1, microbatch_size=1, num_microbatches=8,
                         layers_per_stage=(10, 10, 10, 10))
    flat = EfficiencyCurve(points=((1, 0.5),))
    est = estimate_step(cfg, device=None, curve=flat, network=Network(p2p_bytes_per_s=1e30), peak_flops=1e15)
    # terms are stage 0's: its compute is exactly m · its FLOPs / rate; the last stage also does the logits, so the
    # step is between (m + p − 1) micro-batches of stage 0 and of the last stage.
    from traceana.core.flops import stage_flops

    first = stage_flops(model, layers=10, microbatch_size=1) / (0.5 * 1e15)
    last = stage_flops(model, layers=10, microbatch_size=1, last=True) / (0.5 * 1e15)
    assert est.terms["compute"] == pytest.approx(8 * first, rel=1e-6)
    assert sum(est.terms.values()) == pytest.approx(est.step_s, rel=1e-6)
    assert 11 * first < est.step_s < 11 * last
    assert est.fits is None


def test_candidates_keep_the_global_batch():
    cfg = TrainingConfig(model=MODELS["llama-7b"], pp=4, microbatch_size=2, num_microbatches=8, attention="naive")
    cs = candidates(cfg, bpipe=True)
    assert {c.microbatch_size * c.num_microbatches for c in cs} == {16}
    assert {c.microbatch_size for c in cs} == {1, 2, 4, 8, 16}
    assert all(c.bpipe for c in cs)
    flash = candidates(cfg.replace(attention="sdpa"), bpipe=False)
    assert "selective" not in {c.recompute for c in flash}


def test_bpipe_helps_by_removing_recompute():
    # Naive attention with activations dominating: without BPipe only recompute fits; balanced to ⌈9/2⌉ = 5 micro-
    # batches (stage 0 held 8) the run fits without recompute: the classic BPipe win (Kim et al. 2023). The largest
    # stage is then an acceptor: its own micro-batch with the fp32 logits plus 4 of stage 0's (it takes the next
    # before it returns the last), so the peak falls by less than 5/8 of the activations.
    cfg = TrainingConfig(model=MODELS["llama-7b"], pp=8, tp=1, microbatch_size=1, num_microbatches=32,
                         attention="naive")
    peak = lambda c: estimate_step(c, device=None, curve=EfficiencyCurve(), peak_flops=1e15).peak_bytes  # noqa: E731
    without, with_ = peak(cfg), peak(cfg.replace(bpipe=True))
    assert with_ < 0.85 * without
    dev = Device("between", (without + with_) / 2, 312e12, "test")
    v = bpipe_verdict(cfg, device=dev, network=Network(bpipe_bytes_per_s=1e13), reserve_bytes=0)
    assert v.reference.config.recompute != "none"
    assert v.with_bpipe is not None and v.with_bpipe.config.bpipe and v.with_bpipe.config.recompute == "none"
    assert v.helps and v.speedup > 1.01  # selective recompute is cheap (Korthikanti et al. 2022 §5)
    assert v.deciding_term == "recompute" and v.deltas["recompute"] < 0
    assert "BPipe helps" in v.sentence and "recompute" in v.sentence


def test_slow_blocking_transfers_eat_the_benefit():
    cfg = TrainingConfig(model=MODELS["llama-7b"], pp=8, tp=1, microbatch_size=1, num_microbatches=32,
                         attention="naive")
    peak = lambda c: estimate_step(c, device=None, curve=EfficiencyCurve(), peak_flops=1e15).peak_bytes  # noqa: E731
    dev = Device("between", (peak(cfg) + peak(cfg.replace(bpipe=True))) / 2, 312e12, "test")
    v = bpipe_verdict(cfg, device=dev, network=Network(bpipe_bytes_per_s=1e9, bpipe_overlap=False), reserve_bytes=0)
    assert not v.helps
    assert v.with_bpipe is None or v.deltas["transfer"] > 0


def test_bpipe_does_not_help_when_everything_fits_without_it():
    cfg = TrainingConfig(model=MODELS["llama-7b"], pp=4, tp=1, microbatch_size=1, num_microbatches=16)
    big = Device("huge", 10**15, 312e12, "test")
    v = bpipe_verdict(cfg, device=big, curve=EfficiencyCurve(points=((1, 0.5),)))  # flat: b buys nothing
    assert not v.helps
    assert v.speedup <= 1.0 + 1e-9
    assert v.reference.config.microbatch_size == 1  # more micro-batches, smaller bubble, same efficiency


def test_bpipe_trades_bubble_for_efficiency():
    # BPipe frees memory for b = 2; a steep efficiency curve makes that worth the larger bubble.
    model = MODELS["gpt3-13b"]
    cfg = TrainingConfig(model=model, pp=4, tp=1, microbatch_size=1, num_microbatches=32, attention="naive",
                         recompute="full")
    steep = EfficiencyCurve(points=((1, 0.2), (2, 0.6)), source="measured")
    sizes = {}
    for b in (1, 2):
        for bp in (False, True):
            c = cfg.replace(microbatch_size=b, num_microbatches=32 // b, recompute="none", bpipe=bp)
            sizes[(b, bp)] = estimate_step(c, device=None, curve=steep, peak_flops=1e15).peak_bytes
    assert sizes[(2, True)] < sizes[(2, False)]
    dev = Device("between", (sizes[(2, True)] + sizes[(2, False)]) / 2, 1e15, "test")
    v = bpipe_verdict(cfg, device=dev, curve=steep, network=Network(bpipe_bytes_per_s=1e15), reserve_bytes=0)
    assert v.helps and v.with_bpipe.config.microbatch_size == 2 and v.with_bpipe.config.recompute == "none"
    # without BPipe, b = 2 fits only with selective recompute: dropping it decides; compute is unchanged at b = 2
    assert v.reference.config.microbatch_size == 2 and v.reference.config.recompute == "selective"
    assert v.deciding_term == "recompute"


def test_estimate_cli_prints_stages_and_a_verdict(capsys):
    assert main(["estimate", "--model", "llama-65b", "--tp", "8", "--pp", "4", "--global-batch", "32",
                 "--attention", "naive", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "LLaMA-65B" in out and "fits: yes" in out and "BPipe" in out
    assert main(["estimate", "--family", "gpt", "--layers", "8", "--hidden", "256", "--heads", "4", "--seq", "128",
                 "--pp", "2", "--num-microbatches", "4", "--device", "h100-sxm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 2 and data["fits"] is True and data["bpipe"]["speedup"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--layers", "3"],
        ["estimate", "--model", "nope"],
        ["estimate", "--model", "gpt3-175b", "--pp", "200"],
        ["estimate", "--model", "gpt3-175b", "--efficiency", "x"],
        ["estimate", "--model", "gpt3-175b", "--global-batch", "7", "--microbatch-size", "2"],
    ],
)
def test_estimate_cli_bad_input_is_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("traceana: error:") and err.count("\n") == 1


@pytest.mark.slow
def test_the_verdict_reports_progress_over_every_simulation_and_keeps_none(monkeypatch):
    """on_progress counts every simulated configuration (counted here by wrapping the simulator itself) up to the
    total it announced (which grows only by the flip search's few), and the verdict is the one given without a
    callback. Each simulation is dropped once its estimate is taken: at most one lives at a time (counted by weak references), so memory does not grow with the
    number of configurations times their micro-batches (m = 10^5 had reached 2.3 GB)."""
    import gc
    import weakref

    from traceana.model import bpipe as bpipe_module

    cfg = TrainingConfig(model=MODELS["llama-7b"], pp=4, tp=1, microbatch_size=1, num_microbatches=16,
                         attention="naive")
    dev = Device("between", 60 * 2**30, 312e12, "test")
    quiet = bpipe_verdict(cfg, device=dev)
    real, calls, alive, most = bpipe_module._estimate, [], [], [0]

    def counted(*a, **k):
        est, sim = real(*a, **k)
        calls.append(1)
        gc.collect()
        alive[:] = [r for r in alive if r() is not None]
        most[0] = max(most[0], len(alive))
        alive.append(weakref.ref(sim))
        return est, sim

    monkeypatch.setattr(bpipe_module, "_estimate", counted)
    seen = []
    v = bpipe_verdict(cfg, device=dev, on_progress=lambda done, total: seen.append((done, total)))
    assert [d for d, _ in seen] == list(range(1, len(calls) + 1))
    totals = [t for _, t in seen]  # the flip search announces its few simulations as it goes
    assert totals == sorted(totals) and totals[-1] == len(calls) and all(t >= d for d, t in seen)
    assert most[0] <= 3  # the three the terms are decomposed from, nothing kept from the search
    assert (v.helps, v.speedup, v.sentence) == (quiet.helps, quiet.speedup, quiet.sentence)
