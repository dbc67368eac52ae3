"""The training step of tests/attach_stepfn_script.py, in a module of its own so ``--step-fn`` can name it."""

from __future__ import annotations

import torch


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One step = two optimizer steps on the two halves of the batch (so optimizer steps are not training steps)."""
    total = 0.0
    for half in x.chunk(2):
        loss = (model(half) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total
