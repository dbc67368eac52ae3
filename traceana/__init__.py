"""traceana: profile and explain pipeline-parallel training from Kineto traces.

The public API for notebooks::

    import traceana
    run = traceana.load_run("runs/demo")       # events, memory, traces frames (+ run.json when present)
    result = traceana.analyze(run)              # steps, p2p, schedule, attribution, stage memory frames
    result.summary                              # the headline figures (traceana.summary)
    traceana.load_and_analyze("runs/demo")      # both, cached under the run folder, with the per-rank counts
"""

from __future__ import annotations

from traceana.version import __version__

# Importing traceana changes nothing in the host process (a notebook, a training job under attach): no environment
# variable, no thread, no exit handler. The ``traceana`` program's own performance settings (the allocator's decay,
# one polars thread for a small run, the deferred standard library, the quick exit) are made by its entry point,
# traceana.cli.main, in traceana's own process only.
from traceana.errors import TraceanaError


def __getattr__(name: str):  # lazy: importing traceana stays cheap
    if name == "load_run":
        from traceana.ingest.run_dir import load_run

        return load_run
    if name == "analyze":
        from traceana.analysis import analyze

        return analyze
    if name == "load_and_analyze":
        from traceana.analysis_cache import load_and_analyze

        return load_and_analyze
    raise AttributeError(name)


__all__ = ["TraceanaError", "load_run", "analyze", "load_and_analyze", "__version__"]
