"""The report's sections, in page order. Each adds its HTML and figures to a ``Page``; ``runs`` is [(name, Analysis)].

Figures come from ``reports.figures`` (holoviews), passed in as ``G`` so that importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import polars as pl

from reports import frames as F
from reports import html as H
from reports import palette
from reports.summary import inferred_notes, kpis, summary_facts
from reports.validation import Validated
from traceana.measure.analysis import Analysis
from traceana.measure.gpu import NO_PIPELINE
from traceana.measure.noise import STATISTIC
from traceana.measure.summary import compare_runs

Runs = list[tuple[str, Analysis]]

STAGE_COLUMNS = [
    ("stage", "stage"),
    ("ranks", "ranks"),
    ("step_ms", "step (ms)"),
    ("compute_ms", "compute (ms)"),
    ("p2p_ms", "P2P exposed (ms)"),
    ("bpipe_ms", "BPipe exposed (ms)"),
    ("bubble_ms", "bubble (ms)"),
    ("bubble_fraction", "bubble (% of step)"),
    ("peak_mib", "peak memory (MiB)"),
    ("activation_peak_mib", "activation peak (MiB)"),
]


def summary(page, runs: Runs, *, repeats: dict[str, Sequence[Analysis]] | None = None) -> None:
    """Per run: headline numbers, the facts run.json recorded, and what had to be inferred. A run with --repeat
    collections leads with its side's step time (the A/B table's: traceana.measure.noise's statistic), its own labelled
    so."""
    page.add('<section id="summary"><h2>Run summary</h2>')
    page.add('<div class="cards">')
    repeats = repeats or {}
    sides = {}
    if repeats:
        overview, _ = compare_runs([(n, a.summary) for n, a in runs],
                                   repeats={n: [a.summary for a in rs] for n, rs in repeats.items()})
        sides = {r["run"]: (r["step_ms"], r["runs"]) for r in overview.iter_rows(named=True)}  # a row per run
    for name, a in runs:
        page.add(f'<div class="card"><h3>{H.esc(name)}</h3>')
        page.add(kpis(a, side=sides.get(name)))
        page.add(H.facts(summary_facts(a)))
        notes = inferred_notes(a)
        if notes:
            page.add("<h3>Inferred rather than recorded, or not determined</h3>" + H.bullet_list(notes))
        else:
            page.add(H.para("Everything above was recorded by the collector; nothing had to be inferred.",
                            css_class="lead"))
        page.add("</div>")
    page.add("</div></section>")


def timeline(page, runs: Runs, G) -> None:
    """The pipeline timeline of each run."""
    page.add('<section id="timeline"><h2>Pipeline timeline</h2>')
    page.add(H.para("One row per rank. Upper band: the schedule — forward / backward / recompute / optimizer, with the "
                    "micro-batch number. Lower band: what each instant was spent on (the attribution, same colours as "
                    "the bars below; grey is bubble). The hairline between them marks P2P or BPipe messages arriving "
                    "on that rank; the dark line above a row, where the replayed step's critical path runs on it "
                    "(traceana whatif). Drag to pan, scroll or box-select to zoom, hover for details.",
                    css_class="lead"))
    page.add(H.legend_swatches(list(palette.CATEGORY_COLOURS)))
    for name, a in runs:
        page.figure(G.timeline(F.timeline_blocks(a), F.attribution_strip(a), F.timeline_transfers(a),
                               title=f"{name}: pipeline timeline", path=F.critical_path(a)))
    page.add("</section>")


def attribution(page, runs: Runs, G) -> None:
    """Where each stage's step time goes: stacked bars and the per-stage table."""
    page.add('<section id="attribution"><h2>Where each stage\'s step time goes</h2>')
    page.add(H.para("Mean time per measured step in each category, per pipeline stage (the first profiled step is "
                    "left out when there are more: it pays one-off costs). The categories of one step are "
                    "disjoint and add up to the step's wall time.", css_class="lead"))
    present = pl.concat([F.stage_attribution(a).filter(pl.col("ms") > 0)["category"] for _, a in runs]).unique()
    page.add(H.legend_swatches([c for c in palette.CATEGORY_COLOURS if c in set(present.to_list())]))
    for name, a in runs:
        if not a.summary.pipeline_found:
            not_a_pipeline(page, name, a)
            gpu_views(page, name, a)
            continue
        page.figure(G.stacked_by_stage(F.stage_attribution(a), title=f"{name}: time per step by category",
                                       ylabel="time per step (ms)"))
        page.add(H.table(a.summary.per_stage, STAGE_COLUMNS, formats={"stage": "int", "bubble_fraction": "fraction"}))
        overlapped_phases(page, name, a)
        gpu_views(page, name, a)
        replicas(page, name, a)
    page.add("</section>")


PHASE_COLUMNS = [
    ("rank", "rank"),
    ("phase", "phase"),
    ("own_ms", "own GPU time (ms)"),
    ("overlapped_ms", "of it beside another phase (ms)"),
    ("partition_ms", "in the bars above (ms)"),
    ("shared_fraction", "rank's step run by two phases at once"),
]


def overlapped_phases(page, name: str, a: Analysis) -> None:
    """Where phases ran at once on a GPU (traceana.measure.gpu): each phase's own GPU time beside what the bars (the
    per-instant partition) gave it."""
    from traceana.measure.gpu import OVERLAP_SHOWN_ABOVE, phase_means

    if a.phase_time is None or not a.phase_time.height:
        return
    pm = phase_means(a.phase_time, a.attribution, a.summary.steps)
    shown = pm.filter(pl.col("shared_fraction") > OVERLAP_SHOWN_ABOVE)
    if not shown.height:
        return
    page.add(f"<h3>{H.esc(name)}: phases running at once on the GPU</h3>")
    page.add(H.para("The bars give every instant to one category (backward over forward where both ran), so where "
                    "phases overlapped on two streams they are not each phase's GPU time. Per rank and phase: the "
                    "union of the phase's kernels (each kernel's phase is the annotation whose CPU range launched it), "
                    "the part of it beside another phase's kernels, and what the bars gave it.", css_class="lead"))
    page.add(H.table(shown.with_columns(pl.col("phase").replace_strict(palette.CATEGORY_LABELS,
                                                                          default=pl.col("phase"))),
                     PHASE_COLUMNS, formats={"rank": "int", "shared_fraction": "fraction"}))


STREAM_COLUMNS = [
    ("rank", "rank"),
    ("stream", "stream"),
    ("compute_ms", "compute (ms)"),
    ("communication_ms", "communication (ms)"),
    ("memcpy_ms", "memory copies (ms)"),
    ("idle_ms", "idle (ms)"),
    ("overlapped_ms", "beside another stream's work (ms)"),
]


def not_a_pipeline(page, name: str, a: Analysis) -> None:
    """A run that is no pipeline (its summary's ``pipeline_found``): a sentence instead of per-stage bars, and what
    still helps: the time per rank by category, and per GPU stream."""
    from traceana.measure.gpu import stream_means

    page.add(H.para(f"{name}: {NO_PIPELINE}. Time per rank (mean per measured step) and per GPU stream:",
                    css_class="lead"))
    st = a.stages
    cols = [("rank", "rank"), ("step_ms", "step (ms)")] + [
        (f"{c}_ms", f"{palette.CATEGORY_LABELS[c]} (ms)") for c in palette.CATEGORY_COLOURS
        if f"{c}_ms" in st.columns and (st[f"{c}_ms"].fill_null(0) > 0).any()]
    page.add(H.table(st, cols, formats={"rank": "int"}))
    streams = stream_means(a.stream_time, a.summary.steps) if a.stream_time is not None else pl.DataFrame()
    if streams.height:
        page.add(H.table(streams, STREAM_COLUMNS, formats={"rank": "int", "stream": "int"}))
    else:
        page.add(H.para("No GPU work in these traces: the table above is the CPU's time.", css_class="lead"))


OVERLAP_COLUMNS = [
    ("rank", "rank"),
    ("stage_label", "stage"),
    ("communication_ms", "communication kernels (ms)"),
    ("overlapped_ms", "of it beside computation (ms)"),
    ("overlap_fraction", "overlap"),
]
IDLE_COLUMNS = [
    ("rank", "rank"),
    ("stream", "stream"),
    ("idle_ms", "idle (ms)"),
    ("host_wait_ms", "waiting on the host (ms)"),
    ("kernel_wait_ms", "between kernels (ms)"),
    ("other_ms", "other (ms)"),
]
KERNEL_TYPE_COLUMNS = [("rank", "rank"), ("type", "kernel type"), ("fraction", "share of GPU time")]
TOP_KERNEL_COLUMNS = [("rank", "rank"), ("phase", "phase"), ("name", "kernel"), ("count", "launches"),
                      ("fraction", "share of the phase's GPU time")]
TOP_KERNELS_SHOWN = 3  # per rank and phase


def gpu_views(page, name: str, a: Analysis) -> None:
    """HTA's GPU views made pipeline-aware (traceana.measure.gpu.gpu_views): communication/computation overlap per
    rank with its stage, idle time split by what it waited on, the kernel types, the top kernels per phase."""
    from traceana.measure.gpu import gpu_views as views

    v = views(a)
    if not v:
        return
    page.add(f"<h3>{H.esc(name)}: GPU views (as Holistic Trace Analysis defines them, per rank and stage)</h3>")
    page.add(H.para("Mean per measured step. Overlap: the communication kernels' time during which a computation "
                    "kernel ran on the same GPU. Idle: a stream's time with no kernel, split into waiting on the "
                    "host (no kernel launched yet), between kernels already launched, and the rest.",
                    css_class="lead"))
    ov = pl.DataFrame(v["overlap"]).with_columns(
        pl.col("stages").cast(pl.String).fill_null(pl.col("stage").cast(pl.String)).alias("stage_label"))
    page.add(H.table(ov, OVERLAP_COLUMNS, formats={"rank": "int", "overlap_fraction": "fraction"}))
    page.add(H.table(pl.DataFrame(v["idle"]), IDLE_COLUMNS, formats={"rank": "int", "stream": "int"}))
    page.add(H.table(pl.DataFrame(v["kernel_types"]), KERNEL_TYPE_COLUMNS,
                     formats={"rank": "int", "fraction": "fraction"}))
    top = (pl.DataFrame(v["top_kernels"]).sort("rank", "phase", "fraction", descending=[False, False, True])
           .group_by("rank", "phase", maintain_order=True).head(TOP_KERNELS_SHOWN))
    page.add(H.table(top, TOP_KERNEL_COLUMNS, formats={"rank": "int", "count": "int", "fraction": "fraction"}))


REPLICA_STAGE_COLUMNS = [
    ("stage", "stage"),
    ("replicas", "replicas"),
    ("step_ms", "mean step (ms)"),
    ("own_ms", "mean own time (ms)"),
    ("slowest_replica", "slowest replica"),
    ("slowest_own_ms", "its own time (ms)"),
    ("straggler", "straggler replica (what-if)"),
    ("straggler_rank", "its rank"),
    ("if_ideal_step_ms", "step with it ideal (ms)"),
]
REPLICA_COLUMNS = [
    ("stage", "stage"),
    ("replica", "replica"),
    ("rank", "rank"),
    ("step_ms", "step (ms)"),
    ("own_ms", "own time (ms)"),
    ("compute_ms", "compute (ms)"),
    ("collective_ms", "collective exposed (ms)"),
]


def replicas(page, name: str, a: Analysis) -> None:
    """Data-parallel pipelines: each stage across its replicas, and every replica's exposed collective time
    (traceana.measure.summary's own time), and the straggler the what-if names (traceana.causal.whatif)."""
    ps = a.summary.per_stage
    if "replicas" not in ps.columns or not (ps["replicas"].fill_null(1) > 1).any():
        return
    page.add(f"<h3>{H.esc(name)}: data-parallel replicas</h3>")
    page.add(H.para("A replica is one pipeline (the ranks joined by P2P). Own time is a rank's step minus its exposed "
                    "collective time, the median over the measured steps. The straggler comes from the what-if "
                    "(traceana whatif): a rank is named only when making it ideal (its work at its peers' "
                    "median) shortens the replayed step by more than the noise in every measured step; a rank "
                    "that only waits gains nothing and is never named.", css_class="lead"))
    page.add(H.table(ps.filter(pl.col("replicas") > 1), REPLICA_STAGE_COLUMNS,
                     formats={"stage": "int", "replicas": "int", "slowest_replica": "int", "straggler": "int",
                              "straggler_rank": "int"}))
    page.add(H.table(a.summary.replicas, REPLICA_COLUMNS, formats={"stage": "int", "replica": "int", "rank": "int"}))


def bubbles(page, runs: Runs, G) -> None:
    """The bubble split into warm-up, stall and cool-down, per stage."""
    page.add('<section id="bubbles"><h2>Bubble breakdown</h2>')
    page.add(H.para("Idle time split into warm-up (before the stage's first forward), stall (waiting on a neighbour "
                    "in the steady state) and cool-down (after its last forward: the drain, waiting for gradients).",
                    css_class="lead"))
    page.add(H.legend_swatches(F.BUBBLE_KINDS))
    page.add('<div class="grid">')
    for name, a in runs:
        page.add("<div>")
        if not a.summary.pipeline_found:  # no bubble to draw: the reason, not an empty (or all-zero) chart
            page.add(H.para(f"{name}: {NO_PIPELINE}."))
            page.add("</div>")
            continue
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


def memory(page, runs: Runs, G) -> None:
    """Peak and activation memory per stage across runs (BPipe's balance), and memory over time."""
    page.add('<section id="memory"><h2>Memory per stage</h2>')
    page.add(H.para("Peak allocated memory per stage (the largest over profiled steps and over the ranks of a stage). "
                    "BPipe's goal is to even these out: the ratio max/min is the imbalance.", css_class="lead"))
    mem = pl.concat(
        [a.summary.per_stage.select("stage", "peak_mib", "activation_peak_mib").with_columns(run=pl.lit(n))
         for n, a in runs],
        how="vertical_relaxed",
    )
    balance = ", ".join(
        f"{n}: {H.num(b)}×" if (b := a.summary.memory_balance) else f"{n}: –" for n, a in runs
    )
    page.add(H.run_swatches([n for n, _ in runs]))
    page.figure(G.grouped_by_stage(mem, value="peak_mib", title=f"peak memory per stage (imbalance {balance})",
                                   ylabel="peak allocated (MiB)", runs=[n for n, _ in runs]))
    page.figure(G.grouped_by_stage(mem, value="activation_peak_mib",
                                   title="activation peak per stage (memory allocated and freed in the step)",
                                   ylabel="activation peak (MiB)", runs=[n for n, _ in runs]))
    page.add('<div class="grid">')
    for name, a in runs:
        page.add("<div>")
        page.figure(G.memory_over_time(F.memory_curves(a), title=f"{name}: allocated memory over time"))
        page.add("</div>")
    page.add("</div></section>")


def validation(page, runs: Runs, G, validate: Callable[[Analysis], Validated] | None) -> None:
    """Estimate vs measured per run, from traceana.validation (a failure is one line)."""
    page.add('<section id="validation"><h2>Estimate vs measured</h2>')
    page.add(H.para("The model's prediction for each run from that run's own measured durations (in sample: the "
                    "simulator fed with them, a check of the schedule logic; the what-if's replay is another model) "
                    "and the memory model's estimate, next to what the run measured. A prediction of one run from "
                    "another is in the A/B comparison.", css_class="lead"))
    for name, a in runs:
        v = validate(a) if validate is not None else Validated(message="validation was not requested")
        page.add(f"<h3>{H.esc(name)}</h3>")
        if v.table is None:
            page.add(H.para(v.message or "no validation available", css_class="warn"))
            continue
        items = v.table
        page.add(H.key({"measured": palette.BLUE, "estimated by the model": palette.ORANGE}))
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
        if v.verdict:
            page.add("<h3>Would BPipe help this run?</h3>" + H.para(v.verdict, css_class="verdict"))
    page.add("</section>")


def comparison(page, runs: Runs, G, cross_run: Callable[..., dict | str] | None, *,
               repeats: dict[str, Sequence[Analysis]] | None = None) -> None:
    """Every run against the first: one step time per side (the geometric mean of its runs, traceana.measure.noise) with
    one between-run interval, the model's cross-run prediction against that same measurement, per-stage deltas."""
    page.add('<section id="comparison"><h2>A/B comparison</h2>')
    names = [n for n, _ in runs]
    analyses = [a for _, a in runs]
    base = names[0]
    repeats = repeats or {}
    page.add(H.para(f"Every run against the first one ({base}). A side's step time is the {STATISTIC} (the run and "
                    "its --repeat collections, in the order collected); the change is other/base − 1 and the speed-up "
                    "base/other, so a positive change is a speed-up below 1×. The 95 % interval comes from the "
                    "spread between runs (paired by round when both sides have as many), never from the steps of "
                    "one run: with one run on a side the noise is unknown and no difference is claimed. "
                    "Per-stage deltas and memory are each run's own.", css_class="lead"))
    overview, cmp_ = compare_runs([(n, a.summary) for n, a in runs],
                                  repeats={n: [a.summary for a in rs] for n, rs in repeats.items()})
    page.add(H.run_swatches(names))
    page.figure(G.run_bars(overview, value="step_ms", title=f"step time per side ({STATISTIC})",
                           ylabel="step time (ms)"))
    page.add(H.table(overview, [("run", "run"), ("runs", "runs"), ("step_ms", f"step time (ms, {STATISTIC})"),
                                ("step_change_words", f"against {base}: change, speed-up, 95 % interval between runs"),
                                ("largest_activation_peak_mib", "largest stage activation peak (MiB)"),
                                ("peak_mib", "largest stage peak (MiB)"),
                                ("memory_balance", "memory imbalance (max/min)")]))
    if cross_run is not None:
        page.add("<h3>Predicted from the first run's durations, against the same measurement</h3>")
        page.add(H.para("The model measures the first run's durations and predicts each other run's change of step "
                        "time from them alone (e.g. the same pipeline with BPipe); the measured step times and the "
                        "interval are the table's above.", css_class="lead"))
        predicted, failures = [], []
        for name, a in runs[1:]:
            more = (*repeats.get(base, ()), *repeats.get(name, ()))
            r = cross_run(analyses[0], a, repeat=more) if more else cross_run(analyses[0], a)
            if isinstance(r, str):
                failures.append(f"{name}: {r}")
            else:
                predicted.append({"run": name, **{k: r.get(k) for k in (
                    "baseline_step_ms", "predicted_step_ms", "measured_step_ms", "error",
                    "predicted_speedup", "measured_speedup", "prediction_words")}})
        if predicted:
            pt = pl.DataFrame(predicted, infer_schema_length=None).with_columns(
                (pl.col("error").cast(pl.Float64) * 100).alias("error_pct"))
            page.add(H.table(pt, [("run", "run"), ("baseline_step_ms", f"{base} step (ms)"),
                                  ("predicted_step_ms", "predicted step (ms)"),
                                  ("measured_step_ms", "measured step (ms)"), ("error_pct", "error (%)"),
                                  ("predicted_speedup", "predicted speed-up (×)"),
                                  ("measured_speedup", "measured speed-up (×)"),
                                  ("prediction_words", "the prediction against the measured interval")],
                             formats={"error_pct": "signed_pct"}))
        for f in failures:
            page.add(H.para(f, css_class="warn"))
    page.figure(G.grouped_by_stage(cmp_, value="step_ms", title="step time per stage",
                                   ylabel="step time (ms)", runs=names))
    page.figure(G.grouped_by_stage(cmp_, value="bubble_ms", title="bubble per stage",
                                   ylabel="bubble per step (ms)", runs=names))
    page.add(H.table(cmp_,
                     [("stage", "stage"), ("run", "run"), ("step_ms", "step (ms)"),
                      ("step_change_ms", f"Δ step vs {base} (ms)"), ("bubble_ms", "bubble (ms)"),
                      ("bubble_change_ms", "Δ bubble (ms)"), ("bpipe_ms", "BPipe exposed (ms)"),
                      ("activation_peak_mib", "activation peak (MiB)"),
                      ("activation_peak_change_mib", "Δ activation peak (MiB)"),
                      ("peak_mib", "peak (MiB)"), ("peak_change_mib", "Δ peak (MiB)")],
                     formats={"stage": "int", "step_change_ms": "signed", "bubble_change_ms": "signed",
                              "activation_peak_change_mib": "signed", "peak_change_mib": "signed"}))
    page.add("</section>")
