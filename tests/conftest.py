from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIRD_PARTY = ROOT.parent / "shared" / "traces" / "third_party"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def third_party() -> Path:
    if not THIRD_PARTY.is_dir():
        pytest.skip("../shared/traces/third_party is absent")
    return THIRD_PARTY


@pytest.fixture(scope="session")
def collected_run(tmp_path_factory):
    """``collected_run(name) -> Path``: a tiny real run directory (see tests/collected_runs.py for the names),
    collected once per session and shared across pytest-xdist workers. Skips when torch is not installed."""
    pytest.importorskip("torch")
    from collected_runs import build

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if base.name.startswith("popen-gw") else base) / "traceana-collected-runs"
    return lambda name: build(name, root)


@pytest.fixture(params=["native", "general"])
def decoder(request, monkeypatch) -> str:
    """Run a test with each trace decoder: the native scanner (skipped where it was not built) and the general one."""
    from traceana.ingest import kineto

    if request.param == "native" and kineto._scan is None:
        pytest.skip("the native scanner is not built here (no C compiler at install time)")
    if request.param == "general":
        monkeypatch.setattr(kineto, "_scan", None)
    return request.param
