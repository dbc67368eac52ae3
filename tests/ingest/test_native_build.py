"""Where a C compiler is there, the native scanner was built: setup.py marks it optional (an install without a
compiler still works, on the general decoder), so a scanner that stopped compiling would otherwise go unnoticed,
its tests skipped and every ingest quietly on the slower path. A scanner built from another _scan.c (an editable
install not rebuilt after a pull) is not used, and the user is told why."""

from __future__ import annotations

import shutil
import sysconfig
import types
import warnings
import zlib

import pytest

from traceana.ingest import reading, run_dir
from traceana.ingest.kineto import native_available


def test_the_scanner_is_built_where_a_compiler_is():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the general decoder is the documented fallback")
    assert native_available(), (f"{cc} is installed but traceana/ingest/_scan.c was not built: reinstall with "
                                "`pip install -v -e .` and read the compiler's error")

    assert reading.SCANNER_STALE is None, reading.SCANNER_STALE


def test_a_scanner_built_from_another_source_is_stale(tmp_path):
    source = tmp_path / "_scan.c"
    source.write_bytes(b"int scan(void) { return 1; }\n")
    crc = zlib.crc32(source.read_bytes())  # what setup.py builds in, computed here from the bytes
    assert reading.stale_scanner(types.SimpleNamespace(SOURCE_CRC=crc), source) is None
    for built in (types.SimpleNamespace(SOURCE_CRC=crc ^ 1), types.SimpleNamespace()):  # other source; before CRCs
        why = reading.stale_scanner(built, source)
        assert why and "rebuild" in why and "_scan.c" in why
    assert reading.stale_scanner(types.SimpleNamespace(), tmp_path / "absent.c") is None  # a wheel: no source
    assert reading.stale_scanner(None, source) is None  # not built at all: the other message


def test_a_stale_scanner_is_named_in_the_run_notes(tmp_path, monkeypatch):
    from tracebuilder import TraceBuilder

    tb = TraceBuilder(rank=0, world_size=1)
    tb.cpu_op("aten::mm", 0, 10)
    tb.write(tmp_path / "rank0.pt.trace.json.gz")
    monkeypatch.setattr(run_dir, "SCANNER_STALE", "the native trace scanner was built from another version")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_dir.load_run(tmp_path, cache=False)
    assert any("built from another version" in w for w in run.warnings), run.warnings
