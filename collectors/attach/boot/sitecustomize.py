"""Started by Python in every interpreter of a job run under ``traceana attach`` (this directory is on PYTHONPATH).

Must never break the job: any failure is one line on stderr and the job runs unprofiled. A ``sitecustomize`` that
this one shadows (later on sys.path) is still run.
"""

import os
import sys


def _start() -> None:
    if not os.environ.get("TRACEANA_ATTACH"):
        return
    try:
        try:
            from collectors.attach import runtime
        except ImportError:  # the job's interpreter does not see traceana's checkout: the launcher said where it is
            root = os.environ.get("TRACEANA_ATTACH_ROOT")
            if not root:
                raise
            sys.path.append(root)
            from collectors.attach import runtime
        runtime.install()
    except Exception as e:  # noqa: BLE001 - the job must run whatever happens here
        print(f"traceana attach: not profiling this process ({type(e).__name__}: {e})", file=sys.stderr)


def _chain() -> None:
    """Run the sitecustomize this one hides, if any (a venv's or a distribution's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.machinery
        import importlib.util

        rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        print(f"traceana attach: the job's own sitecustomize failed ({type(e).__name__}: {e})", file=sys.stderr)


_chain()
_start()
