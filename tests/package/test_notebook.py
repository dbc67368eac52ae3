"""traceana from a notebook (issue 28 item 7): the public names, an Analysis's short repr and HTML, one keyword per
concept (``names=``, as ``--names``), and docs/python.md's example, executed as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import traceana
from traceana.core import names

ROOT = Path(__file__).resolve().parents[2]
GPIPE = ROOT / "tests" / "data" / "pipelining_memory" / "gpipe_m2"  # torch.distributed.pipelining, 3 ranks, GPipe
MEGATRON = ROOT / "tests" / "data" / "megatron_pipe" / "interleaved" / "run"  # 2 ranks, 2 virtual stages each


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    return traceana.load_and_analyze(GPIPE, cache=False)


def test_public_names_are_listed_and_resolve_without_importing_polars_first():
    for name in ("load_run", "analyze", "load_and_analyze", "Analysis", "validate", "TraceanaError", "RunConfig"):
        assert name in traceana.__all__ and name in dir(traceana)
    code = ("import sys, traceana; listed = dir(traceana); assert 'polars' not in sys.modules, 'import'; "
            "assert all(getattr(traceana, n) is not None for n in traceana.__all__); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "ok", out.stderr


def test_repr_is_short_and_says_what_the_run_is(gpipe):
    text = repr(gpipe)
    assert len(text) < 1000
    first = text.splitlines()[0]
    # run.json: pp 3, schedule gpipe, its 3 traces; the profiler recorded steps 1 and 2 (step 1 a warm-up step)
    assert "3 ranks" in first and "3 stages" in first and "schedule gpipe" in first and "2 steps" in first
    assert "step time" in text and "bubble" in text
    assert "shape:" not in text and "┌" not in text  # no frame printed


def test_repr_of_a_run_without_run_json_holding_two_stages_per_rank():
    a = traceana.load_and_analyze(MEGATRON, cache=False)
    first = repr(a).splitlines()[0]
    assert "2 ranks" in first and "4 stages" in first and "spans annotated" in first


def test_the_summary_too_is_short_in_a_notebook(gpipe):
    text = repr(gpipe.summary)
    assert len(text) < 1000 and "step time" in text and "3 rows" in text and "shape:" not in text
    assert gpipe.summary._repr_html_().count("<table") == 1


def test_html_shows_the_headline_and_one_row_per_stage(gpipe):
    html = gpipe._repr_html_()
    assert html.count("<table") == 1 and "step time" in html
    body = html[html.index("<tbody"):html.index("</tbody>")]
    assert body.count("<tr") == 3  # three stages
    assert "<script" not in html


def test_names_is_one_keyword_and_the_old_spellings_warn(gpipe):
    run = traceana.load_run(GPIPE, cache=False)
    new = traceana.analyze(run, names="none")
    with pytest.warns(DeprecationWarning, match=r"analyze\(names=\.\.\.\)"):
        old = traceana.analyze(run, name_rules=names.NO_RULES)
    assert old.summary.as_dict() == new.summary.as_dict()
    with pytest.warns(DeprecationWarning, match=r"load_and_analyze\(names=\.\.\.\)"):
        cached = traceana.load_and_analyze(GPIPE, cache=False, names_from="none")
    assert cached.summary.step_ms == new.summary.step_ms
    with pytest.raises(TypeError, match="names_from"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            traceana.analyze(run, names="none", names_from="builtin")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rules'"):
        traceana.analyze(run, rules="none")


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    # The example reads tests/data/...: a copy, so that its cache is written there and not into the repository.
    shutil.copytree(GPIPE, tmp_path / GPIPE.relative_to(ROOT))
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs/python.md", "exec"), {})


def test_the_command_lines_answers_are_small_objects_in_a_notebook(gpipe):
    """issue 36 item 4: what-if, comparison, validation and configuration each show themselves in a few lines and as
    HTML; the what-if is traceana whatif's (the same replay as the module's function)."""
    from traceana.causal.whatif import parse_set, whatif

    w = traceana.what_if(gpipe, set="stage=1:forward*0.5")
    assert w.summary == whatif(gpipe, [parse_set("stage=1:forward*0.5")]).summary
    assert len(repr(w)) < 1000 and "diagnosis:" in repr(w) and w._repr_html_().count("<table") == 1
    assert w.as_dict()["plan"] is None
    c = traceana.compare_runs([("a", gpipe), ("b", gpipe.summary)])
    overview, per_stage = c  # (it unpacks as the tuple it was)
    assert overview.height == 2 and "<table" in c._repr_html_() and "2 runs" in repr(c)
    v = traceana.validate(gpipe)
    assert "validation" in repr(v) and "<table" in v._repr_html_() and v.simulation is not None
    html = gpipe.config._repr_html_()
    assert "<td>pp</td><td>3</td><td>run.json</td>" in html
    with pytest.raises(traceana.TraceanaError):
        traceana.what_if(gpipe, set="nonsense")
