"""Single-process training of the same model on the same data: what every pipeline run must reproduce.

Micro-batches are run one after another with gradient accumulation (loss / m each), which is exactly the
arithmetic a correct pipeline performs per parameter, so the comparison can be tight.
"""

from __future__ import annotations

import torch

from collectors.trainer import data
from collectors.trainer.config import CollectConfig
from collectors.trainer.model import GPT, Stage
from collectors.trainer.train import RankResult


def train_reference(config: CollectConfig) -> RankResult:
    torch.manual_seed(config.seed)
    model = GPT(config.shape, attention=config.attention, recompute_mode=config.recompute)
    whole = Stage(model, stage=0, stages=1)  # first and last stage at once: embedding … head + loss
    optimizer = torch.optim.AdamW(whole.parameters(), lr=config.lr)
    result = RankResult(rank=0, stage=0)
    for step in range(config.total_steps):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = data.batch(seed=config.seed, step=step, num_microbatches=config.num_microbatches,
                                     microbatch_size=config.microbatch_size, seq=config.shape.seq,
                                     vocab=config.shape.vocab)
        losses = []
        for mb in range(config.num_microbatches):
            loss = whole(inputs[mb], targets[mb])
            (loss / config.num_microbatches).backward()
            losses.append(float(loss.detach()))
        optimizer.step()
        result.losses.append(sum(losses) / len(losses))
    result.grads = {n: p.grad.detach().clone() for n, p in whole.named_parameters() if p.grad is not None}
    result.params = {n: p.detach().clone() for n, p in whole.named_parameters()}
    return result
