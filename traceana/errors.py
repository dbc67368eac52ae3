"""One exception hierarchy. Every message is one line: which file, what is wrong, what to do.

The CLI turns any TraceanaError into that line and exit code 2; nothing else escapes as a traceback
for bad input.
"""

from __future__ import annotations

from pathlib import Path


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
        return " — ".join(parts)


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
