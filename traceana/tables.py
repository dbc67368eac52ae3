"""Terminal tables that never cut a number: a table wider than the console is split into several, each repeating
the key columns (a row's label, or rank/stage/step), instead of being squeezed until rich writes "…".

Cells are plain text, shown as written (never read as markup). rich is imported only when something is drawn, so
``plural`` and ``cell`` cost nothing to a command that prints JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

UNKNOWN = "–"  # a value that could not be determined (never drawn as 0 or as some other field)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``plural(1, "rank") == "1 rank"``, ``plural(3, "rank") == "3 ranks"``, ``plural(2, "entry", "entries")``."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def cell(x, spec: str = ",.2f") -> str:
    """``x`` formatted with ``spec``, or ``UNKNOWN`` when it is None."""
    return UNKNOWN if x is None else format(x, spec)


def _width(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.split("\n")), default=0)


def table_width(widths: Sequence[int]) -> int:
    """Cells the drawn table takes for these content widths: one space of padding either side and one rule between
    columns and at both edges (rich's default box and padding)."""
    return sum(w + 2 for w in widths) + len(widths) + 1


def split_columns(widths: Sequence[int], *, keys: int, width: int) -> list[list[int]]:
    """Indices of the columns of each part: the first ``keys`` columns in every part, the others in order in as few
    parts as fit ``width``, as even in size as that allows (a column too wide for any part gets one of its own, and
    rich folds it: nothing is cut)."""
    head, rest = list(range(keys)), list(range(keys, len(widths)))

    def fits(part: list[int]) -> bool:
        return len(part) <= 1 or table_width([widths[j] for j in head + part]) <= width

    greedy: list[list[int]] = [[]]
    for i in rest:
        if not fits(greedy[-1] + [i]):
            greedy.append([])
        greedy[-1].append(i)
    n = len(greedy)
    size = -(-len(rest) // n)  # the same number of columns in each part, when that fits
    even = [rest[k:k + size] for k in range(0, len(rest), size)] if rest else [[]]
    parts = even if len(even) == n and all(fits(p) for p in even) else greedy
    return [head + p for p in parts]


def print_table(console: Console, title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]], *,
                keys: int = 1, justify: Sequence[str] | None = None, sections: Sequence[int] = ()) -> None:
    """Print ``rows`` (strings; headers may have two lines) under ``headers`` at the console's width, split into
    several tables with the first ``keys`` columns repeated when it is too narrow. ``sections``: row indices after
    which a rule is drawn."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    justify = list(justify) if justify is not None else ["left"] * keys + ["right"] * (len(headers) - keys)
    widths = [max([_width(h), *(_width(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    parts = split_columns(widths, keys=keys, width=console.width)
    for n, cols in enumerate(parts):
        if title:  # a line of its own: wrapped at the console's width, not squeezed into the table's
            console.print(Text(title if n == 0 else f"{title} (continued)"))
        t = Table(box=box.HEAVY_HEAD)  # rich's default box, whose rules table_width counts
        for i in cols:
            t.add_column(Text(headers[i]), justify=justify[i], no_wrap=True, overflow="fold", min_width=widths[i])
        for k, r in enumerate(rows):
            t.add_row(*(Text(r[i]) for i in cols), end_section=k in sections)
        console.print(t)


def print_line(console: Console, text: str, *, style: str | None = None, prefix: str = "") -> None:
    """One line of our text: ``prefix`` is our markup (e.g. ``"[yellow]note:[/] "``); ``text`` is shown as written."""
    from rich.markup import escape

    console.print(prefix + escape(text), style=style, highlight=False)
