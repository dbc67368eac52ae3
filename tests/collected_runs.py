"""Tiny real runs collected once per test session (shared by pytest-xdist workers through a file lock).

Use the ``collected_run`` fixture from tests/conftest.py: ``run_dir = collected_run("1f1b_bpipe")``.
Every run: tiny model, 4 stages (pp=2 where noted), 4 micro-batches of 1 sequence, 1 warm-up + 1 profiled step
(2 where noted).
"""

from __future__ import annotations

import shutil
from pathlib import Path

RUNS = {
    # name: CollectConfig keyword arguments
    "1f1b": dict(preset="tiny-gpt", pp=4, microbatches=4, microbatch_size=1, schedule="1f1b"),
    "1f1b_bpipe": dict(preset="tiny-gpt", pp=4, microbatches=4, microbatch_size=1, schedule="1f1b", bpipe=True),
    "gpipe": dict(preset="tiny-gpt", pp=4, microbatches=4, microbatch_size=1, schedule="gpipe"),
    "gpipe_llama_recompute": dict(preset="tiny-llama", pp=2, microbatches=2, microbatch_size=1, schedule="gpipe",
                                  recompute="selective", attention="sdpa"),
    # two profiled steps: validate measures memory on the steps after the first (the first profiled step's
    # activation peak reads ~0.4 MB higher on stages 1-3, see docs/model.md "Memory: model against measurement")
    # (and the check: pp=4, m=8, 2 sequences per micro-batch)
    "1f1b_m8": dict(preset="tiny-gpt", pp=4, microbatches=8, microbatch_size=2, schedule="1f1b", steps=2),
    "1f1b_m8_bpipe": dict(preset="tiny-gpt", pp=4, microbatches=8, microbatch_size=2, schedule="1f1b", bpipe=True,
                          steps=2),
}


def build(name: str, root: Path) -> Path:
    """Collect ``name`` into ``root/name`` unless another worker already did (atomic rename marks it done)."""
    from filelock import FileLock

    from collectors.launch import collect
    from collectors.trainer.config import CollectConfig

    if name not in RUNS:
        raise KeyError(f"unknown collected run {name!r}; known: {', '.join(RUNS)}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (final / "run.json").is_file():
            tmp = root / f".{name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            collect(CollectConfig(**{"steps": 1, "warmup_steps": 1, **RUNS[name]}), tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    return final
