"""``python -m traceana``: until the command line takes SIGINT and SIGTERM over (``traceana.cli.main``), a signal
that arrives while the interpreter imports traceana ends the process with its conventional code (130, 143) and one
line, not a KeyboardInterrupt traceback — nothing is being written yet. Installed from ``traceana/__init__.py`` only
while Python locates ``-m traceana`` (``sys.argv[0] == "-m"``): a program importing traceana keeps its handlers."""

import os
import signal


def _early(signum, frame) -> None:
    os.write(2, b"traceana: interrupted\n" if signum == signal.SIGINT else b"traceana: terminated (SIGTERM)\n")
    os._exit(128 + signum)


def install() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _early)
        except (ValueError, OSError):
            pass
