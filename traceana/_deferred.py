"""Standard-library modules whose code runs on first use instead of when they are imported.

``importlib.util.LazyLoader`` does this, but on Python 3.11 any attribute read runs the module, and the import
statement itself reads ``__spec__``, so a second ``import x`` ran it at once. Here the module object is the real one
(its spec, name and loader set as an import sets them), and only reading an attribute it does not have yet —
anything the module defines — runs its code, once, under a lock. A package's ``__path__`` is such an attribute too,
so importing one of its submodules runs the package first, as an eager import would. A module already imported is
left as it is.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

# Imported by polars (iceberg and cloud I/O), traceana's file helpers and its process-pool fallback, used by none of
# them in a plain analysis: ~20 ms of CPU and ~6 MB of the fixed cost (docs/performance.md "Fixed cost"); bz2 and
# lzma only to learn whether shutil may offer their archive formats (their C modules and libbz2/liblzma loaded for
# nothing: 3M instructions). Deferred only in traceana's own process (traceana.cli.main run as the program, the
# benchmark's jobs).
FOR_PROGRAM = ("importlib.metadata", "hashlib", "subprocess", "multiprocessing", "secrets", "bz2", "lzma")

_LOCK = threading.RLock()
_RUNNING: set[str] = set()


class _Deferred(types.ModuleType):
    def __getattr__(self, attr: str):
        spec = self.__spec__
        with _LOCK:  # other threads wait here until the module has run; this one may read it while it runs
            if type(self) is _Deferred and spec.name not in _RUNNING:
                _RUNNING.add(spec.name)
                if spec.submodule_search_locations is not None:
                    self.__path__ = spec.submodule_search_locations
                try:
                    spec.loader.exec_module(self)
                except BaseException:
                    sys.modules.pop(spec.name, None)  # as a failed import leaves it: the next import retries
                    raise
                finally:
                    _RUNNING.discard(spec.name)
                self.__class__ = types.ModuleType
        return object.__getattribute__(self, attr)


def defer(*names: str) -> None:
    """Put each module (not imported yet) in ``sys.modules`` with its code not yet run."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            continue
        module = importlib.util.module_from_spec(spec)
        if spec.submodule_search_locations is not None:
            del module.__path__  # read (to import a submodule) only once the package has run: see the module doc
        module.__class__ = _Deferred
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
