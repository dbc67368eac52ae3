"""What-if analysis of a measured run: its dependency graph (traceana.graph) replayed with chosen operations made
*ideal* or changed, after *Understanding Stragglers in Large Model Training Using What-if Analysis* (OSDI 2025).
Definitions (docs/whatif.md):

- **ideal** of an operation: the median duration of the same work across its peers — the same action (forward,
  backward, its I/W halves, optimizer, collective) on the same stage, over the ranks holding that stage, their
  micro-batches and the measured steps (a run's micro-batch size is one); its host gap likewise (the step's first
  operation apart: it follows data loading). A P2P or BPipe transfer's: the median transfer of its channel.
- a group (rank, replica) **made ideal**: its operations at the median of its peers *without it* — the median of
  the other ranks' medians of the same work on the same stage; a rank alone on its stage is its own peer (its own
  median: micro-batches and steps even out).
  A **stage made ideal**: its passes at the median of the *other stages'* medians of the same action (the stage
  at the other stages' speed: an imbalance shows), the rest of it at its own ideal.
- ``ideal_step_ms``: everything ideal; ``slowdown`` = measured / ideal; a group's slowdown (``by_*``): everything
  ideal except that group, as measured, over everything ideal (the paper's S).
- a group's **gain**: the replayed step less the step with that group made ideal and the rest as measured.
- **noise** (``noise.noise_ms``, beside the comparisons' rule): the spread (max − min) of the measured step over the
  measured steps, the slowest left out when there are three or more, and at least NOISE_FLOOR of the median step.
- a rank, replica or stage is **named** (a straggler: rank or replica; a bottleneck: stage) only if its gain exceeds
  the noise in every measured step. A rank that only waits gains nothing when made ideal (its work is its peers'
  already), so it is never named; a run without stages names no stage and no replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import polars as pl

from traceana import intervals as iv
from traceana.errors import TraceanaError
from traceana.graph import KIND_OF_ACTION, StepGraph, build, critical_path, on_path, replay, replay_variants
from traceana.noise import noise_ms
from traceana.units import NS_PER_MS

# A what-if's gain counts only above this share of the step even when the measured steps agree more closely (a
# single measured step has no spread): equal replicas of the tiny CPU pipelines on the 2-core machine differed by up
# to 13 % in every one of 5 steps (summary's replica rule), a replay's own error is below 0.1 % (docs/whatif.md).
KINDS = ("forward", "backward", "optimizer", "collective", "p2p", "host")
PASS_ACTIONS = ("F", "B", "I", "W")


def ms(x: float) -> str:
    """Milliseconds with three significant digits at least (a 0.1 ms step and a 1,318 ms one alike)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) >= 0.001 else f"{x:.2g}"


class SetError(TraceanaError):
    """A --set that cannot be read."""


@dataclass(frozen=True)
class Change:
    """One --set: who (stage / rank / replica, or everyone), what (a kind or every kind), how (ideal, × factor,
    = milliseconds)."""

    who: str | None
    who_id: int | None
    kind: str | None  # one of KINDS, None: every kind
    how: str  # "ideal", "scale", "set"
    value: float = 0.0
    text: str = ""


SET_HELP = ("[stage=S:|rank=R:|replica=K:]WHAT where WHAT is ideal, KIND:ideal, KIND*FACTOR or KIND=MS and KIND one of "
            + ", ".join(KINDS) + " (e.g. 'stage=1:forward*0.5', 'p2p=0', 'rank=3:ideal')")


def parse_set(text: str) -> Change:
    """One --set (SET_HELP); SetError on anything else."""
    parts = text.strip().split(":")
    who = who_id = None
    m = re.fullmatch(r"(stage|rank|replica)=(\d+)", parts[0].strip())
    if m and len(parts) > 1:
        who, who_id = m.group(1), int(m.group(2))
        parts = parts[1:]
    rest = ":".join(parts).strip()
    if rest == "ideal":
        return Change(who, who_id, None, "ideal", text=text)
    m = re.fullmatch(r"([a-z0-9_]+)(?::ideal|\*([0-9.eE+-]+)|=([0-9.eE+-]+))", rest)
    if not m or m.group(1) not in KINDS:
        raise SetError(f"--set {text!r} cannot be read", fix=f"write {SET_HELP}")
    number = m.group(2) if m.group(2) is not None else m.group(3)
    if number is None:
        return Change(who, who_id, m.group(1), "ideal", text=text)
    try:
        value = float(number)
    except ValueError:
        raise SetError(f"--set {text!r}: {number!r} is not a number", fix=f"write {SET_HELP}") from None
    if not value >= 0 or value == float("inf"):
        raise SetError(f"--set {text!r}: a duration or factor must be a finite number ≥ 0",
                       fix="give a factor or milliseconds ≥ 0")
    return Change(who, who_id, m.group(1), "scale" if m.group(2) is not None else "set", value, text)


def _ideals(g: StepGraph) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The graph's ops and edges with the ideal columns (module docstring): ideal_work / ideal_gap (all peers),
    peer_work / peer_gap (peers without the op's rank), stage_work (other stages' median; passes only);
    edges' ideal_transfer."""
    # Lazy queries on the analysis' engine (docs/performance.md "Fixed cost": each eager step is a collect; the
    # default engine, streaming, cost 3x the CPU here and paged in its own code), each frame used more than once
    # collected once: without common-subplan elimination (iv.COLLECT) a single query ran the self-joins' inputs,
    # and theirs, again for each use (the tiny run 12 -> 3 ms; the same frames).
    ops = g.ops.lazy().join(g.ranks.lazy().select("rank", "step", "replica"), on=["rank", "step"], how="left",
                            maintain_order="left").with_columns(
        pl.col("action").replace_strict(KIND_OF_ACTION, return_dtype=pl.String).alias("kind"),
        (pl.col("seq") == 0).alias("first"),
        # the same work: the same stage; a rank whose stage is unknown is the peer of none but itself, unless the
        # run has no P2P at all (data parallel: every rank holds the one model)
        pl.coalesce("stage", pl.lit(-1) if g.data_parallel else -1 - pl.col("rank")).alias("_work"))
    work_key, gap_key = ["action", "_work"], ["action", "_work", "first"]
    ops = ops.with_columns(pl.col("work_ns").median().over(work_key).alias("ideal_work"),
                           pl.col("gap_ns").median().over(gap_key).alias("ideal_gap")).collect(**iv.COLLECT).lazy()
    # peers without the op's rank: per (key, rank) the others' values; a rank alone is its own peer
    for col, key, out in (("work_ns", work_key, "peer_work"), ("gap_ns", gap_key, "peer_gap")):
        own = ops.group_by(*key, "rank").agg(pl.col(col).median().alias("_own"))
        others = (own.join(own, on=key, suffix="_o", nulls_equal=True).filter(pl.col("rank") != pl.col("rank_o"))
                  .group_by(*key, "rank").agg(pl.col("_own_o").median().alias(out)))
        ops = (ops.join(others, on=[*key, "rank"], how="left", nulls_equal=True, maintain_order="left")
               .join(own, on=[*key, "rank"], how="left", nulls_equal=True, maintain_order="left")
               .with_columns(pl.coalesce(out, "_own").alias(out)).drop("_own")).collect(**iv.COLLECT).lazy()
    # a stage at the other stages' speed: the median of the other stages' medians of the same pass
    med = (ops.filter(pl.col("action").is_in(PASS_ACTIONS) & pl.col("stage").is_not_null())
           .group_by("action", "stage").agg(pl.col("work_ns").median().alias("_m"))).collect(**iv.COLLECT).lazy()
    other = (med.join(med, on="action", suffix="_o").filter(pl.col("stage") != pl.col("stage_o"))
             .group_by("action", "stage").agg(pl.col("_m_o").median().alias("stage_work")))
    ops = ops.join(other, on=["action", "stage"], how="left", nulls_equal=True, maintain_order="left").with_columns(
        pl.coalesce("stage_work", "peer_work").alias("stage_work")).collect(**iv.COLLECT)
    edges = g.edges.with_columns(pl.col("transfer_ns").median().over("channel").alias("ideal_transfer"))
    return ops, edges


def _selected(c_who: str | None, c_id: int | None, kind: str | None) -> pl.Expr:
    sel = pl.lit(True) if c_who is None else (pl.col(c_who) == c_id)
    if kind is not None and kind != "host":
        sel = sel & (pl.col("kind") == kind)
    return sel


Variant = tuple[pl.Expr, pl.Expr, pl.Expr]  # work_ns, gap_ns (over the ops), transfer_ns (over the edges)


def changed(ops: pl.DataFrame, changes: list[Change]) -> Variant:
    """The ops' work_ns / gap_ns and the edges' transfer_ns after ``changes`` (in order), as expressions."""
    work, gap, transfer = pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns")
    for c in changes:
        if c.kind in ("p2p",):
            sel = pl.lit(True) if c.who is None else (
                pl.col("src").is_in(_members(ops, c)) | pl.col("dst").is_in(_members(ops, c)))
            new = {"ideal": pl.col("ideal_transfer"), "scale": transfer * c.value,
                   "set": pl.lit(c.value * NS_PER_MS)}[c.how]
            transfer = pl.when(sel).then(new).otherwise(transfer).round().cast(pl.Int64)
            continue
        sel = _selected(c.who, c.who_id, c.kind)
        ideal_work = {"stage": "stage_work", "rank": "peer_work", "replica": "peer_work"}.get(c.who, "ideal_work")
        ideal_gap = "ideal_gap" if c.who is None else "peer_gap"
        if c.kind != "host":
            new = {"ideal": pl.col(ideal_work), "scale": work * c.value, "set": pl.lit(c.value * NS_PER_MS)}[c.how]
            work = pl.when(sel).then(new).otherwise(work).round().cast(pl.Int64)
        if c.kind in (None, "host"):
            new = {"ideal": pl.col(ideal_gap), "scale": gap * c.value, "set": pl.lit(c.value * NS_PER_MS)}[c.how]
            gap = pl.when(sel).then(new).otherwise(gap).round().cast(pl.Int64)
    return work, gap, transfer


def materialize(ops: pl.DataFrame, edges: pl.DataFrame, variant: Variant) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A variant's ops and edges (its work_ns, gap_ns, transfer_ns in place of the measured ones)."""
    work, gap, transfer = variant
    return (ops.with_columns(work.alias("work_ns"), gap.alias("gap_ns")),
            edges.with_columns(transfer.alias("transfer_ns")))


def apply(ops: pl.DataFrame, edges: pl.DataFrame, changes: list[Change]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The ops' work_ns / gap_ns and the edges' transfer_ns after ``changes`` (in order)."""
    return materialize(ops, edges, changed(ops, changes))


def _members(ops: pl.DataFrame, c: Change) -> list[int]:
    return ops.filter(pl.col(c.who) == c.who_id)["rank"].unique().to_list()


def all_ideal_except(who: str | None, who_id: int | None, kind: str | None) -> Variant:
    """Everything ideal except the group (who = who_id, or the kind), which stays as measured."""
    keep = pl.lit(False)
    if who is not None:
        keep = pl.col(who) == who_id
    elif kind is not None and kind != "p2p":
        keep = pl.col("kind") == kind if kind != "host" else pl.lit(False)
    work = pl.when(keep).then("work_ns").otherwise(pl.col("ideal_work")).round().cast(pl.Int64)
    gap = pl.when(keep | pl.lit(kind == "host")).then("gap_ns").otherwise(pl.col("ideal_gap")).round().cast(pl.Int64)
    transfer = pl.col("transfer_ns") if kind == "p2p" else pl.col("ideal_transfer").round().cast(pl.Int64)
    return work, gap, transfer


@dataclass(frozen=True)
class WhatIf:
    """A run's what-if (module docstring). Times in ms, means over the measured steps."""

    summary: dict
    per_rank: pl.DataFrame  # rank, stage, replica, measured_step_ms, replayed_step_ms, replay_error
    path_time: pl.DataFrame  # time on the critical path (graph.on_path): group (kind/stage/rank), id, ms, fraction
    path: pl.DataFrame  # the last measured step's critical path (graph.critical_path)
    paths: pl.DataFrame  # every measured step's
    slack: pl.DataFrame  # every operation of the last measured step: rank, seq, kind, stage, start/end, slack_ns
    groups: pl.DataFrame  # group (stage / rank / replica / kind), id, if_ideal_step_ms, gain_ms, min_gain_ms,
    #                       slowdown, named
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        out = dict(self.summary)
        for grp in ("stage", "rank", "replica", "kind"):
            out[f"by_{grp}"] = self.groups.filter(pl.col("group") == grp).drop("group").to_dicts()
        out["per_rank"] = self.per_rank.to_dicts()
        out["critical_path"] = {f"by_{grp}": self.path_time.filter(pl.col("group") == grp).drop("group").to_dicts()
                                for grp in ("kind", "stage", "rank")}
        out["critical_path"]["last_step"] = self.path.to_dicts()
        out["slack"] = self.slack.to_dicts()
        out["notes"] = list(self.notes)
        return out


def whatif(analysis, changes: list[Change] = (), graph: StepGraph | None = None, *, full: bool = True,
           candidates: int | None = None) -> WhatIf:
    """Replay the measured steps as measured, everything ideal, every group made ideal and as the only one measured,
    and with ``changes``; name the stragglers and the bottleneck (module docstring). ``full`` False: only what
    naming needs (each rank, replica and stage made ideal; no per-kind figures, no slowdowns). ``candidates``: make
    ideal only that many ranks and replicas, those whose work and gaps exceed their peers' the most (a rank whose
    work is its peers' gains nothing when made ideal); the others' rows are left empty."""
    g = graph or build(analysis)
    ops, edges = _ideals(g)
    for c in changes:
        if c.who is not None and c.who_id not in set(ops[c.who].drop_nulls().to_list()):
            have = sorted(set(ops[c.who].drop_nulls().to_list()))
            raise SetError(f"--set {c.text!r}: the run has no {c.who} {c.who_id}",
                           fix=f"its {c.who}s are {', '.join(map(str, have)) or 'unknown'}")
    steps = list(g.steps)
    stages_known = ops["stage"].null_count() == 0 or g.data_parallel

    def steps_ms(variants: list[Variant]) -> list[list[float]]:
        """Every variant replayed (graph.replay_variants: the engine's replay, many variants at once)."""
        return [[x / NS_PER_MS for x in v] for v in replay_variants(g, ops, edges, variants)]

    replays = [replay(g, s) for s in steps]
    paths = [critical_path(g, r) for r in replays]
    path_time = on_path([p for p, _ in paths])
    replayed = [r.step_ns / NS_PER_MS for r in replays]
    measured_rank = (g.ranks.select("rank", "step", "stage", "replica",
                                    ((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_MS).alias("measured_step_ms")))
    replay_rank = pl.concat([r.ranks.select("rank", pl.lit(r.step, pl.Int32).alias("step"),
                                            (pl.col("step_ns") / NS_PER_MS).alias("replayed_step_ms"))
                             for r in replays])
    per_rank_step = measured_rank.join(replay_rank, on=["rank", "step"]).with_columns(
        ((pl.col("replayed_step_ms") - pl.col("measured_step_ms")) / pl.col("measured_step_ms")).alias("replay_error"))
    per_rank = (per_rank_step.group_by("rank", "stage", "replica")
                .agg(pl.col("measured_step_ms", "replayed_step_ms").mean(),
                     pl.col("replay_error").abs().max())
                .sort("rank"))
    measured_steps = (per_rank_step.group_by("step").agg(pl.col("measured_step_ms").max()).sort("step")
                      ["measured_step_ms"].to_list())
    measured = sum(measured_steps) / len(measured_steps)
    replay_mean = sum(replayed) / len(replayed)
    ideal = steps_ms([all_ideal_except(None, None, None)])[0]
    ideal_mean = sum(ideal) / len(ideal)
    noise = noise_ms(measured_steps)

    rows = []
    groups: list[tuple[str, int | str]] = [("kind", k) for k in KINDS
                                           if (k == "p2p" and edges.height) or k == "host"
                                           or ops.filter(pl.col("kind") == k).height] if full else []
    excess = (ops.group_by("rank", "replica")
              .agg((pl.col("work_ns") - pl.col("peer_work") + pl.col("gap_ns") - pl.col("peer_gap")).sum().alias("x"))
              .sort("x", "rank", descending=[True, False]))
    ranks = excess["rank"].to_list()
    skipped: list[tuple[str, int]] = []
    if candidates is not None:
        skipped += [("rank", r) for r in ranks[candidates:]]
        ranks = ranks[:candidates]
    groups += [("rank", r) for r in sorted(ranks)]
    if stages_known:
        stages = sorted(ops["stage"].unique().to_list())
        if len(stages) > 1:
            groups += [("stage", s) for s in stages]
        replicas = (excess.group_by("replica").agg(pl.col("x").sum()).sort("x", "replica", descending=[True, False])
                    ["replica"].drop_nulls().to_list())
        if len(replicas) > 1:
            if candidates is not None:
                skipped += [("replica", k) for k in replicas[candidates:]]
                replicas = replicas[:candidates]
            groups += [("replica", k) for k in sorted(replicas)]
    variants = []
    for grp, gid in groups:
        if grp == "kind":
            variants.append(changed(ops, [Change(None, None, gid, "ideal")]))
            variants += [all_ideal_except(None, None, gid)] if full else []
        else:
            variants.append(changed(ops, [Change(grp, gid, None, "ideal")]))
            variants += [all_ideal_except(grp, gid, None)] if full else []
    if changes:
        variants.append(changed(ops, list(changes)))
    replayed_variants = iter(steps_ms(variants))
    for grp, gid in groups:
        if_ideal = next(replayed_variants)
        only = next(replayed_variants) if full else None
        gains = [a - b for a, b in zip(replayed, if_ideal)]
        rows.append((grp, str(gid), sum(if_ideal) / len(if_ideal), sum(gains) / len(gains), min(gains),
                     (sum(only) / len(only)) / ideal_mean if only and ideal_mean else None,
                     grp in ("rank", "replica", "stage") and min(gains) > noise))
    rows += [(grp, str(gid), None, None, None, None, False) for grp, gid in skipped]
    table = pl.DataFrame(rows, schema={"group": pl.String, "id": pl.String, "if_ideal_step_ms": pl.Float64,
                                       "gain_ms": pl.Float64, "min_gain_ms": pl.Float64, "slowdown": pl.Float64,
                                       "named": pl.Boolean}, orient="row")
    # A stage or replica is named for itself only when none of its ranks is: one slow rank makes its stage and its
    # replica slow too, and naming those would point at the ranks that only wait on it.
    with_named = ops.join(table.filter((pl.col("group") == "rank") & pl.col("named"))
                          .select(pl.col("id").cast(pl.Int32).alias("rank")), on="rank")
    for grp in ("stage", "replica"):
        has = with_named[grp].drop_nulls().unique().cast(pl.String).to_list()
        table = table.with_columns(pl.when((pl.col("group") == grp) & pl.col("id").is_in(has))
                                   .then(False).otherwise("named").alias("named"))
    changed_step = None
    if changes:
        changed_ms = next(replayed_variants)
        changed_step = sum(changed_ms) / len(changed_ms)
    spread_gain = min(a - b for a, b in zip(replayed, ideal))  # everything ideal: the gain in the worst step
    diagnosis, bottleneck = _diagnose(table, ops, replay_mean, ideal_mean, noise, stages_known, spread_gain)
    summary = {
        "run": str(analysis.run.path),
        "measured_steps": steps,
        "measured_step_ms": measured,
        "replayed_step_ms": replay_mean,
        "replay_error": float(per_rank["replay_error"].max()),
        "ideal_step_ms": ideal_mean,
        "slowdown": measured / ideal_mean if ideal_mean else None,
        "noise_ms": noise,
        "diagnosis": diagnosis,
        "bottleneck": bottleneck,
        "changes": [c.text for c in changes],
        "changed_step_ms": changed_step,
        "host_gap_fraction": float(ops["gap_ns"].sum()) / total if (
            total := float((g.ranks["end_ns"] - g.ranks["start_ns"]).sum())) else None,
    }
    notes = tuple(g.notes)
    if not stages_known:
        notes += ("the stages of some ranks are unknown: no stage and no replica is named, only ranks",)
    last = replays[-1]
    slack = (g.ops.filter(pl.col("step") == last.step).select("rank", "seq", "phase", "stage", "microbatch")
             .join(last.ops.select("rank", "seq", "start_ns", "end_ns"), on=["rank", "seq"])
             .join(paths[-1][1], on=["rank", "seq"]).sort("rank", "seq"))
    return WhatIf(summary=summary, per_rank=per_rank, groups=table, path_time=path_time, path=paths[-1][0],
                  paths=pl.concat([p for p, _ in paths]), slack=slack, notes=notes)


def _diagnose(table: pl.DataFrame, ops: pl.DataFrame, replayed: float, ideal: float, noise: float,
              stages_known: bool, spread_gain: float) -> tuple[str, dict | None]:
    """One line, and the bottleneck named (group, id, step if it were ideal) or None."""
    named = table.filter(pl.col("named")).sort("gain_ms", descending=True)
    ranks = named.filter(pl.col("group") == "rank")
    replicas = named.filter(pl.col("group") == "replica")
    stages = named.filter(pl.col("group") == "stage")

    def where(rank: int) -> str:
        row = ops.filter(pl.col("rank") == rank).row(0, named=True)
        bits = [f"stage {row['stage']}" if row["stage"] is not None else None,
                f"replica {row['replica']}" if row["replica"] is not None and stages_known
                and ops["replica"].n_unique() > 1 else None]
        return f" ({', '.join(b for b in bits if b)})" if any(bits) else ""

    def cost(row: dict) -> str:
        return f"the step would be {ms(row['if_ideal_step_ms'])} ms instead of {ms(replayed)} ms"

    per_stage = dict(ops.group_by("_work").agg(pl.col("rank").n_unique()).iter_rows())
    alone = {r: per_stage[w] == 1 for r, w in ops.select("rank", "_work").unique().iter_rows()}

    def speed(rank: int) -> str:  # a rank alone on its stage is its own peer: its own median
        return "with its slower operations at its own median" if alone[rank] else "at its peers' speed"

    several_per_stage = max(per_stage.values()) > 1
    if ranks.height == 1 and (several_per_stage or stages.height == 0):
        r = ranks.row(0, named=True)
        return (f"one rank: rank {r['id']}{where(int(r['id']))} holds the step back — {speed(int(r['id']))} "
                f"{cost(r)}", {"group": "rank", "id": int(r["id"]), "step_ms": r["if_ideal_step_ms"],
                               "gain_ms": r["gain_ms"]})
    if replicas.height == 1 and ranks.height <= 1:
        r = replicas.row(0, named=True)
        return (f"one replica: replica {r['id']} holds the step back — at its peers' speed {cost(r)}",
                {"group": "replica", "id": int(r["id"]), "step_ms": r["if_ideal_step_ms"], "gain_ms": r["gain_ms"]})
    if stages.height == 1:
        r = stages.row(0, named=True)
        return (f"one stage (imbalance): stage {r['id']} holds the step back — at the other stages' speed "
                f"{cost(r)}", {"group": "stage", "id": int(r["id"]), "step_ms": r["if_ideal_step_ms"],
                               "gain_ms": r["gain_ms"]})
    if ranks.height == 1:
        r = ranks.row(0, named=True)
        return (f"one rank: rank {r['id']}{where(int(r['id']))} holds the step back — {speed(int(r['id']))} "
                f"{cost(r)}", {"group": "rank", "id": int(r["id"]), "step_ms": r["if_ideal_step_ms"],
                               "gain_ms": r["gain_ms"]})
    if named.height or spread_gain > noise:
        who = ", ".join(f"{r['group']} {r['id']}" for r in named.iter_rows(named=True)) or "no single rank or stage"
        kinds = table.filter((pl.col("group") == "kind") & (pl.col("gain_ms") > 0)).sort("gain_ms", descending=True)
        most = (f"; the most from one kind of time: {kinds['id'][0]} at its ideal, {ms(kinds['gain_ms'][0])} ms"
                if kinds.height else "")
        return (f"spread over many ({who}): with everything at its peers' speed the step would be {ms(ideal)} ms "
                f"instead of {ms(replayed)} ms{most}", None)
    return (f"nothing beyond noise: no rank, replica or stage made ideal shortens the step by more than "
            f"{ms(noise)} ms", None)


# What a plan what-if can change of the run's configuration (everything else is the run's own).
PLAN_FIELDS = ("schedule", "num_microbatches", "bpipe", "virtual_stages")


def plan_of(base, target) -> dict | None:
    """``plan_whatif``'s keywords that make the configuration ``base`` into ``target`` (TrainingConfig), or None
    where they differ in more than a plan what-if changes (PLAN_FIELDS: e.g. recompute, the model, pp)."""
    if base.replace(**{f: getattr(target, f) for f in PLAN_FIELDS}) != target:
        return None
    return {"schedule": target.schedule, "microbatches": target.num_microbatches, "bpipe": bool(target.bpipe),
            "virtual_stages": target.virtual_stages}


def plan_whatif(analysis, *, schedule: str | None = None, microbatches: int | None = None,
                bpipe: bool | None = None, virtual_stages: int | None = None) -> dict:
    """The run's measured durations under another plan: another schedule, micro-batch count, BPipe on or off — the
    measured counterpart of ``estimate``'s verdict, and ``validate --baseline``'s prediction where the two runs
    differ only in these (``plan_of``). Both the run as it ran and the other plan are simulated on the one
    scheduler from the run's own per-stage durations (validation.prediction.predict); the other plan's step is the
    measured step × their ratio, so what the simulator leaves out of the run (host time it does not model, shared
    cores) cancels. ``virtual_stages``: model chunks per device (default: 2 for a multi-stage schedule, else 1).
    Needs run.json's model and pipeline (AnalysisError, ConfigError otherwise)."""
    from traceana.validation.prediction import predict

    base = analysis.config.training_config(path=analysis.run.path)
    changes = {k: v for k, v in (("schedule", schedule), ("num_microbatches", microbatches), ("bpipe", bpipe))
               if v is not None}
    if schedule is not None:  # a multi-stage schedule splits each device's layers into two chunks (and back)
        from traceana.manifest import MULTI_STAGE_SCHEDULES

        changes["virtual_stages"] = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    if virtual_stages is not None:
        changes["virtual_stages"] = virtual_stages
    target = base.replace(**changes)
    as_run = predict(analysis, base, base_cfg=base).step_ns / NS_PER_MS
    other = predict(analysis, target, base_cfg=base).step_ns / NS_PER_MS
    measured = analysis.summary.step_ms
    return {
        "as_run": {"schedule": base.schedule, "microbatches": base.num_microbatches, "bpipe": bool(base.bpipe),
                   "virtual_stages": base.virtual_stages},
        "plan": {"schedule": target.schedule, "microbatches": target.num_microbatches, "bpipe": bool(target.bpipe),
                 "virtual_stages": target.virtual_stages},
        "simulated_as_run_ms": as_run,
        "simulated_plan_ms": other,
        "measured_step_ms": measured,
        "predicted_step_ms": measured * other / as_run if as_run and measured else None,
        "speedup": as_run / other if other else None,
        "kind": "prediction from this run's own measured durations (the simulator, calibrated by the run's own step)",
    }
