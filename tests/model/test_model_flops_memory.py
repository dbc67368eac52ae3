"""The estimation model against hand-computed values from the cited formulas."""

from __future__ import annotations

import pytest

from traceana.core import flops
from traceana.core.errors import ConfigError
from traceana.core.manifest import ModelShape
from traceana.core.training_config import FP32_ADAM, MIXED_ADAM, MIXED_ADAM_FP32_GRAD, TrainingConfig
from traceana.model import memory
from traceana.model.presets import MODELS

GPT3 = MODELS["gpt3-175b"]
LLAMA65 = MODELS["llama-65b"]
LLAMA2_70 = MODELS["llama2-70b"]


# --- FLOPs -------------------------------------------------------------------------------------------------------
def test_gpt_layer_flops_is_24bsh2_plus_4bs2h():
    tiny = ModelShape("gpt", layers=2, hidden=8, heads=2, seq=4, vocab=10)
    # 24·1·4·64 + 4·1·16·8 = 6144 + 512
    assert sum(flops.layer_forward_flops(tiny, tokens=4).values()) == 6656
    # 2 layers × 3 × 6656 + logits 3 × 2·4·8·10
    assert flops.stage_flops(tiny, layers=2, microbatch_size=1, last=True) == 2 * 3 * 6656 + 1920
    assert flops.stage_flops(tiny, layers=2, microbatch_size=1, first=True) == 2 * 3 * 6656


def test_llama_layer_flops_counts_swiglu_and_gqa():
    tiny = ModelShape("llama", layers=1, hidden=8, heads=2, kv_heads=1, ffn=16, seq=4, vocab=10)
    terms = flops.layer_forward_flops(tiny, tokens=4)
    assert terms == {"qkv": 2 * 4 * 8 * (8 + 2 * 4), "attention_core": 512, "output": 512, "mlp": 2 * 3 * 4 * 8 * 16}
    base = 3 * 5120
    assert flops.stage_flops(tiny, layers=1, microbatch_size=1) == base
    assert flops.stage_flops(tiny, layers=1, microbatch_size=1, recompute="selective") == base + 512
    assert flops.stage_flops(tiny, layers=1, microbatch_size=1, recompute="full") == base + 5120


@pytest.mark.parametrize("recompute", [False, True])
def test_iteration_flops_matches_narayanan_eq3_for_gpt3(recompute):
    ours = flops.iteration_flops(GPT3, global_batch=1536, recompute="full" if recompute else "none")
    theirs = flops.narayanan_iteration_flops(GPT3, global_batch=1536, recompute=recompute)
    assert ours == pytest.approx(theirs, rel=1e-12)
    # Kaplan et al. 2020: training ≈ 6·N FLOPs per token (8·N with full recompute); attention adds s/(6h) ≈ 3%.
    per_token = 8 if recompute else 6
    assert theirs == pytest.approx(per_token * 175e9 * 1536 * 2048, rel=0.05)


def test_stage_flops_sums_to_iteration():
    per_stage = [flops.stage_flops(LLAMA65, layers=20, microbatch_size=2, last=s == 3) for s in range(4)]
    assert sum(per_stage) * 8 == pytest.approx(flops.iteration_flops(LLAMA65, global_batch=16))


def test_mfu_is_model_flops_over_peak_time():
    assert flops.mfu(312e12 * 0.5 * 8 * 2.0, seconds=2.0, peak_flops=312e12, devices=8) == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        flops.mfu(1.0, seconds=0, peak_flops=1.0)
    with pytest.raises(ConfigError):
        flops.stage_flops(GPT3, layers=1, microbatch_size=1, recompute="sometimes")


# --- parameters --------------------------------------------------------------------------------------------------
def test_published_parameter_counts():
    count = lambda m: memory.stage_params(m, layers=m.layers, first=True, last=True)  # noqa: E731
    assert memory.layer_params(GPT3) == 12 * 12288**2 + 13 * 12288
    assert count(GPT3) - 50257 * 12288 == pytest.approx(175e9, rel=0.005)  # one copy of the tied embedding
    assert memory.layer_params(LLAMA65) == 809_517_056
    assert count(LLAMA65) == pytest.approx(65.2e9, rel=0.005)
    assert memory.layer_params(LLAMA2_70) == 855_654_400
    assert count(LLAMA2_70) == pytest.approx(69.0e9, rel=0.005)


def test_bytes_per_param_conventions():
    assert MIXED_ADAM.bytes_per_param == 16  # ZeRO §3.1: 2 + 2 + 12
    assert MIXED_ADAM_FP32_GRAD.bytes_per_param == 18  # Megatron-LM with fp32 main_grad
    assert FP32_ADAM.bytes_per_param == 16


# --- activations (Korthikanti et al. 2022, Table 2) ---------------------------------------------------------------
SBH = 2048 * 12288  # GPT-3, b = 1


@pytest.mark.parametrize(
    "tp, sp, recompute, expected",
    [
        (1, False, "none", SBH * (34 + 80)),  # 5as/h = 5·96·2048/12288 = 80
        (8, False, "none", SBH * (10 + 3 + 10)),
        (8, True, "none", SBH * 114 // 8),
        (8, True, "selective", SBH * 34 // 8),
        (8, False, "selective", SBH * (10 + 3)),
        (1, False, "full", 2 * SBH),
    ],
)
def test_gpt_naive_activations_match_korthikanti_table2(tp, sp, recompute, expected):
    got = memory.layer_activation_bytes(GPT3, microbatch_size=1, attention="naive", recompute=recompute, tp=tp,
                                        sequence_parallel=sp)
    assert got == pytest.approx(expected)
    assert memory.korthikanti_layer_bytes(GPT3, microbatch_size=1, tp=tp, sequence_parallel=sp,
                                          recompute=recompute) == pytest.approx(expected)


def test_flash_drops_the_s_by_s_terms():
    naive = memory.layer_activation_bytes(GPT3, microbatch_size=1, attention="naive")
    flash = memory.layer_activation_bytes(GPT3, microbatch_size=1, attention="sdpa")
    assert naive == 2_868_903_936
    assert flash == 34 * SBH + 4 * 96 * 2048  # + fp32 log-sum-exp per (head, token)


def test_llama_activation_terms_by_hand():
    # norms 4sbh, qkv input 2, q 2, k+v 4 (MHA), out-proj input 2, MLP input 2 → 16sbh; SwiGLU 4 tensors of s·b·f
    # in 2 bytes = 8sbf; naive: the softmax output only (no dropout) 2·a·s²·b.
    sbh = 2048 * 8192
    naive = memory.layer_activation_bytes(LLAMA65, microbatch_size=1, attention="naive")
    assert naive == 16 * sbh + 8 * 2048 * 22016 + 2 * 64 * 2048**2
    flash = memory.layer_activation_terms(LLAMA65, microbatch_size=1, attention="sdpa")
    assert "dropout_masks" not in flash and "softmax_out" not in flash
    # GQA: Llama-2-70B's K and V are 8 of 64 heads wide.
    gqa = memory.layer_activation_terms(LLAMA2_70, microbatch_size=1, attention="sdpa")
    assert gqa["k_v"] == 2 * 2 * 4096 * 8192 / 8


def test_fp32_activations_double_the_element_bytes_but_not_masks():
    tiny = ModelShape("gpt", layers=2, hidden=16, heads=2, seq=8, vocab=32)
    t2 = memory.layer_activation_terms(tiny, microbatch_size=1, attention="naive", activation_bytes=2)
    t4 = memory.layer_activation_terms(tiny, microbatch_size=1, attention="naive", activation_bytes=4)
    for k in t2:
        assert t4[k] == (t2[k] if "mask" in k else 2 * t2[k])


# --- in flight and BPipe -------------------------------------------------------------------------------------------
def test_bpipe_pairs_balance():
    from traceana.core.pipeline_rules import bpipe_holding, bpipe_pairs

    p = 8
    held = bpipe_holding("1f1b", pp=p, num_microbatches=16)
    assert bpipe_pairs(p) == ((0, 7), (1, 6), (2, 5), (3, 4))
    totals = [own + foreign for own, foreign in held]
    # every pair (s, 7−s) holds 9 = p + 1 micro-batches: each partner ends at ⌈9/2⌉ = 5 at its peak (the acceptor
    # takes the next before it returns the last, so 5, not 4); pair (3, 4) holds 5 + 4 already: nothing moves.
    assert totals == [5, 5, 5, 5, 4, 5, 5, 5]
    assert [own for own, _ in held] == [5, 5, 5, 5, 4, 3, 2, 1]  # acceptors keep their own p − s
    assert bpipe_pairs(5) == ((0, 4), (1, 3))  # the middle stage of an odd pipeline is unpaired


def test_stage_memory_with_and_without_bpipe():
    cfg = TrainingConfig(model=LLAMA65, pp=8, tp=8, microbatch_size=1, num_microbatches=64, attention="naive")
    base = memory.estimate_stage_memory(cfg)
    bal = memory.estimate_stage_memory(cfg.replace(bpipe=True))
    assert [s.in_flight for s in base] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert max(s.activation_bytes for s in bal) < max(s.activation_bytes for s in base)
    # state: 16 B/param over the stage's parameters / tp
    s1 = base[1]
    assert s1.state_bytes == pytest.approx(16 * 10 * memory.layer_params(LLAMA65) / 8)
    assert memory.fits(base, device_bytes=1e15) and not memory.fits(base, device_bytes=1e9)


def test_config_rejects_impossible_settings():
    with pytest.raises(ConfigError):
        TrainingConfig(model=GPT3, pp=4, schedule="gpipe", bpipe=True)
    with pytest.raises(ConfigError):
        TrainingConfig(model=GPT3, pp=4, tp=7)
    with pytest.raises(ConfigError):
        TrainingConfig(model=GPT3, pp=200)


def test_eager_trainer_terms_by_hand():
    # collectors/trainer/model.py, tiny-llama (h 64, 4 heads, 2 kv heads, ffn 176), b = 2, s = 64, fp32, naive:
    # RMSNorm saves x and x·rsqrt (2 norms: 4Th), QKV input Th, rotated Q Th, repeated K and V 2Th, output-projection
    # input Th, MLP input Th, SwiGLU 4Tf, softmax output a·s²·b.
    m = MODELS["tiny-llama"]
    T, h, f = 2 * 64, 64, 176
    got = memory.layer_activation_bytes(m, microbatch_size=2, attention="naive", activation_bytes=4, eager=True)
    assert got == 4 * (10 * T * h + 4 * T * f + 4 * 64 * 64 * 2)
    # tiny-gpt without dropout: LayerNorm inputs 2Th, QKV input Th, Q Th, K/V projection output 2Th, output
    # projection input Th, MLP input Th, GELU in/out 8Th, softmax output: 16Th + a·s²·b (Korthikanti minus dropout).
    g = MODELS["tiny-gpt"]
    got = memory.layer_activation_bytes(g, microbatch_size=2, attention="naive", activation_bytes=4, eager=True,
                                        dropout=False)
    assert got == 4 * (16 * T * h + 4 * 64 * 64 * 2)


def test_tiny_presets_match_the_reference_trainer():
    trainer = pytest.importorskip("collectors.trainer.config")
    from traceana.model.presets import TINY_MODELS

    assert {k: v for k, v in trainer.PRESETS.items()} == TINY_MODELS


def test_a_runs_bpipe_keep_reaches_the_memory_model():
    # pp=4, m=8: the evictor keeps ⌈(4+1)/2⌉ = 3 by default; a run collected with --bpipe-inflight 2 keeps 2, and its
    # acceptor then holds its own 1 plus up to 3 of stage 0's (pipeline_rules.bpipe_held)
    from traceana.core.manifest import Manifest
    from traceana.core.run_config import RunConfig

    m = Manifest(world_size=4, pp=4, model=GPT3, microbatch_size=1, num_microbatches=8, schedule="1f1b",
                 bpipe=((0, 3),), extra={"bpipe_inflight": 2})
    cfg = RunConfig.from_manifest(m).training_config()
    assert cfg.bpipe_inflight == 2
    assert memory.estimate_stage_memory(cfg.replace(bpipe_inflight=None))[0].in_flight == 3
    assert memory.estimate_stage_memory(cfg)[0].in_flight == 2
    with pytest.raises(ConfigError):
        cfg.replace(bpipe_inflight=0)
