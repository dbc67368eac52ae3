"""run.json against the traces: what the annotated schedule shows (micro-batches, 1F1B or GPipe order, stages per
rank), the notes where run.json contradicts it, and run.json with what the traces show put in (``traced_manifest``)."""

from __future__ import annotations

import polars as pl

from traceana import intervals as iv
from traceana import names
from traceana.manifest import Manifest
from traceana.pipeline_rules import SCHEDULES, placement_of


def annotated_facts(schedule: pl.DataFrame) -> dict:
    """What the annotated forward/backward spans show: ``num_microbatches`` (the most distinct micro-batches any
    (rank, step) runs forwards of), ``interleaved`` (some rank starts a forward after one of its backwards in a
    step, as 1F1B does and GPipe never does; with the first such (rank, step, micro-batch)), and ``missing``
    ((rank, step, phase, micro-batch) rows that one annotated rank lacks while another has them in that step).
    None where nothing is annotated."""
    a = schedule.filter((pl.col("source") == "annotated") & pl.col("microbatch").is_not_null()
                        & pl.col("phase").is_in(list(names.PASS_PHASES)) & pl.col("step").is_not_null())
    if not a.height:
        return {"num_microbatches": None, "interleaved": None, "missing": None}
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
    return {"num_microbatches": int(per["m"].max() or 0) or None,
            "interleaved": late.row(0, named=True) if late.height else False,
            "missing": missing, "stages": set(stages["stage"].to_list()),
            "stages_per_rank": (per_rank["least"][0], per_rank["most"][0]) if per_rank["ranks"][0] else None,
            "stages_of_rank": dict(held.rows())}


def contradiction_notes(facts: dict, manifest: Manifest | None) -> list[str]:
    """Notes naming where run.json's schedule or micro-batch count contradicts the annotations, and the micro-batches
    whose annotations one rank lacks (``annotated_facts``)."""
    notes = []
    missing = facts.get("missing")
    if missing is not None and missing.height:
        shown = ", ".join(f"rank {r} step {s} {p} of micro-batch {mb}" for r, s, p, mb in missing.head(4).rows())
        notes.append(f"{missing.height} forward/backward annotation{'s' if missing.height > 1 else ''} missing on "
                     f"one rank while the others have them ({shown}{', …' if missing.height > 4 else ''}): that "
                     "work's time counts as other compute there, not as forward/backward")
    if manifest is None:
        return notes
    m = facts.get("num_microbatches")
    if m and manifest.num_microbatches and m != manifest.num_microbatches:
        notes.append(f"run.json says num_microbatches {manifest.num_microbatches} but the traces' annotations show {m} "
                     f"micro-batches per step: the traces' {m} are used — fix num_microbatches in run.json")
    listed = manifest.stage_of_rank or ()
    wrong = [(r, listed[r], st) for r, st in sorted(facts.get("stages_of_rank", {}).items())
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
        why = (f"rank {facts['interleaved']['rank']} starts the forward of micro-batch "
               f"{facts['interleaved']['late_f']} after a backward, as 1F1B does" if kind == "1f1b"
               else "every rank runs all its forwards before any backward, as GPipe does")
        notes.append(f"run.json says schedule {manifest.schedule} but in the traces {why}: {kind} is what the "
                     f"traces show and what validate simulates — fix schedule in run.json")
    return notes


def placement_contradiction(facts: dict, manifest: Manifest | None) -> str | None:
    """Where run.json's schedule places a number of stages on each rank (``pipeline_rules.placement_of``: one, two
    for the V schedules, run.json's ``virtual_stages`` or more than one for the looped ones, one also for
    zero-bubble) that the annotated
    ranks do not hold (``annotated_facts``' stages per rank): what run.json says against what the traces show, or
    None (no annotated stages, no run.json schedule, or they agree)."""
    seen = facts.get("stages_per_rank")
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


def observed_schedule(facts: dict, manifest: Manifest | None) -> str | None:
    """``1f1b`` or ``gpipe`` as the annotations show it when run.json names one of those two (the only pair the
    order of forwards and backwards tells apart, one stage per rank); None when they cannot tell."""
    if manifest is None or manifest.schedule not in ("gpipe", "1f1b") or facts.get("interleaved") is None:
        return None
    if facts["interleaved"]:
        return "1f1b"
    # 1F1B's last stage alternates forward and backward from the first micro-batch on; with one micro-batch, one
    # stage, or the last stage not annotated, all-forwards-then-backwards tells nothing.
    m, pp = facts.get("num_microbatches") or 0, manifest.pp or 0
    return "gpipe" if m >= 2 and pp >= 2 and (pp - 1) in facts.get("stages", ()) else None


def traced_manifest(manifest: Manifest | None, schedule: pl.DataFrame, *, facts: dict | None = None
                    ) -> Manifest | None:
    """run.json with its ``num_microbatches`` and ``schedule`` replaced by what the annotated schedule shows where
    the two contradict (``contradiction_notes`` says so): what MFU and validate use, so that neither computes from a
    micro-batch count or a schedule the run did not have. ``facts``: ``annotated_facts(schedule)``, if the caller
    has them already."""
    import dataclasses

    from traceana.errors import BadInputError

    if manifest is None:
        return None
    facts = annotated_facts(schedule) if facts is None else facts
    changes: dict = {}
    m = facts["num_microbatches"]
    if m and manifest.num_microbatches and m != manifest.num_microbatches:
        changes["num_microbatches"] = m
    kind = observed_schedule(facts, manifest)
    if kind is not None and kind != manifest.schedule:
        changes["schedule"] = kind
    if not changes:
        return manifest
    try:
        return dataclasses.replace(manifest, **changes)
    except BadInputError:
        return manifest
