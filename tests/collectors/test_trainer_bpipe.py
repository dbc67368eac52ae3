"""BPipe's eviction mechanics in one process, with a loopback transport standing in for the partner rank."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from collectors.bpipe import Evictor  # noqa: E402
from traceana.core.pipeline_rules import BPipePlan  # noqa: E402
from collectors.trainer.config import PRESETS  # noqa: E402
from collectors.trainer.model import GPT, Stage  # noqa: E402

# micro-batch 0 leaves once; the tests drive evict/load by hand
_ONE_EVICTION = BPipePlan(evictor=0, acceptor=1, keep=1, evict_before={}, load_before={}, accept_after={},
                          return_after={}, order=(0,))


class Loopback:
    """isend keeps a copy of the bytes, irecv hands them back: a partner that stores and returns."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}
        self.sent_bytes = 0
        self.messages = 0

    def isend(self, tensor, dst, *, tag=0):
        self.store[tag] = tensor.detach().clone()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self.messages += 1
        return _Done(), tensor

    def irecv(self, shape, dtype, src, *, tag=0):
        store = self.store
        return type("T", (), {"wait": lambda self_: store.pop(tag)})()


class _Done:
    def wait(self) -> None:
        pass


def _stage(preset: str, attention: str, recompute: str) -> Stage:
    torch.manual_seed(0)
    return Stage(GPT(PRESETS[preset], attention=attention, recompute_mode=recompute), stage=0, stages=2)


def _input(stage: Stage, mb: int) -> torch.Tensor:
    shape = PRESETS["tiny-gpt"]
    return torch.randint(shape.vocab, (2, shape.seq), generator=torch.Generator().manual_seed(mb))


def _grads(stage: Stage) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,attention,recompute", [
    ("tiny-gpt", "naive", "none"), ("tiny-gpt", "sdpa", "selective"), ("tiny-llama", "naive", "full"),
    ("tiny-llama", "sdpa", "none"),
])
def test_evicting_and_loading_back_gives_bitwise_equal_gradients(preset, attention, recompute):
    reference = _stage(preset, attention, recompute)
    for mb in range(2):
        y = reference(_input(reference, mb))
        torch.autograd.backward(y, torch.ones_like(y))
    expected = _grads(reference)

    stage = _stage(preset, attention, recompute)
    link = Loopback()
    evictor = Evictor(stage=0, acceptor_rank=1, plan=_ONE_EVICTION, module=stage, transport=link)
    x_probe = torch.zeros(2, PRESETS[preset].seq, dtype=torch.int64)
    with evictor.capture(-1):
        y_probe = stage(x_probe)
    evictor.measure_layout(-1, held=(x_probe, y_probe))
    del y_probe
    x0 = _input(stage, 0)
    with evictor.capture(0):
        y0 = stage(x0)
    evictor.evict(0, held=(x0, y0))
    assert all(s.tensor is None for s in evictor.bundles[0].saved if s.storage_index >= 0)
    y1 = stage(_input(stage, 1))  # mb 1 computes while mb 0 is away
    torch.autograd.backward(y1, torch.ones_like(y1))
    evictor.prefetch(0)
    evictor.load(0)
    torch.autograd.backward(y0, torch.ones_like(y0))
    got = _grads(stage)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    if recompute != "full":  # full recompute saves only block inputs, held by checkpoint itself
        assert link.sent_bytes > 0


def test_parameter_views_stage_input_and_output_stay_and_shared_storages_go_once():
    stage = _stage("tiny-gpt", "sdpa", "none")
    link = Loopback()
    evictor = Evictor(stage=0, acceptor_rank=1, plan=_ONE_EVICTION, module=stage, transport=link)
    x = _input(stage, 0)
    with evictor.capture(0):
        y = stage(x)
    bundle = evictor.bundles[0]
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved_param_views = [s for s in bundle.saved if s.tensor.untyped_storage().data_ptr() in params]
    assert saved_param_views, "linear layers save their weights (views such as weight.t())"
    groups = evictor._evictable(bundle, (x, y))
    leaving = {g[0].tensor.untyped_storage().data_ptr() for g in groups}
    pinned = params | {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    assert leaving and not leaving & pinned  # parameter views, stage input and output stay
    evictor.layout = [g[0].tensor.untyped_storage().nbytes() for g in groups]
    evictor.evict(0, held=(x, y))
    kept = [s for s in bundle.saved if s.tensor is not None]
    gone = [s for s in bundle.saved if s.tensor is None]
    assert all(s.storage_index < 0 for s in kept)
    assert all(s.tensor.untyped_storage().data_ptr() in params for s in saved_param_views)  # still in place
    assert link.messages == len({s.storage_index for s in gone}) < len(gone)  # views share storages: sent once


def test_an_inplace_change_to_a_saved_tensor_is_caught_before_eviction():
    stage = _stage("tiny-gpt", "naive", "none")
    evictor = Evictor(stage=0, acceptor_rank=1, plan=_ONE_EVICTION, module=stage,
                      transport=Loopback())
    x = _input(stage, 0)
    with evictor.capture(0):
        y = stage(x)
    groups = evictor._evictable(evictor.bundles[0], (x, y))
    evictor.layout = [g[0].tensor.untyped_storage().nbytes() for g in groups]
    victim = next(g[0].tensor for g in groups if g[0].tensor.is_floating_point())
    with torch.no_grad():
        victim.add_(1.0)  # what autograd's version counter would have caught without hooks
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        evictor.evict(0, held=(x, y))
