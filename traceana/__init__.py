"""traceana: profile and explain pipeline-parallel training from Kineto traces.

The public API for notebooks::

    import traceana
    run = traceana.load_run("runs/demo")       # events, memory, traces frames (+ run.json when present)
    result = traceana.analyze(run)              # steps, p2p, schedule, attribution, stage memory frames
"""

from __future__ import annotations

__version__ = "0.1.0"

from traceana.errors import TraceanaError  # noqa: E402


def __getattr__(name: str):  # lazy: importing traceana stays cheap
    if name == "load_run":
        from traceana.ingest.run_dir import load_run

        return load_run
    if name == "analyze":
        from traceana.analysis import analyze

        return analyze
    raise AttributeError(name)


__all__ = ["TraceanaError", "load_run", "analyze", "__version__"]
