"""Where a C compiler is there, the native scanner was built: setup.py marks it optional (an install without a
compiler still works, on the general decoder), so a scanner that stopped compiling would otherwise go unnoticed,
its tests skipped and every ingest quietly on the slower path."""

from __future__ import annotations

import shutil
import sysconfig

import pytest

from traceana.ingest.kineto import native_available


def test_the_scanner_is_built_where_a_compiler_is():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the general decoder is the documented fallback")
    assert native_available(), (f"{cc} is installed but traceana/ingest/_scan.c was not built: reinstall with "
                                "`pip install -v -e .` and read the compiler's error")
