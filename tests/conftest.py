from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIRD_PARTY = ROOT / "tests" / "data" / "third_party"  # in the repository (see its README: source, MIT licence)
sys.path.insert(0, str(Path(__file__).resolve().parent))
# the test folders mirror traceana's layers; a test may import a helper another folder's test defines
sys.path[1:1] = [str(d) for d in sorted(Path(__file__).resolve().parent.iterdir())
                 if d.is_dir() and d.name not in ("data", "benchmarks", "__pycache__")]


def _read_only_copy(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with no write bit anywhere: traceana treats it as read-only (no cache is written into it,
    as in a shared or archived run folder), and it never holds a cache from an earlier run of anything."""
    if not dst.exists():
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".traceana", "README.md"))
        for p in sorted(tmp.rglob("*"), reverse=True):
            p.chmod(0o555 if p.is_dir() else 0o444)
        tmp.chmod(0o555)
        try:
            os.rename(tmp, dst)
        except OSError:  # another xdist worker made it first
            shutil.rmtree(tmp, onerror=lambda f, p, e: (os.chmod(os.path.dirname(p), 0o755), f(p)))
    return dst


@pytest.fixture(autouse=True)
def _sigint_as_from_a_terminal():
    """Each test runs with SIGINT handled (KeyboardInterrupt), as a suite started from a terminal does, so that the
    children it interrupts start with SIGINT at its default. A suite started as a background job of a
    non-interactive shell (``cmd &`` in a script, nohup) inherits SIGINT ignored; Python then installs no handler,
    the children inherit the ignore, and every test that interrupts one fails (loaded run 9, docs/known-workload.md).
    traceana keeps an ignored SIGINT ignored on purpose (cli._install_signals): that is tested by setting it."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def third_party(tmp_path_factory) -> Path:
    """The third-party traces of tests/data/third_party, as a read-only copy made once per session."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    return _read_only_copy(THIRD_PARTY, root / "third-party-traces")


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


# Slow and multi-process tests are marked so that they run apart (README "Tests"): `pytest -m "not slow"` is the fast
# rest (no process of training is started), `pytest -m slow` the others; plain `pytest` (CI) runs everything.
# A test that collects a run through the fixture above starts training processes (one per rank): it is marked here,
# by its use of the fixture, rather than in each file; a test that starts them another way (collect, torchrun,
# attach's launched job) or takes more than ~5 s carries the marks itself (at module level where all of a file does).
@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    slow, multiprocess = pytest.mark.slow, pytest.mark.multiprocess
    for item in items:
        if "collected_run" in getattr(item, "fixturenames", ()):
            item.add_marker(slow)
            item.add_marker(multiprocess)
        elif item.get_closest_marker("multiprocess") is not None:
            item.add_marker(slow)  # starting training processes is slow by itself


_UNMARKED_SLOW_S = 5.0  # what "slow" means here (pyproject.toml's markers)
_unmarked_slow: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call") and report.duration > _UNMARKED_SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append((report.duration, f"{report.nodeid} ({report.when})"))


def pytest_terminal_summary(terminalreporter):
    """Name the tests outside ``slow`` that took longer than it allows (a note, not a failure: a loaded machine
    stretches every test; look at those named on an idle one)."""
    if _unmarked_slow:
        terminalreporter.write_sep("-", f"not marked slow, yet over {_UNMARKED_SLOW_S:g} s (this machine, this load)")
        for seconds, name in sorted(_unmarked_slow, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {name}")
