"""A single-process training loop whose steps are ``attach_stepfn_lib.train_step`` calls (two optimizer steps each)."""

from __future__ import annotations

import sys

import torch

from attach_stepfn_lib import train_step

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    print(f"step {step} loss {train_step(model, optimizer, torch.randn(4, 8)):.6f}", flush=True)
