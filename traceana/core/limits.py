"""Bounded memory on any input: the stated rules, and the memory limit they are measured against.

Rules (docs/reliability.md "Bounded memory"):

- ``MAX_VALUE_BYTES``: no single trace event, and no part of a trace's top level before its ``traceEvents`` array,
  may exceed 64 MiB of JSON. Kineto's largest events (long stacks, record_shapes lists) are a few hundred KB; a
  bigger one is a damaged or hostile file (a 2 GiB string in a 2 MB gzip), refused as soon as the reader has seen
  that much of it.
- ``short_of_room()`` after every batch of events: the memory still free must stay at least twice what reading
  the trace has taken so far (the growth of the process' resident size against the resident limits, and of its
  virtual size against an address-space limit, since the trace was opened; measured on a 3 M-event trace:
  building the final tables then takes about 1.5x that again). So a gzip bomb of
  tiny events is refused while it is being read, with a line saying how many events it had, instead of the process
  being killed (or aborting when an allocation fails under ``prlimit --as``).
- The general decoder (used when the native scanner is not built or hands a file back) streams as the scanner
  does: it holds a JSON of at most 16 MiB whole, a larger one through a window of at most two 4 MB chunks ahead
  or one value (``MAX_VALUE_BYTES``), with the same two rules.
- ``analysis_short()`` before analysing a loaded run: ``ANALYSIS_BYTES_PER_EVENT`` per event must fit in the
  resident memory left, and twice that in the address space left, else one line says so (instead of polars
  aborting on a failed allocation under ``prlimit --as``).

Limits: resident memory may not pass the smallest of ``TRACEANA_MEMORY_LIMIT`` (bytes; K/M/G/T suffixes), the
cgroup's ``memory.max`` and the machine's physical memory; virtual memory may not pass ``RLIMIT_AS``
(``prlimit --as``, ``ulimit -v``).
"""

from __future__ import annotations

import os
import re

from traceana.core.errors import BadInputError
from traceana.core.units import GIB, KIB, MIB, TIB, bytes_text

MAX_VALUE_BYTES = 64 * MIB
ENV = "TRACEANA_MEMORY_LIMIT"
_SUFFIX = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": TIB}


def _env_limit() -> int | None:
    text = os.environ.get(ENV, "").strip().upper().removesuffix("B").removesuffix("I")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", text)
    return int(float(m.group(1)) * _SUFFIX[m.group(2)]) if m else None


def _status() -> tuple[int, int]:
    """(virtual size, resident size) of this process in bytes (0 where /proc does not say)."""
    vm = rss = 0
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmSize:"):
                    vm = int(line.split()[1]) * KIB
                elif line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        pass
    return vm, rss


def _address_space() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return soft


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _physical() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def usage() -> tuple[int, int]:
    """(virtual, resident) bytes of this process now."""
    return _status()


def _limits() -> tuple[int | None, int | None]:
    """(limit on resident memory, limit on address space): None where there is none."""
    resident = [v for v in (_env_limit(), _cgroup_limit(), _physical()) if v]
    return (min(resident) if resident else None), _address_space()


def room(now: tuple[int, int] | None = None) -> int:
    """Bytes this process may still allocate (see the module docstring)."""
    vm, rss = now if now is not None else _status()
    resident, address_space = _limits()
    left = [v for v in (None if resident is None else resident - rss,
                        None if address_space is None else address_space - vm) if v is not None]
    return max(min(left), 0) if left else 1 << 50


def short_of_room(since: tuple[int, int], now: tuple[int, int], factor: float = 2.0) -> tuple[int, int] | None:
    """(taken, left) when ``factor`` times what the process took since ``since`` no longer fits in what is left —
    resident memory against the resident limits, and virtual memory against an address-space limit (under
    ``prlimit --as`` reserved but untouched memory counts too); None while both fit."""
    resident, address_space = _limits()
    for limit, i in ((resident, 1), (address_space, 0)):
        if limit is None:
            continue
        taken, left = max(now[i] - since[i], 0), max(limit - now[i], 0)
        if factor * taken > left:
            return taken, left
    return None


# Analysing a loaded run (pairing, schedule, segments, attribution: polars joins over every event) grew the
# process by ~580 bytes per event resident (measured: 2 M and 3 M-event runs, 1.16 and 1.75 GB) and about twice
# that in address space (polars' allocations reserve more than they touch).
ANALYSIS_BYTES_PER_EVENT = 600


def analysis_short(n_events: int) -> tuple[int, int] | None:
    """(needed, left) when analysing ``n_events`` loaded events would not fit: ANALYSIS_BYTES_PER_EVENT per event
    against the resident memory left, twice that against the address space left (``prlimit --as``); None when
    both fit."""
    vm, rss = _status()
    resident, address_space = _limits()
    for limit, used, factor in ((resident, rss, 1), (address_space, vm, 2)):
        if limit is not None:
            need, left = factor * ANALYSIS_BYTES_PER_EVENT * n_events, max(limit - used, 0)
            if need > left:
                return need, left
    return None


def gib(n: int) -> str:
    return bytes_text(n, 2 if n >= GIB else 0)


# Numbers a trace or run.json declares that would size memory or time, checked against what is present (docs/
# reliability.md "Absurd metadata"): refused above these with one line naming the field.
MAX_RANKS = 1 << 20  # world_size (distributedInfo, traceana metadata, run.json): the largest jobs have ~10^5 ranks
MAX_SCHEDULE_SLOTS = 1 << 16  # pp × virtual stages × micro-batches of one simulated step: the schedule simulator
# steps through every (stage, micro-batch) pass in Python, ~0.6 ms each with the BPipe verdict's ~45 simulations
# (pp 64 × m 128 = 8,192 slots: 7 s on 2 loaded cores), so this bounds `traceana estimate` to about a minute


def check_ranks(world_size: int, field: str, path: str | None = None) -> None:
    """BadInputError when a declared world size is beyond MAX_RANKS."""
    if world_size > MAX_RANKS:
        raise BadInputError(f"{field} is {world_size:,}: more ranks than any job has (traceana reads at most "
                            f"{MAX_RANKS:,})", path=path, fix=f"fix {field}")


def schedule_slots_error(pp: int, virtual_stages: int, num_microbatches: int) -> str | None:
    """Why a step of this size is not simulated (None when it is within MAX_SCHEDULE_SLOTS)."""
    slots = pp * virtual_stages * num_microbatches
    if slots <= MAX_SCHEDULE_SLOTS:
        return None
    return (f"pp {pp:,} × virtual stages {virtual_stages:,} × micro-batches {num_microbatches:,} = {slots:,} stage "
            f"passes per step: more than the schedule simulator steps through ({MAX_SCHEDULE_SLOTS:,}, about a minute "
            "with the BPipe verdict)")


def how_to_raise() -> str:
    return (f"analyse it on a machine with more memory, or raise the limit ({ENV}, ulimit -v) if it is a real "
            "trace — see docs/reliability.md")
