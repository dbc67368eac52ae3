"""Synthetic, deterministic training data: every rank derives the same batch from (seed, step).

The task is learnable (each next token is a fixed function of the current one plus noise), so the loss falls and
the run looks like training, yet needs no dataset on disk.
"""

from __future__ import annotations

import torch


def batch(*, seed: int, step: int, num_microbatches: int, microbatch_size: int, seq: int, vocab: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (num_microbatches, microbatch_size, seq), int64 token ids."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    n = num_microbatches * microbatch_size
    tokens = torch.empty(n, seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
    noise = torch.randint(4, (n, seq), generator=g)
    for t in range(seq):  # next = 3·current + 7 (+ small noise) mod vocab
        tokens[:, t + 1] = (3 * tokens[:, t] + 7 + noise[:, t]) % vocab
    shape = (num_microbatches, microbatch_size, seq)
    return tokens[:, :-1].reshape(shape), tokens[:, 1:].reshape(shape)
