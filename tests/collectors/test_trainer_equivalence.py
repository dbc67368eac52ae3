"""The pipeline computes what single-process training computes: losses, gradients and updated parameters.

One launch per pipeline depth runs many configurations in the same worker processes (start-up dominates on a
small CPU), then each is compared with ``train_reference``: GPipe and 1F1B, GPT and LLaMA blocks, naive and SDPA
attention, no/selective/full recompute, with and without BPipe (balanced, and forced to evict harder).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from collectors.launch import launch  # noqa: E402
from collectors.trainer.config import CollectConfig  # noqa: E402
from collectors.trainer.reference import train_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
ATOL = 1e-5

BASE4 = CollectConfig(pp=4, num_microbatches=4, microbatch_size=1, steps=1, warmup_steps=0, profile=False)
CONFIGS4 = [
    BASE4,
    BASE4.replace(schedule="gpipe", recompute="full"),
    BASE4.replace(bpipe=True),  # balanced: stage 0 keeps 3 of 4 micro-batches
    BASE4.replace(preset="tiny-llama", bpipe=True, recompute="full", attention="sdpa"),
    BASE4.replace(preset="tiny-llama", bpipe=True, bpipe_inflight=1, recompute="selective"),  # both pairs evict
    BASE4.replace(bpipe=True, bpipe_inflight=2, attention="sdpa", recompute="selective"),  # (GPipe + BPipe: refused)
    BASE4.replace(preset="tiny-llama", schedule="gpipe"),
    BASE4.replace(bpipe=True, batch_p2p=True),  # the NCCL path's send/receive batching, exercised on gloo
]
BASE2 = CollectConfig(pp=2, num_microbatches=3, microbatch_size=2, steps=1, warmup_steps=0, profile=False)
CONFIGS2 = [
    # (BPipe at pp = 2 is refused: stage 0's only other resident micro-batch is always the one needed next)
    BASE2.replace(preset="tiny-llama", recompute="selective"),
    BASE2.replace(schedule="gpipe", recompute="full", attention="sdpa", batch_p2p=True),
]


def _compare(configs, results_dir) -> list[str]:
    problems = []
    for index, config in enumerate(configs):
        ref = train_reference(config)
        seen: set[str] = set()
        for rank in range(config.pp):
            got = torch.load(results_dir / f"{index}-rank{rank}.pt")
            if rank == config.pp - 1:
                if not torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref.losses), atol=ATOL, rtol=0):
                    problems.append(f"{config}: losses {got['losses']} != {ref.losses}")
            for kind in ("grads", "params"):
                for name, value in got[kind].items():
                    seen.add(name)
                    err = (value - getattr(ref, kind)[name]).abs().max().item()
                    if err > ATOL:
                        problems.append(f"{config}: {kind} of {name} differ by {err:.3g}")
        if seen != set(ref.params):
            problems.append(f"{config}: stages hold {sorted(seen ^ set(ref.params))} differently")
    return problems


@pytest.mark.parametrize("configs", [CONFIGS4, CONFIGS2], ids=["pp4", "pp2"])
def test_pipeline_training_equals_single_process_training(configs, tmp_path):
    launch(configs[0], None, results_dir=tmp_path, configs=configs, timeout_s=900)
    assert _compare(configs, tmp_path) == []


def test_bpipe_on_data_parallel_replicas_changes_no_gradient(tmp_path):
    """pp 4 × dp 2 with BPipe: each replica's stage 0 evicts to its own replica's stage 3, and every rank ends the
    step with the gradients and parameters of the same run without BPipe (whose replicas see different data, so a
    transfer to the other replica's partner would show)."""
    plain = CollectConfig(pp=4, dp=2, num_microbatches=4, microbatch_size=1, steps=1, warmup_steps=0, profile=False)
    configs = [plain, plain.replace(bpipe=True)]
    launch(configs[0], None, results_dir=tmp_path, configs=configs, timeout_s=900)
    for rank in range(8):
        want, got = (torch.load(tmp_path / f"{i}-rank{rank}.pt") for i in (0, 1))
        for kind in ("grads", "params"):
            assert want[kind].keys() == got[kind].keys()
            for name, value in got[kind].items():
                assert torch.allclose(value, want[kind][name], atol=ATOL, rtol=0), (rank, kind, name)
