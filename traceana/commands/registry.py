"""The command registry: every ``traceana`` command once, with the module that holds it and what it offers others.

A command's module has ``add_arguments(parser)`` and ``run(args) -> int``; its module docstring is the command's
description. traceana's own commands live in ``traceana/commands/``; ``collect`` and ``attach`` in ``collectors/``
(they import torch when they run) and ``report`` and ``demo`` in ``reports/`` (holoviews). Only the module of the
command being run is imported, and only when it runs: the top-level help needs the lines below alone, and traceana
itself never imports collectors or reports (docs/architecture.md "Data flows one way").

A command may offer functions to other commands (``provides``): the demo collects its runs with ``collect``'s
``collect_run`` (``provided("collect", "collect_run")``), so reports never imports the trainer or torch itself.
Imports nothing but the standard library: building the help must stay cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from traceana.core.errors import BadInputError


@dataclass(frozen=True)
class Command:
    name: str  #: as typed: ``traceana NAME``
    module: str  #: where its add_arguments and run live
    help: str  #: its line in ``traceana -h``
    provides: tuple[str, ...] = ()  #: functions of its module other commands call (``provided``)
    needs: str | None = None  #: what its module needs beyond traceana's own dependencies, for the error without it


COMMANDS: tuple[Command, ...] = (
    Command("demo", "reports.demo_command",
            "collect a tiny CPU pipeline with and without BPipe, analyse it, write a report"),
    Command("collect", "collectors.command",
            "run the reference pipeline trainer under the profiler and write a run directory",
            provides=("collect_run",), needs="collect"),
    Command("analyze", "traceana.commands.analyze",
            "attribute each stage's step time (compute, P2P, BPipe, bubbles)"),
    Command("merge", "traceana.commands.merge",
            "merge all ranks into one Perfetto trace with phase and bubble tracks"),
    Command("report", "reports.command", "render a self-contained HTML report of one or more runs"),
    Command("estimate", "traceana.commands.estimate", "estimate memory per stage, step time and BPipe's benefit"),
    Command("validate", "traceana.commands.validate", "compare the model's estimate with what a run measured"),
    Command("whatif", "traceana.commands.whatif",
            "replay the measured step with chosen work made ideal: who holds it back"),
    Command("describe", "traceana.commands.describe",
            "say what a run's traces show and lack, and write a run.json template for it"),
    Command("watch", "traceana.commands.watch",
            "print each profiling window's per-stage attribution as its traces land"),
    Command("attach", "collectors.attach.command",
            "profile a window of steps of an unmodified training command, every rank", needs="collect"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def load(name: str) -> ModuleType:
    """The module of command ``name`` (imported now, once). A KeyError for a name that is no command."""
    return importlib.import_module(BY_NAME[name].module)


def provided(name: str, function: str) -> Any:
    """The function ``function`` that command ``name`` offers other commands (listed in its ``provides``); a
    one-line error, not an ImportError, when that command's package is not installed."""
    command = BY_NAME[name]
    if function not in command.provides:
        raise KeyError(f"command {name!r} provides no {function!r} (it provides: {', '.join(command.provides)})")
    try:
        module = load(name)
    except ImportError as e:
        extra = f"pip install 'traceana[{command.needs}]'" if command.needs else "reinstall traceana"
        raise BadInputError(f"traceana {name} is not installed here ({e.name or e} is missing)", fix=extra) from None
    return getattr(module, function)
