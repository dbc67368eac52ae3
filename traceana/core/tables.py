"""Terminal tables that never cut a number: a table wider than the console is split into several, each repeating
the key columns (a row's label, or rank/stage/step), instead of being squeezed until rich writes "…".

Cells are plain text, shown as written (never read as markup). On a terminal rich draws them (colour, bold
headers); anywhere else — a pipe, a file, a test capturing the output — ``PlainConsole`` writes the same
characters rich would write there, without importing rich (~45 ms of a small analysis' fixed cost,
docs/performance.md "Fixed cost"), and hands rich what it could not draw exactly as rich does. ``plural`` and
``cell`` cost nothing to a command that prints JSON.
"""

from __future__ import annotations

import builtins
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from traceana.core.units import MIB

if TYPE_CHECKING:
    from rich.console import Console

UNKNOWN = "–"  # a value that could not be determined (never drawn as 0 or as some other field)


def stage_label(stage: int | None, stages: str | None = None) -> str:
    """A rank's every stage as a column label: "stage 1", "stages 0+3" (a V or looped placement: ``stages`` is
    ``Analysis.stages``' "0,3"), "stage –" when not determined."""
    if stage is None:
        return f"stage {UNKNOWN}"
    label = (stages or str(stage)).replace(",", "+")
    return f"stage{'s' if '+' in label else ''} {label}"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``plural(1, "rank") == "1 rank"``, ``plural(3, "rank") == "3 ranks"``, ``plural(2, "entry", "entries")``."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def cell(x, spec: str = ",.2f") -> str:
    """``x`` formatted with ``spec``, or ``UNKNOWN`` when it is None."""
    return UNKNOWN if x is None else format(x, spec)


def mib(nbytes: float | None) -> str:
    """A memory cell: bytes in MiB with two decimals in every table (a tiny run's activation peak is 0.01 MiB, as
    the headlines and reports write it), or ``UNKNOWN``."""
    return UNKNOWN if nbytes is None else f"{nbytes / MIB:,.2f}"


def progress_bar(description: str = "{task.description}"):
    """The progress bar of long work (reading traces, the BPipe verdict's search): rich's, on stderr, gone when
    done; description, bar, done/total and time elapsed. Not started: use it as a context manager."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(file=sys.stderr), transient=True)


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


# --- where to draw ------------------------------------------------------------------------------------------------
class PlainConsole:
    """A console that is not a terminal (``file``, default the current ``sys.stdout``, at ``width`` cells, default
    the width rich's ``Console`` would take): ``print_table`` and ``print_line`` write on it the characters rich
    would write there (no colour, rich's box and wrapping), and hand rich (``rich_console``) what they cannot
    draw exactly so — a table wider than the console, characters that are not one cell wide, control characters,
    a line where rich would read an emoji code or a backslash (rich's markup escape doubles a final one)."""

    is_terminal = False

    def __init__(self, file=None, width: int | None = None) -> None:
        self._file = file
        self._width = width

    @property
    def file(self):
        return self._file if self._file is not None else sys.stdout

    @property
    def width(self) -> int:
        """As rich's ``Console().width`` off a terminal: $COLUMNS, else the size of the first of stdin, stdout and
        stderr that is a terminal, else 80."""
        if self._width is not None:
            return self._width
        columns = os.environ.get("COLUMNS")
        if columns is not None and columns.isdigit():
            return int(columns)
        for fd in (0, 1, 2):
            try:
                return os.get_terminal_size(fd).columns or 80
            except (AttributeError, ValueError, OSError):
                continue
        return 80

    def rich_console(self) -> Console:
        from rich.console import Console

        return Console(file=self._file, width=self._width)

    def write(self, lines: Iterable[str]) -> None:
        self.file.write("".join(f"{line}\n" for line in lines))


def console(file=None) -> Console | PlainConsole:
    """Where a command prints its tables and lines: rich's ``Console`` on a terminal, a ``PlainConsole`` elsewhere
    (rich's own test of a terminal: $TTY_COMPATIBLE, $FORCE_COLOR, ``isatty``; rich also for a notebook, Windows
    consoles and an encoding other than UTF-8, where rich draws differently)."""
    out = file if file is not None else sys.stdout
    if _plain(out):
        return PlainConsole(file)
    from rich.console import Console

    return Console(file=file)


def _plain(out) -> bool:
    if sys.platform == "win32" or hasattr(builtins, "get_ipython"):
        return False
    if not (getattr(out, "encoding", "utf-8") or "utf-8").lower().startswith("utf"):
        return False
    tty_compatible = os.environ.get("TTY_COMPATIBLE", "")
    if tty_compatible in ("0", "1"):
        return tty_compatible == "0"
    force_color = os.environ.get("FORCE_COLOR")
    if force_color is not None:
        return force_color == ""
    try:
        return not out.isatty()
    except (AttributeError, ValueError):
        return True


# --- drawing as rich does, for text whose every character is one cell wide ---------------------------------------
# rich's box.HEAVY_HEAD, as (left, fill, divider, right) of each rule and (edge, divider) of each row
_TOP, _HEAD_RULE, _SECTION_RULE, _BOTTOM = "┏━┳┓", "┡━╇┩", "├─┼┤", "└─┴┘"
_HEAD_ROW, _BODY_ROW = "┃┃", "││"
_WORD = re.compile(r"\s*\S+\s*")  # rich's word: leading space only at the start, with the spaces after it
_END_SPACE = re.compile(r"\s+$")
_EMOJI_CODE = re.compile(r":(\S*?)(?:(?:\-)(emoji|text))?:")  # what rich tries as an emoji code in a printed str
_MARKUP_TAG = re.compile(r"\[/?[a-z #]*\]")  # our own markup in a print_line prefix ("[yellow]note:[/] ")


# Printable characters one cell wide, as rich measures them (tests/core/test_tables_plain.py asks rich): rich's own list
# (Latin, box drawing), the dashes, quotes, bullets and ellipsis of General Punctuation, and the
# arrows and signs the commands print.
_ONE_CELL = ((0x20, 0x7E), (0xA1, 0xAC), (0xAE, 0x2FF), (0x2010, 0x2027), (0x2190, 0x2193),
             (0x2212, 0x2212), (0x2248, 0x2248), (0x2264, 0x2265), (0x2500, 0x25FC))


def _one_cell(c: str) -> bool:
    o = ord(c)
    return any(lo <= o <= hi for lo, hi in _ONE_CELL)


def _one_cell_each(texts: Iterable[str]) -> bool:
    """Whether every character of ``texts`` (newlines aside) is printable and one cell wide, as rich measures."""
    chars = set().union(*map(set, texts)) - {"\n"}
    rest = [c for c in chars if not _one_cell(c)]
    if not rest:
        return True
    from rich.cells import get_character_cell_size

    return all(c.isprintable() and get_character_cell_size(c) == 1 for c in rest)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` as rich's ``Console.print`` breaks it at ``width`` cells (one cell a character): at spaces, a word
    longer than a line folded, the spaces ending a line kept up to the width."""
    out = []
    for line in text.split("\n"):
        breaks, offset = [], 0
        for m in _WORD.finditer(line):
            start, word = m.start(), m.group()
            size = len(word.rstrip())
            if width - offset >= size:
                offset += len(word)
            elif size > width:  # folded across lines
                pieces = [word[k:k + width] for k in range(0, len(word), width)]
                for k, piece in enumerate(pieces):
                    if start:
                        breaks.append(start)
                    if k == len(pieces) - 1:
                        offset = len(piece)
                    else:
                        start += len(piece)
            elif offset and start:
                breaks.append(start)
                offset = len(word)
        for a, b in zip([0, *breaks], [*breaks, len(line)]):
            piece = line[a:b]
            if len(piece) > width:
                space = _END_SPACE.search(piece)
                if space is not None:
                    piece = piece[:len(piece) - min(len(space.group()), len(piece) - width)]
            out.append(piece[:width])
    return out


def _plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int], justify: Sequence[str],
                 sections: Sequence[int]) -> list[str]:
    """The lines of rich's ``Table(box=HEAVY_HEAD)`` of these cells (each column ``widths[i]`` wide: no folding)."""
    def rule(chars: str) -> str:
        left, fill, divider, right = chars
        return left + divider.join(fill * (w + 2) for w in widths) + right

    def row(cells: Sequence[str], chars: str, header: bool) -> list[str]:
        edge, divider = chars
        split = [c.split("\n") if w else [] for c, w in zip(cells, widths)]  # rich renders nothing 0 cells wide
        height = max(1, *map(len, split))
        lines = []
        for k in range(height):
            parts = []
            for lines_of, w, j in zip(split, widths, justify):
                pad = height - len(lines_of)
                i = k - pad if header else k  # a header's lines at the bottom, a cell's at the top
                text = lines_of[i] if 0 <= i < len(lines_of) else ""
                parts.append(" " + (text.rstrip().rjust(w) if j == "right" else text.ljust(w)) + " ")
            lines.append(edge + divider.join(parts) + edge)
        return lines

    out = [rule(_TOP), *row(headers, _HEAD_ROW, header=True), rule(_HEAD_RULE)]
    for k, r in enumerate(rows):
        out += row(r, _BODY_ROW, header=False)
        if k in sections and k < len(rows) - 1:  # rich draws no section rule under the last row
            out.append(rule(_SECTION_RULE))
    return [*out, rule(_BOTTOM)]


def print_table(console: Console | PlainConsole, title: str | None, headers: Sequence[str],
                rows: Sequence[Sequence[str]], *, keys: int = 1, justify: Sequence[str] | None = None,
                sections: Sequence[int] = ()) -> None:
    """Print ``rows`` (strings; headers may have two lines) under ``headers`` at the console's width, split into
    several tables with the first ``keys`` columns repeated when it is too narrow. ``sections``: row indices after
    which a rule is drawn."""
    justify = list(justify) if justify is not None else ["left"] * keys + ["right"] * (len(headers) - keys)
    if isinstance(console, PlainConsole):
        texts = [*headers, *(c for r in rows for c in r), title or ""]
        if _one_cell_each(texts):
            widths = [max([len(x) for x in h.split("\n")] + [len(x) for r in rows for x in r[i].split("\n")])
                      for i, h in enumerate(headers)]
            width = console.width
            parts = split_columns(widths, keys=keys, width=width)
            if all(table_width([widths[i] for i in cols]) <= width for cols in parts):
                lines = []
                for n, cols in enumerate(parts):
                    if title:
                        lines += _wrap(title if n == 0 else f"{title} (continued)", width)
                    lines += _plain_table([headers[i] for i in cols], [[r[i] for i in cols] for r in rows],
                                          [widths[i] for i in cols], [justify[i] for i in cols], sections)
                console.write(lines)
                return
        console = console.rich_console()
    from rich import box
    from rich.table import Table
    from rich.text import Text

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


def print_line(console: Console | PlainConsole, text: str, *, style: str | None = None, prefix: str = "") -> None:
    """One line of our text: ``prefix`` is our markup (e.g. ``"[yellow]note:[/] "``); ``text`` is shown as written."""
    if isinstance(console, PlainConsole):
        line = _MARKUP_TAG.sub("", prefix) + text
        if not _EMOJI_CODE.search(line) and "\\" not in line and _one_cell_each([line]):
            console.write(_wrap(line, console.width))
            return
        console = console.rich_console()
    from rich.markup import escape

    console.print(prefix + escape(text), style=style, highlight=False)
