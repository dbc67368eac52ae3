"""``traceana attach``: profile a chosen window of steps of an unmodified training job, in every rank.

How it gets in: the ``traceana attach`` process (``command.py``) runs the job with ``boot/`` first on
``PYTHONPATH`` and the configuration in the ``TRACEANA_ATTACH`` environment variable. Every Python interpreter the
job starts (torchrun's workers, multiprocessing children) inherits both, so ``boot/sitecustomize.py`` runs in each
before the job's own code and calls ``runtime.install()``. That imports nothing heavy: it registers post-import
hooks that, once the job itself imports them, patch

- ``torch.distributed.pipelining``'s schedules (``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step``),
- ``torch.optim`` (one global optimizer step post-hook), and
- the callable named by ``--step-fn module:qualname``, when given.

Each patch only counts steps (an integer compare per step) until the window's first step comes; then a profiler
runs for the window (``collectors.profiler.PipelineProfiler``: atomic per-rank traces) and the rank writes what it
could detect about itself to ``.attach/rank{R}.json``. ``facts.py`` turns those into ``run.json``.

This module holds what both sides (the launching process and the job's processes) share; it imports no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV = "TRACEANA_ATTACH"  # JSON of ``Config``; its presence is what turns the runtime on
FAIL_ENV = "TRACEANA_ATTACH_FAIL"  # tests: "start" makes the profiler's start raise, "hook" makes a step hook raise
BOOT_DIR = Path(__file__).resolve().parent / "boot"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the directory holding ``collectors/``
FACTS_DIR = ".attach"  # per-window, hidden so trace discovery skips it

_WINDOW_DIR_RE = re.compile(r"^steps(\d+)-(\d+)$")


@dataclass(frozen=True)
class Config:
    """What every process of the job is told: where to write, which steps, how steps are found."""

    out: str
    windows: tuple[tuple[int, int], ...]  # half-open [start, end) step indices, sorted, disjoint
    every: int | None = None  # repeat the last window every N steps
    warmup: int = 1  # profiler warm-up steps before each window (running, nothing kept)
    step_fn: str | None = None  # "module:qualname": a call of it starts a step
    split: bool = False  # one sub-directory per window (several windows) instead of ``out`` itself
    extra: dict = field(default_factory=dict)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Config:
        data = json.loads(text)
        data["windows"] = tuple(tuple(int(x) for x in w) for w in data["windows"])
        return cls(**data)

    def window_dir(self, start: int, end: int) -> Path:
        return Path(self.out) / window_dir_name(start, end) if self.split else Path(self.out)


def window_dir_name(start: int, end: int) -> str:
    """``steps10-11`` for the half-open window [10, 12): the first and last step it holds."""
    return f"steps{start}-{end - 1}"


def parse_window_dir(name: str) -> tuple[int, int] | None:
    """[start, end) of a ``steps{first}-{last}`` directory name, else None."""
    m = _WINDOW_DIR_RE.match(name)
    return (int(m.group(1)), int(m.group(2)) + 1) if m else None


def windows_at(config: Config):
    """The windows in order; with ``every`` the last one repeats forever."""
    yield from config.windows
    if config.every:
        start, end = config.windows[-1]
        while True:
            start, end = start + config.every, end + config.every
            yield start, end
