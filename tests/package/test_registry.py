"""The command registry (traceana/commands/registry.py): every command once, each module keeping the protocol, and
the packages' layering: traceana never imports collectors or reports, reports never the collectors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from traceana.commands import registry
from traceana.core.errors import BadInputError

ROOT = Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[str, set[str]]:
    """Module file -> the top-level packages it imports (import statements anywhere in it, function bodies too)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        out[path.relative_to(ROOT).as_posix()] = found
    return out


def test_every_command_module_has_the_protocol_and_a_description():
    assert len(registry.BY_NAME) == len(registry.COMMANDS)  # one entry per name
    for command in registry.COMMANDS:
        module = registry.load(command.name)
        assert callable(module.add_arguments) and callable(module.run), command.name
        assert (module.__doc__ or "").strip(), command.name
        for function in command.provides:
            assert callable(getattr(module, function)), (command.name, function)


def test_packages_import_only_downward():
    traceana = {m: i & {"collectors", "reports", "torch"} for m, i in _imports("traceana").items()}
    assert {m: i for m, i in traceana.items() if i} == {}
    reports = {m: i & {"collectors", "torch"} for m, i in _imports("reports").items()}
    assert {m: i for m, i in reports.items() if i} == {}  # the demo collects through the registry


def test_a_provided_function_of_a_missing_package_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "collectors.command", None)  # as if collectors were not installed
    with pytest.raises(BadInputError, match=r"traceana collect is not installed here .*traceana\[collect\]"):
        registry.provided("collect", "collect_run")
    with pytest.raises(KeyError):
        registry.provided("analyze", "collect_run")
