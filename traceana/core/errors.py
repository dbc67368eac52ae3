"""One exception hierarchy. Every message is one line: which file, what is wrong, what to do.

The CLI turns any TraceanaError into that line and exit code 2; nothing else escapes as a traceback
for bad input.
"""

from __future__ import annotations

import re
from pathlib import Path

# Control characters (C0, DEL, C1: ESC starts terminal escape sequences) and the invisible bidirectional and
# zero-width marks: a file name or event name holding them would rewrite the user's terminal or hide text.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(text: str) -> str:
    """``text`` with every control or invisible formatting character written as a Python escape (``\\x1b``)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def shown(path: str | Path) -> str:
    """A path as printable text: names need not be UTF-8 (undecodable bytes become U+FFFD) and control characters
    are escaped (see ``printable``), so a message naming the file always prints as one harmless line."""
    import os

    return printable(os.fsencode(str(path)).decode("utf-8", "replace"))


class TraceanaError(Exception):
    """Base of every error traceana raises on purpose."""

    def __init__(self, what: str, *, path: str | Path | None = None, fix: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.what = what
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        parts = [f"{self.path}: {self.what}" if self.path else self.what]
        if self.fix:
            parts.append(self.fix)
        return printable(" — ".join(parts))


class BadInputError(TraceanaError):
    """The user's input (a path, a trace, a manifest, a flag) cannot be used as given."""


class TraceFormatError(BadInputError):
    """A file is not a readable Kineto trace."""


class RunDirError(BadInputError):
    """A run directory is inconsistent: duplicate ranks, mixed world sizes, no traces."""


class ConfigError(BadInputError):
    """An impossible configuration (model, parallelism, schedule)."""


class AnalysisError(TraceanaError):
    """The traces are readable but the requested analysis cannot be done on them."""
