"""The ``traceana`` command line: thin, each command calls library functions.

Each command lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``, listed once in the
command registry (``traceana.commands.registry``); only the module of the command being run is imported (the
top-level help needs only the registry's lines), and its heavy imports (torch, holoviews) happen inside ``run`` —
``traceana analyze`` loads neither reports nor collectors.

``main`` is also the program's entry point (the ``traceana`` script, ``python -m traceana``): run so, and only
then, it makes the process settings a library must not make in its host (``program_settings``) and ends the
process without the interpreter's teardown.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

import traceana
from traceana import _early_signals
from traceana.commands.options import HelpFormatter
from traceana.commands.registry import BY_NAME, COMMANDS, load
from traceana.core.errors import TraceanaError, printable
from traceana.core.files import remove_in_flight

class _Parser(argparse.ArgumentParser):
    """Errors about a command's arguments print that command's usage (``traceana analyze …``), not the top level's:
    argparse leaves unrecognised arguments to the top-level parser, so they are reported here by the command's own."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            (getattr(ns, "_command_parser", None) or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the command it names is loaded (none for the top-level help)."""
    wanted = set(BY_NAME) if argv is None else {_command_in(argv)}
    parser = _Parser(
        prog="traceana",
        description="Profile and explain pipeline-parallel training from Kineto traces.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and which trace decoder is built")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=argparse.ArgumentParser)
    for command in COMMANDS:
        name, help_ = command.name, command.help
        if name not in wanted:
            sub.add_parser(name, help=help_, description=help_)  # not run: its line in the help is enough
            continue
        mod = load(name)
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip(), formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _command_parser=p)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command named in ``argv``: its first word that is not a top-level option (None when it is no command)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in BY_NAME else None


class _Version(argparse.Action):
    """``--version``: importing ingest (polars) to say which decoder is built only when asked."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        # (cost: the trace decoder, and polars, only for --version)
        from traceana.ingest.kineto import native_available
        from traceana.ingest.reading import SCANNER_STALE

        scanner = ("built" if native_available() else SCANNER_STALE or
                   "not built (no C compiler at install time): traces are read by the pure-Python decoder, 3–4x slower")
        print(f"traceana {traceana.__version__} (native trace scanner: {scanner})")
        parser.exit()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # Warnings (a truncated trace, a skipped file) are for the user: one line each, no source location.
    # (a job profiled on a sample of its ranks is said as a note: normal practice, not a fault)
    kind = "note" if getattr(category, "__name__", "") == "IngestNote" else "warning"
    print(f"traceana: {kind}: {printable(str(message))}", file=sys.stderr)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt: files being written are cleaned up on the way out
    (``traceana.core.files.atomic_path``, the caches), then the command exits 143 with one line."""


class StdoutClosed(OSError):
    """Standard output was closed when traceana started (``>&-``) and the command printed to it."""


EXIT_SIGINT, EXIT_SIGPIPE, EXIT_SIGTERM = 128 + 2, 128 + 13, 128 + 15  # the shell's codes for those signals
_signalled: int | None = None  # the first SIGINT/SIGTERM of this command, once it arrived
_at_once = False  # end the process in the handler itself (see _on_signal)
# Commands a signal is raised in, to be handled by their own code: those whose processes own children (the
# trainer's ranks, a job, a Dask client), whose clean-up stops the children, and watch, which Ctrl-C ends normally
# (exit 0); every other command ends in the handler.
RAISED_IN = frozenset({"collect", "demo", "attach", "watch"})


def _on_signal(signum, frame) -> None:
    """The first SIGINT or SIGTERM; both are ignored from then on (a second Ctrl-C must not land in the clean-up).

    Run as the program, a command without children ends here and now: the temporaries being written are removed
    (``traceana.core.files.remove_in_flight``), one line is printed, and the process exits with the signal's code. No
    exception is raised into whatever was running — raised inside a polars call it came back twice or as polars'
    own TypeError, and raised inside an extension module's import it once left msgspec half-initialised (a
    segfault). Otherwise (``main`` called in-process, a command with children) it is raised in the main thread and
    the files being written are cleaned up on the way out."""
    global _signalled
    if _signalled is not None:
        return
    _signalled = signum
    _quiet_signals()
    if _at_once:
        remove_in_flight()
        try:
            # (a progress bar hid the cursor)
            os.write(2, (b"\x1b[?25h" if os.isatty(2) else b"") + f"{_early_signals.said(signum)}\n".encode())
        except OSError:
            pass
        os._exit(128 + signum)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _quiet_signals() -> None:
    """After the first interrupt only the clean-up runs."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread
            pass


def _install_signals() -> dict | None:
    """Our handler for SIGINT and SIGTERM (main thread only); returns the handlers it replaced (None: not here)."""
    global _signalled
    _signalled = None
    try:  # (a signal the caller ignores, as a shell does SIGINT for a background job, stays ignored)
        return {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    except (ValueError, OSError):  # main() called from a thread: leave the signals alone
        return None


def _signal_exit(which: int) -> int:
    print(_early_signals.said(which), file=sys.stderr)
    return EXIT_SIGINT if which == signal.SIGINT else EXIT_SIGTERM


def _ended(e: BaseException) -> int | None:
    """The exit code of a command ended by a signal, a reader gone or a closed standard output (one line, never a
    traceback), wherever it surfaced; None for anything else."""
    if isinstance(e, KeyboardInterrupt):
        _quiet_signals()
        return _signal_exit(signal.SIGINT)
    if isinstance(e, Terminated):
        _quiet_signals()
        return _signal_exit(signal.SIGTERM)
    if _signalled is not None:  # a library turned the interrupt into its own error (polars: a TypeError once)
        return _signal_exit(_signalled)
    if isinstance(e, StdoutClosed):
        print("traceana: error: standard output is closed (>&-), so nothing could be printed — run it with "
              "standard output open, or redirected to a file", file=sys.stderr)
        return 2  # a bad output, as every other one (a device, a FIFO, a missing folder)
    if isinstance(e, BrokenPipeError):  # the reader went away (``| head``): quietly, as a program killed by SIGPIPE
        _stdout_to_devnull()
        return EXIT_SIGPIPE
    return None


def _stdout_to_devnull() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _Closed:
    """Standard output when fd 1 was closed at start (``>&-``): fd 1 itself is /dev/null (so no file traceana opens
    takes that number and receives its prints), and writing here raises StdoutClosed."""

    encoding, errors = "utf-8", "strict"

    def write(self, text) -> int:
        raise StdoutClosed(9, "standard output is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise StdoutClosed(9, "standard output is closed")

    @property
    def buffer(self):
        return self


def _standard_streams() -> None:
    """File descriptors 0-2 are held open (on /dev/null where the caller closed one): else the first file traceana
    opens would take the number and receive what is printed. A closed stdout raises StdoutClosed when written."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if fd == 1:
                sys.stdout = _Closed()
            elif fd == 2:
                sys.stderr = open(fd, "w", closefd=False)
    if sys.stdout is None:
        sys.stdout = _Closed()
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code. Run as the program itself (the ``traceana`` script, ``python -m
    traceana``) this is the process's entry point, and it alone changes the process: the allocator's decay and,
    for a small run, one polars thread (``program_settings``), the deferred standard library, and the end right
    after the command, its output flushed, without tearing down the interpreter: freeing every module's objects one
    by one took ~35 ms of CPU after polars was imported (docs/performance.md "Fixed cost"). Called from Python (a
    notebook, a test) it changes none of that. Every file a command writes is closed (and renamed into place)
    before it returns.

    SIGINT (Ctrl-C) exits 130, SIGTERM 143, a reader gone (``| head``) 141, each with at most one line and never a
    traceback, wherever they arrive — in the imports, a polars call or a cache write (docs/reliability.md)."""
    global _at_once
    program = argv is None and _is_program()
    _at_once = program and _command_in(sys.argv[1:]) not in RAISED_IN and "--dask" not in sys.argv
    previous = _install_signals()
    try:
        _standard_streams()
        if program:
            program_settings()
        rc = _main(argv, program=program)
    except BaseException as e:  # what arrived outside the command's own ``try`` (parsing, imports, clean-up)
        rc = _ended(e)
        if rc is None:
            raise
    finally:
        if previous is not None and not program:  # (a program is on its way out: they stay ignored after one)
            for sig, handler in previous.items():
                try:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                except (ValueError, OSError, TypeError):
                    pass
    if program:
        _exit_quietly_on_signals()
        if _nothing_to_tear_down():
            _exit_now(rc)
    return rc


def _exit_quietly_on_signals() -> None:
    """From the command's end to the process' end (flushing, exit handlers reaping children): a signal ends the
    process at once with its code, nothing printed (the command's outcome was said already)."""
    def now(signum, frame) -> None:
        os._exit(128 + signum)

    _early_signals.install(now)


# polars allocates through jemalloc and keeps freed pages 0.5-1 s (its own default) before returning them: ingest
# frees and reallocates whole columns, so the retained pages set the peak (docs/performance.md "Memory"). Returning
# them at once costs ~10% more system time and lowered the peak of a 200 MB rank by ~25%.
ALLOCATOR = "dirty_decay_ms:0,muzzy_decay_ms:0"
# ... except in a run of a few thousand small ranks (one-step ranks of a pp x dp job): there the peak is the
# what-if's, after ingest, whose frames reuse the pages the ranks' columns freed, and returning every freed page at
# once cost a fifth of the CPU in page faults. A second's decay against ALLOCATOR, measured on this machine
# (docs/performance.md "Thousands of small ranks"): 4,096 ranks of 0.3 MB of JSON 36.6 -> 29.5 CPU-s, peak 1,414 ->
# 1,408 MiB; 2,048 of 0.3 MB 19.2-19.6 -> 14.5-15.6 CPU-s, 743-760 -> 753-763 MiB. Outside that the retained pages
# raised the peak: 1,024 of 0.3 MB +26 MiB (+5 %, four rounds), 512 of 0.5 MB +17, 256 of 2 MB +27, 4 of 200 MB +83
# (+16 %), and 8,192 ranks +130 MiB (+7 %), 16,384 +188 MiB (+6 %), where ingest and the graph set the peak (their
# what-if is over diagnosis.WHATIF_MAX_OPERATIONS): those keep ALLOCATOR.
ALLOCATOR_MANY_SMALL = "dirty_decay_ms:1000,muzzy_decay_ms:0"
MANY_FILES = (2048, 4096)  # trace files, at least and at most
SMALL_FILE_BYTES = 2 * 1024 * 1024  # of JSON in the largest, at most (a gzipped file counted at reading.GZ_RATIO)


def allocator_for(raw_sizes: list[int]) -> str:
    """traceana's own allocator setting (``_RJEM_MALLOC_CONF``) for a run whose trace files hold ``raw_sizes``
    bytes of JSON each: ALLOCATOR_MANY_SMALL for MANY_FILES files (bounds included) of at most SMALL_FILE_BYTES,
    else ALLOCATOR."""
    if MANY_FILES[0] <= len(raw_sizes) <= MANY_FILES[1] and max(raw_sizes) <= SMALL_FILE_BYTES:
        return ALLOCATOR_MANY_SMALL
    return ALLOCATOR


def program_settings(run: str | os.PathLike | None = None) -> None:
    """The traceana program's settings of its own process, made before polars is imported (they take effect only
    then) and never by ``import traceana``: the allocator's decay (``ALLOCATOR``), the standard-library modules a
    plain analysis never runs deferred (``traceana._deferred``), and, given the ``run`` a command reads, the decay
    for its shape (``allocator_for``: many small ranks) and, when that run is small (``reading.is_small_run``), one
    polars thread and one jemalloc arena. A value the user set is kept. (The benchmark's jobs call it as the
    program does.)"""
    if "polars" in sys.modules:
        return
    if run is None:
        os.environ.setdefault("_RJEM_MALLOC_CONF", ALLOCATOR)
        from traceana import _deferred  # (only as the program: a notebook calling main keeps its standard library)

        _deferred.defer(*_deferred.FOR_PROGRAM)
        return
    from traceana.ingest import reading  # (cost: isal and the reader only for a command that reads a run)

    sizes = reading.raw_sizes(run)
    if sizes is None:
        return
    ours = os.environ.get("_RJEM_MALLOC_CONF") == ALLOCATOR  # (traceana's own setting: not the user's)
    if ours:
        os.environ["_RJEM_MALLOC_CONF"] = allocator_for(sizes)
    if reading.is_small_run(run, sizes):
        os.environ.setdefault("POLARS_MAX_THREADS", "1")
        if ours:
            os.environ["_RJEM_MALLOC_CONF"] = f"narenas:1,{os.environ['_RJEM_MALLOC_CONF']}"


def _nothing_to_tear_down() -> bool:
    """Whether skipping the interpreter's exit handlers loses nothing: not after a command that ran torch, started
    child processes or a Dask/Ray client (collect, demo, attach, analyze --dask), whose atexit handlers reap
    children and close process groups."""
    if any(m in sys.modules for m in ("torch", "distributed", "ray")):
        return False
    if "multiprocessing.process" in sys.modules and sys.modules["multiprocessing.process"].active_children():
        return False
    return True


def _is_program() -> bool:
    """Whether this interpreter was started to run traceana (not a script, notebook or test that calls ``main``)."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    if spec is not None:
        return spec.name == "traceana.__main__"
    return os.path.basename(getattr(top, "__file__", "") or "") in ("traceana", "traceana.exe", "traceana-script.py")


def _exit_now(rc: int) -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``| head``): as the command's own handler does
        _stdout_to_devnull()
        rc = rc or EXIT_SIGPIPE
    except StdoutClosed:
        pass
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()  # flush and close log files, as the exit handlers would
    os._exit(rc)


def _run_read(args: argparse.Namespace) -> str | None:
    """The run a command reads in this process (``run_dir``, or ``runs`` of which the first is read first, with
    the reading options): None for a command that reads none here."""
    path = getattr(args, "run_dir", None)
    if path is None and getattr(args, "runs", None):
        path = args.runs[0]
    if path is None or not hasattr(args, "no_cache") or getattr(args, "dask", None) is not None:
        return None
    return path


def _read_ahead(args: argparse.Namespace, *, program: bool = False) -> bool:
    """A command that reads a run in this process starts reading its first trace now, in a thread, while it imports
    polars and the analysis (``traceana.ingest.reading.read_ahead``: bounded, used only for the same file
    unchanged, never on a cache hit); as the program, a small run's settings first (``program_settings``).
    Returns whether one was started."""
    path = _run_read(args)
    if path is None:
        return False
    if program:
        program_settings(path)
    from traceana.ingest import reading  # (cost: as in program_settings)

    return reading.read_ahead(path, cache=not args.no_cache) is not None


def _main(argv: list[str] | None, *, program: bool = False) -> int:
    warnings.showwarning = _show_warning
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    ahead = _read_ahead(args, program=program)
    try:
        return int(args._run(args) or 0)
    except TraceanaError as e:
        if _signalled is not None:  # (a clean-up's error after the signal: the signal is what happened)
            return _signal_exit(_signalled)
        print(f"traceana: error: {e.line()}", file=sys.stderr)
        return 2
    except MemoryError:
        print("traceana: error: ran out of memory — the input is larger than this machine (or its memory limit) can "
              "analyse; see docs/performance.md for what each trace needs", file=sys.stderr)
        return 2
    except BaseException as e:
        rc = _ended(e)
        if rc is not None:
            return rc
        if not isinstance(e, Exception) or args.debug:
            raise
        # an internal bug: one line by default, the traceback with --debug
        first = (str(e).strip().splitlines() or [""])[0][:300]  # polars messages run over many lines
        print(printable(f"traceana: internal error: {type(e).__name__}: {first} — rerun with --debug and report it"),
              file=sys.stderr)
        return 1
    finally:
        if ahead:  # not taken (a cache hit, an error before reading): stopped, its memory freed
            from traceana.ingest import reading  # (loaded by then: it was read ahead)

            kineto = sys.modules.get("traceana.ingest.kineto")
            if kineto is not None:
                kineto.drop_finished()  # (its threads take read-aheads: first)
            reading.drop_ahead()


if __name__ == "__main__":
    sys.exit(main())
