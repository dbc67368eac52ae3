"""The result of analysing one run: every derived table, plus what could and could not be determined.

``analyze(run)`` chains the pure steps of the flow: classify → steps → P2P messages and pairs → clocks →
stages → schedule (annotated, else inferred) → busy timeline → attribution → memory → per-stage summary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from traceana.core import limits, names
from traceana.core import names as _names  # (analyze's keyword ``names`` hides the module there)
from traceana.core.errors import BadInputError, shown
from traceana.core.intervals import COLLECT
from traceana.core.schedule_names import MULTI_STAGE_SCHEDULES, WHOLE_BACKWARD_MULTI_STAGE
from traceana.ingest import Run
from traceana.measure import attribution as attr
from traceana.measure import classify as cls
from traceana.measure import memory as mem
from traceana.measure import gpu, timeline

# Multi-stage schedules whose backward is one pass (no input/weight split): autograd's ops tell their phases.
from traceana.core.names import NameRules
from traceana.core.run_config import RunConfig
from traceana.core.schema import CATEGORIES, SCHEDULE, conform
from traceana.core.units import NS_PER_MS, NS_PER_S
from traceana.measure.p2p import bpipe_groups, link_bandwidth, messages, pair, transfer_ceiling
from traceana.measure.placement import several_stages, stage_map, virtual_stage_ranks
from traceana.measure.reconcile import annotated_facts, missing_notes, run_config, run_facts
from traceana.measure.schedule import (annotated_schedule, autograd_schedule, dropped_annotation_notes, infer_schedule,
                                       overlap_notes, pipeline_group_stages,
                                       overlap_rows, overlap_spans)
from traceana.measure.summary import RunSummary, headline, measured_steps, rank_steps, summarize


@dataclass(frozen=True)
class Analysis:
    """Everything ``analyze`` measured about one run, as polars tables. Times are int64 nanoseconds on the aligned
    clock (columns ``*_ns``) unless a column name gives another unit (``*_ms``, ``*_bytes``, ``*_pct`` in 0..100,
    ``fraction`` in 0..1)."""

    run: Run  #: the loaded run: events, memory samples, per-trace facts and run.json
    steps: pl.DataFrame  #: schema.STEPS: one row per (rank, step), its start_ns, end_ns, dur_ns
    p2p: pl.DataFrame  #: schema.P2P: matched send/recv pairs with wait_ns (peer not ready) and transfer_ns
    schedule: pl.DataFrame  #: schema.SCHEDULE: one row per (rank, step, stage, micro-batch, phase) span, its source
    attribution: pl.DataFrame  #: schema.ATTRIBUTION: ns and fraction per (rank, step, category), summing to the step
    stage_memory: pl.DataFrame  #: schema.STAGE_MEMORY: per (rank, step) baseline, peak and activation peak bytes
    #: one row per rank over the measured steps: stage (its first), stages (every virtual stage it holds, "0,3"),
    #: step_ms, <category>_ms/_pct, memory, MFU
    stages: pl.DataFrame
    clock_offsets: pl.DataFrame  #: rank, offset_ns, source: the clock correction applied to each rank
    notes: tuple[str, ...] = field(default_factory=tuple)  #: what was inferred, what could not be determined
    segments: pl.DataFrame | None = None  #: attribution.SEGMENTS: the category of every instant (timelines, merge)
    events: pl.DataFrame | None = None  #: classified events on the aligned clock (kind, step, comm_dir, channel, …)
    #: per-rank counts of the run's traces (ingest.run_dir.rank_summary); filled by
    #: analysis_cache.load_and_analyze so a cached result can show it without the events
    rank_summary: pl.DataFrame | None = None
    #: gpu.PHASE_TIME: per (rank, step, phase) of GPU ranks, the phase's own GPU time (the union of its kernels) and
    #: the part of it another phase's kernels ran beside; the attribution gives each instant to one of them
    phase_time: pl.DataFrame | None = None
    #: gpu.STREAM_TIME: per (rank, step, GPU stream), compute, communication, memory copies, idle and overlapped time
    stream_time: pl.DataFrame | None = None
    peak_flops: float | None = None  #: the device's peak FLOP/s given as an option (--peak-flops), over run.json's

    @functools.cached_property
    def config(self) -> RunConfig:
        """The run's configuration, reconciled once from run.json and the traces (``reconcile.run_config``): every
        fact with its source, and the conflicts. MFU, the summary, validation, the verdict and the reports read it."""
        return run_config(run_facts(self.run.manifest, self.run.traces, peak_flops=self.peak_flops), self.schedule,
                          self.stages)

    @functools.cached_property
    def per_rank_step(self) -> pl.DataFrame:
        """ONE row per (rank, step): step_ns, every category's ``<category>_ns``, compute_ns, bubble_ns (warm-up +
        stall + cool-down) and blocked_ns (bubble + exposed P2P) (``summary.rank_steps``): what the stage table,
        the summary, validation and export read."""
        return rank_steps(self.attribution)

    @functools.cached_property
    def summary(self) -> RunSummary:
        """The run's headline figures (traceana.measure.summary): what analyze, validate, report and demo all show.
        Figures only: who holds the step back is the causal layer's (traceana.causal.diagnosis.diagnose)."""
        return summarize(self)

    def keep_summary(self, summary: RunSummary) -> RunSummary:
        """``summary`` as this analysis' summary from now on: its own figures completed by a layer above (the
        causal layer's diagnosis), so that every later reader — the report, export, the analysis cache — reads the
        same. Returns it."""
        self.__dict__["summary"] = summary  # (functools.cached_property's own slot)
        return summary

    def tables(self) -> dict[str, pl.DataFrame]:
        """Every table by name (for export)."""
        out = {"steps": self.steps, "p2p": self.p2p, "schedule": self.schedule, "attribution": self.attribution,
               "stage_memory": self.stage_memory, "stages": self.stages, "clock_offsets": self.clock_offsets}
        for name in ("segments", "phase_time", "stream_time"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    # --- in a notebook: what the run is and its headline figures, not the tables' rows -----------------------------
    def _facts(self) -> dict[str, str]:
        """What the run is, in words: its path, ranks, stages, schedule and steps (the repr's first line)."""
        ranks = sorted(set(self.stages["rank"].to_list()))
        held = {int(s) for listed in self.stages["stages"].drop_nulls().to_list() for s in listed.split(",")} \
            if "stages" in self.stages.columns else set()
        held |= set(self.stages["stage"].drop_nulls().to_list())
        spans = " + ".join(sorted(set(self.schedule["source"].drop_nulls().to_list()))) if self.schedule.height else ""
        c = self.config  # (the schedule's name as reconciled from run.json and the traces, with where it came from)
        schedule = (f"schedule {c.schedule} ({c.source('schedule')}; spans {spans or 'none'})"
                    if c.schedule != "unknown" else f"schedule unknown (spans {spans or 'none'})")
        steps = sorted(set(self.steps["step"].to_list()))
        measured = list(self.summary.steps)
        path = str(self.run.path)
        return {"path": path if len(path) <= 100 else "…" + path[-99:],
                "ranks": f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}",
                "stages": f"{len(held)} stage{'s' if len(held) != 1 else ''}" if held else "stages unknown",
                "schedule": schedule,
                "steps": f"{len(steps)} step{'s' if len(steps) != 1 else ''} (measured: "
                         f"{', '.join(map(str, measured[:8])) + (', …' if len(measured) > 8 else '') or 'none'})"}

    def __repr__(self) -> str:
        """A few lines (not the events' rows): ranks, stages, schedule, steps, the headline figures
        (``summary.headline``) and where the rest is."""
        f = self._facts()
        lines = [f"<traceana.Analysis of {f['path']}: {f['ranks']}, {f['stages']}, {f['schedule']}, {f['steps']}>",
                 *(f"  {line}" for line in headline(self.summary)),
                 f"  {len(self.notes)} note{'s' if len(self.notes) != 1 else ''} (.notes); tables: "
                 + ", ".join(self.tables()) + "; per stage: .summary.per_stage"]
        return "\n".join(line if len(line) <= 180 else line[:179] + "…" for line in lines)  # (many steps)

    def _repr_html_(self) -> str:
        """The headline figures and the per-stage table (``RunSummary.table_html``), for Jupyter."""
        from html import escape

        f = self._facts()
        head = "".join(f"<li>{escape(line)}</li>" for line in headline(self.summary))
        notes = "".join(f"<li>{escape(n)}</li>" for n in self.notes[:10])
        more = f"<li>… {len(self.notes) - 10} more (.notes)</li>" if len(self.notes) > 10 else ""
        return (f"<div><p><b>traceana.Analysis</b> of <code>{escape(f['path'])}</code>: {escape(f['ranks'])}, "
                f"{escape(f['stages'])}, {escape(f['schedule'])}, {escape(f['steps'])}</p><ul>{head}</ul>"
                f"<p>Per stage (mean per measured step):</p>{self.summary.table_html()}"
                + (f"<details><summary>{len(self.notes)} notes</summary><ul>{notes}{more}</ul></details>"
                   if self.notes else "") + "</div>")


def analyze(run: Run, *, peak_flops: float | None = None, names: str | Path | NameRules | None = None,
            by_name: cls.NameTable | None = None, **old_keywords) -> Analysis:
    """Analyse a loaded run (``traceana.load_run``): classify its events, find steps and P2P pairs, align clocks,
    map ranks to stages, reconstruct the schedule (annotated, else inferred from P2P order), attribute every instant
    of every step to a category, and measure memory per stage. ``peak_flops`` (FLOP/s per device) overrides
    run.json's for MFU; ``names``: the name rules mapping other frameworks' names to phases and kinds, as the
    command line's ``--names`` (a rules file, docs/naming.md; ``"none"``; or ``NameRules``), default run.json's
    ``"names"``, else the built-ins (``name_rules=`` is an old spelling); ``by_name``:
    ``classify.name_table(run.events, rules)``, if the caller has it. Pure: the run is not modified. The headline
    figures are ``Analysis.summary``."""
    given = _names.names_keyword(names, old_keywords, "analyze")
    rules = _names.rules_for_run(run.path, run.manifest.names if run.manifest is not None else None, given)
    return _analyze(run, peak_flops=peak_flops, name_rules=rules, by_name=by_name)


def _analyze(run: Run, *, peak_flops: float | None, name_rules: names.NameRules,
             by_name: cls.NameTable | None) -> Analysis:
    short = limits.analysis_short(run.events.height)  # a failed allocation in polars would abort the process
    if short is not None:
        raise BadInputError(f"its {run.events.height:,} events would take about {limits.gib(short[0])} to analyse "
                            f"and only {limits.gib(short[1])} of memory is left", path=shown(run.path),
                            fix=limits.how_to_raise())
    notes: list[str] = []
    if by_name is None:  # (the caller may have it: classify.name_table(run.events, name_rules))
        by_name = cls.name_table(run.events, name_rules)  # for both classify and rule_notes
    # The peer, size and group GPU work takes from its launching op are written into the events last, once the
    # analysis' largest frames are gone (docs/performance.md "How the analysis stays fast and small"); until then
    # only the P2P messages read them, from the few rows they come from.
    events, fill = cls.classify_apart(run.events, name_rules, by_name=by_name)
    steps, n = timeline.steps(events)
    notes += n
    events = timeline.assign_steps(events, steps)
    # The one configuration (reconcile): run.json's facts and the hosts now, what the schedule shows added below; the
    # P2P pairing, the clock alignment and the stage map read it, not run.json.
    config = run_facts(run.manifest, run.traces, peak_flops=peak_flops)
    interleaved = (config.schedule in MULTI_STAGE_SCHEDULES
                   or any(len(held) > 1 for held in (config.stages_of_rank or {}).values()))
    # Without run.json, a trace's own metadata (our profiler writes the stages each rank holds) says the same.
    interleaved = interleaved or bool(virtual_stage_ranks(run.traces))
    notes += cls.rule_notes(events, name_rules, by_name=by_name)
    # (messages reads the communication events and the LOAD/ACCEPT spans, nothing else.)
    msgs = messages(cls.filled_rows(events, fill, pl.col("comm_dir").is_not_null()
                                    | pl.col("pp_action").is_in([names.LOAD, names.ACCEPT])),
                    bpipe_groups(run.traces))
    # (the transfer floor's bandwidth, and the ceiling's between CPU ranks: traceana.measure.p2p)
    link, ceiling = link_bandwidth(config), transfer_ceiling(config)
    pairs, unmatched, msgs, pair_notes = pair(msgs, link_bytes_per_s=link, ceiling=ceiling)
    ranks = sorted(set(run.traces["rank"].to_list()) | set(events["rank"].unique().to_list()))
    offsets, n = timeline.clock_offsets(pairs, ranks, same_host=config.same_host)
    copies = msgs.height - msgs.unique(["rank", "dir", "channel", "peer", "tag", "post_ns"]).height
    if copies:  # duplicated events: the pairing (and any clock "cycle" it shows) is not the run's
        n = [f"{copies} P2P operations are exact copies of another (same rank, peer, tag and start: duplicated "
             "events), so sends and receives cannot be matched one to one; clock offsets and P2P waits from them "
             "are not the run's — re-export the traces"
             + ("; clocks left as recorded" if any("cycle of impossible" in x for x in n) else "")]
    notes += n
    if offsets["offset_ns"].abs().max() or 0:
        events = timeline.shift(events, offsets, ["ts_ns", "launch_ns"])
        steps = timeline.shift(steps, offsets, ["start_ns", "end_ns"])
        msgs = timeline.shift(msgs, offsets, ["post_ns", "end_ns", "launch_ns"])
        pairs, unmatched, msgs, pair_notes = pair(msgs, link_bytes_per_s=link, ceiling=ceiling)
    notes += pair_notes
    # The overlapped F/B spans are read from the events once (their names and times: numbering micro-batches in
    # order below changes neither).
    spans = overlap_spans(events)
    overlapped = overlap_rows(events, spans=spans)
    stages, n = stage_map(events, run.traces, config, pairs, msgs, overlapped=overlapped)
    notes += n
    # Micro-batches a name rule numbers in order: not on ranks holding several stages (by run.json, the traces'
    # metadata or the P2P pattern), whose spans of one phase alternate between stages the names do not give.
    several = ranks if interleaved else several_stages(stages)
    events = cls.number_in_order(events, skip_ranks=several)
    unstaged = sorted(set(events.lazy().filter(pl.col("pp_order") & pl.col("pp_stage").is_null()).select("rank")
                          .unique().collect(**COLLECT)["rank"].to_list()) & set(several))
    if unstaged:
        notes.append(f"ranks {', '.join(map(str, unstaged))} hold several (virtual) stages and the name rules that "
                     "gave their forward/backward spans read no stage or micro-batch from the names: each phase's "
                     "time is attributed, but which stage and micro-batch a span belongs to is not known (the "
                     "schedule lists those spans under the rank's first stage, with no micro-batch)")

    annotated = annotated_schedule(events, stages, overlapped=overlapped)
    notes += overlap_notes(events, spans=spans)
    fb = annotated.filter(pl.col("phase").is_in(list(names.PASS_PHASES)))
    unannotated = sorted(set(ranks) - set(fb["rank"].to_list()))
    inferred = conform(pl.DataFrame(), SCHEDULE).clear()
    # (interleaved: from run.json or the traces' metadata, above; without either the P2P pattern can tell:
    # placement.placements, a V or a looped placement.)
    refused = unannotated if interleaved else sorted(set(unannotated) & set(several_stages(stages)))
    # A multi-stage schedule that keeps each backward whole (interleaved 1F1B, looped BFS: no I/W split) still has
    # its phases in autograd's ops: those ranks get their passes from them (no stage, no micro-batch); a split
    # backward (zero-bubble, zbv, DualPipeV) or an unnamed schedule stays refused.
    # (megatron-core, known by its pipeline process group, has no split-backward schedule: its multi-chunk one is
    # interleaved 1F1B)
    whole_backward = config.schedule in WHOLE_BACKWARD_MULTI_STAGE or (
        config.schedule == "unknown" and bool(pipeline_group_stages(run.traces)))
    phases_only = refused if whole_backward else []
    refused = [] if whole_backward else refused
    if refused:
        notes.append(f"ranks {', '.join(map(str, refused))} carry no forward/backward annotations and run a "
                     f"{config.schedule if config.schedule in MULTI_STAGE_SCHEDULES else 'multi-stage'} schedule "
                     "(several virtual stages per rank): which stage, micro-batch and phase each piece of their work "
                     "belongs to cannot be told from P2P order, so their schedule is not inferred and no "
                     "forward/backward is claimed for them (their compute counts as other compute)")
    rest = sorted(set(unannotated) - set(refused) - set(phases_only))
    if rest:
        inferred, n = infer_schedule(events, msgs, stages, ranks=rest)
        notes += n
        got = sorted(set(inferred["rank"].to_list()))
        if got:
            notes.append(f"schedule of ranks {', '.join(map(str, got))} inferred from P2P order (no forward/backward "
                         "annotations)")
    # torch.profiler's defaults (no peers in the P2P calls): the passes from autograd's ops and the calls' order.
    left = sorted((set(rest) - set(inferred["rank"].to_list())) | set(phases_only))
    if left:
        # run.json's plan numbers a multi-stage schedule's passes (its device order)
        plan = ((config.schedule, config.pp // config.virtual_stages, config.virtual_stages, config.num_microbatches)
                if config.schedule in WHOLE_BACKWARD_MULTI_STAGE and config.pp and config.virtual_stages
                and config.num_microbatches and config.pp % config.virtual_stages == 0 else None)
        from_defaults, stages, n = autograd_schedule(events, stages, run.traces, ranks=left,
                                                     several=True if interleaved or phases_only else None, plan=plan)
        if stages["stage"].null_count() == 0:  # (stage_map's "could not be determined" no longer holds)
            notes = [x for x in notes if not (x.startswith("stage of rank") and "could not be determined" in x)]
        notes += n
        inferred = pl.concat([inferred, from_defaults])
    schedule = pl.concat([annotated, inferred]).sort("rank", "step", "start_ns")
    notes += dropped_annotation_notes(events)
    facts = annotated_facts(annotated)
    config = run_config(config, annotated, stages, facts=facts)
    notes += missing_notes(facts) + list(config.conflicts)

    busy = timeline.busy_events(events)
    notes += timeline.gpu_lag_notes(busy, steps)
    labelled = attr.label_busy(busy, schedule)
    del busy
    # (The GPU extents before the segments, which they do not change: their group-by of the busy kernels then
    # does not add to the segments' memory, the analysis' peak; the segments do not read the windows.)
    extents = attr.gpu_schedule_extents(schedule, labelled)
    labelled = labelled.drop("window_start")
    segs = attr.segments(events=events, steps=steps, labelled=labelled, pairs=pairs, unmatched=unmatched,
                         schedule=schedule)
    phase_time = gpu.phase_time(labelled, steps)
    del labelled
    work = gpu.gpu_work(events, steps)  # (GPU work by stream, cut to the steps: once for both)
    stream_time = gpu.stream_time(events, steps, work=work)
    notes += gpu.concurrent_notes(events, steps, work=work)
    notes += gpu.batched_p2p_notes(events)
    del work
    schedule = extents
    attribution = attr.attribute(segs, steps, stages)
    # the allocator samples on the same corrected clock as the steps they are measured in
    stage_mem = mem.stage_memory(timeline.shift(run.memory, offsets, ["ts_ns"]), steps, stages)
    if run.memory.height == 0:
        notes.append("no allocator samples ([memory] events): profile with profile_memory=True for memory per stage")
    elif stage_mem.height and (stage_mem["baseline_bytes"] == 0).any() and (run.memory["device"] < 0).all():
        notes.append("CPU allocator samples count only memory allocated since profiling began (weights and optimizer "
                     "state allocated earlier are missing): peaks are relative, activation peaks are comparable")
    unpaired = mem.ranks_without_addresses(run.memory)
    if unpaired:
        notes.append(f"rank{'s' if len(unpaired) > 1 else ''} {', '.join(map(str, unpaired))}: allocator samples "
                     "carry no block address (Addr: older torch or a hand-written trace), so allocations cannot be "
                     "paired with their frees; the activation peak there is peak − step-start allocation, which "
                     "reads low by up to the gradients zero_grad frees inside the step when the peak comes before "
                     "backward allocates new ones, and high by the new gradients when it comes after")
    measured = measured_steps(attribution, schedule)
    mfu, n = _mfu(config, stages, steps.filter(pl.col("step").is_in(measured)))
    notes += n
    events = cls.apply_fill(events, fill)
    truncated = run.traces.filter(pl.col("truncated"))["rank"].sort().to_list()
    if truncated:
        notes.append(f"rank{'s' if len(truncated) > 1 else ''} {', '.join(map(str, truncated))}: trace truncated (the "
                     "writer stopped mid-file); only its complete events are analysed — re-collect for a full analysis")
    per_rank_step = rank_steps(attribution)
    out = Analysis(
        run=run, steps=steps, p2p=pairs, schedule=schedule, attribution=attribution, stage_memory=stage_mem,
        stages=stage_table(per_rank_step.filter(pl.col("step").is_in(measured)), stages,
                           stage_mem.filter(pl.col("step").is_in(measured)), mfu), clock_offsets=offsets, notes=tuple(notes),
        segments=segs, events=events, phase_time=phase_time, stream_time=stream_time, peak_flops=peak_flops,
    )
    # (built once here: Analysis.config, the one MFU and the notes above used, and Analysis.per_rank_step)
    out.__dict__.update(config=config, per_rank_step=per_rank_step)
    return out


def stage_table(
    per_rank_step: pl.DataFrame, stages: pl.DataFrame, stage_mem: pl.DataFrame, mfu: pl.DataFrame
) -> pl.DataFrame:
    """One row per rank: mean over the given rows of ``Analysis.per_rank_step`` (analyze passes the measured steps,
    traceana.measure.summary) of the step time and of every category (ms and % of the step)."""
    # One lazy query (docs/performance.md "Fixed cost").
    means = (
        per_rank_step.lazy().group_by("rank")
        .agg(pl.len().alias("steps"), pl.col("step_ns").mean().alias("_step"),
             *(pl.col(f"{c}_ns").mean().alias(f"_{c}") for c in CATEGORIES))
    )
    out = means.with_columns(
        (pl.col("_step") / NS_PER_MS).alias("step_ms"),
        *((pl.col(f"_{c}") / NS_PER_MS).alias(f"{c}_ms") for c in CATEGORIES),
        *(pl.when(pl.col("_step") > 0).then(100 * pl.col(f"_{c}") / pl.col("_step")).otherwise(0.0).alias(f"{c}_pct")
          for c in CATEGORIES),
    )
    memory = stage_mem.lazy().group_by("rank").agg(pl.col("peak_bytes").max().alias("peak_memory_bytes"),
                                            pl.col("activation_peak_bytes").max())
    return (
        stages.lazy().join(out, on="rank", how="left")
        .join(memory, on="rank", how="left")
        .join(mfu.lazy(), on="rank", how="left")
        .select("rank", "stage", "stages", "stage_source", "steps", "step_ms",
                *(f"{c}_ms" for c in CATEGORIES), *(f"{c}_pct" for c in CATEGORIES),
                "peak_memory_bytes", "activation_peak_bytes", "mfu", "hfu")
        .sort("stage", "rank", nulls_last=True)
        .collect(**COLLECT)
    )


def _mfu(m: RunConfig, stages: pl.DataFrame, steps: pl.DataFrame) -> tuple[pl.DataFrame, list]:
    """``rank, mfu, hfu``: model (and hardware, with recompute) FLOPs of the stage's step over step time × peak,
    with each stage's layers as the configuration splits them (``RunConfig.stage_layers``)."""
    empty = pl.DataFrame(schema={"rank": pl.Int32, "mfu": pl.Float64, "hfu": pl.Float64})
    peak = m.peak_flops
    missing = [what for what, ok in (
        ("model", m.model is not None), ("pp", bool(m.pp)), ("microbatch_size", bool(m.microbatch_size)),
        ("num_microbatches", bool(m.num_microbatches)), ("peak_flops", bool(peak)),
    ) if not ok]
    if missing:  # (each by its run.json key: what to write, not only what is lacking)
        where = "run.json lacks" if m.has_run_json else "there is no run.json to give"
        return empty, [f"MFU not computed: {where} {', '.join(missing)} (--peak-flops gives peak_flops; "
                       "`traceana describe RUN -o run.json` writes a template for the run folder)"]
    layers_of = m.stage_layers()
    if layers_of is None:
        return empty, [f"MFU not computed: run.json's layers_per_stage ({len(m.layers_per_stage or ())} entries) "
                       f"does not say how the layers of {m.pp} stages divide, several a device"]
    from traceana.core.flops import stage_flops  # (only with a model shape: not imported by a plain analysis)

    model, pp = m.model, m.pp
    rows = []
    step_s = steps.filter(pl.col("step") >= 0).group_by("rank").agg((pl.col("dur_ns").mean() / NS_PER_S).alias("s"))
    secs = dict(step_s.rows())
    held = stages.select("rank", "stage", "stages") if "stages" in stages.columns else stages.select(
        "rank", "stage", pl.lit(None, pl.String).alias("stages"))
    for rank, stage, listed in held.rows():
        # every stage the rank holds (a looped or V placement: several), not only its first
        own = [int(s) for s in listed.split(",")] if listed else ([] if stage is None else [stage])
        if not own or not all(0 <= s < pp for s in own) or rank not in secs or not secs[rank]:
            continue

        def flops(recompute: str) -> float:
            return sum(stage_flops(model, recompute=recompute, layers=layers_of[s], microbatch_size=m.microbatch_size,
                                   last=s == pp - 1) for s in own) * m.num_microbatches

        model_f, hw_f = flops("none"), flops(m.recompute or "none")
        rows.append((rank, model_f / (secs[rank] * peak * m.tp), hw_f / (secs[rank] * peak * m.tp)))
    over = [(r, h) for r, _, h in rows if h > 1]
    if over:  # more FLOPs than the device can do in the step: the inputs, not the run, are wrong
        r, h = max(over, key=lambda x: x[1])
        return empty, [f"MFU not shown: rank {r} would run {h:,.3g} times the peak FLOP/s, which no device can — "
                       "run.json's model shape, micro-batch size or micro-batch count, or the peak FLOP/s "
                       "(--peak-flops, run.json's peak_flops), cannot be right"]
    return pl.DataFrame(rows, schema=empty.schema, orient="row"), []


def strip_annotations(events: pl.DataFrame, *, keep_bpipe: bool = True) -> pl.DataFrame:
    """The events without the schedule's annotations (PP: compute and P2P actions, Forward/Backward {i}): what
    inference starts from, e.g. to check inference against the annotated truth. BPipe's EVICT/LOAD/ACCEPT/RETURN
    spans say which traffic is BPipe's, not what the schedule did, so they stay unless ``keep_bpipe`` is False."""
    name = pl.col("name")
    keep = name.is_null() | names.name_test(name, lambda t: names.pp_columns(t)["pp_action"].is_null()) \
        | (pl.col("cat") != "user_annotation")
    if keep_bpipe:
        keep = keep | names.name_test(name, lambda t: names.pp_columns(t)["pp_action"].is_in(list(names.BPIPE_ACTIONS)))
    return events.filter(keep)
