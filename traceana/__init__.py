"""traceana: profile and explain pipeline-parallel training from Kineto traces.

The public API for notebooks::

    import traceana
    run = traceana.load_run("runs/demo")       # events, memory, traces frames (+ run.json when present)
    result = traceana.analyze(run)              # steps, p2p, schedule, attribution, stage memory frames
    result.summary                              # the headline figures (traceana.measure.summary)
    traceana.diagnose(result)                   # the summary with the what-if's straggler, bottleneck, critical path
    traceana.load_and_analyze("runs/demo")      # both, cached under the run folder, with the per-rank counts
    traceana.what_if(result, set=["stage=1:forward*0.5"])  # traceana whatif (docs/python.md)
"""

from __future__ import annotations

import sys as _sys


def _located_as_program() -> bool:
    """Whether Python is locating ``python -m traceana`` right now (``sys.argv[0]`` is "-m" only until the module
    runs) — not another ``python -m`` program whose package imports traceana, which keeps its own signal handlers —
    or running the ``traceana`` console script pip writes (``from traceana.cli import main``: the script is
    ``__main__`` and ``sys.argv[0]``, and its imports took ~0.3 s before cli.main took the signals over)."""
    if _sys.argv[:1] != ["-m"]:
        script = getattr(_sys.modules.get("__main__"), "__file__", None)
        return bool(script) and script == _sys.argv[0] and script.replace("\\", "/").rsplit("/", 1)[-1] in (
            "traceana", "traceana-script.py")
    args = list(getattr(_sys, "orig_argv", ()))
    at = next((i for i, a in enumerate(args) if a.startswith("-m")), None)
    if at is None:
        return False
    target = args[at][2:] or (args[at + 1] if at + 1 < len(args) else "")
    return target == "traceana"


if _located_as_program():  # signals during the program's own imports: one line, its exit code
    from traceana import _early_signals

    _early_signals.install()

from traceana.version import __version__  # noqa: E402

# Importing traceana changes nothing in the host process (a notebook, a training job under attach): no environment
# variable, no thread, no exit handler. The ``traceana`` program's own performance settings (the allocator's decay,
# one polars thread for a small run, the deferred standard library, the quick exit) are made by its entry point,
# traceana.cli.main, in traceana's own process only.
from traceana.core.errors import TraceanaError  # noqa: E402


# The public names, each imported on first use (``import traceana`` stays cheap: no polars until one is read;
# tests/package/test_import_hygiene.py). name -> module that defines it.
_PUBLIC = {
    "load_run": "traceana.ingest.run_dir",  # a run directory (or one trace) -> Run: events, memory, traces, run.json
    "analyze": "traceana.measure.analysis",  # Run -> Analysis
    # both, cached under the run folder, as traceana analyze does
    "load_and_analyze": "traceana.measure.analysis_cache",
    "Analysis": "traceana.measure.analysis",
    "Run": "traceana.ingest",
    "RunSummary": "traceana.measure.summary",  # Analysis.summary: the headline figures and the per-stage table
    "diagnose": "traceana.causal.diagnosis",  # Analysis -> its summary with the what-if's straggler and bottleneck
    # Analysis.config: the run's configuration, each fact with where it came from
    "RunConfig": "traceana.core.run_config",
    # several runs side by side (traceana report's comparison): a Comparison, which unpacks as (overview, per_stage)
    "compare_runs": "traceana.results",
    "validate": "traceana.results",  # the model replayed with a run's own durations, against the run
    "what_if": "traceana.results",  # traceana whatif: the step replayed with changes, or under another plan
    "WhatIfResult": "traceana.results",
    "Comparison": "traceana.results",
    "ValidationResult": "traceana.results",
    # HTA's GPU views of an Analysis: kernel types, overlap, idle split, top kernels
    "gpu_views": "traceana.measure.gpu",
    "load_rules": "traceana.core.names",  # a name rules file (docs/naming.md) -> NameRules, for names=
}

__all__ = ["TraceanaError", "__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # (found directly the next time)
        return value
    raise AttributeError(f"module 'traceana' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_")} - {"annotations"} | set(__all__))
