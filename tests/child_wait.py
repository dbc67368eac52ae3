"""Waiting for a child process to end, with a hang guard measured in the child's own time, not the wall clock.

On a loaded machine (2 cores, 8 CPU-bound processes beside the suite) a child can wait a long time for a CPU: a
wall-clock limit then fails a child that is merely slow. What a hung child does instead is either run without
ending (its CPU time grows) or stop wanting a CPU at all (blocked: a deadlock, a sleep that does not wake). Linux's
schedstat (``/proc/PID/task/TID/schedstat``: time on a CPU, time runnable but waiting for one) tells the two from
slowness: every thread's running and waiting, summed, is the time the child wanted a CPU; the wall time less that
is the time nothing of it could run.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def _wanted_ns(pid: int, seen: dict[int, int]) -> int:
    """The child's threads' time on a CPU or waiting for one, summed: ``seen`` keeps each thread's last reading, so a
    thread that has ended keeps what it had."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return sum(seen.values())
    for t in tasks:
        try:
            cpu, waited, _ = (int(x) for x in (t / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        seen[int(t.name)] = cpu + waited
    return sum(seen.values())


def _cpu_s(pid: int) -> float | None:
    """The child's CPU time (user + system, all threads), seconds; None where /proc cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_unless_hung(proc: subprocess.Popen, *, cpu_s: float = 5.0, stuck_s: float = 10.0,
                     wall_s: float = 900.0) -> int:
    """``proc``'s exit code once it ends. Fails (AssertionError) if, from now, it ran ``cpu_s`` of CPU without
    ending (it does not stop), or ``stuck_s`` of wall time went by in which none of its threads ran or waited for a
    CPU (it is blocked, not slow), or, as a backstop where /proc cannot be read, after ``wall_s``. The waiting for a
    CPU a loaded machine imposes counts against neither."""
    start, cpu0 = time.monotonic(), _cpu_s(proc.pid)
    seen: dict[int, int] = {}
    wanted0 = _wanted_ns(proc.pid, seen)
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        wall = time.monotonic() - start
        cpu = _cpu_s(proc.pid)
        wanted = (_wanted_ns(proc.pid, seen) - wanted0) / 1e9  # (a thread started since: all its time)
        if cpu is not None and cpu0 is not None and cpu - cpu0 >= cpu_s:
            raise AssertionError(f"pid {proc.pid} ran {cpu - cpu0:.1f} s of CPU ({wall:.1f} s wall) without ending")
        if cpu is not None and wall - wanted >= stuck_s:
            raise AssertionError(f"pid {proc.pid} is blocked: in {wall:.1f} s its threads ran or waited for a CPU "
                                 f"{wanted:.1f} s only")
        if wall >= wall_s:
            raise AssertionError(f"pid {proc.pid} did not end in {wall:.0f} s")
