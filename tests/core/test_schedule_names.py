"""The schedule names are listed once (traceana.core.schedule_names) and everything reads them from there."""

from __future__ import annotations

import ast
from pathlib import Path

from traceana.core import schedule_names as sn

ROOT = Path(__file__).resolve().parents[2]


def test_the_kinds_as_the_papers_and_torch_define_them():
    # written by hand from docs/schedules.md: GPipe and 1F1B one stage a device; interleaved 1F1B, looped BFS and
    # ZB-1P looped; ZB-V and DualPipe-V in a V; the zero-bubble family splits the backward into I and W
    assert sn.SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
    assert sn.ONE_STAGE_SCHEDULES == ("gpipe", "1f1b") == sn.TRAINER_SCHEDULES
    assert sn.V_SCHEDULES == ("zbv", "dualpipev")
    assert sn.SPLIT_BACKWARD_SCHEDULES == ("zero-bubble", "zbv", "dualpipev")
    assert sn.WHOLE_BACKWARD_MULTI_STAGE == ("interleaved-1f1b", "looped-bfs")
    assert sn.RUN_JSON_SCHEDULES[-1] == "unknown"


def test_every_list_of_schedules_is_the_one():
    from collectors.trainer.config import SCHEDULES as trainer
    from traceana.core import manifest, pipeline_rules, training_config

    assert manifest.SCHEDULES is sn.RUN_JSON_SCHEDULES and manifest.MULTI_STAGE_SCHEDULES is sn.MULTI_STAGE_SCHEDULES
    assert pipeline_rules.SCHEDULES is sn.SCHEDULES and pipeline_rules.V_SCHEDULES is sn.V_SCHEDULES
    assert training_config.MODEL_SCHEDULES is sn.SCHEDULES and trainer is sn.TRAINER_SCHEDULES


def test_no_module_lists_the_names_again():
    """A tuple, list or set literal naming two schedules or more, anywhere in traceana/ or collectors/ but
    schedule_names.py, is a second list (a mapping from another framework's names is not: its keys are not ours;
    nor is a branch of the pipeline rules that two schedules share, ``if schedule in ("interleaved-1f1b", ...)``)."""
    names = set(sn.RUN_JSON_SCHEDULES)
    again = []
    for path in [*(ROOT / "traceana").rglob("*.py"), *(ROOT / "collectors").rglob("*.py")]:
        if path.name == "schedule_names.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        branches = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    for c in node.comparators} if path.name == "pipeline_rules.py" else set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in branches:
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(listed) >= 2:
                    again.append(f"{path.relative_to(ROOT)}:{node.lineno} {listed}")
    assert not again, "schedule names listed outside traceana/core/schedule_names.py:\n" + "\n".join(again)
