"""Writing ``run.json`` (``traceana.core.manifest.Manifest``) and finding out which ranks really wrote their trace.

Traces are written atomically (temporary name, then ``os.replace``), so a ``rank{R}.pt.trace.json.gz`` that exists is
complete. Stale files from an earlier run in the same directory are told apart by their modification time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path

from traceana.core.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("traceana.collectors")

TRACE_NAME = "rank{rank}.pt.trace.json.gz"
_TRACE_RE = re.compile(r"^rank(\d+)\.pt\.trace\.json\.gz$")
STALE_SLACK_S = 5.0  # clock granularity and start-up skew between ranks


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / TRACE_NAME.format(rank=rank)


def host_facts(world_size: int) -> dict[str, int]:
    """run.json's ``host_cpus`` and ``ranks_per_host``: whether the ranks had a processor each (validate says so
    when they did not). A launch without torchrun's LOCAL_WORLD_SIZE put every rank on this host."""
    return {"host_cpus": len(os.sched_getaffinity(0)),
            "ranks_per_host": int(os.environ.get("LOCAL_WORLD_SIZE", world_size))}


def ranks_written(out_dir: Path, *, since: float | None = None) -> tuple[int, ...]:
    """Ranks whose trace file exists (and, with ``since``, was written after that wall-clock time)."""
    found = []
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return ()
    for entry in entries:
        m = _TRACE_RE.match(entry.name)
        if m is None:
            continue
        try:
            if since is not None and entry.stat().st_mtime < since - STALE_SLACK_S:
                continue
        except OSError:
            continue
        found.append(int(m.group(1)))
    return tuple(sorted(found))


def wait_for_ranks(out_dir: Path, world_size: int, *, since: float, timeout_s: float) -> tuple[int, ...]:
    """Polls (no collective: a crashed rank must not hang the others) until every rank wrote or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        written = ranks_written(out_dir, since=since)
        if len(written) >= world_size or time.monotonic() >= deadline:
            return written
        time.sleep(0.2)


def write_manifest(out_dir: Path, manifest: Manifest) -> Path | None:
    """Atomically write run.json; a failure is a warning, never an exception (profiling must not break training)."""
    from traceana.core.errors import BadInputError
    from traceana.core.files import write_text

    path = Path(out_dir) / MANIFEST_NAME
    try:  # traceana's one writer: a temporary renamed into place, through a symlink to its target, never a device
        write_text(path, manifest.to_json())
        return path
    except (OSError, BadInputError) as e:
        log.warning("traceana: could not write %s (%s); training goes on without a manifest", path,
                    getattr(e, "strerror", None) or e)
        return None


def finalize_manifest(out_dir: Path, manifest: Manifest, *, since: float | None = None) -> Path | None:
    """Write run.json with ``ranks_written`` taken from the files actually on disk."""
    return write_manifest(out_dir, dataclasses.replace(manifest, ranks_written=ranks_written(out_dir, since=since)))
