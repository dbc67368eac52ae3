"""Assemble one self-contained HTML report from one or more analysed runs.

    html_text = build_report([analysis_a, analysis_b], names=["baseline", "bpipe"])

Reads only ``traceana.analysis.Analysis`` tables (and the run's manifest); calls ``traceana.validate`` when it exists.
The bokeh JavaScript and CSS are inlined, so the file opens with no network.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from reports import frames as F
from reports import html as H
from reports import palette
from traceana.analysis import Analysis
from traceana.errors import AnalysisError, BadInputError

Validation = Callable[[Analysis], object]


@dataclass
class Validated:
    """What ``traceana.validate`` said about one run, for the report.

    ``table``: one row per compared quantity — item, unit, measured, estimated, error_pct — or None with ``message``
    saying why there is no comparison. ``notes``: how the estimate was made, in the model's own words.
    """

    table: pl.DataFrame | None = None
    message: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def check_analysable(a: Analysis) -> None:
    """A run with no steps, no schedule and no attribution cannot make a report worth reading: say so, clearly."""
    if a.steps.height == 0 and a.schedule.height == 0 and a.attribution.height == 0:
        raise AnalysisError(
            "no profiled training steps were found, so there is nothing to report",
            path=a.run.path,
            fix="profile at least one active step (ProfilerStep#N) with traceana collect or torch.profiler",
        )


def run_name(a: Analysis, taken: set[str]) -> str:
    name = a.run.path.name or str(a.run.path)
    base, k = name, 2
    while name in taken:
        name, k = f"{base} ({k})", k + 1
    taken.add(name)
    return name


# --- sections ----------------------------------------------------------------------------------------------------
def summary_facts(a: Analysis) -> list[tuple[str, object]]:
    m = a.run.manifest
    rows: list[tuple[str, object]] = [("run directory", a.run.path)]
    if m is None:
        rows.append(("run.json", "absent: every fact below was inferred from the traces"))
        rows.append(("world size", a.run.world_size))
        backends = a.run.traces["backend"].drop_nulls().unique().to_list()
        if backends:
            rows.append(("backend", ", ".join(map(str, backends))))
        return rows
    if m.model is not None:
        s = m.model
        kv = f", {s.n_kv_heads} KV heads" if s.kv_heads else ""
        rows.append(
            ("model", f"{s.name + ' — ' if s.name else ''}{s.family}, {s.layers} layers, hidden {s.hidden}, "
                      f"{s.heads} heads{kv}, FFN {s.ffn_dim}, vocab {s.vocab}, sequence {s.seq}")
        )
    rows.append(("parallelism", f"world {m.world_size} = PP {m.pp if m.pp is not None else '?'} × DP {m.dp} × TP {m.tp}"))
    if m.stage_of_rank is not None:
        rows.append(("stage of each rank", ", ".join(f"r{r}→s{s}" for r, s in enumerate(m.stage_of_rank))))
    rows.append(("schedule", m.schedule))
    mb = [f"{m.num_microbatches} micro-batches" if m.num_microbatches else None,
          f"of {m.microbatch_size} samples" if m.microbatch_size else None,
          f"(global batch {m.global_batch})" if m.global_batch else None]
    if any(mb):
        rows.append(("micro-batching", " ".join(x for x in mb if x)))
    rows.append(("BPipe", "off" if not m.bpipe else "on — evictor→acceptor stage pairs "
                 + ", ".join(f"{e}→{c}" for e, c in m.bpipe)))
    rows.append(("attention", m.attention or "not recorded"))
    rows.append(("recompute", m.recompute or "not recorded"))
    for label, value in (("dtype", m.dtype), ("device", m.device), ("torch", m.torch_version)):
        if value:
            rows.append((label, value))
    if m.peak_flops:
        rows.append(("peak FLOP/s per device", f"{m.peak_flops:.3g}"))
    if m.profiler:
        rows.append(("profiler schedule", ", ".join(f"{k}={v}" for k, v in sorted(m.profiler.items()))))
    for k, v in sorted(m.extra.items()):
        if v is not None:
            rows.append((k.replace("_", " "), v if isinstance(v, str) else json.dumps(v)))
    return rows


def inferred_notes(a: Analysis) -> list[str]:
    """Everything the analysis had to infer or could not determine, in the analysis' own words."""
    notes = list(a.notes) + [w for w in a.run.warnings if w not in a.notes]
    if a.schedule.height and "source" in a.schedule.columns:
        sources = a.schedule["source"].drop_nulls().unique().sort().to_list()
        if sources and sources != ["annotated"]:
            notes.append(f"schedule spans come from: {', '.join(sources)} (not only from annotations)")
    if "rank_source" in a.run.traces.columns:
        rs = a.run.traces["rank_source"].drop_nulls().unique().sort().to_list()
        if rs and set(rs) - {"distributedInfo", "traceana_meta"}:
            notes.append(f"rank numbers taken from: {', '.join(rs)}")
    offsets = a.clock_offsets
    if offsets.height and "offset_ns" in offsets.columns and offsets["offset_ns"].abs().max():
        worst = offsets["offset_ns"].abs().max() / 1e6
        notes.append(f"clocks corrected per rank (largest offset {H.num(worst)} ms), estimated from P2P pairs")
    return notes


def kpis(a: Analysis) -> str:
    step = F.step_time_ms(a)
    summary = F.stage_summary(a)
    bubble = summary["bubble_pct"].drop_nulls()
    balance = F.memory_balance(a)
    items = [
        (H.num(step) + " ms" if step is not None else "–", "step time (slowest rank, mean over steps)"),
        (H.num(float(bubble.mean()), digits=2) + " %" if len(bubble) else "–", "bubble, mean over stages"),
        (H.num(float(summary["peak_mib"].max())) + " MiB" if summary["peak_mib"].drop_nulls().len() else "–",
         "largest stage peak memory"),
        (H.num(balance, digits=3) + "×" if balance else "–", "memory imbalance (max/min stage peak)"),
        (str(a.steps["step"].n_unique()), "profiled steps"),
    ]
    cells = "".join(f'<div class="kpi"><b>{H.esc(v)}</b><span>{H.esc(label)}</span></div>' for v, label in items)
    return f'<div class="kpis">{cells}</div>'


STAGE_COLUMNS = [
    ("stage", "stage"),
    ("ranks", "ranks"),
    ("step_ms", "step (ms)"),
    ("compute_ms", "compute (ms)"),
    ("p2p_ms", "P2P exposed (ms)"),
    ("bpipe_ms", "BPipe exposed (ms)"),
    ("bubble_ms", "bubble (ms)"),
    ("bubble_pct", "bubble (% of step)"),
    ("peak_mib", "peak memory (MiB)"),
    ("activation_mib", "activation peak (MiB)"),
]


def _one_line(e: Exception) -> str:
    return e.line() if hasattr(e, "line") else f"{type(e).__name__}: {e}"


def default_validation(a: Analysis) -> Validated:
    """Ask ``traceana.validate`` for estimate vs measured; any failure becomes one line in the report, not a crash."""
    try:
        from traceana import validate as v
    except ImportError:
        return Validated(message="estimate vs measured: traceana.validate is not available in this installation")
    try:
        return coerce_validation(v.validate(a))
    except Exception as e:  # noqa: BLE001 — a failure of the model must not cost the user the rest of the report
        return Validated(message=f"estimate vs measured could not be computed: {_one_line(e)}")


def coerce_validation(result: object) -> Validated:
    """Turn ``traceana.validate.Validation`` (per_stage frame + summary dict + notes) into the report's table."""
    if isinstance(result, Validated):
        return result
    per_stage = getattr(result, "per_stage", None)
    if not isinstance(per_stage, pl.DataFrame):
        raise TypeError(f"validate() returned {type(result).__name__} without a per_stage table")
    table = F.validation_items(per_stage, getattr(result, "summary", None) or {})
    return Validated(table=table, notes=tuple(getattr(result, "notes", ()) or ()))


def default_cross_run(baseline: Analysis, target: Analysis) -> dict | str:
    """``traceana.validate.cross_run``: predict the target run from the baseline's measurements; a string if it fails."""
    try:
        from traceana.validate import cross_run
    except ImportError:
        return "the cross-run prediction is not available in this installation"
    try:
        return cross_run(baseline, target)
    except Exception as e:  # noqa: BLE001 — as above: one line in the report
        return f"could not predict this run from {baseline.run.path.name}: {_one_line(e)}"


class Page:
    """Collects HTML blocks and bokeh figures in order; the figures are embedded together at the end."""

    def __init__(self) -> None:
        self.parts: list[str | object] = []

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, element) -> None:
        """A holoviews element, or the sentence a figure function returns when there is nothing to draw."""
        self.parts.append(H.para(element, css_class="warn") if isinstance(element, str) else element)

    def render(self) -> tuple[str, str]:
        from bokeh.embed import components

        from reports.figures import to_bokeh

        models = [to_bokeh(p) for p in self.parts if not isinstance(p, str)]
        script, divs = components(models) if models else ("", ())
        out, k = [], 0
        for p in self.parts:
            if isinstance(p, str):
                out.append(p)
            else:
                out.append(f'<div class="plot">{divs[k]}</div>')
                k += 1
        return "\n".join(out), script


def build_report(
    analyses: Sequence[Analysis],
    *,
    names: Sequence[str] | None = None,
    validation: Validation | None = default_validation,
    cross_run: Callable[[Analysis, Analysis], dict | str] | None = default_cross_run,
    title: str | None = None,
) -> str:
    """Return the report for ``analyses`` as one HTML string. Raises AnalysisError for a run with nothing to show."""
    if not analyses:
        raise BadInputError("no runs to report on", fix="pass one or more run directories")
    for a in analyses:
        check_analysable(a)
    from bokeh.resources import Resources

    from reports import figures as G  # holoviews: imported only now

    taken: set[str] = set()
    names = list(names) if names else [run_name(a, taken) for a in analyses]
    runs = list(zip(names, analyses, strict=True))
    page = Page()
    nav = [("summary", "Summary"), ("timeline", "Timeline"), ("attribution", "Attribution"),
           ("bubbles", "Bubbles"), ("memory", "Memory"), ("validation", "Estimate vs measured")]
    if len(runs) > 1:
        nav.append(("comparison", "A/B comparison"))

    # Summary
    page.add('<section id="summary"><h2>Run summary</h2>')
    page.add('<div class="cards">')
    for name, a in runs:
        page.add(f'<div class="card"><h3>{H.esc(name)}</h3>')
        page.add(kpis(a))
        page.add(H.facts(summary_facts(a)))
        notes = inferred_notes(a)
        if notes:
            page.add("<h3>Inferred rather than recorded, or not determined</h3>" + H.bullet_list(notes))
        else:
            page.add(H.para("Everything above was recorded by the collector; nothing had to be inferred.",
                            css_class="lead"))
        page.add("</div>")
    page.add("</div></section>")

    # Timeline
    page.add('<section id="timeline"><h2>Pipeline timeline</h2>')
    page.add(H.para("One row per rank. Upper band: the schedule — forward / backward / recompute / optimizer, with the "
                    "micro-batch number. Lower band: what each instant was spent on (the attribution, same colours as "
                    "the bars below; grey is bubble). The hairline between them marks P2P or BPipe messages arriving "
                    "on that rank. Drag to pan, scroll or box-select to zoom, hover for details.", css_class="lead"))
    page.add(H.legend_swatches(list(palette.CATEGORY_COLOURS)))
    for name, a in runs:
        page.figure(G.timeline(F.timeline_blocks(a), F.attribution_strip(a), F.timeline_transfers(a),
                               title=f"{name}: pipeline timeline"))
    page.add("</section>")

    # Attribution
    page.add('<section id="attribution"><h2>Where each stage\'s step time goes</h2>')
    page.add(H.para("Mean time per profiled step in each category, per pipeline stage. The categories of one step are "
                    "disjoint and add up to the step's wall time.", css_class="lead"))
    present = pl.concat([F.stage_attribution(a).filter(pl.col("ms") > 0)["category"] for _, a in runs]).unique()
    page.add(H.legend_swatches([c for c in palette.CATEGORY_COLOURS if c in set(present.to_list())]))
    for name, a in runs:
        page.figure(G.stacked_by_stage(F.stage_attribution(a), title=f"{name}: time per step by category",
                                       ylabel="time per step (ms)"))
        page.add(H.table(F.stage_summary(a), STAGE_COLUMNS, formats={"stage": "int", "bubble_pct": "pct"}))
    page.add("</section>")

    # Bubbles
    page.add('<section id="bubbles"><h2>Bubble breakdown</h2>')
    page.add(H.para("Idle time split into warm-up (before the stage's first forward), stall (waiting on a neighbour "
                    "in the steady state) and cool-down (after its last backward).", css_class="lead"))
    page.add(H.legend_swatches(F.BUBBLE_KINDS))
    page.add('<div class="grid">')
    for name, a in runs:
        page.add("<div>")
        bub = F.bubble_breakdown(a)
        page.figure(G.stacked_by_stage(bub, title=f"{name}: bubble per step", ylabel="bubble per step (ms)"))
        wide = (
            bub.pivot(on="category", index="stage", values="ms")
            if bub.height else pl.DataFrame({"stage": []})
        )
        cols = [("stage", "stage")] + [
            (c, f"{palette.CATEGORY_LABELS[c]} (ms)") for c in F.BUBBLE_KINDS if c in wide.columns
        ]
        page.add(H.table(wide.sort("stage") if wide.height else wide, cols, formats={"stage": "int"}))
        page.add("</div>")
    page.add("</div></section>")

    # Memory
    page.add('<section id="memory"><h2>Memory per stage</h2>')
    page.add(H.para("Peak allocated memory per stage (the largest over profiled steps and over the ranks of a stage). "
                    "BPipe's goal is to even these out: the ratio max/min is the imbalance.", css_class="lead"))
    mem = pl.concat(
        [F.stage_summary(a).select("stage", "peak_mib", "activation_mib").with_columns(run=pl.lit(n))
         for n, a in runs],
        how="vertical_relaxed",
    )
    balance = ", ".join(
        f"{n}: {H.num(b)}×" if (b := F.memory_balance(a)) else f"{n}: –" for n, a in runs
    )
    page.add(H.run_swatches(names))
    page.figure(G.grouped_by_stage(mem, value="peak_mib", title=f"peak memory per stage (imbalance {balance})",
                                   ylabel="peak allocated (MiB)", runs=names))
    page.figure(G.grouped_by_stage(mem, value="activation_mib", title="activation peak per stage (peak − step start)",
                                   ylabel="activation peak (MiB)", runs=names))
    page.add('<div class="grid">')
    for name, a in runs:
        page.add("<div>")
        page.figure(G.memory_over_time(F.memory_curves(a), title=f"{name}: allocated memory over time"))
        page.add("</div>")
    page.add("</div></section>")

    # Estimate vs measured
    page.add('<section id="validation"><h2>Estimate vs measured</h2>')
    page.add(H.para("The performance model's estimate for each run next to what the run measured.", css_class="lead"))
    for name, a in runs:
        v = validation(a) if validation is not None else Validated(message="validation was not requested")
        page.add(f"<h3>{H.esc(name)}</h3>")
        if v.table is None:
            page.add(H.para(v.message or "no validation available", css_class="warn"))
            continue
        items = v.table
        page.add('<div class="key"><span class="swatch"><i style="background:' + palette.BLUE + '"></i>measured</span>'
                 '<span class="swatch"><i style="background:' + palette.ORANGE + '"></i>estimated by the model</span></div>')
        page.add('<div class="grid">')
        for unit in items["unit"].unique(maintain_order=True).to_list():
            page.add("<div>")
            page.figure(G.estimate_vs_measured(items.filter(pl.col("unit") == unit),
                                               title=f"{name}: estimate vs measured ({unit})", xlabel=unit))
            page.add("</div>")
        page.add("</div>")
        page.add(H.table(items, [("item", "what"), ("unit", "unit"), ("measured", "measured"),
                                 ("estimated", "estimated"), ("error_pct", "error (%)")],
                         formats={"error_pct": "signed_pct"}))
        page.add(H.bullet_list(v.notes))
    page.add("</section>")

    # A/B comparison
    if len(runs) > 1:
        page.add('<section id="comparison"><h2>A/B comparison</h2>')
        base = names[0]
        page.add(H.para(f"Every run against the first one ({base}). Negative deltas mean less time or memory.",
                        css_class="lead"))
        overview = pl.DataFrame(
            {
                "run": names,
                "step_ms": [F.step_time_ms(a) for a in analyses],
                "balance": [F.memory_balance(a) for a in analyses],
                "peak_mib": [F.stage_summary(a)["peak_mib"].max() for a in analyses],
            },
            schema={"run": pl.String, "step_ms": pl.Float64, "balance": pl.Float64, "peak_mib": pl.Float64},
        )
        b0 = overview["step_ms"][0]
        overview = overview.with_columns(
            d_step_pct=100 * (pl.col("step_ms") - b0) / b0 if b0 else pl.lit(None, pl.Float64),
        )
        page.add(H.run_swatches(names))
        page.figure(G.run_bars(overview, value="step_ms", title="step time per run", ylabel="step time (ms)"))
        page.add(H.table(overview, [("run", "run"), ("step_ms", "step time (ms)"),
                                    ("d_step_pct", f"change vs {base} (%)"), ("peak_mib", "largest stage peak (MiB)"),
                                    ("balance", "memory imbalance (max/min)")],
                         formats={"d_step_pct": "signed_pct"}))
        if cross_run is not None:
            page.add("<h3>Predicted from the first run, then measured</h3>")
            page.add(H.para("The model measures the first run's durations and predicts each other run's step time "
                            "from them (e.g. the same pipeline with BPipe); the measured step time is what the run "
                            "actually took.", css_class="lead"))
            predicted, failures = [], []
            for name, a in runs[1:]:
                r = cross_run(analyses[0], a)
                if isinstance(r, str):
                    failures.append(f"{name}: {r}")
                else:
                    predicted.append({"run": name, **{k: r.get(k) for k in (
                        "baseline_step_ms", "predicted_step_ms", "measured_step_ms", "error",
                        "predicted_speedup", "measured_speedup")}})
            if predicted:
                pt = pl.DataFrame(predicted, infer_schema_length=None).with_columns(
                    (pl.col("error").cast(pl.Float64) * 100).alias("error_pct"))
                page.add(H.table(pt, [("run", "run"), ("baseline_step_ms", f"{base} step (ms)"),
                                      ("predicted_step_ms", "predicted step (ms)"),
                                      ("measured_step_ms", "measured step (ms)"), ("error_pct", "error (%)"),
                                      ("predicted_speedup", "predicted speed-up (×)"),
                                      ("measured_speedup", "measured speed-up (×)")],
                                 formats={"error_pct": "signed_pct"}))
            for f in failures:
                page.add(H.para(f, css_class="warn"))
        cmp_ = F.compare_stages(runs)
        page.figure(G.grouped_by_stage(cmp_, value="step_ms", title="step time per stage",
                                       ylabel="step time (ms)", runs=names))
        page.figure(G.grouped_by_stage(cmp_, value="bubble_ms", title="bubble per stage",
                                       ylabel="bubble per step (ms)", runs=names))
        page.add(H.table(cmp_.sort("stage", "run"),
                         [("stage", "stage"), ("run", "run"), ("step_ms", "step (ms)"),
                          ("d_step_ms", f"Δ step vs {base} (ms)"), ("bubble_ms", "bubble (ms)"),
                          ("d_bubble_ms", "Δ bubble (ms)"), ("bpipe_ms", "BPipe exposed (ms)"),
                          ("peak_mib", "peak (MiB)"), ("d_peak_mib", "Δ peak (MiB)")],
                         formats={"stage": "int", "d_step_ms": "signed", "d_bubble_ms": "signed",
                                  "d_peak_mib": "signed"}))
        page.add("</section>")

    body, script = page.render()
    # Only bokeh's own bundle, inline. Resources.render_js() would also add a <script src> that panel (imported by
    # holoviews) registers for its extensions: a relative path that does not exist beside the report, and that
    # plain holoviews plots do not need.
    resources = Resources(mode="inline", components=["bokeh"])
    inline_js = "".join(f"<script>\n{js}\n</script>\n" for js in resources.js_raw)
    subtitle = (f"{len(runs)} run{'s' if len(runs) > 1 else ''}: " + ", ".join(names)
                + f" · generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return H.page(
        title=title or "traceana report", subtitle=subtitle, nav=nav, body=body,
        resources=inline_js, script=script,
    )


def write_report(path: str | Path, analyses: Sequence[Analysis], **kwargs) -> Path:
    """Build the report and write it to ``path`` (parent folders created). Returns the path."""
    path = Path(path)
    text = build_report(analyses, **kwargs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BadInputError(f"cannot write the report ({e.strerror})", path=path,
                            fix="choose a writable path with -o") from None
    return path
