"""The report's figures: holoviews elements (bokeh backend) drawn from the frames in ``reports.frames``.

Importing this module imports holoviews (~3–4 s), so only ``reports.build`` imports it, when a report is made.
Every figure uses ``reports.palette``; every axis names its unit; hovers round numbers for people.
"""

from __future__ import annotations

import holoviews as hv
import polars as pl

from reports import frames as F
from reports import palette
from traceana.core import names
from traceana.core.units import MIB

hv.extension("bokeh", logo=False)

WIDTH_OPTS = {"responsive": True, "toolbar": "above", "default_tools": ["pan", "box_zoom", "wheel_zoom", "reset",
                                                                         "save"]}
PHASE_KINDS = (*names.PASS_PHASES, "recompute", "optimizer")  # zero-bubble's I and W are drawn too
LABEL_MIN_FRACTION = 0.012  # a block narrower than this share of the timeline gets no label (they would overlap)
MAX_LABELS = 3000  # beyond this many blocks micro-batch labels would only be ink; hover still tells


def _label(kind: str) -> str:
    return palette.CATEGORY_LABELS.get(kind, kind)


def _pd(frame: pl.DataFrame):
    # holoviews' grouping needs pandas (docs/field-notes.md: polars frames partly work, Bars grouping does not).
    return frame.to_pandas()


def _title(text: str) -> str:
    """A plot's title as holoviews takes it: it formats titles with ``str.format`` (``{label}``, ``{group}``), so
    braces in a run's name are doubled to stay text (``--name '{x}'`` was a KeyError). Plain text otherwise: bokeh
    draws it as is, and escapes its own embedded JSON (no HTML escaping here)."""
    return text.replace("{", "{{").replace("}", "}}")


def _empty(title: str, message: str) -> str:
    """A figure with nothing to draw is a sentence instead (``reports.build.Page`` shows it as a note)."""
    return f"{title}: {message}"


def timeline(
    blocks: pl.DataFrame, strip: pl.DataFrame, transfers: pl.DataFrame, *, title: str,
    path: pl.DataFrame | None = None,
) -> hv.Overlay | str:
    """Pipeline timeline, one row per rank, in two bands.

    Upper band: what the schedule says the rank works on — forward / backward / recompute / optimizer blocks with the
    micro-batch number. Lower band: what each instant was spent on according to the attribution (the same categories
    and colours as the bars: compute, exposed P2P / BPipe, bubbles). Between them, a hairline per received P2P or BPipe
    message (hover: how long the receiver waited for the sender, and how long the bytes took). Above the upper band,
    a dark line where the replayed step's critical path runs on that rank (``path``: reports.frames.critical_path).
    """
    if blocks.height == 0 and strip.height == 0:
        return _empty(title, "no schedule: the analysis found no forward/backward spans")
    ranks = sorted(set(blocks["rank"].to_list()) | set(strip["rank"].to_list()))
    row = {r: i for i, r in enumerate(ranks)}
    stages = dict(
        blocks.filter(pl.col("stage").is_not_null())
        .group_by("rank")
        .agg(pl.col("stage").unique().sort().cast(pl.String).str.join(", "), n=pl.col("stage").n_unique())
        .select("rank", pl.format("stage{} {}", pl.when(pl.col("n") > 1).then(pl.lit("s")).otherwise(pl.lit("")),
                                  pl.col("stage")))
        .iter_rows()
    )
    yticks = [(i, f"rank {r} · {stages.get(r, 'stage ?')}") for r, i in row.items()]
    rows = pl.DataFrame({"rank": list(row), "y": list(row.values())}, schema={"rank": pl.Int32, "y": pl.Float64})
    layers = []

    hover_blocks = [("what", "@what"), ("rank", "@rank"), ("stage", "@stage"), ("micro-batch", "@microbatch"),
                    ("step", "@step"), ("start (ms)", "@start_ms{0,0.000}"), ("duration (ms)", "@dur_ms{0,0.000}")]
    b = blocks.filter(pl.col("kind").is_in(PHASE_KINDS)).join(rows, on="rank").with_columns(
        y0=pl.col("y") - 0.44, y1=pl.col("y") + 0.08,
        microbatch=pl.col("microbatch").cast(pl.String).fill_null("–"),
        stage=pl.col("stage").cast(pl.String).fill_null("?"),
    )
    # One glyph layer per band, colours as a column: holoviews renders each layer at a fixed cost of about a second
    # here, so twenty per-category layers made the timeline the slowest figure of the report.
    colour = pl.col("kind").replace_strict(palette.CATEGORY_COLOURS, default="#999999")
    what = pl.col("kind").replace_strict(palette.CATEGORY_LABELS, default=pl.col("kind"))
    if b.height:
        layers.append(
            hv.Rectangles(_pd(b.with_columns(colour=colour, what=what)), kdims=["start_ms", "y0", "end_ms", "y1"],
                          vdims=["what", "rank", "stage", "microbatch", "step", "dur_ms", "colour"]).opts(
                color="colour", line_color="white", line_width=0.5, tools=[_hover(hover_blocks)])
        )

    hover_strip = [("time spent on", "@what"), ("rank", "@rank"), ("from (ms)", "@start_ms{0,0.000}"),
                   ("for (ms)", "@dur_ms{0,0.000}"), ("share of this block", "@share{0}%")]
    st = strip.join(rows, on="rank").rename({"category": "kind"}).with_columns(
        y0=pl.col("y") + 0.16, y1=pl.col("y") + 0.44, colour=colour, what=what)
    if st.height:
        layers.append(
            hv.Rectangles(_pd(st), kdims=["start_ms", "y0", "end_ms", "y1"],
                          vdims=["what", "rank", "dur_ms", "share", "colour"]).opts(
                color="colour", line_alpha=0, tools=[_hover(hover_strip)])
        )

    t = transfers.join(rows, on="rank").with_columns(
        yl=pl.col("y") + 0.12, mib=pl.col("nbytes") / MIB, colour=colour,
        what=pl.when(pl.col("kind") == "bpipe").then(pl.lit("BPipe")).otherwise(pl.lit("P2P")),
    )
    hover_xfer = [("message", "@what"), ("to rank", "@rank"), ("from rank", "@peer"), ("size (MiB)", "@mib{0,0.000}"),
                  ("receiver waited for sender (ms)", "@wait_ms{0,0.000}"),
                  ("transfer (ms)", "@transfer_ms{0,0.000}")]
    if t.height:
        layers.append(
            hv.Segments(_pd(t), kdims=["start_ms", "yl", "end_ms", "yl"],
                        vdims=["what", "rank", "peer", "mib", "wait_ms", "transfer_ms", "colour"]).opts(
                color="colour", line_width=3, tools=[_hover(hover_xfer)])
        )

    cp = path.join(rows, on="rank") if path is not None and path.height else None
    if cp is not None and cp.height:
        layers.append(
            hv.Segments(_pd(cp.with_columns(yp=pl.col("y") - 0.47)), kdims=["start_ms", "yp", "end_ms", "yp"],
                        vdims=["kind", "rank", "dur_ms"]).opts(
                color="#111111", line_width=3,
                tools=[_hover([("critical path", "@kind"), ("rank", "@rank"), ("for (ms)", "@dur_ms{0,0.000}")])])
        )

    # Labels only on blocks wide enough to hold one at full view; the others tell their micro-batch on hover.
    span = max(float(b["end_ms"].max() - b["start_ms"].min()), 1e-9) if b.height else 1.0
    work = b.filter(pl.col("kind").is_in([*names.PASS_PHASES, "recompute"])
                    & (pl.col("dur_ms") >= LABEL_MIN_FRACTION * span))
    if 0 < work.height <= MAX_LABELS:
        labels = work.with_columns(x=(pl.col("start_ms") + pl.col("end_ms")) / 2, yl=pl.col("y") - 0.18)
        layers.append(
            hv.Labels(_pd(labels), kdims=["x", "yl"], vdims=["microbatch"]).opts(
                text_color="white", text_font_size="8pt", text_font_style="bold"
            )
        )
    height = max(220, 70 * len(ranks) + 90)
    return hv.Overlay(layers).opts(
        hv.opts.Overlay(
            title=_title(title), height=height, xlabel="time since the first profiled step (ms)", ylabel="",
            yticks=yticks, invert_yaxis=True, show_legend=False, show_grid=False, **WIDTH_OPTS,
        )
    )


def _hover(tooltips: list[tuple[str, str]]):
    from bokeh.models import HoverTool

    return HoverTool(tooltips=tooltips)


def stacked_by_stage(
    stage_attr: pl.DataFrame, *, title: str, categories: tuple[str, ...] | None = None, ylabel: str
) -> hv.Element:
    """Stacked bars: one bar per stage, one segment per category, in the palette's colours.

    Colours travel as an explicit column: holoviews' categorical colour mapping of stacked Bars mismatched colours and
    segments when the category order was set (seen with holoviews 1.23). The key above the figure names them.
    """
    df = stage_attr if categories is None else stage_attr.filter(pl.col("category").is_in(categories))
    if df.height == 0 or not (df["ms"] > 0).any():
        return _empty(title, "nothing measured in these categories")
    df = df.with_columns(
        stage=F.stage_label(),
        colour=pl.col("category").replace_strict(palette.CATEGORY_COLOURS, default="#999999"),
        category=pl.col("category").replace_strict(palette.CATEGORY_LABELS, default=pl.col("category")),
    )
    bars = hv.Bars(_pd(df), kdims=["stage", "category"], vdims=["ms", "percent", "colour"])
    return bars.opts(
        stacked=True, color="colour", title=_title(title), ylabel=ylabel, xlabel="pipeline stage",
        height=320, line_color="white", show_legend=False,
        tools=[_hover([("stage", "@stage"), ("category", "@category"), ("ms per step", "@ms{0,0.00}"),
                       ("share of step", "@percent{0.0}%")])],
        **WIDTH_OPTS,
    )


def grouped_by_stage(frame: pl.DataFrame, *, value: str, title: str, ylabel: str, runs: list[str]) -> hv.Element:
    """Bars per stage, one bar per run side by side (e.g. peak memory with and without BPipe), in run colours."""
    if frame.height == 0 or frame[value].null_count() == frame.height:
        return _empty(title, "not measured in these runs (profile with profile_memory=True for memory)")
    colour = {r: palette.run_colour(i) for i, r in enumerate(runs)}
    df = (
        frame.filter(pl.col(value).is_not_null())
        .with_columns(stage=F.stage_label(),
                      colour=pl.col("run").replace_strict(colour, default="#999999"))
        .select("stage", "run", value, "colour")
    )
    return hv.Bars(_pd(df), kdims=["stage", "run"], vdims=[value, "colour"]).opts(
        color="colour", title=_title(title), ylabel=ylabel, xlabel="pipeline stage · run", height=320, show_legend=False,
        tools=[_hover([("stage", "@stage"), ("run", "@run"), (ylabel, f"@{value}{{0,0.0}}")])],
        multi_level=len(runs) > 1, **WIDTH_OPTS,
    )


def memory_over_time(curves: pl.DataFrame, *, title: str) -> hv.Element:
    if curves.height == 0:
        return _empty(title, "the traces hold no allocator events (profile with profile_memory=True)")
    lines = []
    for i, r in enumerate(sorted(curves["rank"].unique().to_list())):
        part = curves.filter(pl.col("rank") == r)
        stage = part["stage"][0]
        label = f"rank {r}" + (f" · stage {stage}" if stage is not None else "")
        lines.append(
            hv.Curve(_pd(part.select("t_ms", "mib")), kdims=["t_ms"], vdims=["mib"], label=label).opts(
                color=palette.run_colour(i), line_width=2, interpolation="steps-post",
                tools=[_hover([("rank", label), ("time (ms)", "@t_ms{0,0.0}"), ("allocated (MiB)", "@mib{0,0.0}")])],
            )
        )
    return hv.Overlay(lines).opts(
        hv.opts.Overlay(title=_title(title), height=320, xlabel="time since the first profiled step (ms)",
                        ylabel="allocated memory (MiB, max per bin)", legend_position="top",
                        **WIDTH_OPTS)
    )


def run_bars(frame: pl.DataFrame, *, value: str, title: str, ylabel: str) -> hv.Element:
    """One bar per run (e.g. step time), each in its run colour."""
    df = frame.select("run", value).with_columns(
        colour=pl.Series([palette.run_colour(i) for i in range(frame.height)], dtype=pl.String)
    )
    return hv.Bars(_pd(df), kdims=["run"], vdims=[value, "colour"]).opts(
        color="colour", title=_title(title), ylabel=ylabel, xlabel="run", height=300, show_legend=False,
        tools=[_hover([("run", "@run"), (ylabel, f"@{value}{{0,0.00}}")])], **WIDTH_OPTS,
    )


def estimate_vs_measured(frame: pl.DataFrame, *, title: str, xlabel: str) -> hv.Element:
    """A dot plot: one row per item (e.g. "stage 1 · bubble"), the measured value and the model's estimate as two
    markers on the same row, so the gap between them is the error. Rows read top to bottom in the table's order."""
    items = frame["item"].to_list()
    layers = []
    for source, colour, marker in (("measured", palette.BLUE, "circle"), ("estimated", palette.ORANGE, "diamond")):
        part = frame.select("item", pl.col(source).alias("value"), "error_pct").with_columns(source=pl.lit(source))
        layers.append(
            hv.Scatter(_pd(part), kdims=["item"], vdims=["value", "source", "error_pct"]).opts(
                color=colour, marker=marker, size=11, line_color="white",
                tools=[_hover([("", "@item"), ("", "@source"), (xlabel, "@value{0,0.00}"),
                               ("error", "@error_pct{+0.0}%")])],
            )
        )
    return hv.Overlay(layers).redim.values(item=items[::-1]).opts(
        # with invert_axes the value axis is drawn horizontally but keeps the y label
        hv.opts.Overlay(title=_title(title), invert_axes=True, height=70 + 26 * len(items), xlabel="", ylabel=xlabel,
                        show_legend=False, show_grid=True, **WIDTH_OPTS)
    )


def to_bokeh(element: hv.Element):
    return hv.render(element, backend="bokeh")
