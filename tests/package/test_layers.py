"""The layers (issue 34; docs/architecture.md "Layers"): every import in traceana/, collectors/ and reports/ — at
module top, inside functions, under ``if TYPE_CHECKING`` — read from the AST, none of them upward in the declared
order, and no cycle among modules, whatever their layer.

The order, low to high (a module may import its own layer and those below it):
core → ingest → measure → causal → model → validation → commands → the program → collectors, reports.
The engine (causal/scheduler.py) sits in causal, below model: causal replays the measured step on it and the
model's simulator runs the rules' plan on it. collectors and reports are two trees above traceana: neither imports
the other; the demo (reports) reaches collect only through the command registry, by name (checked below).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (layer, the modules or packages in it), low to high. A module belongs to the longest prefix listed.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("traceana", "traceana.core", "traceana.version", "traceana._deferred", "traceana._early_signals")),
    ("ingest", ("traceana.ingest",)),
    ("measure", ("traceana.measure",)),
    ("causal", ("traceana.causal",)),
    ("model", ("traceana.model",)),
    ("validation", ("traceana.validation",)),
    ("commands", ("traceana.commands",)),
    ("program", ("traceana.cli", "traceana.__main__", "traceana.reference", "traceana.results")),
    ("collectors", ("collectors",)),
    ("reports", ("reports",)),
)
#: layers on one floor: neither may import the other
SIBLINGS = {frozenset({"collectors", "reports"})}
#: what one command asks another for through the registry (commands.registry.provided), by name, not import
PROVIDED = {("reports.demo_command", "collect", "collect_run")}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("traceana", "collectors", "reports"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = p
    return mods


MODULES = _modules()


def _known(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> tuple[int, str]:
    best = max(((len(p), i, name) for i, (name, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best[1], best[2]


def _imports() -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import of a module of the three trees."""
    out = []
    for m, p in MODULES.items():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
            else:
                continue
            for t in {_known(n) for n in names}:
                if t is not None and t != m:
                    out.append((m, t, node.lineno, id(node) in local))
    return out


IMPORTS = _imports()


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _layer(m)


def test_nothing_imports_upward_not_even_inside_a_function():
    upward = []
    for m, t, line, local in IMPORTS:
        (a, la), (b, lb) = _layer(m), _layer(t)
        if b > a or (a == b and la != lb) or frozenset({la, lb}) in SIBLINGS:
            upward.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} ({la}) imports {t} ({lb})"
                          + (" inside a function" if local else ""))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, t, _, _ in IMPORTS:
        edges[m].add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package's __init__ importing its own modules is no cycle of the design
            head = min(comp, key=len)
            if len(comp) > 1 and not all(x == head or x.startswith(head + ".") for x in comp):
                cycles.append(sorted(comp))

    for v in MODULES:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" ↔ ".join(c) for c in cycles)


def test_the_registry_is_the_only_way_across_and_names_modules_that_exist():
    """The registry names every command's module as a string (the CLI imports only the one being run); a command
    that uses another through ``provided`` crosses layers by name: those crossings are the ones listed here."""
    from traceana.commands.registry import BY_NAME, COMMANDS

    for c in COMMANDS:
        assert c.module in MODULES, f"registry: {c.name}'s module {c.module} does not exist"
    found = set()
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "provided"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)):
                found.add((m, node.args[0].value, node.args[1].value))
    assert found == PROVIDED
    for m, name, function in found:
        assert function in BY_NAME[name].provides


@pytest.mark.parametrize("package", ["core", "ingest", "measure", "causal", "model", "validation", "commands"])
def test_each_package_says_what_it_holds(package):
    doc = ast.get_docstring(ast.parse((ROOT / "traceana" / package / "__init__.py").read_text(encoding="utf-8")))
    assert doc and len(doc) > 80, f"traceana/{package}/__init__.py: a few lines saying what the package holds"
