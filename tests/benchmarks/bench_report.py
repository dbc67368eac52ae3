"""How long a report takes to make and how big it is, for a 4-rank run (target: a few MB).

    .venv/bin/python tests/benchmarks/bench_report.py [RUN_DIR ...]

Without arguments, collects a 4-stage tiny-GPT 1F1B run (and a BPipe one, for the A/B report) into a temporary
folder with the collectors' API (needs torch). Prints: load + analyse time, report build time (holoviews import
counted separately), file size, number of timeline blocks drawn against the number of trace events.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def strip_scaling(analysis, n: int = 1_000_000) -> None:
    """The timeline's attribution band from a million segments (a million-kernel trace): time and blocks drawn."""
    import dataclasses

    import numpy as np
    import polars as pl

    from reports import frames as F

    rng = np.random.default_rng(0)
    ranks = 4
    dur = rng.integers(1_000, 20_000, n)
    start = np.concatenate([np.cumsum(d) - d for d in np.split(dur, ranks)]) + 1_700_000_000_000_000_000
    segs = pl.DataFrame({
        "rank": np.repeat(np.arange(ranks), n // ranks).astype(np.int32), "step": np.zeros(n, np.int32),
        "category": np.array(["forward", "backward", "host", "p2p", "bubble_stall"])[rng.integers(0, 5, n)],
        "start_ns": start, "end_ns": start + dur,
    })
    t = time.perf_counter()
    strip = F.attribution_strip(dataclasses.replace(analysis, segments=segs))
    print(f"timeline band from {n:,} attribution segments: {time.perf_counter() - t:.2f} s, "
          f"{strip.height:,} blocks drawn")


def main(argv: list[str]) -> int:
    from reports.command import analyse_runs

    tmp = None
    paths = [Path(p) for p in argv]
    if not paths:
        from reports.demo_command import collect_run

        tmp = tempfile.TemporaryDirectory(prefix="bench_report_")
        t = time.perf_counter()
        paths = [collect_run(Path(tmp.name) / "baseline", bpipe=False),
                 collect_run(Path(tmp.name) / "bpipe", bpipe=True)]
        print(f"collected 2 runs of 4 ranks in {time.perf_counter() - t:.1f} s")

    t = time.perf_counter()
    analyses = analyse_runs(paths, progress=False)
    t_analyse = time.perf_counter() - t
    events = sum(a.run.events.height for a in analyses)

    t = time.perf_counter()
    import holoviews  # noqa: F401 — timed apart: it is a fixed cost of every report

    from reports import figures  # noqa: F401
    t_import = time.perf_counter() - t

    from reports import frames as F
    from reports.build import build_report

    blocks = sum(F.timeline_blocks(a).height + F.attribution_strip(a).height for a in analyses)
    for label, subset in (("single run", analyses[:1]), (f"{len(analyses)} runs (A/B)", analyses)):
        if label.startswith("single") or len(analyses) > 1:
            t = time.perf_counter()
            text = build_report(subset)
            t_build = time.perf_counter() - t
            print(f"report, {label}: {t_build:.2f} s to build, {len(text.encode()) / 2**20:.2f} MiB")
    ranks = [a.run.traces.height for a in analyses]
    print(f"runs: {', '.join(map(str, paths))} ({'/'.join(map(str, ranks))} ranks, {events:,} trace events)")
    print(f"load + analyse: {t_analyse:.2f} s; holoviews + bokeh import: {t_import:.2f} s")
    print(f"timeline blocks drawn: {blocks:,} (for {events:,} events)")
    strip_scaling(analyses[0])
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
