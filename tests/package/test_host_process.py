"""The library leaves its host process alone (issue 28 item 5): importing traceana — or any of its library modules,
or analysing a run in process — sets no environment variable, starts no thread that outlives the call, and no
library module ends the process. Only the program's entry point (traceana/cli.py ``main`` run as ``traceana`` or
``python -m traceana``) changes its own process (docs/performance.md "Fixed cost")."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from tracebuilder import write_two_stage_run

ROOT = Path(__file__).resolve().parents[2]
# The program's entry point, the modules allowed to end its process: cli.main run as the program, and the handlers
# _early_signals installs while `python -m traceana` is being located (its signals before cli.main takes over).
ENTRY_POINTS = {"traceana/cli.py", "traceana/__main__.py", "traceana/_early_signals.py"}

HOST = """
import json, os, sys, threading
before = dict(os.environ)
import traceana
after_import = dict(os.environ)
threads_after_import = threading.active_count()
import polars  # polars itself writes its allocator defaults into _RJEM_MALLOC_CONF when it loads: the baseline
before_library = dict(os.environ)
import importlib, pkgutil
for m in pkgutil.walk_packages(traceana.__path__, "traceana."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
threads_after_library = threading.active_count()
after_library = dict(os.environ)
result = traceana.load_and_analyze(sys.argv[1], progress=False)
changed = lambda a, b: sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
print(json.dumps({"import": changed(before, after_import), "threads_import": threads_after_import,
                  "library": changed(before_library, after_library), "threads_library": threads_after_library,
                  "analysis": changed(after_library, dict(os.environ)),
                  "threads_analysis": threading.active_count(), "steps": len(result.summary.steps)}))
"""


def test_importing_and_using_traceana_changes_nothing_in_the_host_process(tmp_path):
    run = write_two_stage_run(tmp_path)
    out = subprocess.run([sys.executable, "-c", HOST, str(run)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT) + ":" + str(ROOT / "tests")})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["import"] == [] and got["library"] == [] and got["analysis"] == []  # no environment variable
    assert got["threads_import"] == got["threads_library"] == got["threads_analysis"] == 1  # only the main thread
    assert got["steps"] > 0


def test_no_library_module_ends_the_process():
    pattern = re.compile(r"\bos\._exit\b|\bsys\.exit\b|\bos\.abort\b")
    offenders = []
    for path in sorted((ROOT / "traceana").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ENTRY_POINTS:
            continue
        offenders += [f"{rel}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line.split("#")[0])]
    assert offenders == []


def test_the_program_sets_its_allocator_before_polars_and_keeps_the_users(tmp_path):
    # What the program does (and the library does not): its allocator setting, made before polars loads.
    code = ("import os; from traceana.cli import program_settings; program_settings(); "
            "print(os.environ.get('_RJEM_MALLOC_CONF'))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=env | {"_RJEM_MALLOC_CONF": "dirty_decay_ms:5"})
    assert ours.stdout.strip() == "dirty_decay_ms:0,muzzy_decay_ms:0"
    assert theirs.stdout.strip() == "dirty_decay_ms:5"


def test_a_python_m_program_importing_traceana_keeps_its_signal_handlers(tmp_path):
    # While Python locates ``python -m PKG``, sys.argv[0] is "-m"; the program's early handlers (traceana's own
    # ``python -m traceana``) must not be installed into another program whose package imports traceana.
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import traceana\n")
    (pkg / "__main__.py").write_text("import signal\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    # (the child starts with SIGINT at its default, as a program started from a terminal does: a suite launched as a
    # background job of a non-interactive shell inherits SIGINT ignored, and Python then installs no handler at all)
    out = subprocess.run([sys.executable, "-m", "mypkg"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.stdout.strip() == "True", out.stderr
