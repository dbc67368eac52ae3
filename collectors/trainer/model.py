"""A Transformer you can read in one sitting (after nanoGPT), cut into pipeline stages.

Two block families:
- ``gpt``: pre-LayerNorm, GELU MLP (Radford et al. 2019; nanoGPT's model.py).
- ``llama``: pre-RMSNorm, SwiGLU MLP, rotary position embeddings, optional grouped-query attention
  (Touvron et al. 2023, §2; RoPE: Su et al. 2021; GQA: Ainslie et al. 2023).

Attention ``naive`` materialises the s×s scores and their softmax (as non-flash kernels do; this is what makes
activation memory grow with s²); ``sdpa`` calls ``scaled_dot_product_attention`` (flash-style on CUDA).

Recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):
``full`` checkpoints each block, ``selective`` checkpoints only the attention core (scores → softmax → ·V), which holds
the s² activations but few FLOPs. Recomputation during backward is annotated ``PP:{stage}RECOMPUTE{mb}``.

Inside the stage runner's passes each block's forward, backward and recompute is a span of its own naming the
block's index in the whole model (``PP:{stage}F{mb}/L{layer}``, ``…B…/L…``, ``…RECOMPUTE…/L…``:
``collectors.annotations.layer``); outside them (the single-process reference) nothing is added.

The whole model is built on every rank from one seed and each stage keeps its slice, so a pipeline run and a
single-process run start from identical weights (the tests compare their gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from collectors import annotations as ann
from traceana.core import names
from traceana.core.manifest import ModelShape
from traceana.core.pipeline_rules import stage_layer_ranges


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), LLaMA's normalisation."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings (Su et al. 2021, eq. 34), shape (seq, head_dim/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of a (batch, heads, seq, head_dim) tensor."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: str) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) tensors."""
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # the s×s matrix flash attention never stores
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return probs @ v


class Recompute:
    """Runs a function under activation checkpointing and annotates its re-run during backward.

    ``stage_label(action)`` is set by the pipeline executor while a backward runs, so a recomputation nested in B
    gets ``PP:{stage}RECOMPUTE{mb}``.
    """

    label_during_backward: Callable[[], object] | None = None

    def __call__(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        def annotated(*a: torch.Tensor) -> torch.Tensor:
            ctx = Recompute.label_during_backward() if Recompute.label_during_backward else None
            if ctx is None:
                return fn(*a)
            inner = ann.layer(layer, names.RECOMPUTE) if layer is not None else None
            with ctx:
                if inner is None:
                    return fn(*a)
                with inner:  # the block's share: PP:{stage}RECOMPUTE{mb}/L{layer}
                    return fn(*a)

        return checkpoint(annotated, *args, use_reentrant=False)


recompute = Recompute()


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, *, attention: str, selective: bool, layer: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.n_kv_heads, shape.head_dim
        self.rope = shape.family == "llama"
        bias = shape.family == "gpt"
        self.q = nn.Linear(shape.hidden, self.heads * self.head_dim, bias=bias)
        self.kv = nn.Linear(shape.hidden, 2 * self.kv_heads * self.head_dim, bias=bias)
        self.proj = nn.Linear(shape.hidden, shape.hidden, bias=bias)
        self.attention, self.selective = attention, selective
        if self.rope:
            cos, sin = rope_tables(shape.seq, self.head_dim)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = apply_rope(q, self.cos[:s], self.sin[:s]), apply_rope(k, self.cos[:s], self.sin[:s])
        if self.kv_heads != self.heads:  # grouped-query attention: each K/V head serves heads/kv_heads queries
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        core = lambda q, k, v: attention_core(q, k, v, kind=self.attention)  # noqa: E731
        y = recompute(core, q, k, v, layer=self.layer) if self.selective else core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.swiglu = shape.family == "llama"
        bias = not self.swiglu
        self.up = nn.Linear(shape.hidden, shape.ffn_dim * (2 if self.swiglu else 1), bias=bias)
        self.down = nn.Linear(shape.ffn_dim, shape.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:  # SwiGLU (Shazeer 2020): silu(x W) ⊙ (x V)
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, *, attention: str, recompute_mode: str, layer: int | None = None) -> None:
        super().__init__()
        norm = nn.LayerNorm if shape.family == "gpt" else RMSNorm
        self.layer = layer  # the block's index in the whole model (its spans' /L{layer})
        self.norm1, self.norm2 = norm(shape.hidden), norm(shape.hidden)
        self.attn = Attention(shape, attention=attention, selective=recompute_mode == "selective", layer=layer)
        self.mlp = MLP(shape)
        self.full_recompute = recompute_mode == "full"

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self._forward, x, layer=self.layer) if self.full_recompute else self._forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        span = ann.layer(self.layer) if self.layer is not None else None
        if span is None:  # outside a runner's pass, or no profiler recording
            return self._run(x)
        with span:  # PP:{stage}F{mb}/L{layer}; its backward's span opens at the output, closes at the input
            ann.block_input(x, self.layer)
            return ann.block_output(self._run(x), self.layer)


class GPT(nn.Module):
    """The whole model. Parameter names (``embed``, ``pos``, ``blocks.{i}``, ``norm``, ``head``) are global, so a
    stage's parameters keep the names they have here."""

    def __init__(self, shape: ModelShape, *, attention: str = "naive", recompute_mode: str = "none") -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.pos = nn.Embedding(shape.seq, shape.hidden) if shape.family == "gpt" else None
        self.blocks = nn.ModuleList(
            Block(shape, attention=attention, recompute_mode=recompute_mode, layer=i) for i in range(shape.layers)
        )
        self.norm = nn.LayerNorm(shape.hidden) if shape.family == "gpt" else RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        # GPT-2 initialisation (nanoGPT): N(0, 0.02), residual projections scaled by 1/sqrt(2·layers).
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first stage, its blocks, the final norm + head + loss on the last.
    Its blocks are the stage's share of ``layers_per_stage`` (one count a stage), else of the rules' even split."""

    def __init__(self, model: GPT, *, stage: int, stages: int, layers_per_stage: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == stages - 1
        # the blocks of this stage: layers_per_stage's split (collect --layers-per-stage), else the even one
        self.layer_ids = stage_layer_ranges(model.shape.layers, stages, layers_per_stage)[stage]
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.layer_ids})
        if self.last:
            self.norm, self.head = model.norm, model.head

    def global_named_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters under their names in the whole ``GPT`` (``blocks.{i}.…``)."""
        return {n: p for n, p in self.named_parameters()}

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:  # x: token ids (batch, seq)
            h = self.embed(x)
            if self.pos is not None:
                h = h + self.pos(torch.arange(x.shape[1], device=x.device))
            x = h
        for i in self.layer_ids:
            x = self.blocks[str(i)](x)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
