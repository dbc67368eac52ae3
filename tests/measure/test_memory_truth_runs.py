"""The measured activation peak of real collected runs against bytes counted outside the trace.

Truth: the reference trainer's own stage modules (collectors.trainer.model.Stage, the run's shapes) run one
micro-batch's forward in this process under ``torch.autograd.graph.saved_tensors_hooks``, which counts every
storage autograd saves for backward once, without parameters and buffers: S(stage) bytes per micro-batch. Nothing
of the trace or of traceana's memory code is used for it.

Why a band, and its width, by hand. 1F1B with m ≥ p − s: stage s has run k = p − s forwards when its first
backward starts, and the k saved sets are then all alive and were all allocated in the step and are freed in it:
the activation peak is at least k·S. Beyond them, at most, one layer's backward working memory (naive attention: up
to four a·s²·b fp32 buffers — the gradients of the probabilities, of the masked and of the scaled scores, and
softmax's temporary), the k stage outputs the runner holds, the incoming gradient, the outgoing input gradient and
the gradient flowing through the layer ((k + 3)·b·s·h fp32), and on the last stage the logits' gradient and
log-softmax's (2·b·s·V fp32). For tiny-gpt at b = 1 that is 0.33–0.43 MiB on 0.7–2.5 MiB of saved activations.
The old rule (peak − step start) fails the lower bound where the peak comes before this step's gradients exist
(pp 3, m 3, stage 0: 2.40 MiB < 3 · 0.95 MiB), and counting the stage's gradients (~0.6 MiB) would pass the upper.

BPipe (pp 4, m 4, pair (0, 3)): the evictor keeps ceil((p + 1)/2) = 3 of its 4 micro-batches (BPipe, Kim et al.
2023), the acceptor holds its own one and the one evicted: the evicted bytes are the evictor's saved storages less
its input (the pipeline holds it) and storages under collectors.bpipe.MIN_EVICT_BYTES (not worth a message), as the
collector's docstring says; both sides' buffers are the step's transient memory.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from collectors.bpipe import MIN_EVICT_BYTES  # noqa: E402
from collectors.trainer.model import GPT, Stage  # noqa: E402
from traceana.ingest.run_dir import load_run  # noqa: E402
from traceana.measure.analysis import analyze  # noqa: E402
from traceana.model.presets import TINY_MODELS  # noqa: E402

FP32 = 4


def saved_per_microbatch(preset: str, pp: int, stage: int, b: int, *, evictable: bool = False) -> int:
    """Bytes autograd saves for one micro-batch's backward on ``stage`` (each storage once, no parameters or
    buffers); ``evictable``: less the stage's input and storages under MIN_EVICT_BYTES (what BPipe moves)."""
    shape = TINY_MODELS[preset]
    module = Stage(GPT(shape, attention="naive", recompute_mode="none"), stage=stage, stages=pp)
    state = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    if stage == 0:
        x = torch.zeros(b, shape.seq, dtype=torch.int64)
    else:
        x = torch.randn(b, shape.seq, shape.hidden, requires_grad=True)
    target = torch.zeros(b, shape.seq, dtype=torch.int64) if stage == pp - 1 else None
    skip = state | ({x.untyped_storage().data_ptr()} if evictable else set())
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip and not (evictable and s.nbytes() < MIN_EVICT_BYTES):
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, target)
    return sum(seen.values())


def allowance(preset: str, b: int, k: int, last: bool) -> int:
    """Bytes alive at the peak beyond the saved activations, at most (the module docstring's arithmetic)."""
    sh = TINY_MODELS[preset]
    return FP32 * (4 * sh.heads * sh.seq**2 * b + (k + 3) * b * sh.seq * sh.hidden + (2 * b * sh.seq * sh.vocab
                                                                                        if last else 0))


def measured(run_dir) -> dict[int, list[int]]:
    """The activation peak of every profiled step, per stage (traceana's stage_memory)."""
    sm = analyze(load_run(run_dir, cache=False)).stage_memory
    return {s: sm.filter(sm["stage"] == s)["activation_peak_bytes"].to_list() for s in sorted(set(sm["stage"]))}


@pytest.mark.parametrize("name,pp,m", [("1f1b_pp3_m3", 3, 3), ("1f1b", 4, 4)])
def test_1f1b_activation_peak_holds_the_saved_activations_in_flight(collected_run, name, pp, m):
    got = measured(collected_run(name))
    assert sorted(got) == list(range(pp))
    for s, peaks in got.items():
        k = min(pp - s, m)
        low = k * saved_per_microbatch("tiny-gpt", pp, s, 1)
        high = low + allowance("tiny-gpt", 1, k, s == pp - 1)
        for p in peaks:
            assert low <= p <= high, f"stage {s}: {p / 2**20:.3f} MiB, truth {low / 2**20:.3f}–{high / 2**20:.3f}"


def test_bpipe_activation_peak_holds_what_each_partner_keeps(collected_run):
    pp = 4
    got = measured(collected_run("1f1b_bpipe"))
    evicted = saved_per_microbatch("tiny-gpt", pp, 0, 1, evictable=True)
    holds = {  # stage: (saved bytes alive at its peak, micro-batches in flight for the allowance)
        0: (3 * saved_per_microbatch("tiny-gpt", pp, 0, 1), 3),
        1: (3 * saved_per_microbatch("tiny-gpt", pp, 1, 1), 3),
        2: (2 * saved_per_microbatch("tiny-gpt", pp, 2, 1), 2),
        3: (saved_per_microbatch("tiny-gpt", pp, 3, 1) + evicted, 1),
    }
    for s, (low, k) in holds.items():
        high = low + allowance("tiny-gpt", 1, k, s == pp - 1)
        for p in got[s]:
            assert low <= p <= high, f"stage {s}: {p / 2**20:.3f} MiB, truth {low / 2**20:.3f}–{high / 2**20:.3f}"
