"""docs/commands.md, written from the parser itself: every command's ``--help`` as the command prints it, so the
reference cannot drift from the options (tests/commands/test_cli.py checks that the file equals what this writes).

    python -m traceana.reference > docs/commands.md
"""

from __future__ import annotations

import argparse
import functools
import sys

from traceana.cli import build_parser
from traceana.commands.registry import COMMANDS

WIDTH = 100  # the help's line width in the file (a terminal of this many columns)

PYTHON = "3.11"  # argparse lays the help out differently from one Python to the next; the file is written with this

HEAD = f"""# Command reference

Every `traceana` command and option, as `traceana COMMAND --help` prints it (a 100-column terminal, Python
{PYTHON}). The README's "Commands" section says what each command is for, with examples; docs/naming.md describes
`--names` files. This file is written by `python -m traceana.reference > docs/commands.md`; a test fails
when it is out of date.
"""


def reference() -> str:
    """The whole page: the top-level help, then each command's."""
    parser = build_parser(None)
    parser.prog = "traceana"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in (parser, *sub.choices.values()):  # the width a COLUMNS=100 terminal gives (argparse takes 2 off)
        p.formatter_class = functools.partial(p.formatter_class, width=WIDTH - 2)
    parts = [HEAD, "## `traceana`\n", "```\n" + parser.format_help().rstrip() + "\n```\n"]
    for name in (c.name for c in COMMANDS):
        parts.append(f"## `traceana {name}`\n")
        parts.append("```\n" + sub.choices[name].format_help().rstrip() + "\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(reference())
