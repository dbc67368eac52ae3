"""Memory per pipeline stage: weights, gradients, optimizer state and saved activations.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198, §4.1, Table 2): one GPT layer with 16-bit activations and 1-byte dropout masks saves

    s·b·h·(34 + 5·a·s/h) bytes
      attention 11sbh + 5as²b: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, softmax-dropout mask as²b,
                               dropout output 2as²b, V 2sbh, output-projection input 2sbh, dropout mask sbh
      MLP       19sbh:         first linear input 2sbh, GELU input 8sbh, GELU output 8sbh, dropout mask sbh
      2 LayerNorms 4sbh:       their inputs

With tensor parallelism t the attention and MLP interiors split (24sbh/t + 5as²b/t) while LayerNorm inputs, the QKV and
MLP inputs and the dropout masks stay replicated (10sbh); sequence parallelism splits those too: sbh(34 + 5as/h)/t.

What this module adds, each derived term by term in :func:`layer_activation_terms`:
- ``ffn`` ≠ 4h and grouped-query attention (K and V are kv_heads·head_dim wide);
- flash / SDPA attention keeps no s×s tensor: only the output and one fp32 log-sum-exp per (head, token) (Dao et al.
  2022, FlashAttention §3.1; dropout is regenerated from the RNG state, no mask);
- LLaMA: RMSNorm, SwiGLU, no dropout, so no masks and the softmax output is the only s×s tensor (naive attention);
- the element size (2 bytes for bf16/fp16, 4 for the fp32 CPU trainer).
Recompute: full keeps only each layer's input (Korthikanti Table 2, "2sbh"); selective drops the s×s core (§5).

Micro-batches in flight and BPipe's holding per stage are the pipeline rules' (traceana/core/pipeline_rules.py:
``microbatches_in_flight``, ``bpipe_holding``), the same ones the trainer runs and the simulator schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceana.core.manifest import ModelShape
from traceana.core.pipeline_rules import bpipe_holding, bpipe_pairs, microbatches_in_flight
from traceana.core.training_config import TrainingConfig

LSE_BYTES = 4  # flash attention saves one fp32 log-sum-exp per (head, query token)
LOGIT_BYTES = 4  # cross-entropy keeps fp32 logits (Korthikanti et al. 2022 §4.3: "4sbv")


# --- parameters ----------------------------------------------------------------------------------------------------
def layer_params(model: ModelShape) -> int:
    """Parameters of one Transformer block.

    GPT (biases everywhere, two LayerNorms): 4h² + 4h attention, 2·h·f + f + h MLP, 4h norms = 12h² + 13h for f = 4h
    (Narayanan et al. 2021 §5.1). LLaMA (no biases, RMSNorm): h·(h + 2·kv) + h² attention, 3·h·f SwiGLU, 2h norms.
    """
    h, f, kv = model.hidden, model.ffn_dim, model.n_kv_heads * model.head_dim
    if model.family == "gpt":
        return (h * (h + 2 * kv) + (h + 2 * kv)) + (h * h + h) + (2 * h * f + f + h) + 4 * h
    return h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h


def embedding_params(model: ModelShape) -> int:
    """Token embedding V·h, plus learned positions s·h for GPT (LLaMA uses RoPE: no parameters)."""
    return model.vocab * model.hidden + (model.seq * model.hidden if model.family == "gpt" else 0)


def head_params(model: ModelShape, *, tied: bool) -> int:
    """Final norm plus the output projection h×V (a second copy on the last stage even when tied: Megatron keeps the
    embedding on both ends of the pipeline and all-reduces its gradient)."""
    norm = 2 * model.hidden if model.family == "gpt" else model.hidden
    del tied  # tied or not, the last stage holds an h×V matrix
    return norm + model.vocab * model.hidden


def stage_params(model: ModelShape, *, layers: int, first: bool, last: bool) -> int:
    n = layers * layer_params(model)
    if first:
        n += embedding_params(model)
    if last:
        n += head_params(model, tied=model.family == "gpt")
    return n


# --- activations -----------------------------------------------------------------------------------------------------
def layer_activation_terms(
    model: ModelShape,
    *,
    microbatch_size: int,
    attention: str = "sdpa",
    recompute: str = "none",
    tp: int = 1,
    sequence_parallel: bool = False,
    activation_bytes: int = 2,
    dropout: bool | None = None,
    eager: bool = False,
) -> dict[str, float]:
    """Bytes one layer saves for its backward, per micro-batch on one tensor-parallel rank, term by term.

    With GPT, MHA, ffn 4h, dropout, 2-byte activations, naive attention and t = 1 the terms sum to Korthikanti's
    sbh(34 + 5as/h). ``replicated`` terms are divided by t only with sequence parallelism.

    ``eager``: what autograd saves in the reference trainer's plain PyTorch blocks (collectors/trainer/model.py)
    where it differs from fused kernels: its RMSNorm is written out (x · rsqrt(mean(x²)) · w), so the product
    x · rsqrt is saved beside x; grouped-query K and V are repeated to all heads before the attention core, which then
    saves them at full width; with as many K/V heads as query heads the core saves the rotated K and V, a view that
    keeps the whole fused K/V projection output alive; SDPA's output and the projection input are separate tensors
    when Q was rotated. tests/model/test_model_autograd.py checks these terms against what autograd really saves.
    """
    b, s, h, a, f = microbatch_size, model.seq, model.hidden, model.heads, model.ffn_dim
    e = activation_bytes
    sbh = s * b * h
    kv_frac = model.n_kv_heads / model.heads
    drop = (model.family == "gpt") if dropout is None else dropout
    split = tp
    repl = tp if sequence_parallel else 1

    if recompute == "full":
        # Only the layer's input survives the forward (Korthikanti Table 2: 2sbh; sharded by sequence parallelism).
        return {"layer_input": e * sbh / repl}

    terms: dict[str, float] = {}
    # Norm inputs (LayerNorm / RMSNorm backward needs x; mean/rstd are O(s·b), ignored as in Korthikanti).
    terms["norm_inputs"] = 2 * e * sbh / repl
    terms["qkv_input"] = e * sbh / repl
    terms["q"] = e * sbh / split
    terms["k_v"] = 2 * e * sbh * kv_frac / split
    if eager and model.family == "llama":
        terms["rmsnorm_normalized"] = 2 * e * sbh / repl
        # repeated K, V (Th each); or rotated K (Th) + the K/V projection output kept alive by V's view (2Th)
        terms["k_v"] = (2 if model.n_kv_heads < model.heads else 3) * e * sbh / split
    terms["out_proj_input"] = e * sbh / split  # the attention output (flash keeps it as its own output too)
    if attention == "naive" and recompute != "selective":
        # softmax output (a·s²·b elements); with dropout also its 1-byte mask and the dropped-out copy that the
        # attention·V product saves. Without dropout the softmax output is what attention·V saves: one copy.
        terms["softmax_out"] = e * a * s * s * b / split
        if drop:
            terms["softmax_dropout_mask"] = a * s * s * b / split
            terms["softmax_dropout_out"] = e * a * s * s * b / split
    elif attention == "sdpa" and recompute != "selective":  # selective re-runs the core: keeps only q, k, v
        terms["softmax_lse"] = LSE_BYTES * a * s * b / split
        if eager and model.family == "llama":
            # The rotated Q is (b, a, s, d)-contiguous, so SDPA's saved output is too and the output projection's
            # input (b, s, h) is a separate copy. (GPT's Q is a transposed view, the output comes out (b, s, a, d)
            # and the projection input is a view of it: one tensor.)
            terms["attention_output"] = e * sbh / split
    if model.family == "gpt":
        terms["mlp_input"] = e * sbh / repl
        terms["gelu_input"] = e * s * b * f / split
        terms["gelu_output"] = e * s * b * f / split  # input of the second linear
    else:
        # SwiGLU: down(silu(gate(x)) · up(x)). Saved: x (shared input of gate and up), gate(x) for silu's backward,
        # up(x) and silu(gate(x)) for the product's backward, and the product as the down projection's input.
        terms["mlp_input"] = e * sbh / repl
        terms["swiglu_gate_up_act_prod"] = 4 * e * s * b * f / split
    if drop:
        terms["dropout_masks"] = 2 * sbh / repl  # after attention and after the MLP, 1 byte each
    return terms


def layer_activation_bytes(model: ModelShape, **kwargs) -> float:
    return sum(layer_activation_terms(model, **kwargs).values())


def korthikanti_layer_bytes(model: ModelShape, *, microbatch_size: int, tp: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2 verbatim (GPT, MHA, ffn 4h, naive attention): a cross-check."""
    s, b, h, a, t = model.seq, microbatch_size, model.hidden, model.heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    core = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)


def stage_extra_activation_bytes(cfg: TrainingConfig, *, first: bool, last: bool) -> float:
    """Per micro-batch activations outside the Transformer layers (Korthikanti et al. 2022 §4.3).

    First stage: the embedding dropout mask (GPT). Last stage: the final norm's input, the logit projection's input and
    fp32 logits for the cross-entropy (4·s·b·V, split by tensor parallelism).
    """
    m, b, e = cfg.model, cfg.microbatch_size, cfg.precision.activation_bytes
    sbh = m.seq * b * m.hidden
    repl = cfg.tp if cfg.sequence_parallel else 1
    extra = 0.0
    if first and cfg.has_dropout:
        extra += sbh / repl
    if last:
        extra += 2 * e * sbh / repl + LOGIT_BYTES * m.seq * b * m.vocab / cfg.tp
        if cfg.eager and m.family == "llama":
            extra += e * sbh / repl  # the written-out RMSNorm's x · rsqrt
    return extra


# --- per stage ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """Memory of one pipeline device, in bytes, on one tensor/data-parallel rank."""

    stage: int
    layers: int
    params: int  # parameters on this rank (after tensor parallelism)
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_per_microbatch: float  # one micro-batch through all of this device's layers (+ stage extras)
    in_flight: float  # micro-batches of its own the device holds at its peak
    foreign_in_flight: float  # micro-batches accepted from its BPipe partner
    activation_bytes: float  # peak saved activations
    recompute_working_bytes: float  # one layer re-materialised during the backward (full recompute)
    backward_working_bytes: float = 0.0  # gradient tensors of one layer's backward (``backward_working_bytes``)

    @property
    def state_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_peak_bytes(self) -> float:
        """Activation memory at the stage's peak: saved activations in flight (own and accepted) plus one layer's
        recompute and backward working memory; what ``validate`` compares with the measured activation peak."""
        return self.activation_bytes + self.recompute_working_bytes + self.backward_working_bytes

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_peak_bytes


def estimate_stage_memory(cfg: TrainingConfig) -> tuple[StageMemory, ...]:
    """Peak memory of every pipeline device for a configuration (see the module docstring for the rules)."""
    model, p = cfg.model, cfg.pp
    layers = cfg.stage_layers()
    kw = dict(
        microbatch_size=cfg.microbatch_size,
        attention=cfg.attention,
        tp=cfg.tp,
        sequence_parallel=cfg.sequence_parallel,
        activation_bytes=cfg.precision.activation_bytes,
        dropout=cfg.has_dropout,
        eager=cfg.eager,
    )
    per_layer = layer_activation_bytes(model, recompute=cfg.recompute, **kw)
    full_layer = layer_activation_bytes(model, recompute="none", **kw)
    # With interleaving, device s holds chunks s, s+p, …: the first chunk of the model is on device 0 and the last on
    # device p−1, as without interleaving.
    per_mb = [
        layers[s] * per_layer + stage_extra_activation_bytes(cfg, first=s == 0, last=s == cfg.last_device)
        for s in range(p)
    ]
    in_flight = [
        microbatches_in_flight(cfg.schedule, pp=p, stage=s, num_microbatches=cfg.num_microbatches,
                               virtual_stages=cfg.virtual_stages)
        for s in range(p)
    ]
    held = (bpipe_holding(cfg.schedule, pp=p, num_microbatches=cfg.num_microbatches, keep=cfg.bpipe_inflight)
            if cfg.bpipe else [(n, 0.0) for n in in_flight])
    # The reference trainer's runner keeps each in-flight micro-batch's stage output (sent downstream, needed for
    # its backward); no layer saves it. BPipe cannot evict it (collectors/bpipe.py), so it stays on the evictor.
    pinned = [
        cfg.precision.activation_bytes * model.seq * cfg.microbatch_size * model.hidden
        if cfg.eager and s < p - 1 else 0.0
        for s in range(p)
    ]
    per_mb = [x + pin for x, pin in zip(per_mb, pinned)]
    partner = {a: e for e, a in bpipe_pairs(p)} if cfg.bpipe else {}
    evicted = {e: in_flight[e] - held[e][0] for e in partner.values()}
    prec = cfg.precision
    shard = cfg.dp if cfg.distributed_optimizer else 1
    work = backward_working_bytes(cfg)
    out = []
    for s in range(p):
        params = stage_params(model, layers=layers[s], first=s == 0, last=s == cfg.last_device) / cfg.tp
        own, foreign = held[s]
        foreign_bytes = foreign * (per_mb[partner[s]] - pinned[partner[s]]) if foreign else 0.0
        foreign_bytes += evicted.get(s, 0.0) * pinned[s]  # an evictor still holds the pinned part of what it sent
        out.append(
            StageMemory(
                stage=s,
                layers=layers[s],
                params=int(params),
                weight_bytes=params * prec.weight_bytes,
                grad_bytes=params * prec.grad_bytes,
                optimizer_bytes=params * prec.optimizer_bytes / shard,
                activation_per_microbatch=per_mb[s],
                in_flight=own,
                foreign_in_flight=foreign,
                activation_bytes=own * per_mb[s] + foreign_bytes,
                recompute_working_bytes=full_layer if cfg.recompute == "full" else 0.0,
                backward_working_bytes=work,
            )
        )
    return tuple(out)


def backward_working_bytes(cfg: TrainingConfig) -> float:
    """Gradient tensors alive at once while one layer's backward runs, on top of the saved activations.

    MLP: the incoming gradient (T·h) and the gradients of the hidden activations (GELU: 2·T·f; SwiGLU: gate, up,
    product and their concatenation, 4·T·f). Attention: the incoming gradient plus, naive, the gradients of the
    probabilities and of the scores (2·a·s²·b), or, flash, the gradients of q, k and v (3·T·h). The larger one counts.
    """
    m, e = cfg.model, cfg.precision.activation_bytes
    T = cfg.microbatch_size * m.seq
    mlp = T * m.hidden + (4 if m.family == "llama" else 2) * T * m.ffn_dim
    if cfg.attention == "naive" and cfg.recompute != "selective":
        attn = T * m.hidden + 2 * m.heads * m.seq * m.seq * cfg.microbatch_size
    else:
        attn = 4 * T * m.hidden
    return e * max(mlp, attn) / cfg.tp


def activation_peak_estimate(cfg: TrainingConfig, *, grads_in_step: bool = False) -> list[float]:
    """The memory model's prediction of the measured activation peak (memory allocated and freed within the step,
    traceana.measure.memory) per stage: ``StageMemory.activation_peak_bytes``, the figure ``estimate`` prints, plus the
    gradients when they too are allocated and freed inside the measured step window.

    In flight: own micro-batches and, with BPipe, accepted ones (``pipeline_rules.bpipe_holding``, which the reference
    collector's acceptor follows). Gradients count only when they are transient in the measured window
    (``grads_in_step``): a loop that calls zero_grad(set_to_none=True) after optimizer.step() and before
    profiler.step(). Where zero_grad comes at the top of the iteration (the reference trainer, torch pipelining) the
    new gradients outlive the step and the old ones existed before it: neither is an activation.
    """
    return [st.activation_peak_bytes + (st.grad_bytes if grads_in_step else 0.0) for st in estimate_stage_memory(cfg)]


# Memory a training process needs beyond the model's terms: the CUDA context, the allocator's fragmentation and
# cached blocks, NCCL and cuBLAS workspaces. Without a figure of the user's, 10 % of the device is kept free.
DEFAULT_RESERVE_FRACTION = 0.10


def reserve_bytes(device_bytes: float, reserve: float | None = None) -> float:
    """The memory kept free on a device: ``reserve`` bytes when given, else DEFAULT_RESERVE_FRACTION of it."""
    return DEFAULT_RESERVE_FRACTION * device_bytes if reserve is None else reserve


# How far the memory model's activation peak has been off on measured runs (docs/model.md, "Memory: model against
# measurement", tests/validation/test_memory_model_runs.py): within 4.2 % on every stage of every collected run without
# full recompute; with full recompute up to +34.3 % (it adds a whole re-materialised layer that the measurement frees as
# its backward proceeds). The weights, gradients and optimizer state are exact arithmetic and carry no such error. A
# verdict whose deciding configuration is closer to the fit line than this says so (model.bpipe).
ACTIVATION_MODEL_ERROR = {"none": 0.042, "selective": 0.042, "full": 0.343}


def fit_uncertainty_bytes(stage: StageMemory, *, recompute: str) -> float:
    """Bytes by which the model's total for ``stage`` may be off: its activation peak times the measured error."""
    return ACTIVATION_MODEL_ERROR[recompute] * stage.activation_peak_bytes


def fits(stages: tuple[StageMemory, ...], *, device_bytes: float, reserve: float | None = None) -> bool:
    """Whether every stage's peak (state, activations in flight, recompute and backward working memory) fits in the
    device memory minus the reserve (``reserve_bytes``: 10 % unless given)."""
    return all(st.total_bytes <= device_bytes - reserve_bytes(device_bytes, reserve) for st in stages)
