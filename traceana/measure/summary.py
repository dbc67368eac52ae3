"""The measured summary of a run: the headline figures every surface shows (``analyze``, ``validate``, ``report``,
``demo``), computed once, here, from the analysis tables.

Definitions (each figure is one of these, and is labelled so wherever it is shown):
- **measured steps**: the profiled steps every rank recorded, preferring those with forward work on every rank,
  else those in which every rank did anything but host time (the profiler's last ``ProfilerStep`` is often an empty
  stub: HTA's amd_trace ends with one of 49 µs holding no event, after a step of 9.3 ms); the first of them is
  dropped when there are more (it pays one-off costs: allocator growth, optimizer state creation,
  lazy initialisation); when no step is common to every rank, each rank's own steps, its first left out alike.
  Every figure below is over these steps.
- **step time** (``step_ms``): per measured step the slowest rank's step (a pipeline step ends when its last rank
  ends), averaged over the measured steps; when the ranks' steps do not line up, the slowest rank's mean step.
  A stage's step time (``per_stage.step_ms``) is its ranks' own mean step.
- **per (rank, step)** (``rank_steps``, ``Analysis.per_rank_step``): the one table every per-rank figure is read
  from: ``step_ns`` (the attribution's categories summed: the step), each category's ``<category>_ns`` (0 where
  it has none), ``compute_ns``, ``bubble_ns`` and ``blocked_ns``.
- **bubble** (``bubble_ns``): the attribution's warm-up + stall + cool-down (pipeline_rules.bubble_windows): waiting
  no dependency but the pipeline's fill and drain explains; exposed P2P and BPipe time are their own categories,
  never part of the bubble. ``bubble_fraction`` is bubble time over step time summed over every rank, a fraction in
  0..1.
- **blocked** (``blocked_ns``): bubble + exposed P2P (``p2p_ns``): all the time a rank waited on the pipeline,
  wherever a sum of the two is needed (validate compares it with the simulator's, which cannot tell a send still in
  flight from a bubble).
- **exposed BPipe transfer** (``bpipe_ms``): the attribution's ``bpipe`` category per step, on the stage that spends
  most on it.
- **activation peak**: per stage the largest of its ranks' over the measured steps (``stage_memory``'s: memory
  allocated and freed within the step, at its most alive at once, traceana.measure.memory); the run's is the largest
  stage's. **Memory balance**: max/min over stages of their peak allocation.
- **replicas** (data-parallel pipelines, pp × dp): a replica is one pipeline group — the ranks joined by P2P
  (``p2p.pipeline_groups``), numbered by their lowest rank; replicas meet only in collectives. Ranks whose
  stage is unknown are no stage's replicas (none is invented), unless the run holds no P2P at all (pure data
  parallelism: they are replicas of stage '–'). A rank's **own time** (``own_ms``) is its step minus
  its exposed collective time: waiting in the gradient all-reduce is waiting for the slower replicas. Per stage
  across its replicas: the mean (``per_stage``: the stage's ranks' means) and the **slowest replica** (largest
  median own time over the measured steps), descriptive only: own time still holds waiting on the pipeline, so the
  slowest is not always the one to blame. Exposed collective time per replica is in ``replicas``.
- **no pipeline** (``pipeline_found`` False, traceana.measure.gpu.pipeline_found: no rank has a stage, no
  forward/backward, no matched P2P message): no bubble figure applies, so ``bubble_fraction`` and the per-stage bubble
  columns are null (not 0: nothing was measured as a bubble because there is no pipeline to wait on), and no replicas
  are formed (two ranks of an all-to-all job are not data-parallel replicas of anything); ``as_dict`` gives the reason
  (``no_pipeline``: gpu.NO_PIPELINE).
- **straggler** and **bottleneck**: from the what-if (traceana.causal.whatif), not from step times: a rank or replica is
  a straggler (``per_stage.straggler``: its replica on its stage, ``straggler_rank``) and a stage a bottleneck only
  when making it ideal (its work at its peers' median) shortens the replayed step by more than the noise in every
  measured step (``noise.NOISE_FLOOR``); a rank that only waits gains nothing, so it is never named.
  ``diagnosis`` is the what-if's one line, ``bottleneck`` what it names and what the step would be without it.
  These are the causal layer's (traceana.causal.diagnosis.diagnose), not this module's: the summary holds figures
  only, its what-if fields empty (``diagnosed`` False) until a surface that shows them asks for the diagnosis.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from traceana.core.intervals import COLLECT
from traceana.core.schema import BLOCKED_CATEGORIES, BUBBLE_CATEGORIES, CATEGORIES, COMPUTE_CATEGORIES
from traceana.core.units import MIB, NS_PER_MS
from traceana.measure.gpu import NO_PIPELINE, pipeline_found
from traceana.measure.p2p import pipeline_replicas, replica_of  # noqa: F401  (summary's names: the pipeline groups)
from traceana.measure.timeline import WHOLE_TRACE_STEP
STEP_TIME_LABEL = "step time (slowest rank, mean over measured steps)"
# The what-if's columns of ``per_stage``: null until the causal layer is asked (traceana.causal.diagnosis)
WHATIF_COLUMNS = {"straggler": pl.Int32, "straggler_rank": pl.Int32, "if_ideal_step_ms": pl.Float64}
P2P_KINDS = ("p2p_send", "p2p_recv", "p2p_call", "bpipe_transfer")


def rank_steps(attribution: pl.DataFrame) -> pl.DataFrame:
    """ONE row per (rank, step) of the attribution: rank, stage, step, step_ns, ``<category>_ns`` for every category
    (0 where the step has none of it), compute_ns, bubble_ns (warm-up + stall + cool-down) and blocked_ns (bubble +
    exposed P2P). Every per-rank figure (the stage table, the summary, validation, export) is read from it."""
    cat = pl.col("category").cast(pl.String)
    ns = lambda cs: pl.sum_horizontal(*(pl.col(f"{c}_ns") for c in cs))  # noqa: E731
    return (  # one query (docs/performance.md "Fixed cost")
        attribution.lazy().group_by("rank", "step")
        .agg(pl.col("stage").drop_nulls().first(),
             *(pl.col("ns").filter(cat == c).sum().cast(pl.Int64).alias(f"{c}_ns") for c in CATEGORIES))
        .select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32), pl.col("step").cast(pl.Int32),
                ns(CATEGORIES).alias("step_ns"), *(f"{c}_ns" for c in CATEGORIES),
                ns(COMPUTE_CATEGORIES).alias("compute_ns"), ns(BUBBLE_CATEGORIES).alias("bubble_ns"),
                ns(BLOCKED_CATEGORIES).alias("blocked_ns"))
        .sort("rank", "step")
        .collect(**COLLECT)
    )


def measured_steps(attribution: pl.DataFrame, schedule: pl.DataFrame) -> list[int]:
    """The steps the summary (and validation) measure: see the module docstring."""
    ranks = attribution["rank"].n_unique()
    on_all, with_work, with_forward = (f["step"] for f in pl.collect_all([  # one call (docs/performance.md)
        attribution.lazy().group_by("step").agg(pl.col("rank").n_unique().alias("n")).filter(pl.col("n") == ranks),
        attribution.lazy().filter((pl.col("category") != "host") & (pl.col("ns") > 0)).group_by("step")
        .agg(pl.col("rank").n_unique().alias("n")).filter(pl.col("n") == ranks),
        schedule.lazy().filter(pl.col("phase") == "forward").group_by("step")
        .agg(pl.col("rank").n_unique().alias("n")).filter(pl.col("n") == ranks),
    ], **COLLECT))
    on_all = set(on_all.to_list())
    chosen = (sorted(set(with_forward.to_list()) & on_all) or sorted(set(with_work.to_list()) & on_all)
              or sorted(on_all))
    if not chosen:  # no step common to every rank: each rank's own steps, its first left out as above
        own = attribution.group_by("rank").agg(pl.col("step").unique().sort())["step"].to_list()
        return sorted({s for steps in own for s in (steps[1:] if len(steps) > 1 else steps)})
    return chosen[1:] if len(chosen) > 1 else chosen


@dataclass(frozen=True)
class RunSummary:
    steps: tuple[int, ...]  # the measured steps
    step_ms: float | None  # pipeline step time
    bubble_fraction: float | None  # 0..1, over every rank
    bpipe_ms: float | None  # exposed BPipe per step on the stage that spends most on it; None without BPipe time
    largest_activation_stage: int | None
    largest_activation_peak_mib: float | None
    memory_balance: float | None
    per_stage: pl.DataFrame  # stage (null: unknown), ranks, step_ms, <category>_ms, compute_ms, bubble_ms,
    #                          bubble_fraction, peak_mib, activation_peak_mib, and across replicas: replicas, own_ms,
    #                          slowest_replica, slowest_rank, slowest_own_ms; from the what-if: straggler (replica),
    #                          straggler_rank, if_ideal_step_ms (the step with it ideal)
    replicas: pl.DataFrame | None = None  # one row per rank: stage, replica, rank, step_ms, own_ms (median),
    #                                       compute_ms, collective_ms (exposed)
    step_times_ms: tuple[float, ...] = ()  # each measured step's time (step_ms is their mean): the noise's samples
    # the what-if's one line (traceana.causal.whatif); why there is none where it could not run
    diagnosis: str | None = None
    bottleneck: dict | None = None  # what the what-if names: group, id, step_ms (if it were ideal), gain_ms
    pipeline_found: bool = True  # gpu.pipeline_found: False = no bubble or replica figure (module docstring)
    critical_path: pl.DataFrame | None = None  # time on the replayed step's critical path (on_path): group
    #                                            (kind / stage / rank), id, ms (mean per step), fraction of the path
    path: pl.DataFrame | None = None  # the critical path itself, every measured step (causal.critical_path): rank,
    #                                   stage, seq, kind, start_ns, end_ns, ms, step — what the report draws
    diagnosed: bool = False  # whether the causal layer's diagnosis is in (traceana.causal.diagnosis.diagnose)

    @property
    def stragglers(self) -> pl.DataFrame:
        """The per-stage rows that name a straggler (the what-if's: traceana.causal.whatif)."""
        return self.per_stage.filter(pl.col("straggler").is_not_null())

    def as_dict(self) -> dict:
        """JSON-ready: the headline figures and the per-stage rows; for a run that is no pipeline, why it has no
        bubble or replica figure (``no_pipeline``)."""
        return {
            "pipeline_found": self.pipeline_found,
            "no_pipeline": None if self.pipeline_found else NO_PIPELINE,
            "measured_steps": list(self.steps),
            "step_ms": self.step_ms,
            "step_times_ms": list(self.step_times_ms),
            "bubble_fraction": self.bubble_fraction,
            "bpipe_ms": self.bpipe_ms,
            "largest_activation_stage": self.largest_activation_stage,
            "largest_activation_peak_bytes": _bytes(self.largest_activation_peak_mib),
            "memory_balance": self.memory_balance,
            "per_stage": [_bytes_keys(row) for row in self.per_stage.to_dicts()],
            "replicas": [] if self.replicas is None else self.replicas.to_dicts(),
            "diagnosis": self.diagnosis,
            "bottleneck": self.bottleneck,
            "critical_path": [] if self.critical_path is None else self.critical_path.to_dicts(),
        }

    # --- in a notebook: the headline figures and the main per-stage columns, not the frames' full text ---------------
    def __repr__(self) -> str:
        lines = ["<traceana.RunSummary>", *(f"  {line}" for line in headline(self)),
                 f"  per stage: {self.per_stage.height} rows (.per_stage)"]
        return "\n".join(line if len(line) <= 180 else line[:179] + "…" for line in lines)

    def table_html(self) -> str:
        """The per-stage table's main columns (``HTML_COLUMNS``) as HTML, times rounded to the µs."""
        shown = [c for c in HTML_COLUMNS if c in self.per_stage.columns]
        return self.per_stage.select(shown).with_columns(pl.selectors.float().round(3))._repr_html_()

    def _repr_html_(self) -> str:
        from html import escape

        head = "".join(f"<li>{escape(line)}</li>" for line in headline(self))
        return f"<div><ul>{head}</ul><p>Per stage (mean per measured step):</p>{self.table_html()}</div>"


def _bytes(mib: float | None) -> int | None:
    """Memory in JSON is in bytes, as every other table's ``*_bytes`` (README "Commands"); the tables show MiB."""
    return None if mib is None else round(mib * MIB)


def _bytes_keys(row: dict) -> dict:
    """A per-stage row for JSON: each ``*_mib`` figure as ``*_bytes``."""
    return {(k.removesuffix("_mib") + "_bytes" if k.endswith("_mib") else k): (_bytes(v) if k.endswith("_mib") else v)
            for k, v in row.items()}


# The per-stage columns a notebook shows (RunSummary / Analysis ``_repr_html_``); the rest are in ``per_stage``.
HTML_COLUMNS = ("stage", "ranks", "step_ms", "compute_ms", "bubble_ms", "bubble_fraction", "p2p_ms", "bpipe_ms",
                "collective_ms", "peak_mib", "activation_peak_mib")


def _per_stage(per_rank_step: pl.DataFrame, stages: pl.DataFrame, stage_memory: pl.DataFrame,
               steps: list[int]) -> pl.DataFrame:
    # One lazy query (docs/performance.md "Fixed cost") over the per-(rank, step) table.
    rank_stage = stages.lazy().select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32))
    per_rank = (
        per_rank_step.lazy().filter(pl.col("step").is_in(steps))
        .group_by("rank").agg(*(pl.col(f"{c}_ns").mean().alias(c) for c in CATEGORIES),
                              pl.col("step_ns").mean().alias("step"))
        .join(rank_stage, on="rank", how="left")
    )
    mem = (
        stage_memory.lazy().filter(pl.col("step").is_in(steps))
        .group_by("rank").agg(pl.col("peak_bytes").max(), pl.col("activation_peak_bytes").max())
        .with_columns(pl.col("rank").cast(pl.Int32))
    )
    ms = lambda e: e / NS_PER_MS  # noqa: E731
    return (
        per_rank.join(mem, on="rank", how="left")
        .group_by("stage")
        .agg(
            pl.col("rank").sort().cast(pl.String).str.join(", ").alias("ranks"),
            ms(pl.col("step").mean()).alias("step_ms"),
            *(ms(pl.col(c).mean()).alias(f"{c}_ms") for c in CATEGORIES),
            ms(pl.sum_horizontal(*COMPUTE_CATEGORIES).mean()).alias("compute_ms"),
            ms(pl.sum_horizontal(*BUBBLE_CATEGORIES).mean()).alias("bubble_ms"),
            (pl.col("peak_bytes").max() / MIB).alias("peak_mib"),
            (pl.col("activation_peak_bytes").max() / MIB).alias("activation_peak_mib"),
        )
        .with_columns(pl.when(pl.col("step_ms") > 0).then(pl.col("bubble_ms") / pl.col("step_ms"))
                      .otherwise(None).alias("bubble_fraction"))
        .sort("stage", nulls_last=True)
        .collect(**COLLECT)
    )


def replica_steps(attribution: pl.DataFrame, stages: pl.DataFrame, pairs: pl.DataFrame,
                  steps: list[int]) -> pl.DataFrame:
    """One row per (rank, step) of ``steps``: stage, replica (its pipeline group's number), rank, step, step_ms,
    own_ms (step − exposed collective), compute_ms, collective_ms."""
    att = (attribution.lazy().filter(pl.col("step").is_in(steps)).with_columns(pl.col("category").cast(pl.String))
           .collect(**COLLECT))
    replica = replica_of(sorted(att["rank"].unique().to_list()), pairs)
    ms = lambda e: e / NS_PER_MS  # noqa: E731
    return (  # one query (docs/performance.md "Fixed cost")
        att.lazy().group_by("rank", "step").agg(
            pl.col("ns").sum().alias("_step"),
            pl.col("ns").filter(pl.col("category") == "collective").sum().alias("_collective"),
            pl.col("ns").filter(pl.col("category").is_in(COMPUTE_CATEGORIES)).sum().alias("_compute"))
        .with_columns(pl.col("rank").cast(pl.Int32))
        .join(replica.lazy(), on="rank", how="left")
        .join(stages.lazy().select(pl.col("rank").cast(pl.Int32), pl.col("stage").cast(pl.Int32)), on="rank",
              how="left")
        .select("stage", "replica", "rank", "step", ms(pl.col("_step")).alias("step_ms"),
                ms(pl.col("_step") - pl.col("_collective")).alias("own_ms"),
                ms(pl.col("_compute")).alias("compute_ms"), ms(pl.col("_collective")).alias("collective_ms"))
        .sort("stage", "replica", "rank", "step", nulls_last=True)
        .collect(**COLLECT)
    )


def replica_table(per_step: pl.DataFrame) -> pl.DataFrame:
    """One row per rank (``replica_steps`` over the measured steps): stage, replica, rank, step_ms, compute_ms,
    collective_ms (means per step) and own_ms (the median over the steps)."""
    return (
        per_step.group_by("stage", "replica", "rank")
        .agg(pl.col("step_ms").mean(), pl.col("own_ms").median(), pl.col("compute_ms", "collective_ms").mean())
        .sort("stage", "replica", "rank", nulls_last=True)
    )


def across_replicas(per_step: pl.DataFrame, *, unknown_are_replicas: bool = False) -> pl.DataFrame:
    """Per stage across its replicas (``replica_steps``): replicas, own_ms (the mean of the replicas' median own
    times), the slowest replica (largest median own time) and its rank and own time. Ranks of unknown stage are
    replicas of stage '–' only when ``unknown_are_replicas`` (the run holds no P2P at all: pure data parallelism,
    data_parallel_only); in a pipeline they are no stage's replicas. Descriptive: who holds the step back is
    the what-if's to say (traceana.causal.whatif)."""
    # One query (docs/performance.md "Fixed cost").
    r = (per_step.lazy().filter(pl.col("stage").is_not_null() | pl.lit(unknown_are_replicas))
         .group_by("stage", "replica", "step").agg(pl.col("own_ms").mean(), pl.col("rank").min()))
    per_replica = r.group_by("stage", "replica").agg(pl.col("own_ms").median(), pl.col("rank").min())
    slowest = (per_replica.sort(["own_ms", "replica"], descending=[True, False])  # a tie: the lowest replica
               .group_by("stage", maintain_order=True).first())
    stats = per_replica.group_by("stage").agg(pl.len().cast(pl.Int32).alias("replicas"), pl.col("own_ms").mean())
    return (
        stats.join(slowest.select("stage", pl.col("replica").alias("slowest_replica"),
                                  pl.col("rank").alias("slowest_rank"), pl.col("own_ms").alias("slowest_own_ms")),
                   on="stage", how="left", nulls_equal=True)
        .collect(**COLLECT)
    )


def data_parallel_only(analysis) -> bool:
    """Whether the run holds no point-to-point communication at all (pure data parallelism): then ranks whose stage
    is unknown all hold the one model and are each other's peers. Any P2P operation (its peer known or not: without
    record_shapes a pipeline's peers are not) makes it a pipeline, whose ranks of unknown stage are peers of none.
    Unknown (a result kept without its events): False."""
    if analysis.p2p.height:
        return False
    ev = analysis.events
    if ev is None:
        return False
    return (ev.lazy().filter(pl.col("kind").cast(pl.String).is_in(P2P_KINDS)).select(pl.len())
            .collect(**COLLECT).item() == 0)


def without_bubble(frame: pl.DataFrame) -> pl.DataFrame:
    """A run that is no pipeline: its bubble columns (``bubble*``) null, not 0 (module docstring)."""
    return frame.with_columns(pl.lit(None, pl.Float64).alias(c) for c in frame.columns if c.startswith("bubble"))


def summarize(analysis) -> RunSummary:
    """The run's summary from an ``Analysis`` (its attribution, schedule, stages and stage_memory tables)."""
    att = analysis.attribution
    steps = measured_steps(att, analysis.schedule)
    pipeline = pipeline_found(analysis.stages, analysis.schedule, analysis.p2p)
    per_replica_step = replica_steps(att, analysis.stages, analysis.p2p, steps)
    # no pipeline: no replicas (module docstring); its ranks are the per-rank table's
    replicas = replica_table(per_replica_step) if pipeline else None
    named = pl.DataFrame(schema={"stage": pl.Int32, **WHATIF_COLUMNS})  # (the causal layer's, when asked)
    replicas_of = across_replicas(per_replica_step, unknown_are_replicas=pipeline and data_parallel_only(analysis))
    per_stage = (_per_stage(analysis.per_rank_step, analysis.stages, analysis.stage_memory, steps)
                 .join(replicas_of, on="stage", how="left", nulls_equal=True)
                 .join(named, on="stage", how="left", nulls_equal=True))
    if not pipeline:
        per_stage = without_bubble(per_stage)
    used = analysis.per_rank_step.filter(pl.col("step").is_in(steps))
    ranks = used["rank"].n_unique()
    if used.height and used.group_by("step").agg(pl.col("rank").n_unique().alias("n"))["n"].min() == ranks:
        per_step = used.group_by("step").agg(pl.col("step_ns").max()).sort("step")["step_ns"]
    elif used.height:  # steps that do not line up across ranks: the slowest rank's own steps
        slowest = used.group_by("rank").agg(pl.col("step_ns").mean()).sort("step_ns", "rank").tail(1)["rank"]
        per_step = used.filter(pl.col("rank").is_in(slowest.implode())).sort("step")["step_ns"]
    else:
        per_step = pl.Series([], dtype=pl.Int64)
    step_times_ms = tuple(float(x) / NS_PER_MS for x in per_step.to_list())  # the noise rule's samples
    step_ms = sum(step_times_ms) / len(step_times_ms) if step_times_ms else None
    total = float(used["step_ns"].sum()) if used.height else 0.0
    bubble = float(used["bubble_ns"].sum()) if used.height else 0.0
    bpipe = per_stage["bpipe_ms"].drop_nulls()
    known = per_stage.filter(pl.col("stage").is_not_null() & pl.col("activation_peak_mib").is_not_null())
    largest = known.sort("activation_peak_mib", descending=True).head(1)
    peaks = per_stage.filter(pl.col("stage").is_not_null())["peak_mib"].drop_nulls()
    return RunSummary(
        steps=tuple(steps),
        step_ms=step_ms,
        bubble_fraction=bubble / total if total and pipeline else None,
        bpipe_ms=float(bpipe.max()) if len(bpipe) and bpipe.max() > 0 else None,
        largest_activation_stage=int(largest["stage"][0]) if largest.height else None,
        largest_activation_peak_mib=float(largest["activation_peak_mib"][0]) if largest.height else None,
        memory_balance=float(peaks.max() / peaks.min()) if len(peaks) > 1 and peaks.min() > 0 else None,
        per_stage=per_stage,
        replicas=replicas,
        step_times_ms=step_times_ms,
        pipeline_found=pipeline,
    )


def compare_runs(runs: list[tuple[str, RunSummary]], *,
                 repeats: dict[str, list[RunSummary]] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Every run against the first: (overview, per_stage). Overview: run, runs (its side's runs: itself and its
    ``repeats``, in the order collected), step_ms (its side's step time: the geometric mean of its runs' step times,
    traceana.measure.noise), run_step_ms (this run's own, the first of its side), step_change (other/base − 1) with its
    between-run interval (traceana.measure.noise.between_runs: step_change_low, step_change_high, within_noise — null
    with one run on a side: the noise is unknown —, noise_from, paired), speedup (base/other: < 1 is slower),
    step_change_words (the rule's sentence), largest_activation_peak_mib, peak_mib (largest stage), memory_balance.
    Per stage: stage, run, step_ms, bubble_ms, bpipe_ms, peak_mib, activation_peak_mib (this run's own) and each
    one's change against the first run (null for a run whose stages are not the first run's)."""
    from traceana.measure.noise import between_runs  # (cost: noise, and statistics, only to compare runs)

    repeats = repeats or {}

    def side(name: str, s: RunSummary) -> list[float]:  # its runs' step times, in the order given
        return [x.step_ms for x in (s, *repeats.get(name, ())) if x.step_ms]

    base = side(*runs[0])
    rows = []
    for name, s in runs:
        mine = side(name, s)
        c = between_runs(base, mine) if base and mine else None
        first = name == runs[0][0]
        rows.append((name, max(len(mine), 1), c.other_ms if c else s.step_ms, s.step_ms, c.change if c else None,
                     c and c.low, c and c.high, None if c is None or first else c.within_noise,
                     c.as_dict()["noise_from"] if c else None, c.paired if c else None, c.speedup if c else None,
                     None if c is None or first else c.words(),
                     s.largest_activation_peak_mib, s.per_stage["peak_mib"].max(), s.memory_balance))
    overview = pl.DataFrame(
        rows,
        schema={"run": pl.String, "runs": pl.Int32, "step_ms": pl.Float64, "run_step_ms": pl.Float64,
                "step_change": pl.Float64, "step_change_low": pl.Float64, "step_change_high": pl.Float64,
                "within_noise": pl.Boolean, "noise_from": pl.String, "paired": pl.Boolean, "speedup": pl.Float64,
                "step_change_words": pl.String, "largest_activation_peak_mib": pl.Float64, "peak_mib": pl.Float64,
                "memory_balance": pl.Float64},
        orient="row",
    )
    values = ("step_ms", "bubble_ms", "bpipe_ms", "peak_mib", "activation_peak_mib")
    # Stage s of two runs is the same part of the model only when both runs have the same stages: a run split into
    # other stages than the first gets no per-stage change (its stage 0 is another slice of the model).
    stages_of = lambda s: sorted(s.per_stage["stage"].to_list(), key=lambda x: (x is None, x))  # noqa: E731
    alike = [stages_of(s) == stages_of(runs[0][1]) for _, s in runs]
    both = pl.concat([s.per_stage.select("stage", *values).with_columns(run=pl.lit(name), _alike=pl.lit(ok))
                      for (name, s), ok in zip(runs, alike)], how="vertical_relaxed")
    first = both.filter(pl.col("run") == runs[0][0]).select("stage", *(pl.col(v).alias(f"_b_{v}") for v in values))
    per_stage = (
        both.join(first, on="stage", how="left", nulls_equal=True)
        .with_columns(*(pl.when(pl.col("_alike")).then(pl.col(f"_b_{v}")).alias(f"_b_{v}") for v in values))
        .drop("_alike")
        .with_columns(*((pl.col(v) - pl.col(f"_b_{v}")).alias(f"{v.removesuffix('_ms').removesuffix('_mib')}_change"
                                                              + ("_ms" if v.endswith("_ms") else "_mib"))
                        for v in values))
        .drop(*(f"_b_{v}" for v in values))
        .sort("stage", "run", nulls_last=True)
    )
    return overview, per_stage


def steps_label(steps) -> str:
    """Measured steps as labels, not a count: "step #2", "steps #2, #3", "steps #1–#8" (a run of consecutive ones),
    "no step" (ProfilerStep numbers are names: "over steps 2" read as two steps)."""
    steps = list(steps)
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step #{steps[0]}"
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps #{steps[0]}–#{steps[-1]}"
    return "steps " + ", ".join(f"#{x}" for x in steps)


def headline(summary) -> list[str]:
    """The run's headline figures, one per line, in the words every surface uses (traceana analyze, an Analysis's
    repr in a notebook); no bubble line for a run that is no pipeline (``summary.pipeline_found``: it has none)."""
    def num(x, fmt):
        return "–" if x is None else format(x, fmt)

    over = ("the whole trace (no ProfilerStep spans)" if tuple(summary.steps) == (WHOLE_TRACE_STEP,)
            else steps_label(summary.steps))
    lines = [f"{STEP_TIME_LABEL}: {num(summary.step_ms, ',.2f')} ms over {over}"]
    if summary.pipeline_found:
        lines.append(f"bubble (warm-up + stall + cool-down, all ranks): "
                     f"{num(None if summary.bubble_fraction is None else 100 * summary.bubble_fraction, '.1f')} % of "
                     "step time")
    if summary.bpipe_ms is not None:
        lines.append(f"exposed BPipe transfer (largest stage): {summary.bpipe_ms:,.2f} ms per step")
    if summary.largest_activation_peak_mib is not None:
        lines.append(f"largest activation peak: {summary.largest_activation_peak_mib:,.2f} MiB on stage "
                     f"{summary.largest_activation_stage}")
    if summary.memory_balance is not None:
        lines.append(f"memory balance across stages (max/min peak): {summary.memory_balance:.2f}")
    if summary.diagnosis is not None:
        lines.append(f"bottleneck (what-if, traceana whatif): {summary.diagnosis}")
    return lines
