"""traceana: profile and explain pipeline-parallel training from Kineto traces.

The public API for notebooks::

    import traceana
    run = traceana.load_run("runs/demo")       # events, memory, traces frames (+ run.json when present)
    result = traceana.analyze(run)              # steps, p2p, schedule, attribution, stage memory frames
    result.summary                              # the headline figures (traceana.summary)
    traceana.load_and_analyze("runs/demo")      # both, cached under the run folder, with the per-rank counts
"""

from __future__ import annotations

import os as _os
import sys as _sys

if _sys.argv[:1] == ["-m"]:  # Python is locating ``python -m traceana``: signals during its imports, one line
    from traceana import _early_signals

    _early_signals.install()

from traceana.version import __version__  # noqa: E402

# polars allocates through jemalloc and keeps freed pages 0.5-1 s (its own default) before returning them: ingest
# frees and reallocates whole columns, so the retained pages set the peak (docs/performance.md "Memory"). Returning
# them at once costs ~10% more system time and lowered the peak of a 200 MB rank by ~25%. Only takes effect when
# traceana is imported before polars; a value the user set is kept (a small run adds one arena: reading.py).
ALLOCATOR = "dirty_decay_ms:0,muzzy_decay_ms:0"
_os.environ.setdefault("_RJEM_MALLOC_CONF", ALLOCATOR)

from traceana.errors import TraceanaError  # noqa: E402


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
