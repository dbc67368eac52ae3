"""Function-local imports of traceana modules, counted from the AST (issue 34, Show: "the number of function-local
imports before and after, each one left with its reason").

    python tests/benchmarks/count_local_imports.py [REPO] [--list] [--by-file]

Counts every ``import traceana...`` / ``from traceana... import`` (relative ones included) statement that sits inside
a function (``def`` or ``async def``, at any depth) of traceana/, collectors/ or reports/, against those at module
top (``if TYPE_CHECKING:`` blocks at module top count as top). ``--list`` prints each function-local one with its
reason: the comment on its line, or on the comment lines right above it (or above the first of a run of imports),
else the file's ``# Function-local imports here:`` comment, ``(no reason given)`` where there is none. ``--by-file`` prints the counts per file. Prints counts; asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path


def _is_traceana(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "traceana" or a.name.startswith("traceana.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "traceana"
    return False


def imports(path: Path) -> tuple[list[ast.AST], list[ast.AST], list[str]]:
    """(module-top traceana imports, function-local ones, the file's lines)."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if n is not f}
    top, local = [], []
    for n in ast.walk(tree):
        if _is_traceana(n):
            (local if id(n) in inner else top).append(n)
    return sorted(top, key=lambda n: n.lineno), sorted(local, key=lambda n: n.lineno), text.splitlines()


def reason(node: ast.AST, lines: list[str]) -> str:
    """The comment on the import's line(s), else the comment lines right above it or above the run of imports it
    belongs to."""
    for i in range(node.lineno - 1, node.end_lineno):
        code, hash_, comment = lines[i].partition("#")
        if hash_ and comment.strip():
            return comment.strip()
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")) and "#" not in lines[i]:
        i -= 1  # up through a run of imports
    above = []
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    if above:
        return " ".join(above)
    for j, line in enumerate(lines):  # the file's own word for all of them
        if line.startswith("# Function-local imports here:"):
            text = [line.removeprefix("# Function-local imports here:").strip()]
            k = j + 1
            while k < len(lines) and lines[k].startswith("# "):
                text.append(lines[k][2:].strip())
                k += 1
            return "(the module's) " + " ".join(text)
    return "(no reason given)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("repo", nargs="?", type=Path, default=Path(__file__).resolve().parents[2])
    p.add_argument("--list", action="store_true", help="print each function-local import with its reason")
    p.add_argument("--by-file", action="store_true", help="counts per file")
    a = p.parse_args()
    n_top = n_local = 0
    per_file: Counter[str] = Counter()
    listing = []
    for tree in ("traceana", "collectors", "reports"):
        for path in sorted((a.repo / tree).rglob("*.py")):
            top, local, lines = imports(path)
            rel = str(path.relative_to(a.repo))
            n_top += len(top)
            n_local += len(local)
            if local:
                per_file[rel] = len(local)
            for n in local:
                listing.append(f"{rel}:{n.lineno}: {lines[n.lineno - 1].strip()}  — {reason(n, lines)}")
    print(f"traceana imports: {n_local} function-local, {n_top} at module top "
          f"(traceana/, collectors/, reports/; statements)")
    if a.by_file:
        for f, c in per_file.most_common():
            print(f"{c:4d}  {f}")
    if a.list:
        print("\n".join(listing))


if __name__ == "__main__":
    main()
