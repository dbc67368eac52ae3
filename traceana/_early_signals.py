"""``python -m traceana``: until the command line takes SIGINT and SIGTERM over (``traceana.cli.main``), a signal
that arrives while the interpreter imports traceana ends the process with its conventional code (130, 143) and one
line, not a KeyboardInterrupt traceback — nothing is being written yet. Installed from ``traceana/__init__.py`` only
while Python locates ``-m traceana`` (``sys.argv[0] == "-m"``): a program importing traceana keeps its handlers."""

import os
import signal


def said(signum: int) -> str:
    """The one line a signal that ends traceana prints (here, and in traceana.cli's handlers)."""
    return "traceana: interrupted" if signum == signal.SIGINT else "traceana: terminated (SIGTERM)"


def _early(signum, frame) -> None:
    os.write(2, f"{said(signum)}\n".encode())
    os._exit(128 + signum)


def install(handler=_early) -> None:
    """``handler`` for SIGINT and SIGTERM, except where they are ignored (nohup) or this is not the main thread."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
