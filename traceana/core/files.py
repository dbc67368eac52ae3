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
  partial file.
- An output path that is a symlink is never replaced: the output is written (atomically, as above) at the file the
  link finally names, and the link stays (``output_target``). A path naming one of the process' own file
  descriptors — ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``, or a symlink to one — is
  ``-o -``: the output goes to that stream (``descriptor_of``); nothing in /dev or /proc is ever replaced.
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

from traceana.core.errors import BadInputError

# what tables are written as (traceana.commands.export; here so the CLI needs no polars)
TABLE_FORMATS = ("parquet", "csv")
# Ours: ".NAME.PID.TOKEN.tmp"; earlier versions wrote ".NAME.PID.tmp" (and ".NAME.PID.old" while replacing).
_TMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")
# (apart, and tried second: in one pattern ".NAME.PID.01234567.tmp", whose token happens to be all digits, one in
# 43, read as the older form of a dead "PID" 1234567, and a live writer's temporary was swept)
_OLD_TMP = re.compile(r"^\..+\.(\d+)\.(?:tmp|old)$")
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


SHORT_NAME_BYTES = 100  # a cache entry named after an input keeps the input's name up to this many bytes


def short_name(name: str, limit: int = SHORT_NAME_BYTES) -> str:
    """``name`` itself when it is at most ``limit`` bytes, else its first whole characters and a hash of all of it
    (``~`` and 16 hex digits), at most ``limit`` bytes in all: a cache entry named after an input (a 216-byte rank
    file is legal) stays readable and within NAME_MAX with its key and suffix, whatever the input's name."""
    import hashlib

    raw = os.fsencode(name)
    if len(raw) <= limit:
        return name
    digest = hashlib.sha1(raw).hexdigest()[:16]
    head = raw[:limit - 17].decode("utf-8", "ignore") if _utf8(raw) else os.fsdecode(raw[:limit - 17])
    return f"{head}~{digest}"


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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


_MAX_LINKS = 40  # symlinks followed in one path (the kernel's own limit)
# a path naming one of this process' file descriptors once its folders are resolved (/dev/fd is /proc/self/fd)
_DESCRIPTOR = re.compile(r"/dev/(?P<std>stdin|stdout|stderr)|/dev/fd/(?P<dev>\d+)"
                         r"|/proc/(?P<pid>self|thread-self|\d+)(?:/task/(?P<tid>\d+))?/fd/(?P<proc>\d+)")
_STD = {"stdin": 0, "stdout": 1, "stderr": 2}


def _named_fd(path: str) -> int | None:
    m = _DESCRIPTOR.fullmatch(path)
    if m is None:
        return None
    if m["std"] is not None:
        return _STD[m["std"]]
    if m["dev"] is not None:
        return int(m["dev"])
    if m["pid"] not in ("self", "thread-self", str(os.getpid())):
        return None  # another process' descriptor: a path like any other
    return int(m["proc"])


def descriptor_of(path: str | Path) -> int | None:
    """The file descriptor of this process that ``path`` names — ``-`` (standard output), ``/dev/stdout``,
    ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N`` (or this pid's), or a symlink, or a chain of them, ending
    at one — else None. Told by the names themselves, never by what the descriptor points to: ``/proc/self/fd/1``
    of ``> F`` resolves to F, and renaming a file onto F would leave the shell's F empty (its descriptor holds the
    old inode)."""
    if str(path) == STDOUT:
        return 1
    p = os.path.abspath(os.fspath(path))
    for _ in range(_MAX_LINKS):
        folder, name = os.path.split(p)
        p = os.path.join(os.path.realpath(folder), name)  # its folders resolved (/dev/fd -> /proc/PID/fd)
        fd = _named_fd(p)
        if fd is not None:
            return fd
        try:
            target = os.readlink(p)
        except (OSError, ValueError):  # not a symlink (or nothing there): a file path
            return None
        p = os.path.normpath(os.path.join(os.path.dirname(p), target))  # (an absolute target replaces the folder)
    return None


def output_target(path: str | Path) -> Path:
    """Where an output named ``path`` is written: ``path`` itself, or, when it is a symlink (a chain of them), the
    path the last link names (created when it does not exist yet, as the shell's ``>`` does) — so that the rename
    replaces the target's content and never the link. A symlink loop is refused (BadInputError)."""
    p = Path(path)
    if not os.path.islink(p):
        return p
    target = Path(os.path.realpath(p))
    if os.path.islink(target):  # realpath gives up on a loop (ELOOP) and hands back a link
        raise BadInputError("is a symlink that loops (it never reaches a file)", path=str(path),
                            fix="fix the symlink or choose another output path")
    return target


def output_stream(fd: int, *, shown: str):
    """A binary file object writing to descriptor ``fd`` (``descriptor_of``): standard output and error through
    Python's own streams (so that what was printed before stays in order, and a closed standard output raises),
    another descriptor when it is open for writing; else BadInputError."""
    import sys

    std = {1: sys.stdout, 2: sys.stderr}.get(fd)
    if std is not None:
        std.flush()
        return getattr(std, "buffer", std)
    import fcntl

    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        raise BadInputError(f"names file descriptor {fd}, which is not open", path=shown,
                            fix=f"open it ({fd}>FILE) or choose a file path") from None
    if mode not in (os.O_WRONLY, os.O_RDWR):
        raise BadInputError(f"names file descriptor {fd}, which is not open for writing", path=shown,
                            fix=f"open it for writing ({fd}>FILE) or choose a file path")
    return os.fdopen(fd, "wb", closefd=False)


def refuse_inputs(output: str | Path, inputs: Iterable[str | Path], *, flag: str = "-o") -> None:
    """BadInputError when ``output`` is the same file as one of ``inputs`` (compared by device and inode, so
    ``RUN/../RUN/./rank0…``, symlinks and hard links are all caught), or the same path once resolved (an input that
    does not exist yet, like a run folder's absent run.json, is not to be created by an output either). A device,
    FIFO, socket or directory at ``output`` is refused too (``refuse_special``). A descriptor (``descriptor_of``)
    is a stream, not a file: nothing to compare."""
    if descriptor_of(output) is not None:
        return
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
    any of them is never replaced by an output (the rename onto it would destroy it). A path naming a descriptor
    (``/dev/stdout``) is a stream, written as ``-o -``."""
    if descriptor_of(output) is not None:
        return
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

    Never renamed over anything but a regular file (``refuse_special``, checked again right before the rename), and
    never over a symlink: through one, the temporary is made beside the file the link names and renamed onto that
    (``output_target``). A path naming a descriptor (``/dev/stdout``) gets a temporary file in the temporary folder,
    copied to that stream when the block succeeds (``-o -``)."""
    fd = descriptor_of(path)
    if fd is not None:
        with _through_stream(fd, shown=str(path)) as tmp:
            yield tmp
        return
    path = output_target(path)
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
        if os.path.islink(path):  # (or a symlink: never replaced)
            raise BadInputError("became a symlink while it was being written; it was left as it is", path=str(path),
                                fix="run again")
        os.replace(tmp, path)
    except BaseException:  # errors, full disks, KeyboardInterrupt, SystemExit from SIGTERM: no partial file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        release(tmp)


@contextlib.contextmanager
def _through_stream(fd: int, *, shown: str) -> Iterator[Path]:
    """``atomic_path`` for a descriptor: the writer (polars, gzip: they want a path) writes a temporary in the
    temporary folder, copied to the stream once complete — a failed write sends nothing."""
    import shutil
    import tempfile

    out = output_stream(fd, shown=shown)  # (refused before anything is computed: not open, not writable)
    tmp = temporary_name(Path(tempfile.gettempdir()) / "traceana-output")
    try:
        yield tmp
        with open(tmp, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
        out.flush()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
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


def os_error_of(e: BaseException, folder: str | Path, needed: int = 0) -> BaseException:
    """``e`` as the OSError it stands for, so that ``write_failure_fix`` and the message can say what happened. A
    library that writes in native code may hide the errno: polars reports a full disk as "underlying IO error: No
    space left on device (os error 28)", or — when the disk fills while it writes a Parquet footer — as "Invalid
    thrift: transport error", with no errno at all. The errno in the text is taken; without one, a write into a
    file system with less free than ``needed`` bytes (what was being written) and 1 MiB is a full disk."""
    import errno

    if isinstance(e, OSError) and e.errno is not None:
        return e
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    try:
        st = os.statvfs(folder)
    except (OSError, ValueError, AttributeError):
        return e
    free = st.f_bavail * st.f_frsize
    if free < needed + (1 << 20):
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free // 1024:,} KiB free there")
    return e


def failure_reason(e: BaseException) -> str:
    """What went wrong, for a warning: an OSError's own words (``os_error_of`` gives one), else the exception's type
    and its first line (polars' messages run over many)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


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
    on another host sharing the folder), is kept; a temporary folder (an analysis cache entry being written) is
    young while anything in it is (``_newest``: a writer adding a table to it changes the folder's mtime, and
    writing a large one changes only the table's)."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        m = _TMP.match(e.name) or _OLD_TMP.match(e.name)
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or now - _newest(e.path, st) < STALE_AFTER_S or _alive(int(m.group(1))):
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


def _newest(path: str, st: os.stat_result) -> float:
    """The latest mtime of ``path`` and, for a folder, of what it holds (one level: a cache entry's tables)."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_mtime
    newest = st.st_mtime
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    continue
    except OSError:
        pass
    return newest


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
