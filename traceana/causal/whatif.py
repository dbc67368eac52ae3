"""What-if analysis of a measured run: its dependency graph (traceana.causal.graph) replayed with chosen operations made
*ideal* or changed, after *Understanding Stragglers in Large Model Training Using What-if Analysis* (Lin et al.,
OSDI 2025; its artifact github.com/ByteDance-Seed/StragglerAnalysis). Definitions (docs/whatif.md):

The study's (the headline):

- **ideal** of an operation: each compute kind (forward, backward, its I/W halves, optimizer) made the *mean* of
  that kind across stages, replicas, micro-batches and steps (a stage that does more than the others is a cause);
  communication the *median* (a collective: of its name; a P2P or BPipe transfer: of its channel); host gaps, which
  the study has no time for (it zeroes its launch delays), at ours below (the median of the stage's gaps before the
  same action; the step's first operation apart: it follows data loading).
- ``ideal_step_ms``: everything ideal; ``slowdown`` S = measured / ideal (the study's Eq. 1);
  ``slowdown_without_host``: with every host gap 0 on both sides (the study's S exactly).
- a group's (stage, rank, replica, kind) ``slowdown``: everything ideal except that group, as measured, over
  everything ideal (Eq. 2-3); its ``if_ideal_step_ms`` / ``gain_ms``: the step with that group made ideal and the
  rest as measured (the same ideal values: the two agree in sign wherever the group's work is at or above its ideal).
- ``m_s``: the share of the slowdown the last stage made ideal removes (stage partitioning); ``m_w``: the share the
  workers of the top 3 % (at least one) by Eq. 4's score min(S of its replica, S of its stage) remove (single
  workers). Shares of (replayed − ideal); above 1 where fixing the group overshoots the everything-ideal step.

Ours, beside it (``within_stage``; what names a straggler):

- **peers** of an operation: the same action on the same stage, over the ranks holding that stage, their
  micro-batches and the measured steps (median). A rank or replica **at its peers' speed**: its operations at the
  median of the other ranks' medians of the same work on the same stage; a rank alone on its stage (one replica)
  has no peer but itself (its own median: micro-batches and steps even out; a note says so). A **stage at the other
  stages' speed**: its passes at the median of the other stages' medians of the same action.
- **noise** (``noise.noise_ms``): the spread of the measured step over the measured steps, at least NOISE_FLOOR of
  the median step. A rank, replica or stage is **named** only if at its peers' speed the step is shorter by more than
  the noise in every measured step; a rank that only waits gains nothing, so it is never named; a run without stages
  names no stage and no replica.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import polars as pl

from traceana.causal.critical_path import critical_path, on_path
from traceana.causal.graph import KIND_OF_ACTION, GraphError, StepGraph, build
from traceana.causal import group_replay
from traceana.causal.replay import replay, replay_variants
from traceana.core import intervals as iv
from traceana.core.errors import AnalysisError, ConfigError, TraceanaError
from traceana.core.units import NS_PER_MS
from traceana.measure.noise import noise_ms

KINDS = ("forward", "backward", "optimizer", "collective", "p2p", "host")
PASS_ACTIONS = ("F", "B", "I", "W")
# The study's M_W: the workers of the top 3 % by Eq. 4's score (its artifact's compute_mw.RATIO), at least one.
TOP_WORKERS_PERCENT = 3
# --set's bounds: a factor at most MAX_FACTOR, a duration at most MAX_MS, and after every change composed no
# operation longer than MAX_MS (beyond it a replay's nanoseconds leave the float's exact integers, 2**53 ns).
MAX_FACTOR = 1e6
MAX_MS = 1e9  # about 11.6 days
# what --set cannot change because it is a plan, not a duration: the option that does
PLAN_WORDS = {"bpipe": "--bpipe on|off", "recompute": "--recompute on|off", "schedule": "--schedule NAME",
              "microbatches": "--microbatches N"}


def ms(x: float) -> str:
    """Milliseconds with three significant digits at least (a 0.1 ms step and a 1,318 ms one alike)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) >= 0.001 else f"{x:.2g}"


class SetError(TraceanaError):
    """A --set that cannot be read."""


@dataclass(frozen=True)
class Change:
    """One --set: who (stage / rank / replica, or everyone), what (a kind or every kind), how (ideal: the study's,
    peers: ours, × factor, = milliseconds)."""

    who: str | None
    who_id: int | None
    kind: str | None  # one of KINDS, None: every kind
    how: str  # "ideal", "peers", "scale", "set"
    value: float = 0.0
    text: str = ""


SET_HELP = ("[stage=S:|rank=R:|replica=K:]WHAT where WHAT is ideal, peers, KIND:ideal, KIND:peers, KIND*FACTOR "
            "or KIND=MS and KIND one of " + ", ".join(KINDS)
            + " (e.g. 'stage=1:forward*0.5', 'p2p=0', 'rank=3:ideal')")


def parse_set(text: str) -> Change:
    """One --set (SET_HELP); SetError on anything else: a plan word (bpipe, recompute, …) names the option that
    changes it, a factor above MAX_FACTOR or a duration above MAX_MS states the bound."""
    parts = text.strip().split(":")
    who = who_id = None
    m = re.fullmatch(r"(stage|rank|replica)=(\d+)", parts[0].strip())
    if m and len(parts) > 1:
        who, who_id = m.group(1), int(m.group(2))
        parts = parts[1:]
    rest = ":".join(parts).strip()
    if rest in ("ideal", "peers"):
        return Change(who, who_id, None, rest, text=text)
    word = re.match(r"[a-z_]+", rest)
    if word and word.group() in PLAN_WORDS:
        raise SetError(f"--set {text!r}: {word.group()} is a plan, not a duration --set changes",
                       fix=f"use {PLAN_WORDS[word.group()]} (a plan what-if on the measured work)")
    m = re.fullmatch(r"([a-z0-9_]+)(?::(ideal|peers)|\*([0-9.eE+-]+)|=([0-9.eE+-]+))", rest)
    if not m or m.group(1) not in KINDS:
        raise SetError(f"--set {text!r} cannot be read", fix=f"write {SET_HELP}")
    if m.group(2) is not None:
        return Change(who, who_id, m.group(1), m.group(2), text=text)
    scale = m.group(3) is not None
    number = m.group(3) if scale else m.group(4)
    try:
        value = float(number)
    except ValueError:
        raise SetError(f"--set {text!r}: {number!r} is not a number", fix=f"write {SET_HELP}") from None
    if not value >= 0 or value == float("inf"):
        raise SetError(f"--set {text!r}: a duration or factor must be a finite number ≥ 0",
                       fix="give a factor or milliseconds ≥ 0")
    if value > (MAX_FACTOR if scale else MAX_MS):
        raise SetError(f"--set {text!r}: " + (f"a factor must be at most {MAX_FACTOR:,.0f}" if scale else
                                              f"a duration must be at most {MAX_MS:,.0f} ms (about 11.6 days)"),
                       fix=f"give a factor ≤ {MAX_FACTOR:,.0f} or milliseconds ≤ {MAX_MS:,.0f}")
    return Change(who, who_id, m.group(1), "scale" if scale else "set", value, text)


def median_of_others(frame: pl.LazyFrame, key: list[str], who: str, col: str, out: str) -> pl.LazyFrame:
    """Per row of ``frame`` (one a (key, who)): the median of ``col`` over the other rows of its key (``out``), beside
    ``col``; null where no other row has a value. Without the self-join (n² rows a key, 512² at 4,096 ranks): with a
    key's n values sorted, removing the one at position p leaves a median that depends only on where p lies against
    the middle (before it, in it, after it), so each key's three medians of n - 1 values are taken by polars' own
    median (the same arithmetic as over the others' rows) and each row reads the one of its position. A row whose
    value is null removes nothing (the median of all n)."""
    frame = frame.collect(**iv.COLLECT).lazy()  # read twice (common-subplan elimination is off: iv.COLLECT)
    ranked = frame.with_columns((pl.col(col).rank("ordinal").over(key) - 1)
                                .cast(pl.Int64).alias("_p"))
    v = pl.col("_v")
    n = v.list.len().cast(pl.Int64)
    k = n - 1  # the others' count of a row with a value; lo, hi: their middle positions
    lo, hi = (k - 1) // 2, k // 2
    per_key = (frame.group_by(key).agg(pl.col(col).drop_nulls().sort().alias("_v"))
               .with_columns(v.list.median().alias("_all"),                          # nothing removed
                             v.list.slice(1).list.median().alias("_before"),          # p <= lo: the first removed
                             pl.concat_list(v.list.slice(0, hi), v.list.slice(hi + 1))  # lo < p <= hi
                             .list.median().alias("_in"),
                             v.list.slice(0, k.clip(0)).list.median().alias("_after"),       # p > hi: the last removed
                             lo.alias("_lo"), hi.alias("_hi"))
               .drop("_v"))
    p = pl.col("_p")
    return (ranked.join(per_key, on=key, how="left", nulls_equal=True, maintain_order="left")
            .with_columns(pl.when(p.is_null()).then(pl.col("_all"))
                          .when(p <= pl.col("_lo")).then(pl.col("_before"))
                          .when(p <= pl.col("_hi")).then(pl.col("_in"))
                          .otherwise(pl.col("_after")).alias(out))
            .drop("_p", "_all", "_before", "_in", "_after", "_lo", "_hi"))


def _ideals(g: StepGraph) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The graph's ops and edges with the ideal columns (module docstring): the study's pub_work / pub_gap; ours
    ideal_work / ideal_gap (all peers of the stage), peer_work / peer_gap (peers without the op's rank), stage_work
    (the other stages' median; passes only); edges' ideal_transfer (both: the median of the channel)."""
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
        pl.coalesce("stage", pl.lit(-1) if g.data_parallel else -1 - pl.col("rank")).alias("_work"),
        # the study's kinds: a compute action, or a collective by its name (graph: "step|scope|name|k")
        pl.when(pl.col("action") == "C")
        .then(pl.lit("C|") + pl.col("group").str.split("|").list.get(2, null_on_oob=True))
        .otherwise(pl.col("action")).alias("_pub"))
    ops = ops.with_columns(
        pl.when(pl.col("action") == "C").then(pl.col("work_ns").median().over("_pub"))
        .otherwise(pl.col("work_ns").mean().over("_pub")).alias("pub_work"))
    work_key, gap_key = ["action", "_work"], ["action", "_work", "first"]
    # host gaps (the study has none: it zeroes its launch delays) at ours on both: the median of the stage's gaps
    # before the same action — a gap a rank spent waiting on another stage stays on that stage
    ops = ops.with_columns(pl.col("work_ns").median().over(work_key).alias("ideal_work"),
                           pl.col("gap_ns").median().over(gap_key).alias("ideal_gap"))
    ops = ops.with_columns(pl.col("ideal_gap").alias("pub_gap")).collect(**iv.COLLECT).lazy()
    # peers without the op's rank: per (key, rank) the others' values; a rank alone is its own peer
    for col, key, out in (("work_ns", work_key, "peer_work"), ("gap_ns", gap_key, "peer_gap")):
        own = ops.group_by(*key, "rank").agg(pl.col(col).median().alias("_own"))
        ops = (ops.join(median_of_others(own, key, "rank", "_own", out), on=[*key, "rank"], how="left",
                        nulls_equal=True, maintain_order="left")
               .with_columns(pl.coalesce(out, "_own").alias(out)).drop("_own")).collect(**iv.COLLECT).lazy()
    # a stage at the other stages' speed: the median of the other stages' medians of the same pass
    med = (ops.filter(pl.col("action").is_in(PASS_ACTIONS) & pl.col("stage").is_not_null())
           .group_by("action", "stage").agg(pl.col("work_ns").median().alias("_m")))
    other = median_of_others(med, ["action"], "stage", "_m", "stage_work").select("action", "stage", "stage_work")
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


def _ideal_columns(c: Change) -> tuple[str, str]:
    """The ops' columns a change to ``ideal`` (the study's) or ``peers`` (ours) sets work and gap to."""
    if c.how == "ideal":
        return "pub_work", "pub_gap"
    return ({"stage": "stage_work", "rank": "peer_work", "replica": "peer_work"}.get(c.who, "ideal_work"),
            "ideal_gap" if c.who is None else "peer_gap")


def _step(ops: pl.DataFrame, c: Change, work: pl.Expr, gap: pl.Expr, transfer: pl.Expr) -> Variant:
    """One change over the (float) work, gap and transfer before it."""
    if c.kind == "p2p":
        sel = pl.lit(True) if c.who is None else (
            pl.col("src").is_in(_members(ops, c)) | pl.col("dst").is_in(_members(ops, c)))
        new = {"ideal": pl.col("ideal_transfer"), "peers": pl.col("ideal_transfer"), "scale": transfer * c.value,
               "set": pl.lit(c.value * NS_PER_MS)}[c.how]
        return work, gap, pl.when(sel).then(new).otherwise(transfer)
    sel = _selected(c.who, c.who_id, c.kind)
    ideal_work, ideal_gap = _ideal_columns(c) if c.how in ("ideal", "peers") else (None, None)
    if c.kind != "host":
        new = {"scale": work * c.value, "set": pl.lit(c.value * NS_PER_MS)}.get(c.how, pl.col(ideal_work or "work_ns"))
        work = pl.when(sel).then(new).otherwise(work)
    if c.kind in (None, "host"):
        new = {"scale": gap * c.value, "set": pl.lit(c.value * NS_PER_MS)}.get(c.how, pl.col(ideal_gap or "gap_ns"))
        gap = pl.when(sel).then(new).otherwise(gap)
    return work, gap, transfer


def _int(x: pl.Expr) -> pl.Expr:
    return x.round().cast(pl.Int64)


def changed(ops: pl.DataFrame, changes: list[Change]) -> Variant:
    """The ops' work_ns / gap_ns and the edges' transfer_ns after one or two ``changes`` (in order), as
    expressions (each change refers to what the one before made twice: for many, ``apply`` composes them in
    columns, linearly)."""
    work, gap, transfer = (pl.col(c).cast(pl.Float64) for c in ("work_ns", "gap_ns", "transfer_ns"))
    for c in changes:
        work, gap, transfer = _step(ops, c, work, gap, transfer)
    return _int(work), _int(gap), _int(transfer)


def apply(ops: pl.DataFrame, edges: pl.DataFrame, changes: list[Change]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The ops' work_ns / gap_ns and the edges' transfer_ns after ``changes`` (in order), composed one after the
    other in float columns (cost linear in the number of changes); SetError where they make an operation longer
    than MAX_MS."""
    o = ops.with_columns(pl.col("work_ns", "gap_ns").cast(pl.Float64))
    e = edges.with_columns(pl.col("transfer_ns").cast(pl.Float64))
    for c in changes:
        work, gap, transfer = _step(o, c, pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns"))
        o = o.with_columns(work.alias("work_ns"), gap.alias("gap_ns"))
        e = e.with_columns(transfer.alias("transfer_ns"))
    top = max(float(o.select(pl.max_horizontal(pl.col("work_ns", "gap_ns").max())).item() or 0),
              float(e["transfer_ns"].max() or 0) if e.height else 0.0)
    if not top <= MAX_MS * NS_PER_MS:
        named = (repr(" ".join(c.text for c in changes)) if len(changes) <= 3 else
                 f"({len(changes):,} changes, from {changes[0].text!r} to {changes[-1].text!r})")
        raise SetError(f"--set {named}: together they make an operation last "
                       f"{'more than' if math.isfinite(top) else 'beyond'} {MAX_MS:,.0f} ms (about 11.6 days)",
                       fix="give smaller factors or durations")
    return (o.with_columns(_int(pl.col("work_ns")), _int(pl.col("gap_ns"))),
            e.with_columns(_int(pl.col("transfer_ns"))))


def materialize(ops: pl.DataFrame, edges: pl.DataFrame, variant: Variant) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A variant's ops and edges (its work_ns, gap_ns, transfer_ns in place of the measured ones)."""
    work, gap, transfer = variant
    return (ops.with_columns(work.alias("work_ns"), gap.alias("gap_ns")),
            edges.with_columns(transfer.alias("transfer_ns")))


def _members(ops: pl.DataFrame, c: Change) -> list[int]:
    return ops.filter(pl.col(c.who) == c.who_id)["rank"].unique().to_list()


def all_ideal_except(who: str | None, who_id: int | None, kind: str | None, *, peers: bool = False) -> Variant:
    """Everything ideal (the study's; ``peers``: ours, each op at its stage's median) except the group (who =
    who_id, or the kind), which stays as measured."""
    keep = pl.lit(False)
    if who is not None:
        keep = pl.col(who) == who_id
    elif kind is not None and kind != "p2p":
        keep = pl.col("kind") == kind if kind != "host" else pl.lit(False)
    ideal_work, ideal_gap = ("ideal_work", "ideal_gap") if peers else ("pub_work", "pub_gap")
    work = pl.when(keep).then("work_ns").otherwise(pl.col(ideal_work)).round().cast(pl.Int64)
    gap = pl.when(keep | pl.lit(kind == "host")).then("gap_ns").otherwise(pl.col(ideal_gap)).round().cast(pl.Int64)
    transfer = pl.col("transfer_ns") if kind == "p2p" else pl.col("ideal_transfer").round().cast(pl.Int64)
    return work, gap, transfer


@dataclass(frozen=True)
class WhatIf:
    """A run's what-if (module docstring). Times in ms, means over the measured steps."""

    summary: dict
    per_rank: pl.DataFrame  # rank, stage, replica, measured_step_ms, replayed_step_ms, replay_error
    path_time: pl.DataFrame  # time on the critical path (on_path): group (kind/stage/rank), id, ms, fraction
    path: pl.DataFrame  # the last measured step's critical path (causal.critical_path)
    paths: pl.DataFrame  # every measured step's
    slack: pl.DataFrame  # every operation of the last measured step: rank, seq, kind, stage, start/end, slack_ns
    groups: pl.DataFrame  # GROUP_SCHEMA: group (stage / rank / replica / kind), id; the study's if_ideal_step_ms,
    #                       gain_ms, min_gain_ms, slowdown; ours if_peers_step_ms, peers_gain_ms, peers_min_gain_ms;
    #                       named
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


GROUP_SCHEMA = {"group": pl.String, "id": pl.String, "if_ideal_step_ms": pl.Float64, "gain_ms": pl.Float64,
                "min_gain_ms": pl.Float64, "slowdown": pl.Float64, "if_peers_step_ms": pl.Float64,
                "peers_gain_ms": pl.Float64, "peers_min_gain_ms": pl.Float64, "named": pl.Boolean}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def whatif(analysis, changes: list[Change] = (), graph: StepGraph | None = None, *, full: bool = True,
           candidates: int | None = None, per_group=None) -> WhatIf:
    """Replay the measured steps as measured, everything ideal (the study's and ours), every group made ideal (the
    study's: removal) and as the only one measured (addition: its slowdown), at its peers' speed (ours), and with
    ``changes``; the study's M_S and M_W; name the stragglers and the bottleneck (module docstring). ``full`` False:
    only what naming needs (each rank, replica and stage at its peers' speed, everything ideal; no per-kind figures,
    no slowdowns, no M_S / M_W). ``candidates``: take only that many ranks and replicas, those whose work and gaps
    exceed their peers' the most (a rank whose work is its peers' gains nothing when made ideal); the others' rows
    are left empty. ``per_group``: a ``map`` (builtin ``map``, ``measure.partitioned.dask_map(client)``) to replay
    the variants one pipeline group a task with (causal.group_replay: the same figures); None: in one process."""
    g = graph or build(analysis)
    ops, edges = _ideals(g)
    have_ids = {who: set(ops[who].drop_nulls().to_list()) for who in ("stage", "rank", "replica")}
    for c in changes:
        if c.who is not None and c.who_id not in have_ids[c.who]:
            have = sorted(have_ids[c.who])
            raise SetError(f"--set {c.text!r}: the run has no {c.who} {c.who_id}",
                           fix=f"its {c.who}s are {', '.join(map(str, have)) or 'unknown'}")
    steps = list(g.steps)
    # the stages are known where every pass has one (an optimizer step the traces give no stage is the rank's)
    stages_known = (ops.filter(pl.col("action").is_in(PASS_ACTIONS))["stage"].null_count() == 0
                    or g.data_parallel)
    per_work = dict(ops.group_by("_work").agg(pl.col("rank").n_unique()).iter_rows())
    alone = {r: per_work[w] == 1 for r, w in ops.select("rank", "_work").unique().iter_rows()}
    notes: list[str] = list(g.notes)
    if per_group is not None:  # (refused here, before any replay, where the run does not split)
        groups = group_replay.pipeline_groups(g)
        sizes = ", ".join(sorted({str(len(x)) for x in groups}, key=int))
        notes.append(f"the variants replayed one pipeline group a task: {len(groups)} group"
                     f"{'s' if len(groups) > 1 else ''} of {sizes} ranks" +
                     (" (the job has one replica: one group, as in one process)" if len(groups) == 1 else ""))
    for c in changes:
        if c.how == "peers" and c.who in ("rank", "replica") and all(
                alone[r] for r in _members(ops, c)):
            notes.append(f"--set {c.text!r}: {c.who} {c.who_id} is alone on its stage (one replica): its peers are its "
                         "own micro-batches and steps (their median); 'ideal' is the study's (the mean of each kind "
                         "across stages)")

    def steps_ms(variants: list[Variant], o: pl.DataFrame = ops, e: pl.DataFrame = edges) -> list[list[float]]:
        """Every variant replayed (replay.replay_variants: the engine's replay, many variants at once; with
        ``per_group``, group_replay's, one pipeline group a task)."""
        got = group_replay.replay_variants(g, o, e, variants, map=per_group) if per_group is not None else None
        if got is None:  # (in one process; or a group's graph the batched evaluator does not take)
            got = replay_variants(g, o, e, variants)
        return [[x / NS_PER_MS for x in v] for v in got]

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
    measured = _mean(measured_steps)
    replay_mean = _mean(replayed)
    noise = noise_ms(measured_steps)

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
    stages: list[int] = []
    replicas: list[int] = []
    if stages_known:
        stages = sorted(ops["stage"].drop_nulls().unique().to_list())
        if len(stages) > 1:
            groups += [("stage", s) for s in stages]
        replicas = (excess.group_by("replica").agg(pl.col("x").sum()).sort("x", "replica", descending=[True, False])
                    ["replica"].drop_nulls().to_list())
        if len(replicas) > 1:
            if candidates is not None:
                skipped += [("replica", k) for k in replicas[candidates:]]
                replicas = replicas[:candidates]
            groups += [("replica", k) for k in sorted(replicas)]
    # the variants, in the order they are read back below
    variants: list[Variant] = [all_ideal_except(None, None, None), all_ideal_except(None, None, None, peers=True)]
    if full:  # the study's S exactly: host gaps 0 on both sides
        variants += [(pl.col("work_ns"), pl.lit(0, pl.Int64), pl.col("transfer_ns")),
                     (pl.col("pub_work").round().cast(pl.Int64), pl.lit(0, pl.Int64),
                      pl.col("ideal_transfer").round().cast(pl.Int64))]
    for grp, gid in groups:
        who, who_id, kind = (None, None, gid) if grp == "kind" else (grp, gid, None)
        if full:  # the study's: made ideal (removal), the only one measured (addition)
            variants += [changed(ops, [Change(who, who_id, kind, "ideal")]), all_ideal_except(who, who_id, kind)]
        if grp != "kind":  # ours: at its peers' speed
            variants.append(changed(ops, [Change(who, who_id, kind, "peers")]))
    if changes:
        o, e = apply(ops, edges, list(changes))
        ops = ops.with_columns(o["work_ns"].alias("_set_work"), o["gap_ns"].alias("_set_gap"))
        edges = edges.with_columns(e["transfer_ns"].alias("_set_transfer"))
        variants.append((pl.col("_set_work"), pl.col("_set_gap"), pl.col("_set_transfer")))
    out = iter(steps_ms(variants, ops, edges))
    ideal, within = next(out), next(out)
    ideal_mean, within_mean = _mean(ideal), _mean(within)
    no_host = no_host_ideal = None
    if full:
        no_host, no_host_ideal = _mean(next(out)), _mean(next(out))
    rows = []
    for grp, gid in groups:
        pub = peer = None
        if full:
            removed, added = next(out), next(out)
            gains = [a - b for a, b in zip(replayed, removed)]
            pub = (_mean(removed), _mean(gains), min(gains), _mean(added) / ideal_mean if ideal_mean else None)
        if grp != "kind":
            at_peers = next(out)
            gains = [a - b for a, b in zip(replayed, at_peers)]
            peer = (_mean(at_peers), _mean(gains), min(gains))
        # a rank alone on its stage has no peers but its own micro-batches: their spread is not a straggler (a slow
        # rank alone on its stage is its stage's imbalance, named as the stage)
        rows.append((grp, str(gid), *(pub or (None,) * 4), *(peer or (None,) * 3),
                     peer is not None and peer[2] > noise and not (grp == "rank" and alone.get(int(gid), False))))
    rows += [(grp, str(gid), *(None,) * 7, False) for grp, gid in skipped]
    table = pl.DataFrame(rows, schema=GROUP_SCHEMA, orient="row")
    # A stage or replica is named for itself only when none of its ranks is: one slow rank makes its stage and its
    # replica slow too, and naming those would point at the ranks that only wait on it.
    with_named = ops.join(table.filter((pl.col("group") == "rank") & pl.col("named"))
                          .select(pl.col("id").cast(pl.Int32).alias("rank")), on="rank")
    for grp in ("stage", "replica"):
        has = with_named[grp].drop_nulls().unique().cast(pl.String).to_list()
        table = table.with_columns(pl.when((pl.col("group") == grp) & pl.col("id").is_in(has))
                                   .then(False).otherwise("named").alias("named"))
    if full:
        against = table.filter(pl.col("slowdown").is_not_null() & pl.col("gain_ms").is_not_null()
                               & ((pl.col("slowdown") - 1) * pl.col("gain_ms") < 0)
                               & (pl.col("gain_ms").abs() > 0.001 * replay_mean)
                               & ((pl.col("slowdown") - 1).abs() > 0.001))
        if against.height:
            notes.append("the study's removal (made ideal: gain) and addition (the only one measured: slowdown) differ "
                         "in sign for " + ", ".join(f"{a} {b}" for a, b in against.select("group", "id").iter_rows())
                         + ": part of its work is faster than its ideal, part slower (the study's artifact shows the "
                           "same, its explain_slowdown's rem and add)")
    changed_step = _mean(next(out)) if changes else None
    if changes:  # a gain beyond the time the changes removed comes from the waits' and lags' scaling (a proxy)
        n_steps = max(ops["step"].n_unique(), 1)
        removed_ms = max(((ops["work_ns"] + ops["gap_ns"] - ops["_set_work"] - ops["_set_gap"]).sum()
                          + (edges["transfer_ns"] - edges["_set_transfer"]).sum()) / n_steps / NS_PER_MS, 0.0)
        beyond = replay_mean - changed_step - removed_ms
        if beyond > max(0.001 * replay_mean, 0.001):
            notes.append(f"with {', '.join(c.text for c in changes)} the step gains {ms(replay_mean - changed_step)} "
                         f"ms, {ms(beyond)} ms more than the {ms(removed_ms)} ms of time the changes remove "
                         "per step: the waits no edge explains and the late starts shrink with the step's work (rho), "
                         "the lags with their rank's host work — a proxy for what they waited on (docs/whatif.md \"No "
                         "frozen time\"); with them held fixed the gain would be at most the time removed")
    m_s = m_w = m_w_ranks = None
    if full and stages_known and len(stages) > 1:
        m_s, m_w, m_w_ranks, n = _shares(table, ops, edges, steps_ms, replay_mean, ideal_mean, stages, replicas,
                                         noise)
        notes += n
    spread_gain = min(a - b for a, b in zip(replayed, within))  # everything at its peers' speed, the worst step
    diagnosis, bottleneck = _diagnose(table, ops, replay_mean, within_mean, noise, stages_known, spread_gain, alone)
    summary = {
        "run": str(analysis.run.path),
        "measured_steps": steps,
        "measured_step_ms": measured,
        "replayed_step_ms": replay_mean,
        "replay_error": float(per_rank["replay_error"].max()),
        "consistent_operations": g.consistent[0],
        "operations": g.consistent[1],
        "replay": "the measured step's graph replayed on the measured durations (in sample: how far the graph's "
                  "edges agree with the timeline, not a prediction)",
        "ideal_step_ms": ideal_mean,
        "slowdown": measured / ideal_mean if ideal_mean else None,
        "slowdown_without_host": no_host / no_host_ideal if no_host and no_host_ideal else None,
        "m_s": m_s,
        "m_w": m_w,
        "m_w_ranks": m_w_ranks,
        "ideal": "the study's (Lin et al., OSDI 2025): each compute kind at its mean across stages, replicas, "
                 "micro-batches and steps; communication at its median; host gaps at their stage's median",
        "within_stage": {"ideal_step_ms": within_mean, "slowdown": measured / within_mean if within_mean else None,
                         "ideal": "ours: each operation at the median of the same action on its stage"},
        "noise_ms": noise,
        "diagnosis": diagnosis,
        "bottleneck": bottleneck,
        "changes": [c.text for c in changes],
        "changed_step_ms": changed_step,
        "host_gap_fraction": float(ops["gap_ns"].sum()) / total if (
            total := float((g.ranks["end_ns"] - g.ranks["start_ns"]).sum())) else None,
    }
    if not stages_known:
        notes.append("the stages of some ranks are unknown: no stage and no replica is named, only ranks")
    last = replays[-1]
    slack = (g.ops.filter(pl.col("step") == last.step).select("rank", "seq", "phase", "stage", "microbatch")
             .join(last.ops.select("rank", "seq", "start_ns", "end_ns"), on=["rank", "seq"])
             .join(paths[-1][1], on=["rank", "seq"]).sort("rank", "seq"))
    return WhatIf(summary=summary, per_rank=per_rank, groups=table, path_time=path_time, path=paths[-1][0],
                  paths=pl.concat([p for p, _ in paths]), slack=slack, notes=tuple(notes))


def _shares(table: pl.DataFrame, ops: pl.DataFrame, edges: pl.DataFrame, steps_ms, replayed: float, ideal: float,
            stages: list[int], replicas: list[int], noise: float
            ) -> tuple[float | None, float | None, list[int], list[str]]:
    """The study's M_S (the last stage made ideal) and M_W (the top TOP_WORKERS_PERCENT of the workers by Eq. 4's
    score made ideal): the share of (replayed − ideal) each removes; the ranks M_W made ideal; notes. Not given
    where replayed − ideal is within the noise (a share of noise is noise; the study's artifact decomposes only
    slowdowns of 1.03 or more)."""
    notes = []
    slow = replayed - ideal
    last = table.filter((pl.col("group") == "stage") & (pl.col("id") == str(stages[-1])))["if_ideal_step_ms"][0]
    s_of = {(grp, i): s for grp, i, s in table.filter(pl.col("group").is_in(["stage", "replica"]))
            .select("group", "id", "slowdown").iter_rows()}
    where = ops.filter(pl.col("stage").is_not_null()).select("rank", "stage", "replica").unique()
    whole = replayed / ideal if ideal else None
    # Eq. 4: a worker's score is the smaller of its replica's and its stage's slowdowns (one replica: the job's)
    score = sorted(((min(s_of.get(("replica", str(k)), whole) if len(replicas) > 1 else whole,
                         s_of[("stage", str(s))]), -r) for r, s, k in where.iter_rows()), reverse=True)
    top = [-r for _, r in score[:max(1, math.ceil(len(score) * TOP_WORKERS_PERCENT / 100))]]
    removed = _mean(steps_ms([_top_variant(top)], ops, edges)[0])
    if len(replicas) <= 1:
        notes.append("one replica: each rank is its stage, so the study's M_W (single workers) and M_S (the last "
                     "stage) look at the same ranks")
    if slow <= noise:
        notes.append(f"everything ideal ({ms(ideal)} ms) is within the noise ({ms(noise)} ms) of the replayed step "
                     f"({ms(replayed)} ms) or above it: no slowdown to share, M_S and M_W are not given")
        return None, None, sorted(top), notes
    return (replayed - last) / slow, (replayed - removed) / slow, sorted(top), notes


def _top_variant(ranks: list[int]) -> Variant:
    """The study's ideal for every operation of ``ranks``, the rest (and every transfer, as for a rank made ideal)
    as measured."""
    sel = pl.col("rank").is_in(ranks)
    return (pl.when(sel).then(pl.col("pub_work")).otherwise(pl.col("work_ns")).round().cast(pl.Int64),
            pl.when(sel).then(pl.col("pub_gap")).otherwise(pl.col("gap_ns")).round().cast(pl.Int64),
            pl.col("transfer_ns"))


def _diagnose(table: pl.DataFrame, ops: pl.DataFrame, replayed: float, within: float, noise: float,
              stages_known: bool, spread_gain: float, alone: dict[int, bool]) -> tuple[str, dict | None]:
    """One line, and the bottleneck named (group, id, step at its peers' speed, gain) or None."""
    named = table.filter(pl.col("named")).sort("peers_gain_ms", descending=True)
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
        return f"the step would be {ms(row['if_peers_step_ms'])} ms instead of {ms(replayed)} ms"

    def named_as(row: dict) -> dict:
        return {"group": row["group"], "id": int(row["id"]), "step_ms": row["if_peers_step_ms"],
                "gain_ms": row["peers_gain_ms"]}

    def speed(rank: int) -> str:  # a rank alone on its stage is its own peer: its own median
        return "with its slower operations at its own median" if alone[rank] else "at its peers' speed"

    several_per_stage = not all(alone.values())
    if ranks.height == 1 and (several_per_stage or stages.height == 0):
        r = ranks.row(0, named=True)
        return (f"one rank: rank {r['id']}{where(int(r['id']))} holds the step back — {speed(int(r['id']))} "
                f"{cost(r)}", named_as(r))
    if replicas.height == 1 and ranks.height <= 1:
        r = replicas.row(0, named=True)
        return f"one replica: replica {r['id']} holds the step back — at its peers' speed {cost(r)}", named_as(r)
    if stages.height == 1:
        r = stages.row(0, named=True)
        return (f"one stage (imbalance): stage {r['id']} holds the step back — at the other stages' speed "
                f"{cost(r)}", named_as(r))
    if ranks.height == 1:
        r = ranks.row(0, named=True)
        return (f"one rank: rank {r['id']}{where(int(r['id']))} holds the step back — {speed(int(r['id']))} "
                f"{cost(r)}", named_as(r))
    if named.height or spread_gain > noise:
        who = ", ".join(f"{r['group']} {r['id']}" for r in named.iter_rows(named=True)) or "no single rank or stage"
        kinds = table.filter((pl.col("group") == "kind") & (pl.col("gain_ms") > 0)).sort("gain_ms", descending=True)
        most = (f"; the most from one kind of time: {kinds['id'][0]} at its ideal, {ms(kinds['gain_ms'][0])} ms"
                if kinds.height else "")
        return (f"spread over many ({who}): with everything at its peers' speed the step would be {ms(within)} ms "
                f"instead of {ms(replayed)} ms{most}", None)
    return (f"nothing beyond noise: no rank, replica or stage at its peers' speed shortens the step by more than "
            f"{ms(noise)} ms", None)
