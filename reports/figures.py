"""The report's figures: holoviews elements (bokeh backend) drawn from the frames in ``reports.frames``.

Importing this module imports holoviews (~3–4 s), so only ``reports.build`` imports it, when a report is made.
Every figure uses ``reports.palette``; every axis names its unit; hovers round numbers for people.
"""

from __future__ import annotations

import holoviews as hv
import polars as pl

from reports import palette

hv.extension("bokeh", logo=False)

WIDTH_OPTS = {"responsive": True, "toolbar": "above", "default_tools": ["pan", "box_zoom", "wheel_zoom", "reset",
                                                                         "save"]}
PHASE_KINDS = ("forward", "backward", "recompute", "optimizer")
ROW_HALF = 0.42  # half the height of a rank's row in the timeline (rows are 1 apart)
TRANSFER_BAND = 0.16  # P2P / BPipe transfers: a thin band at the bottom of the row, over the bubble it explains
MAX_LABELS = 3000  # beyond this many blocks micro-batch labels would only be ink; hover still tells


def _label(kind: str) -> str:
    return palette.CATEGORY_LABELS.get(kind, kind)


def _pd(frame: pl.DataFrame):
    # holoviews' grouping needs pandas (FIELD-NOTES.md: polars frames partly work, Bars grouping does not).
    return frame.to_pandas()


def _empty(title: str, message: str) -> hv.Element:
    return hv.Text(0, 0, message).opts(title=title, height=120, xaxis=None, yaxis=None, toolbar=None,
                                       responsive=True)


def timeline(blocks: pl.DataFrame, transfers: pl.DataFrame, *, title: str) -> hv.Overlay | hv.Element:
    """Pipeline timeline: one row per rank; forward/backward/recompute/optimizer blocks, bubbles in grey,
    P2P and BPipe transfers as a thin band at the bottom of the receiving rank's row, micro-batch numbers on blocks."""
    if blocks.height == 0:
        return _empty(title, "no schedule: the analysis found no forward/backward spans")
    ranks = sorted(blocks["rank"].unique().to_list())
    row = {r: i for i, r in enumerate(ranks)}
    stage_of = dict(zip(blocks["rank"].to_list(), blocks["stage"].to_list(), strict=True))
    yticks = [(i, f"rank {r} · stage {stage_of.get(r) if stage_of.get(r) is not None else '?'}")
              for r, i in row.items()]
    rows = pl.DataFrame({"rank": list(row), "y": list(row.values())}, schema={"rank": pl.Int32, "y": pl.Float64})
    hover_blocks = [("what", "@what"), ("rank", "@rank"), ("stage", "@stage"), ("micro-batch", "@microbatch"),
                    ("step", "@step"), ("start (ms)", "@start_ms{0,0.000}"), ("duration (ms)", "@dur_ms{0,0.000}")]
    layers = []
    b = blocks.join(rows, on="rank").with_columns(
        y0=pl.col("y") - ROW_HALF, y1=pl.col("y") + ROW_HALF,
        microbatch=pl.col("microbatch").cast(pl.String).fill_null("–"),
        stage=pl.col("stage").cast(pl.String).fill_null("?"),
    )
    for kind in (*PHASE_KINDS, "bubble_warmup", "bubble_stall", "bubble_cooldown"):
        part = b.filter(pl.col("kind") == kind).with_columns(what=pl.lit(_label(kind)))
        if part.height == 0:
            continue
        layers.append(
            hv.Rectangles(
                _pd(part), kdims=["start_ms", "y0", "end_ms", "y1"],
                vdims=["what", "rank", "stage", "microbatch", "step", "dur_ms"], label=_label(kind),
            ).opts(color=palette.CATEGORY_COLOURS[kind], line_color="white", line_width=0.5,
                   tools=[_hover(hover_blocks)])
        )
    t = transfers.join(rows, on="rank").with_columns(
        y1=pl.col("y") + ROW_HALF, y0=pl.col("y") + ROW_HALF - TRANSFER_BAND,
        mib=pl.col("nbytes") / 2**20,
    )
    hover_xfer = [("what", "@what"), ("to rank", "@rank"), ("from rank", "@peer"), ("size (MiB)", "@mib{0,0.00}"),
                  ("waited for peer (ms)", "@wait_ms{0,0.000}"), ("transfer (ms)", "@transfer_ms{0,0.000}")]
    for kind in ("p2p", "bpipe"):
        part = t.filter(pl.col("kind") == kind).with_columns(what=pl.lit(_label(kind).replace(" (exposed)", "")))
        if part.height == 0:
            continue
        layers.append(
            hv.Rectangles(
                _pd(part), kdims=["start_ms", "y0", "end_ms", "y1"],
                vdims=["what", "rank", "peer", "mib", "wait_ms", "transfer_ms"],
                label=_label(kind).replace(" (exposed)", "") + " (received)",
            ).opts(color=palette.CATEGORY_COLOURS[kind], line_color=palette.CATEGORY_COLOURS[kind],
                   tools=[_hover(hover_xfer)])
        )
    work = b.filter(pl.col("kind").is_in(["forward", "backward", "recompute"]))
    if 0 < work.height <= MAX_LABELS:
        labels = work.with_columns(x=(pl.col("start_ms") + pl.col("end_ms")) / 2)
        layers.append(
            hv.Labels(_pd(labels), kdims=["x", "y"], vdims=["microbatch"]).opts(
                text_color="white", text_font_size="8pt", text_font_style="bold"
            )
        )
    height = max(220, 60 * len(ranks) + 110)
    return hv.Overlay(layers).opts(
        hv.opts.Overlay(
            title=title, height=height, xlabel="time since the first profiled step (ms)", ylabel="",
            yticks=yticks, invert_yaxis=True, legend_position="right", show_grid=False, **WIDTH_OPTS,
        )
    )


def _hover(tooltips: list[tuple[str, str]]):
    from bokeh.models import HoverTool

    return HoverTool(tooltips=tooltips)


def stacked_by_stage(
    stage_attr: pl.DataFrame, *, title: str, categories: tuple[str, ...] | None = None, ylabel: str
) -> hv.Element:
    """Stacked bars: one bar per stage, one segment per category, in the palette's colours."""
    df = stage_attr if categories is None else stage_attr.filter(pl.col("category").is_in(categories))
    if df.height == 0:
        return _empty(title, "no attribution for this run")
    present = [c for c in palette.CATEGORY_COLOURS if c in set(df["category"].to_list())]
    df = df.with_columns(
        stage=pl.format("stage {}", pl.col("stage")),
        category=pl.col("category").replace_strict(palette.CATEGORY_LABELS, default=pl.col("category")),
    )
    cmap = {palette.CATEGORY_LABELS[c]: palette.CATEGORY_COLOURS[c] for c in present}
    bars = hv.Bars(_pd(df), kdims=["stage", "category"], vdims=["ms", "percent"]).redim.values(
        category=[palette.CATEGORY_LABELS[c] for c in present]
    )
    return bars.opts(
        stacked=True, cmap=cmap, color="category", title=title, ylabel=ylabel, xlabel="pipeline stage",
        height=340, legend_position="right", line_color="white",
        tools=[_hover([("stage", "@stage"), ("category", "@category"), ("ms per step", "@ms{0,0.00}"),
                       ("share of step", "@percent{0.0}%")])],
        **WIDTH_OPTS,
    )


def grouped_by_stage(frame: pl.DataFrame, *, value: str, title: str, ylabel: str, runs: list[str]) -> hv.Element:
    """Bars per stage, one bar per run side by side (e.g. peak memory with and without BPipe)."""
    if frame.height == 0 or frame[value].null_count() == frame.height:
        return _empty(title, "not measured in these runs")
    df = frame.with_columns(stage=pl.format("stage {}", pl.col("stage"))).filter(pl.col(value).is_not_null())
    cmap = {r: palette.run_colour(i) for i, r in enumerate(runs)}
    bars = hv.Bars(_pd(df.select("stage", "run", value)), kdims=["stage", "run"], vdims=[value])
    bars = bars.redim.values(run=runs)
    return bars.opts(
        cmap=cmap, color="run", title=title, ylabel=ylabel, xlabel="pipeline stage, run", height=320,
        legend_position="right", tools=[_hover([("stage", "@stage"), ("run", "@run"), (ylabel, f"@{value}{{0,0.0}}")])],
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
        hv.opts.Overlay(title=title, height=320, xlabel="time since the first profiled step (ms)",
                        ylabel="allocated memory (MiB, max per bin)", legend_position="right", **WIDTH_OPTS)
    )


def run_bars(frame: pl.DataFrame, *, value: str, title: str, ylabel: str) -> hv.Element:
    """One bar per run (e.g. step time), each in its run colour."""
    runs = frame["run"].to_list()
    cmap = {r: palette.run_colour(i) for i, r in enumerate(runs)}
    return hv.Bars(_pd(frame.select("run", value)), kdims=["run"], vdims=[value]).opts(
        color="run", cmap=cmap, title=title, ylabel=ylabel, xlabel="run", height=300, show_legend=False,
        tools=[_hover([("run", "@run"), (ylabel, f"@{value}{{0,0.00}}")])], **WIDTH_OPTS,
    )


def estimate_vs_measured(frame: pl.DataFrame, *, title: str, ylabel: str) -> hv.Element:
    """Measured and estimated side by side per item (e.g. per-stage bubble or peak memory)."""
    long = frame.unpivot(index="item", on=["measured", "estimated"], variable_name="source", value_name="value")
    cmap = {"measured": palette.BLUE, "estimated": palette.ORANGE}
    return hv.Bars(_pd(long), kdims=["item", "source"], vdims=["value"]).opts(
        cmap=cmap, color="source", title=title, ylabel=ylabel, xlabel="", height=300, multi_level=True,
        legend_position="right", tools=[_hover([("item", "@item"), ("", "@source"), (ylabel, "@value{0,0.00}")])],
        **WIDTH_OPTS,
    )


def to_bokeh(element: hv.Element):
    return hv.render(element, backend="bokeh")
