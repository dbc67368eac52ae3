"""The files traceana reads and writes: regular files only in, outputs never over an input nor half-written.

    with open_regular(path) as fh: ...     # a regular file (through symlinks), or BadInputError: FIFO, device, dir
    refuse_inputs(output, inputs)          # BadInputError when ``output`` is one of the input files
    with atomic_path(out) as tmp:          # write ``tmp`` (any writer: polars, gzip, open); renamed onto ``out``
        frame.write_parquet(tmp)           # when the block ends, removed when it raises (Ctrl-C and SIGTERM too)
    write_bytes(out, data) / write_text(out, text)

Rules (docs/reliability.md "Files traceana reads and writes"):

- Inputs are read only when they are regular files (a symlink to one is fine): a FIFO would block forever and a
  device (``/dev/zero``, ``/dev/urandom``) never ends, so both are refused with one line before a byte is read.
- An output that is the same file as an input (the same path, another spelling of it, a symlink to it or a hard
  link of it: the same device and inode) is refused before anything is computed or written.
- Every output is written to a temporary name in its own folder (``.NAME.PID.TOKEN.tmp``) and renamed over the
  target only when it is complete: a full disk, an error or an interrupt leaves the previous file as it was and no
  partial file. The rename replaces a symlink at the target, never the file it points to.
- ``sweep_temporaries`` removes only files with that exact pattern whose writer process is gone, and only in a
  folder traceana created itself (its caches); nothing else is ever deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from traceana.errors import BadInputError

TABLE_FORMATS = ("parquet", "csv")  # what tables are written as (traceana.export; here so the CLI needs no polars)
# Ours: ".NAME.PID.TOKEN.tmp"; earlier versions wrote ".NAME.PID.tmp" (and ".NAME.PID.old" while replacing).
_TMP = re.compile(r"^\..+\.(\d+)(?:\.[0-9a-f]{8}\.tmp|\.tmp|\.old)$")
STALE_AFTER_S = 60.0  # a temporary of a dead writer older than this is swept (younger: it may be on another host)


NAME_MAX = 255  # bytes in one file name (Linux, macOS): a temporary's name must fit too
STDOUT = "-"  # ``-o -``: standard output, where a command offers it (merge)


_IN_FLIGHT: dict[str, None] = {}  # every temporary name handed out and not yet released (insertion-ordered set)


def temporary_name(path: Path) -> Path:
    """A fresh temporary name next to ``path`` that ``sweep_temporaries`` recognises, registered as in flight until
    ``release``d: a signal that ends the process at once removes what is still registered (``remove_in_flight``).
    The target's name is cut (by bytes) so that the temporary's name stays within NAME_MAX bytes: a legal
    250-byte output name must not fail "File name too long" on its temporary."""
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp = path.with_name("." + _cut(path.name, NAME_MAX - 1 - len(suffix)) + suffix)
    _IN_FLIGHT[str(tmp)] = None
    return tmp


def release(*tmps: Path) -> None:
    """The temporaries are renamed into place or removed: no longer ours to remove."""
    for t in tmps:
        _IN_FLIGHT.pop(str(t), None)


def remove_in_flight() -> None:
    """Remove every temporary still being written (files, or an analysis cache entry's folder): called by the CLI's
    signal handler right before the process ends, so an interrupt leaves no temporary behind wherever it arrives.
    Names that were renamed into place meanwhile are simply gone (nothing else is ever removed)."""
    for name in list(_IN_FLIGHT):
        try:
            if stat.S_ISDIR(os.lstat(name).st_mode):
                import shutil

                shutil.rmtree(name, ignore_errors=True)
            else:
                os.unlink(name)
        except OSError:
            pass


def _cut(name: str, limit: int) -> str:
    """``name`` cut to at most ``limit`` bytes (the bytes themselves: a cut character stays as its bytes)."""
    raw = os.fsencode(name)
    return name if len(raw) <= limit else os.fsdecode(raw[:limit])


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def file_kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | Path, *, shown: str | None = None):
    """``path`` opened for binary reading when it is a regular file; else one BadInputError line (nothing read).

    Opened non-blocking, so that a FIFO does not wait for a writer before ``fstat`` says what it is."""
    name = shown if shown is not None else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadInputError("no such file", path=name, fix="check the path") from None
    except IsADirectoryError:
        raise BadInputError("is a directory, not a file", path=name, fix="pass a file") from None
    except PermissionError:
        raise BadInputError("permission denied", path=name, fix="make the file readable (chmod +r)") from None
    except OSError as e:  # symlink loops (ELOOP), I/O errors, names the OS rejects
        raise BadInputError(f"cannot read the file ({e.strerror or e})", path=name,
                            fix="check the file and any symlinks to it") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadInputError(f"is {file_kind(mode)}, not a regular file; traceana reads regular files only",
                                path=name, fix="pass the file itself (copy it out of the pipe or device first)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def refuse_inputs(output: str | Path, inputs: Iterable[str | Path], *, flag: str = "-o") -> None:
    """BadInputError when ``output`` is the same file as one of ``inputs`` (compared by device and inode, so
    ``RUN/../RUN/./rank0…``, symlinks and hard links are all caught), or the same path once resolved (an input that
    does not exist yet, like a run folder's absent run.json, is not to be created by an output either). A device,
    FIFO, socket or directory at ``output`` is refused too (``refuse_special``)."""
    refuse_special(output, flag=flag)
    out = _identity(Path(output))
    real = os.path.realpath(output)
    for p in inputs:
        if (out is not None and _identity(Path(p)) == out) or os.path.realpath(p) == real:
            raise BadInputError(f"the output is an input file ({p}); writing it would destroy that input",
                                path=str(output), fix=f"choose another {flag} path")


def refuse_special(output: str | Path, *, flag: str = "-o") -> None:
    """BadInputError unless ``output`` is a new path or a regular file (a symlink to one is fine): a device (a
    ``mknod`` copy of /dev/null, /dev/null itself when run as root), a FIFO, a socket, a directory or a symlink to
    any of them is never replaced by an output (the rename onto it would destroy it)."""
    kind = _special(Path(output))
    if kind is not None:
        raise BadInputError(f"is {kind}; traceana writes outputs only to regular files or new paths (renaming its "
                            "output onto it would replace it)", path=str(output),
                            fix=f"choose another {flag} path" + (" (or -o - for standard output)" if flag == "-o"
                                                                  else ""))


def _special(path: Path) -> str | None:
    """What ``path`` is when an output must not replace it (through symlinks); None for nothing or a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # nothing there, or a dangling symlink (the symlink is replaced, nothing else)
        return None
    except OSError:  # unreadable: the write itself says why
        return None
    if stat.S_ISREG(mode):
        return None
    link = " (through a symlink)" if os.path.islink(path) else ""
    return file_kind(mode) + link


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds, else remove it.

    Never renamed over anything but a regular file (``refuse_special``, checked again right before the rename)."""
    path = Path(path)
    refuse_special(path)
    sweep_temporaries_of(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        with contextlib.suppress(OSError):  # keep the mode of the file replaced (else the umask's default)
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
        refuse_special(path)  # (it may have become a FIFO meanwhile)
        os.replace(tmp, path)
    except BaseException:  # errors, full disks, KeyboardInterrupt, SystemExit from SIGTERM: no partial file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        release(tmp)


def write_failure_fix(e: BaseException, *, writable: str = "choose a writable folder") -> str:
    """What to do about a failed write, from its errno: a full disk is not a permission problem."""
    import errno

    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space (the disk or the quota is full) and run again"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return writable
    if code == errno.ENOENT:
        return "check that the folder exists"
    if code == errno.ENAMETOOLONG:
        return f"use a name of at most {NAME_MAX} bytes"
    return f"free disk space, or {writable}"


def write_bytes(path: str | Path, data: bytes | memoryview) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "xb") as fh:
        fh.write(data)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8", "surrogateescape"))


def sweep_temporaries(directory: Path, *, now: float | None = None) -> int:
    """Remove temporaries (``temporary_name``) left in ``directory`` by writers that died; returns how many.

    Only for folders traceana created (its caches). A temporary of a live process, or a young one (its writer may be
    on another host sharing the folder), is kept."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        m = _TMP.match(e.name)
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or now - st.st_mtime < STALE_AFTER_S or _alive(int(m.group(1))):
                continue
            if stat.S_ISDIR(st.st_mode):
                import shutil

                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
            removed += 1
        except OSError:
            continue
    return removed


def sweep_temporaries_of(path: Path, *, now: float | None = None) -> int:
    """Remove the temporaries an earlier, killed writer of ``path`` left beside it (``kill -9`` during a merge
    leaves a ``.merged.json.gz.PID.TOKEN.tmp`` of megabytes): only names ``temporary_name(path)`` makes, of dead
    writers, older than STALE_AFTER_S — in a user's folder nothing else is touched."""
    now = time.time() if now is None else now
    longest = NAME_MAX - 1 - len(".4194304.00000000.tmp")  # the name as cut for the longest pid (7 digits)
    head = "." + _cut(path.name, longest)
    tail = _OUR_TMP if len(os.fsencode(path.name)) <= longest else _OUR_CUT_TMP  # cut: a few more of its bytes
    removed = 0
    try:
        entries = [e for e in os.scandir(path.parent) if e.name.startswith(head)]
    except OSError:
        return 0
    for e in entries:
        m = tail.fullmatch(e.name[len(head):])
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= STALE_AFTER_S and not _alive(int(m.group(1))):
                os.unlink(e.path)
                removed += 1
        except OSError:
            continue
    return removed


_OUR_TMP = re.compile(r"\.(\d+)\.[0-9a-f]{8}\.tmp")
_OUR_CUT_TMP = re.compile(r".{0,12}\.(\d+)\.[0-9a-f]{8}\.tmp", re.S)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process (or unknowable): keep its file
    return True
