"""run.json against the traces, once: what the annotated schedule shows (micro-batches, 1F1B or GPipe order, stages
per rank: ``annotated_facts``), the conflicts with run.json, and the reconciled configuration (``Analysis.config``),
each fact with its source (traceana.core.run_config). The analysis builds that one configuration in two steps:
``run_facts`` before the schedule is known (run.json's facts, and whether every rank ran on one host, from run.json or
the traces' metadata: what the P2P pairing, the clock alignment and the stage map read), then ``run_config`` adds what
the schedule shows to it."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.manifest import Manifest
from traceana.core.pipeline_rules import placement_of
from traceana.core.schedule_names import ONE_STAGE_SCHEDULES, SCHEDULES
from traceana.core.run_config import DEFAULT, INFERRED, RUN_JSON, TRACE, RunConfig


@dataclass(frozen=True)
class AnnotatedFacts:
    """What the annotated forward/backward spans show (``annotated_facts``); None where nothing is annotated."""

    num_microbatches: int | None = None  #: the most distinct micro-batches any (rank, step) runs forwards of
    #: some rank starts a forward after one of its backwards in a step (as 1F1B does and GPipe never does): the
    #: first such (rank, step, late_f: micro-batch); False when none does
    interleaved: dict | bool | None = None
    missing: pl.DataFrame | None = None  #: (rank, step, phase, micro-batch) one annotated rank lacks, another has
    stages: frozenset[int] = frozenset()  #: every annotated stage
    stages_per_rank: tuple[int, int] | None = None  #: (least, most) stages an annotated rank holds
    stages_of_rank: dict[int, list[int]] = field(default_factory=dict)  #: rank -> its annotated stages


def annotated_facts(schedule: pl.DataFrame) -> AnnotatedFacts:
    """What the annotated forward/backward spans of ``schedule`` show (``AnnotatedFacts``)."""
    a = schedule.filter((pl.col("source") == "annotated") & pl.col("microbatch").is_not_null()
                        & pl.col("phase").is_in(list(names.PASS_PHASES)) & pl.col("step").is_not_null())
    if not a.height:
        return AnnotatedFacts()
    fwd = pl.col("phase") == "forward"
    a = a.lazy()  # the rest is one collect_all (docs/performance.md "Fixed cost")
    per = a.group_by("rank", "step").agg(
        m=pl.col("microbatch").filter(fwd).n_unique(),
        first_b=pl.col("start_ns").filter(~fwd).min(),
        late_f=pl.col("microbatch").filter(fwd).sort_by(pl.col("start_ns").filter(fwd)).last(),
        last_f=pl.col("start_ns").filter(fwd).max(),
    )
    late = per.filter(pl.col("last_f") > pl.col("first_b")).sort("rank", "step")
    have = a.select("rank", "step", pl.col("phase").replace(dict.fromkeys(names.BACKWARD_PHASES, "backward")),
                    "microbatch").unique()
    expected = have.select("rank", "step").unique().join(have.select("step", "phase", "microbatch").unique(),
                                                          on="step")
    missing = expected.join(have, on=["rank", "step", "phase", "microbatch"], how="anti").sort(
        "rank", "step", "phase", "microbatch")
    held = a.filter(pl.col("stage").is_not_null()).group_by("rank").agg(pl.col("stage").unique().sort())
    per_rank = held.select(n=pl.col("stage").list.len())
    per, late, missing, stages, per_rank, held = pl.collect_all(
        [per, late, missing, a.select(pl.col("stage").drop_nulls().unique()),
         per_rank.select(most=pl.col("n").max(), least=pl.col("n").min(), ranks=pl.len()), held], **iv.COLLECT)
    return AnnotatedFacts(
        num_microbatches=int(per["m"].max() or 0) or None,
        interleaved=late.row(0, named=True) if late.height else False,
        missing=missing, stages=frozenset(stages["stage"].to_list()),
        stages_per_rank=(per_rank["least"][0], per_rank["most"][0]) if per_rank["ranks"][0] else None,
        stages_of_rank=dict(held.rows()))


def missing_notes(facts: AnnotatedFacts) -> list[str]:
    """A note naming the micro-batches whose annotations one rank lacks while the others have them."""
    missing = facts.missing
    if missing is None or not missing.height:
        return []
    shown = ", ".join(f"rank {r} step {s} {p} of micro-batch {mb}" for r, s, p, mb in missing.head(4).rows())
    return [f"{missing.height} forward/backward annotation{'s' if missing.height > 1 else ''} missing on one rank "
            f"while the others have them ({shown}{', …' if missing.height > 4 else ''}): that work's time counts as "
            "other compute there, not as forward/backward"]


def conflicts(facts: AnnotatedFacts, manifest: Manifest | None) -> list[str]:
    """Where run.json's micro-batch count, stage of a rank, placement or schedule contradicts the annotations: one
    note each, saying which one analyze and validate use and what to fix."""
    notes: list[str] = []
    if manifest is None:
        return notes
    m = facts.num_microbatches
    if m and manifest.num_microbatches and m != manifest.num_microbatches:
        notes.append(f"run.json says num_microbatches {manifest.num_microbatches} but the traces' annotations show {m} "
                     f"micro-batches per step: the traces' {m} are used — fix num_microbatches in run.json")
    listed = manifest.stage_of_rank or ()
    wrong = [(r, listed[r], st) for r, st in sorted(facts.stages_of_rank.items())
             if 0 <= r < len(listed) and listed[r] not in st]
    if wrong:
        r, said, st = wrong[0]
        notes.append(f"run.json's stage_of_rank puts rank {r} on stage {said}, but its annotations name stage"
                     f"{'s' if len(st) > 1 else ''} {', '.join(map(str, st))}"
                     f"{f' (and {len(wrong) - 1} more ranks)' if len(wrong) > 1 else ''}: the per-stage tables "
                     "follow run.json, so they label that work with another stage — fix stage_of_rank in run.json")
    placement = placement_contradiction(facts, manifest)
    if placement:
        notes.append(f"{placement}: the traces' stages are what analyze uses; validate refuses to simulate it — fix "
                     "schedule (or virtual_stages) in run.json")
    kind = observed_schedule(facts, manifest)
    if kind is not None and kind != manifest.schedule:
        why = (f"rank {facts.interleaved['rank']} starts the forward of micro-batch "
               f"{facts.interleaved['late_f']} after a backward, as 1F1B does" if kind == "1f1b"
               else "every rank runs all its forwards before any backward, as GPipe does")
        notes.append(f"run.json says schedule {manifest.schedule} but in the traces {why}: {kind} is what the "
                     f"traces show and what validate simulates — fix schedule in run.json")
    return notes


def placement_contradiction(facts: AnnotatedFacts, manifest: Manifest | None) -> str | None:
    """Where run.json's schedule places a number of stages on each rank (``pipeline_rules.placement_of``: one, two
    for the V schedules, run.json's ``virtual_stages`` or more than one for the looped ones, one also for
    zero-bubble) that the annotated
    ranks do not hold (``annotated_facts``' stages per rank): what run.json says against what the traces show, or
    None (no annotated stages, no run.json schedule, or they agree)."""
    seen = facts.stages_per_rank
    if manifest is None or seen is None or manifest.schedule not in SCHEDULES:
        return None
    least, most = seen
    placement = placement_of(manifest.schedule)
    want = 1 if placement == "single" else 2 if placement == "v" else manifest.stages_a_rank
    if want is not None and least == most == want or want is None and least > 1:
        return None
    # torch's ScheduleInterleavedZeroBubble also runs one stage per rank: ZB-H1 (docs/schedules.md, "Bubbles")
    if want is None and manifest.schedule == "zero-bubble" and least == most == 1:
        return None
    holds = f"{least}" if least == most else f"{least} to {most}"
    says = f"{want} stage{'s' if want != 1 else ''}" if want else "several stages"
    return (f"run.json says schedule {manifest.schedule}, which places {says} on each rank, but the traces' "
            f"annotations give each rank {holds}")


def observed_schedule(facts: AnnotatedFacts, manifest: Manifest | None) -> str | None:
    """``1f1b`` or ``gpipe`` as the annotations show it when run.json names one of those two (the only pair the
    order of forwards and backwards tells apart, one stage per rank); None when they cannot tell."""
    if manifest is None or manifest.schedule not in ONE_STAGE_SCHEDULES or facts.interleaved is None:
        return None
    if facts.interleaved:
        return "1f1b"
    # 1F1B's last stage alternates forward and backward from the first micro-batch on; with one micro-batch, one
    # stage, or the last stage not annotated, all-forwards-then-backwards tells nothing.
    m, pp = facts.num_microbatches or 0, manifest.pp or 0
    return "gpipe" if m >= 2 and pp >= 2 and (pp - 1) in facts.stages else None


def same_host(config: RunConfig, traces: pl.DataFrame | None) -> tuple[bool | None, str]:
    """Whether every rank ran on one host, and where that is told: run.json's ``hosts`` (one name) or ``nnodes``
    (1), else the traces' own metadata (a ``host`` on every trace, one name); (None, default) when neither says."""
    if config.hosts and len(set(config.hosts)) == 1 or config.nnodes == 1:
        return True, RUN_JSON
    if traces is not None and "host" in traces.columns:
        hosts = traces["host"].drop_nulls()
        if len(hosts) == traces.height and hosts.n_unique() == 1:
            return True, TRACE
    return None, DEFAULT


def run_facts(manifest: Manifest | None, traces: pl.DataFrame | None = None, *,
              peak_flops: float | None = None) -> RunConfig:
    """The configuration before the schedule is known: run.json's facts (``RunConfig.from_manifest``; ``peak_flops``
    the option over its own) and ``same_host`` (``same_host``: run.json's, else the traces' metadata). The analysis
    pairs the P2P messages (``link_bytes_per_s``, ``p2p_latency_ns``), aligns the clocks (``same_host``) and maps the
    stages (``stage_of_rank``, ``stages_of_rank``) with it, then ``run_config`` reconciles the schedule into it."""
    cfg = RunConfig.from_manifest(manifest, peak_flops=peak_flops)
    one_host, source = same_host(cfg, traces)
    if one_host is None:
        return cfg
    return cfg.replace(same_host=one_host, sources={**cfg.sources, "same_host": source})


def run_config(start: RunConfig | Manifest | None, schedule: pl.DataFrame, stages: pl.DataFrame | None = None, *,
               peak_flops: float | None = None, facts: AnnotatedFacts | None = None) -> RunConfig:
    """The run's configuration reconciled once (``Analysis.config``): ``start`` — ``run_facts``' configuration, or
    run.json (its facts, ``RunConfig.from_manifest``, with ``peak_flops`` the option over its own) —
    with the micro-batch count and the schedule the annotated ``schedule`` shows where run.json contradicts or lacks
    them (source trace; the contradiction among ``conflicts``), every rank's stages from the stage map ``stages``
    where run.json lists none (source trace when the traces name them, else inferred; and ``pp`` from them when
    run.json gives none and they hold every stage up to the last, one a rank), and ``refusal`` where
    run.json's schedule places another number of stages on each rank than the traces hold. ``peak_flops``: the
    option overriding run.json's (with ``start`` a Manifest); ``facts``: ``annotated_facts(schedule)``, if the caller
    has them. ``overruled`` keeps run.json's value of each fact the traces' replaced."""
    facts = annotated_facts(schedule) if facts is None else facts
    cfg = start if isinstance(start, RunConfig) else RunConfig.from_manifest(start, peak_flops=peak_flops)
    manifest = cfg.manifest
    sources = dict(cfg.sources)
    changes: dict = {}
    overruled = dict(cfg.overruled)
    m = facts.num_microbatches
    if m and m != cfg.num_microbatches and (manifest is not None or cfg.num_microbatches is None):
        if cfg.source("num_microbatches") == RUN_JSON:
            overruled["num_microbatches"] = cfg.num_microbatches
        changes["num_microbatches"], sources["num_microbatches"] = m, TRACE
    kind = observed_schedule(facts, manifest)
    if kind is not None and kind != cfg.schedule:
        overruled["schedule"] = cfg.schedule
        changes["schedule"], sources["schedule"] = kind, TRACE
    if cfg.stages_of_rank is None and stages is not None and stages.height and "stages" in stages.columns:
        listed = {r: tuple(int(x) for x in st.split(",")) for r, st in stages.select("rank", "stages").rows() if st}
        if listed:
            told = set(stages.filter(pl.col("stages").is_not_null())["stage_source"].to_list())
            changes["stages_of_rank"] = listed
            sources["stages_of_rank"] = INFERRED if told - {RUN_JSON, "trace metadata", "annotations"} else TRACE
            held = {s for st in listed.values() for s in st}
            # one stage a rank, every stage up to the last: the pipeline's stages (several a rank: how many devices
            # and stages run.json would mean is not told, so pp stays unknown)
            if cfg.pp is None and all(len(st) == 1 for st in listed.values()) and held == set(range(max(held) + 1)):
                changes["pp"], sources["pp"] = len(held), sources["stages_of_rank"]
    return cfg.replace(**changes, sources=sources, overruled=overruled, conflicts=tuple(conflicts(facts, manifest)),
                       refusal=placement_contradiction(facts, manifest))
