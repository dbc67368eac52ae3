"""The memory model's per-layer activation bytes against what autograd really saves in the reference trainer's blocks.

Saved tensors are collected with torch.autograd.graph.saved_tensors_hooks and counted once per storage, without
parameters and buffers (weights are state, not activations). What the model ignores is small: LayerNorm mean/rstd,
RMSNorm's rsqrt (s·b each), the shared causal mask (s² booleans)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
trainer_model = pytest.importorskip("collectors.trainer.model")

from traceana.model import memory  # noqa: E402
from traceana.model.presets import TINY_MODELS  # noqa: E402


def saved_activation_bytes(block, x) -> int:
    state = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "small-llama"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_activation_bytes_match_autograd(preset, attention, recompute):
    shape = TINY_MODELS[preset]
    torch.manual_seed(0)
    block = trainer_model.Block(shape, attention=attention, recompute_mode=recompute)
    x = torch.randn(2, shape.seq, shape.hidden, requires_grad=True)
    measured = saved_activation_bytes(block, x)
    model = memory.layer_activation_bytes(shape, microbatch_size=2, attention=attention, recompute=recompute,
                                          activation_bytes=4, dropout=False, eager=True)
    assert model == pytest.approx(measured, rel=0.02)
    assert model <= measured  # what is ignored is only ever missing, never invented
