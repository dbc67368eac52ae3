"""traceana.core.tables.PlainConsole writes, off a terminal, exactly what rich writes there (docs/performance.md "Fixed
cost"): each table and line is drawn both ways, by rich's own Console and by the plain one, and compared."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from traceana.core import tables
from traceana.core.tables import PlainConsole, print_line, print_table

# one-cell characters the commands print (digits, "–" unknown, "·" nothing, "−", "×"), rich markup and emoji-code
# look-alikes, spaces to wrap at
TEXT = st.text(alphabet="ab0 1,.%()–·−×[]/\\:_-", max_size=40)
LINE = st.text(alphabet="ab0 1,.%()–·[]:\\-\n", max_size=200)


def _both(draw, width: int, *, plain_only: bool = False) -> tuple[str, str]:
    theirs, ours = io.StringIO(), io.StringIO()
    draw(Console(file=theirs, width=width, force_terminal=False))
    plain = PlainConsole(file=ours, width=width)
    if plain_only:  # must be drawn without rich
        plain.rich_console = lambda: pytest.fail("handed to rich")
    draw(plain)
    return theirs.getvalue(), ours.getvalue()


@st.composite
def table_args(draw):
    n = draw(st.integers(1, 6))
    headers = draw(st.lists(st.one_of(TEXT, st.builds(lambda a, b: f"{a}\n{b}", TEXT, TEXT)), min_size=n,
                            max_size=n))
    cells = st.one_of(TEXT, st.builds(lambda a, b: f"{a}\n{b}", TEXT, TEXT))
    rows = draw(st.lists(st.lists(cells, min_size=n, max_size=n), max_size=5))
    keys = draw(st.integers(0, n))
    justify = draw(st.lists(st.sampled_from(["left", "right"]), min_size=n, max_size=n))
    sections = draw(st.lists(st.integers(0, 5), max_size=3))
    title = draw(st.one_of(st.none(), TEXT, LINE))
    return title, headers, rows, keys, justify, sections


@settings(max_examples=300, deadline=None)
@given(table_args(), st.integers(20, 140))
def test_a_table_is_drawn_as_rich_draws_it(args, width):
    title, headers, rows, keys, justify, sections = args
    theirs, ours = _both(lambda c: print_table(c, title, headers, rows, keys=keys, justify=justify,
                                               sections=sections), width)
    assert ours == theirs


@settings(max_examples=300, deadline=None)
@given(LINE, st.sampled_from(["", "note: ", "[yellow]note:[/] "]), st.integers(5, 120))
def test_a_line_is_wrapped_as_rich_wraps_it(text, prefix, width):
    theirs, ours = _both(lambda c: print_line(c, text, prefix=prefix), width)
    assert ours == theirs


def test_what_the_commands_print_needs_no_rich():
    headers = ["", "stage 0\nrank 0", "stage 1\nrank 1"]
    rows = [["steps", "1", "1"], ["step ms", "0.10", "–"], ["forward", "0.02 (20%)", "·"]]
    theirs, ours = _both(lambda c: print_table(c, "Where each stage's step time goes", headers, rows, sections=[1]),
                         80, plain_only=True)
    assert ours == theirs and "├" in ours
    note = ("CPU allocator samples count only memory allocated since profiling began (weights and optimizer state "
            "allocated earlier are missing): peaks are relative; no allocator samples ([memory] events)")
    theirs, ours = _both(lambda c: print_line(c, note, prefix="[yellow]note:[/] "), 80, plain_only=True)
    assert ours == theirs and ours.count("\n") == 3


def test_what_rich_draws_differently_is_handed_to_rich():
    wide = "x" * 100  # one column wider than the console: rich folds it
    for draw in (lambda c: print_table(c, None, ["a", "b"], [["1", wide]]),
                 lambda c: print_table(c, "漢字", ["a"], [["1"]]),  # two cells a character
                 lambda c: print_line(c, "tab\there, bell\a"),  # control characters rich strips or expands
                 lambda c: print_line(c, "a :thumbs_up: b")):  # rich reads an emoji code in a printed line
        theirs, ours = _both(draw, 60)
        assert ours == theirs


def test_the_characters_taken_as_one_cell_are_one_cell_for_rich():
    from rich.cells import get_character_cell_size

    chars = [chr(o) for lo, hi in tables._ONE_CELL for o in range(lo, hi + 1)]
    assert all(c.isprintable() and get_character_cell_size(c) == 1 for c in chars)


def test_a_pipe_gets_the_plain_console_and_a_terminal_rich(monkeypatch):
    for var in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(tables.console(io.StringIO()), PlainConsole)
    assert isinstance(tables.console(Tty()), Console)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the output as a terminal: colours
    assert isinstance(tables.console(io.StringIO()), Console)
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    assert isinstance(tables.console(Tty()), PlainConsole)


def test_the_width_is_rich_s(monkeypatch):
    monkeypatch.setenv("COLUMNS", "123")
    assert PlainConsole(io.StringIO()).width == Console(file=io.StringIO()).width == 123
    monkeypatch.delenv("COLUMNS")
    assert PlainConsole(io.StringIO()).width == Console(file=io.StringIO()).width
