"""Training FLOPs of GPT- and LLaMA-style Transformers, and MFU.

Counting convention (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters using
Megatron-LM", SC'21, §5.1 and appendix): only matrix multiplications count, one multiply-accumulate = 2 FLOPs, the
backward pass costs twice the forward (input and weight gradients), and attention scores are counted over the full
s×s matrix (no causal-mask discount). For a GPT layer (h hidden, s sequence, b micro-batch, ffn 4h) the forward is

    24·b·s·h²  (Q, K, V, output projections 8bsh², MLP 16bsh²)  +  4·b·s²·h  (QKᵀ and attention·V)

so one iteration of B sequences over l layers with a vocabulary V costs

    72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h))        (their eq. (3) without recomputation)
    96·B·s·l·h² · (1 + s/(6h) + V/(16·l·h))        (eq. (3) as printed: full activation recomputation)

This module generalises the per-layer count to grouped-query attention (K and V project to kv_heads·head_dim) and to
SwiGLU MLPs (three h×ffn matrices, Shazeer 2020; LLaMA, Touvron et al. 2023 §2). Recomputation adds work that model
FLOPs do not count (Chowdhery et al. 2022, PaLM, appendix B): full recompute repeats every layer's forward, selective
recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
§5) repeats only the attention core, QKᵀ and attention·V. The logit layer is never recomputed.

MFU (PaLM appendix B) = model FLOPs per second / peak FLOP/s, where model FLOPs exclude recomputation; HFU includes it.
"""

from __future__ import annotations

from traceana.core.errors import ConfigError
from traceana.core.manifest import RECOMPUTES, ModelShape

TRAIN_MULTIPLIER = 3  # forward + backward (2× forward): Narayanan et al. 2021 §5.1; Kaplan et al. 2020 §2.1


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTES:
        raise ConfigError(f"unknown recompute {recompute!r}", fix=f"use one of {', '.join(RECOMPUTES)}")


def layer_forward_flops(model: ModelShape, *, tokens: int) -> dict[str, float]:
    """Forward FLOPs of one Transformer layer for ``tokens`` = b·s tokens, by matrix multiplication.

    Keys: ``qkv``, ``attention_core`` (QKᵀ and attention·V), ``output``, ``mlp``. With GPT shapes (MHA, ffn 4h) they sum
    to 24·b·s·h² + 4·b·s²·h (Narayanan et al. 2021 §5.1).
    """
    h, s = model.hidden, model.seq
    kv = model.n_kv_heads * model.head_dim
    mlp_matrices = 3 if model.family == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: up, down
    return {
        "qkv": 2.0 * tokens * h * (h + 2 * kv),
        # scores QKᵀ: a·(s×d)·(d×s) per sequence = 2·s²·h FLOPs; attention·V the same. With GQA the key/value heads are
        # shared, but every query head still does its own s×s products, so the core does not shrink.
        "attention_core": 2.0 * 2.0 * tokens * s * h,
        "output": 2.0 * tokens * h * h,
        "mlp": 2.0 * mlp_matrices * tokens * h * model.ffn_dim,
    }


def logit_forward_flops(model: ModelShape, *, tokens: int) -> float:
    """Forward FLOPs of the output (logit) projection h → V: 2·b·s·h·V (Narayanan et al. 2021 §5.1)."""
    return 2.0 * tokens * model.hidden * model.vocab


def recompute_forward_flops(model: ModelShape, *, tokens: int, recompute: str) -> float:
    """Extra forward FLOPs per layer that recomputation repeats before the backward (Korthikanti et al. 2022 §5)."""
    _check_recompute(recompute)
    terms = layer_forward_flops(model, tokens=tokens)
    if recompute == "full":
        return sum(terms.values())
    if recompute == "selective":
        return terms["attention_core"]
    return 0.0


def stage_flops(
    model: ModelShape,
    *,
    layers: int,
    microbatch_size: int,
    recompute: str = "none",
    first: bool = False,
    last: bool = False,
) -> float:
    """Training FLOPs (forward + backward, plus recomputation) of one micro-batch on a stage of ``layers`` layers.

    The last stage also does the logit projection (forward + backward, never recomputed). The embedding lookup on the
    first stage is a gather, not a matmul: 0 FLOPs (``first`` is accepted for symmetry). FLOPs are for the whole stage
    (all tensor-parallel ranks together). Pass ``recompute="none"`` for *model* FLOPs (MFU, PaLM appendix B) and the
    run's recompute setting for *hardware* FLOPs (HFU).
    """
    _check_recompute(recompute)
    if layers < 0 or microbatch_size <= 0:
        raise ConfigError(
            f"need layers >= 0 and microbatch_size > 0, got {layers} and {microbatch_size}",
            fix="check the stage's layer count and the micro-batch size",
        )
    del first  # no matmul in the embedding lookup
    tokens = microbatch_size * model.seq
    per_layer = TRAIN_MULTIPLIER * sum(layer_forward_flops(model, tokens=tokens).values())
    per_layer += recompute_forward_flops(model, tokens=tokens, recompute=recompute)
    total = layers * per_layer
    if last:
        total += TRAIN_MULTIPLIER * logit_forward_flops(model, tokens=tokens)
    return total


def stage_weight_gradient_flops(model: ModelShape, *, layers: int, microbatch_size: int, last: bool = False) -> float:
    """FLOPs of the weight-gradient half (W) of one micro-batch's backward on a stage: one matmul per weight matmul
    of the forward, so the forward's FLOPs without the attention core (QKᵀ and attention·V have no weights), plus
    the logit projection's on the last stage. The input-gradient half (I) is the rest of the backward. Qi et al.
    2023, Table 1: F = sbh(24h + 4s), I ("B") = sbh(24h + 8s), W = sbh·24h per GPT layer."""
    tokens = microbatch_size * model.seq
    terms = layer_forward_flops(model, tokens=tokens)
    total = layers * (sum(terms.values()) - terms["attention_core"])
    return total + (logit_forward_flops(model, tokens=tokens) if last else 0.0)


def iteration_flops(model: ModelShape, *, global_batch: int, recompute: str = "none") -> float:
    """Training FLOPs of one iteration over ``global_batch`` sequences (all layers, logits once)."""
    return stage_flops(model, layers=model.layers, microbatch_size=global_batch, recompute=recompute, last=True)


def narayanan_iteration_flops(model: ModelShape, *, global_batch: int, recompute: bool) -> float:
    """Narayanan et al. 2021 eq. (3) verbatim (GPT, MHA, ffn 4h only): a cross-check of :func:`iteration_flops`."""
    B, s, l, h, V = global_batch, model.seq, model.layers, model.hidden, model.vocab
    if recompute:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


# What each utilisation counts, said wherever one is shown (estimate, analyze, report): MFU counts the model's FLOPs
# once, recompute excluded — for GPT 72·B·s·l·h²·(1 + s/6h + V/12lh) per iteration (Narayanan et al. 2021 eq. 3;
# PaLM, Chowdhery et al. 2022, appendix B); HFU (hardware FLOPs utilisation) also counts the recomputed forward —
# 96·B·s·l·h²·(1 + s/6h + V/16lh) under full recompute, the figure Megatron-LM quotes — so it equals MFU without
# recompute and is shown only beside it when recompute is on.
MFU_COUNTS = "model FLOPs, recompute not counted (PaLM app. B; for GPT 72·B·s·l·h²·(1 + s/6h + V/12lh))"
HFU_COUNTS = ("hardware FLOPs, recompute counted (Megatron-LM's figure; for GPT under full recompute "
              "96·B·s·l·h²·(1 + s/6h + V/16lh))")


def mfu(model_flops: float, *, seconds: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, PaLM, appendix B): achieved model FLOP/s over the peak."""
    if seconds <= 0 or peak_flops <= 0 or devices <= 0:
        raise ConfigError(
            f"MFU needs positive time, peak and device count, got {seconds}, {peak_flops}, {devices}",
            fix="check the step time and the device's peak FLOP/s",
        )
    return model_flops / (seconds * peak_flops * devices)
