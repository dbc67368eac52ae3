"""Watch a folder as profiling windows land and print each window's per-stage attribution as it arrives.

  traceana watch runs/x                 # a run directory of traceana attach (one window, or steps*/ sub-directories)
  traceana watch tb_logs/ --count 3     # a folder tensorboard_trace_handler writes into: one trace per worker per cycle

For every window: step time, compute, exposed P2P and BPipe transfers, collectives, bubbles by kind (warm-up,
cool-down, stall) and host time per stage (the same attribution as traceana analyze), then the step time of every window
so far against the first, and the latest window's pipeline step against the first's with its noise interval
(traceana/measure/noise.py: "within noise" where the windows cannot be told apart; JSON ``vs_first_step``). A window is
taken once its files have stopped changing (--settle) and, for a run directory with run.json, once every rank's trace is
there (or its job has ended). Stop with Ctrl-C, --count or --timeout.
"""

# Function-local imports here: order and cost. This module is imported to build the parser, before polars;
# polars, and what imports it, must come after the program's settings for a small run (traceana.cli), so
# they are imported in ``run`` and the functions it calls (docs/architecture.md "Function-local imports").

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from traceana.commands import options
from traceana.core.errors import BadInputError, TraceanaError, shown
from traceana.core.files import file_kind
from traceana.core.units import NS_PER_S

# tensorboard_trace_handler names files "{worker_name}.{time_ns}.pt.trace.json[.gz]" (torch.profiler.profiler).
TB_NAME = re.compile(r"^(?P<worker>.+)\.(?P<ts>\d+)\.pt\.trace\.json(\.gz)?$")
PARTIAL = ".partial"  # collectors write "….partial" temporaries, then rename

def _rows() -> tuple[tuple[str, str], ...]:
    """The rows of a window's table: (label, column of ``window_table``); the categories' labels are schema's
    (imported here: building the parser imports no polars)."""
    from traceana.core.schema import CATEGORY_LABELS

    cats = ("p2p", "bpipe", "collective", "bubble_warmup", "bubble_cooldown", "bubble_stall", "host")
    return (("step ms", "step_ms"), ("compute", "compute_ms"), *((CATEGORY_LABELS[c], f"{c}_ms") for c in cats))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="RUN_DIR", help="a run directory, a folder of window run directories, or "
                                                         "a folder tensorboard_trace_handler writes into")
    parser.add_argument("--once", action="store_true", help="print the windows there now and exit")
    parser.add_argument("--count", type=options.positive_int, metavar="N",
                        help="exit after N windows (default: keep watching)")
    parser.add_argument("--timeout", type=options.seconds(above_zero=True), metavar="S",
                        help="exit after S seconds without a new window (default: never)")
    parser.add_argument("--interval", type=options.seconds(above_zero=True), default=1.0, metavar="S",
                        help="poll every S seconds")
    parser.add_argument("--settle", type=options.seconds(above_zero=False), default=2.0, metavar="S",
                        help="a file is complete once unchanged for S seconds")
    parser.add_argument("--json", action="store_true", help="one JSON object per window instead of tables")
    options.names(parser)


# --- finding windows ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    key: str  # identity: the directory, or the tensorboard files
    label: str
    files: tuple[Path, ...]  # the traces
    run_dir: Path | None  # analysed as is; None: ``files`` are linked into a temporary directory first
    order: tuple


def ready_windows(root: Path, *, settle_s: float, now: float | None = None) -> list[Window]:
    """The windows under ``root`` whose traces are complete, in the order they were taken."""
    from traceana.ingest.run_dir import find_traces
    from traceana.core.manifest import MANIFEST_NAME

    now = time.time() if now is None else now
    found: list[Window] = []
    try:
        traces = find_traces(root)
    except BadInputError:
        return found
    loose = [p for p in traces if TB_NAME.match(p.name)]
    if (root / MANIFEST_NAME).exists() or len(loose) < len(traces):
        window = _run_dir_window(root, [p for p in traces if p not in loose], settle_s=settle_s, now=now)
        if window is not None:
            found.append(window)
    elif loose:
        found.extend(_tensorboard_windows(loose, settle_s=settle_s, now=now))
    try:
        subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        subdirs = []
    for d in subdirs:
        try:
            files = find_traces(d)
        except BadInputError:
            continue
        window = _run_dir_window(d, files, settle_s=settle_s, now=now) if files else None
        if window is not None:
            found.append(window)
    return sorted(found, key=lambda w: w.order)


def _settled(files, *, settle_s: float, now: float) -> float | None:
    """The newest modification time of ``files`` if none changed in the last ``settle_s`` seconds, else None."""
    try:
        newest = max(f.stat().st_mtime for f in files)
    except (OSError, ValueError):
        return None
    return newest if newest <= now - settle_s else None


def _run_dir_window(d: Path, files: list[Path], *, settle_s: float, now: float) -> Window | None:
    from traceana.ingest.kineto import rank_from_filename
    from traceana.core.manifest import MANIFEST_NAME, Manifest

    if not files or any(p.name.endswith(PARTIAL) for p in d.iterdir()):
        return None
    newest = _settled(files, settle_s=settle_s, now=now)
    if newest is None:
        return None
    label, start = d.name, None
    if (d / MANIFEST_NAME).exists():
        try:
            manifest = Manifest.read(d / MANIFEST_NAME)
        except TraceanaError:
            if _settled([d / MANIFEST_NAME], settle_s=settle_s, now=now) is None:
                return None  # being rewritten: wait
            manifest = None  # broken and no longer changing: the window's analysis says what is wrong with it
        attach = manifest.attach if manifest is not None else None
        ranks = {rank_from_filename(p) for p in files}
        if attach is not None:
            complete = len({r for r in ranks if 0 <= r < manifest.world_size}) == manifest.world_size
            if not complete and not attach.get("job"):
                return None  # a rank's trace is still to come and its job is running
            label, start = f"steps {attach.get('steps', '?')}", (attach.get("window") or [None])[0]
    return Window(key=str(d), label=label, files=tuple(files), run_dir=d,
                  order=(start if start is not None else float("inf"), newest, str(d)))


def _tensorboard_windows(files: list[Path], *, settle_s: float, now: float) -> list[Window]:
    """Window k = every worker's k-th file (by its time stamp), once each worker has one and none is changing."""
    by_worker: dict[str, list[tuple[int, Path]]] = {}
    for p in files:
        m = TB_NAME.match(p.name)
        by_worker.setdefault(m.group("worker"), []).append((int(m.group("ts")), p))
    for items in by_worker.values():
        items.sort()
    out = []
    k = 0
    while all(len(items) > k for items in by_worker.values()):
        chosen = [items[k][1] for items in by_worker.values()]
        newest = _settled(chosen, settle_s=settle_s, now=now)
        if newest is None:
            break
        first_ts = min(items[k][0] for items in by_worker.values())
        out.append(Window(key="|".join(sorted(map(str, chosen))), label=f"cycle {k + 1}", files=tuple(sorted(chosen)),
                          run_dir=None, order=(float("inf"), first_ts / NS_PER_S, str(chosen[0]))))
        k += 1
    return out


# --- tables (pure) -----------------------------------------------------------------------------------------------
def window_table(stages):
    """``Analysis.stages`` → one row per rank: step time and the ms of each row in ``_rows()`` (compute = the sum of the
    compute categories, bubbles = the sum of the bubble kinds)."""
    import polars as pl

    from traceana.core.schema import BUBBLE_CATEGORIES, COMPUTE_CATEGORIES

    cats = [c for _, c in _rows() if c not in ("step_ms", "compute_ms")]
    return stages.select(
        "rank", "stage", *(["stages"] if "stages" in stages.columns else []), "steps", "step_ms",
        compute_ms=pl.sum_horizontal(pl.col(f"{c}_ms").fill_null(0) for c in COMPUTE_CATEGORIES),
        bubble_ms=pl.sum_horizontal(pl.col(f"{c}_ms").fill_null(0) for c in BUBBLE_CATEGORIES),
        *(pl.col(c).fill_null(0) for c in cats),
    ).sort("rank")


def running_comparison(history):
    """``history`` (window, label, rank, stage, step_ms, compute_ms, bubble_ms; window 0 first) → the same with the
    change of step time, compute and bubbles against the first window of each rank (ms and % of the first)."""
    import polars as pl

    first = history.filter(pl.col("window") == pl.col("window").min()).select(
        "rank", first_step_ms="step_ms", first_compute_ms="compute_ms", first_bubble_ms="bubble_ms")
    return (
        history.join(first, on="rank", how="left")
        .with_columns(
            d_step_ms=pl.col("step_ms") - pl.col("first_step_ms"),
            d_compute_ms=pl.col("compute_ms") - pl.col("first_compute_ms"),
            d_bubble_ms=pl.col("bubble_ms") - pl.col("first_bubble_ms"),
        )
        .with_columns(d_step_pct=pl.when(pl.col("first_step_ms") > 0)
                      .then(100 * pl.col("d_step_ms") / pl.col("first_step_ms")))
        .drop("first_step_ms", "first_compute_ms", "first_bubble_ms")
        .sort("window", "rank")
    )


def _against_first(steps_of: list[tuple[float, ...]]):
    """The latest window's pipeline step against the first window's, with its noise (traceana.measure.noise); None for
    the first window or without measured steps. Within one job the windows' steps are the samples
    (traceana.measure.noise.compare_steps); across runs the unit is the run (traceana.measure.noise.between_runs)."""
    from traceana.measure.noise import compare_steps

    if len(steps_of) < 2 or not steps_of[0] or not steps_of[-1]:
        return None
    return compare_steps(steps_of[0], steps_of[-1])


# --- analysing and printing --------------------------------------------------------------------------------------
def analyse_window(window: Window, names=None):
    """(the window's ``Analysis``, its notes): traceana analyze's attribution; no cache is written next to a live
    job's files, and a folder's other cycles are not read with this one."""
    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.ingest.run_dir import IngestWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IngestWarning)  # the window's notes are printed with it
        if window.run_dir is not None:
            analysis = load_and_analyze(window.run_dir, cache=False, names=names)
            return analysis, list(analysis.notes) + list(analysis.run.warnings)
        with tempfile.TemporaryDirectory(prefix="traceana-watch-") as tmp:
            for f in window.files:
                (Path(tmp) / f.name).symlink_to(f.resolve())
            analysis = load_and_analyze(tmp, cache=False, names=names)
        folder = str(window.files[0].parent)  # notes name the user's files, not the links
        return analysis, [n.replace(tmp, folder) for n in (*analysis.notes, *analysis.run.warnings)]


def _ms(ms: float | None, step: float | None) -> str:
    if ms is None:
        return "–"
    if not ms:
        return "·"
    return f"{ms:,.2f} ({100 * ms / step:.0f}%)" if step else f"{ms:,.2f}"


def print_window(console, n: int, window: Window, table, comparison, notes: list[str]) -> None:
    """One window: its mean step per rank, the step against window 1 once there are several, and its new notes."""
    from traceana.core.tables import print_line, print_table, stage_label

    rows = table.to_dicts()  # one dict per rank: display only
    print_line(console, f"{window.label} — {window.run_dir or Path(window.files[0]).parent}",
               prefix=f"[bold]window {n}[/]: ")
    heads = ["", *(f"{stage_label(r['stage'], r.get('stages'))}\nrank {r['rank']}" for r in rows)]
    body = [["steps", *(str(r["steps"] or 0) for r in rows)]]
    sections = []
    for label, col in _rows():
        if col == "step_ms":
            body.append([label, *("–" if r["step_ms"] is None else f"{r['step_ms']:,.2f}" for r in rows)])
            sections.append(len(body) - 1)
        else:
            body.append([label, *(_ms(r[col], r["step_ms"]) for r in rows)])
    print_table(console, "mean per step: ms (% of the step)", heads, body, sections=sections)
    if comparison["window"].n_unique() > 1:
        ranks = sorted(set(comparison["rank"].to_list()))
        held = table["stages"].to_list() if "stages" in table.columns else [None] * table.height
        stage_of = {r: (s, h) for r, s, h in zip(table["rank"].to_list(), table["stage"].to_list(), held)}
        heads = ["window", *(f"{stage_label(*stage_of.get(r, (None, None)))}\nrank {r}" for r in ranks)]
        body = []
        for (w, label), part in comparison.group_by("window", "label", maintain_order=True):  # one row per window
            by_rank = {d["rank"]: d for d in part.to_dicts()}
            cells = []
            for r in ranks:
                d = by_rank.get(r)
                if d is None or d["step_ms"] is None:
                    cells.append("–")
                elif w == 0:
                    cells.append(f"{d['step_ms']:,.2f}")
                else:
                    pct = "" if d["d_step_pct"] is None else f", {d['d_step_pct']:+.1f}%"
                    cells.append(f"{d['step_ms']:,.2f} ({d['d_step_ms']:+,.2f}{pct})")
            body.append([f"{w + 1}: {label}", *cells])
        print_table(console, "step ms vs window 1", heads, body)
    for note in notes:
        print_line(console, note, prefix="[yellow]note:[/] ")


def watch(root: Path, *, once: bool = False, count: int | None = None, timeout_s: float | None = None,
          interval_s: float = 1.0, settle_s: float = 2.0, as_json: bool = False,
          stop: threading.Event | None = None, console=None, names=None) -> int:
    """Poll ``root`` and print every new window; returns how many were printed. ``stop``: end once it is set (after
    a last look: ``traceana attach --live`` sets it when its job has ended). ``names``: the name rules
    (``traceana.core.names.NameRules``; default: each window's run.json, else the built-ins)."""
    import polars as pl

    from traceana.core.tables import console as tables_console, print_line

    console = console or tables_console()
    seen: set[str] = set()
    history = []
    steps_of: list[tuple[float, ...]] = []  # each window's measured step times (the noise rule's samples)
    first_notes: set[str] | None = None
    printed = 0
    last_new = time.monotonic()
    while True:
        finishing = stop is not None and stop.is_set()
        for window in ready_windows(root, settle_s=0.0 if finishing else settle_s):
            if window.key in seen:
                continue
            seen.add(window.key)
            try:
                analysis, notes = analyse_window(window, names)
            except TraceanaError as e:
                print_line(console, f"traceana: warning: window {window.label}: {e.line()}", style="yellow")
                continue
            table = window_table(analysis.stages)
            steps_of.append(analysis.summary.step_times_ms)
            noise = _against_first(steps_of)
            history.append(table.select("rank", "stage", "step_ms", "compute_ms", "bubble_ms")
                           .with_columns(window=pl.lit(len(history)), label=pl.lit(window.label)))
            comparison = running_comparison(pl.concat(history, how="vertical_relaxed"))
            if first_notes is None:
                first_notes, shown = set(notes), notes
            else:
                shown = [n for n in notes if n not in first_notes]  # only what is new against the first window
            printed += 1
            if as_json:
                latest = comparison.filter(pl.col("window") == len(history) - 1)
                print(json.dumps({"window": printed, "label": window.label,
                                  "path": str(window.run_dir or window.files[0].parent),
                                  "stages": table.to_dicts(), "vs_first": latest.to_dicts(),
                                  "vs_first_step": None if noise is None else noise.as_dict(), "notes": shown},
                                 default=str), flush=True)
            else:
                print_window(console, printed, window, table, comparison, shown)
                if noise is not None:
                    print_line(console, f"window {printed} against window 1: {noise.words(what='pipeline step')}")
            last_new = time.monotonic()
            if count is not None and printed >= count:
                return printed
        if once or finishing:
            return printed
        if timeout_s is not None and time.monotonic() - last_new >= timeout_s:
            return printed
        if stop is not None:
            stop.wait(interval_s)
        else:
            time.sleep(interval_s)


def run(args: argparse.Namespace) -> int:
    root = Path(args.path)
    if not root.is_dir():
        raise BadInputError("not a directory", path=root,
                            fix="pass the run directory (or the folder the profiler writes into)")
    for name, value in (("--interval", args.interval), ("--settle", args.settle), ("--timeout", args.timeout),
                        ("--count", args.count)):
        if value is not None and value < 0 or name in ("--interval", "--count") and value == 0:
            raise BadInputError(f"{name} must be positive, got {value}", fix=f"give a positive {name}")
    names = None
    if args.names is not None:  # a bad rules file is refused now, not once per window
        from traceana.core.names import load_rules

        names = load_rules(args.names)
    try:
        printed = watch(root, once=args.once, count=args.count, timeout_s=args.timeout, interval_s=args.interval,
                        settle_s=args.settle, as_json=args.json, names=names)
    except KeyboardInterrupt:  # the normal way to stop watching
        print("", file=sys.stderr)
        return 0
    if not printed:
        why = _what_blocks(root, settle_s=args.settle)
        print(f"traceana watch: no complete window in {root}" + (f" ({why})" if why else ""), file=sys.stderr)
    return 0


def _what_blocks(root: Path, *, settle_s: float | None) -> str | None:
    """Why no window was complete, when a file shows it: a FIFO or device named like a trace, a trace still being
    written (a ``.partial`` name, or changed within the settle time), or no trace at all."""
    import os
    import stat
    import time

    from traceana.ingest.reading import is_trace_name

    settle = 2.0 if settle_s is None else settle_s
    try:
        dirs = [root, *(p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith("."))]
    except OSError:
        return None
    traces = 0
    for d in dirs:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            continue
        for p in entries:
            if p.name.endswith(PARTIAL):
                return f"{shown(p)} is still being written"
            if not is_trace_name(p):
                continue
            traces += 1
            try:
                st = os.stat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                return f"{shown(p)} is {file_kind(st.st_mode)}, not a trace file"
            if st.st_mtime > time.time() - settle:
                return f"{shown(p)} changed less than {settle:g} s ago (--settle)"
    return None if traces else "no trace files in it yet"
