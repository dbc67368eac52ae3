"""A plain ``traceana analyze`` loads only what it needs (docs/performance.md "Fixed cost").

Importing pyarrow alone cost ~0.2 s and ~40 MB, building the parser used to import every command's module
(reports, collectors), and rich's tables ~45 ms where the output is not a terminal. Each check runs the command in a fresh interpreter and looks at ``sys.modules`` after it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tracebuilder import write_two_stage_run

RUN = """
import json, sys
from traceana.cli import main
rc = main({argv!r})
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] in ("pyarrow", "reports", "collectors", "torch", "pandas", "rich"))
print(json.dumps({{"rc": rc, "loaded": loaded}}), file=sys.stderr)
"""


def _loaded(argv: list[str]) -> tuple[int, list[str], str]:
    out = subprocess.run([sys.executable, "-c", RUN.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stderr.strip().splitlines()[-1])
    return result["rc"], result["loaded"], out.stdout


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run").mkdir()
    return write_two_stage_run(tmp_path / "run")


@pytest.mark.parametrize("cache", [False, True])
def test_plain_analyze_imports_no_pyarrow_reports_or_collectors(run_dir, cache):
    argv = ["analyze", "--quiet", str(run_dir)] + ([] if cache else ["--no-cache"])
    if cache:  # the second run reads the analysis cache
        assert _loaded(argv)[0] == 0
    rc, loaded, stdout = _loaded(argv)
    assert rc == 0
    assert "stage 0" in stdout and "┡" in stdout  # the tables were printed, drawn as rich draws them
    assert loaded == []  # nor rich: the output is a pipe (traceana.core.tables.PlainConsole)


def test_plain_analyze_imports_no_export(run_dir):
    # Export's tables, JSON summary and merged trace are for --export, --json and --per-step (~2 ms and ~1 MB of
    # imports where the plain command needs none of them); the cluster tasks (partitioned, scale) for --dask.
    code = RUN.replace('m.split(".")[0] in',
                       'm in ("traceana.commands.export", "traceana.measure.partitioned", "traceana.ingest.scale")'
                       ' or m.split(".")[0] in')
    out = subprocess.run([sys.executable, "-c", code.format(argv=["analyze", "--quiet", "--no-cache", str(run_dir)])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stderr.strip().splitlines()[-1]) == {"rc": 0, "loaded": []}


def test_json_analyze_draws_no_tables(run_dir):
    rc, loaded, stdout = _loaded(["analyze", "--json", "--no-cache", str(run_dir)])
    assert rc == 0
    assert json.loads(stdout)
    assert loaded == []  # no rich table (nor progress display) is built for --json


def test_top_level_help_lists_every_command_without_importing_them():
    code = RUN.replace("rc = main({argv!r})", "try:\n    main(['--help'])\nexcept SystemExit as e:\n    rc = e.code")
    out = subprocess.run([sys.executable, "-c", code.format()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stderr.strip().splitlines()[-1])
    assert result == {"rc": 0, "loaded": []}
    for name in ("demo", "collect", "analyze", "merge", "report", "estimate", "validate"):
        assert name in out.stdout
