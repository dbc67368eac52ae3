"""The stage of each rank: run.json, the trace's metadata, the PP: annotations, else the P2P pattern (a chain, a ring,
activations flowing back: ``placements``), with a note wherever it cannot be told."""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.run_config import RunConfig
from traceana.core.pipeline_rules import stages_of_ranks
from traceana.measure.schedule import overlap_rows


def stage_map(
    events: pl.DataFrame, traces: pl.DataFrame, config: RunConfig | None, pairs: pl.DataFrame,
    msgs: pl.DataFrame | None = None, *, overlapped: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, list[str]]:
    """``rank, stage, stage_source, stages`` for every rank: run.json, else the trace's own metadata, else the stage
    in its PP: annotations, else the position in the P2P neighbour chain. Unknown stays null (with a note).

    ``stage`` is the rank's first stage; ``stages`` lists every (virtual) stage it holds, e.g. ``"0,3"`` on rank 0
    of a V schedule: from run.json's ``stages_of_rank``, else the PP: annotations, else the trace metadata's
    ``stages``, else ``stage`` alone.
    ``config``: the run's configuration (``reconcile.run_facts``: run.json's ``stage_of_rank`` and ``stages_of_rank``;
    None: no run.json); ``overlapped``: ``overlap_rows(events)``, if the caller has it already."""
    ranks = sorted(set(traces["rank"].to_list()) | set(events["rank"].unique().to_list()))
    known: dict[int, tuple[int, str]] = {}
    # every stage of each rank where run.json's stages_of_rank lists them (not stage_of_rank's first stage alone)
    held = dict(config.stages_of_rank) if config is not None and config.run_json_lists_stages() else {}
    if config is not None and config.has_run_json:
        # run.json's stage_of_rank, else the first of the stages its stages_of_rank lists: either way run.json's,
        # ahead of anything the traces suggest (the P2P pattern included)
        listed = config.stage_of_rank or tuple(held[r][0] if held.get(r) else None
                                               for r in range(max(held, default=-1) + 1))
        for r in ranks:
            if r < len(listed) and listed[r] is not None:
                known[r] = (listed[r], "run.json")
    if "stage" in traces.columns:
        for r, s in traces.select("rank", "stage").drop_nulls().rows():
            known.setdefault(r, (s, "trace metadata"))
    overlapped = (overlap_rows(events) if overlapped is None else overlapped).lazy().select("rank", "pp_stage")
    annotated = (
        pl.concat([events.lazy().filter(pl.col("pp_stage").is_not_null()
                                        & pl.col("pp_action").is_in(list(names.COMPUTE_ACTIONS)))
                   .select("rank", "pp_stage"),
                   overlapped])
        .group_by("rank").agg(pl.col("pp_stage").min().alias("first"), pl.col("pp_stage").unique().sort().alias("all"))
        .collect(**iv.COLLECT)
    )
    # the stages in the PP: annotations, else those the trace's metadata lists (names without a stage number,
    # e.g. Megatron-LM's, leave only the metadata to tell), overridden by run.json's stages_of_rank
    virtual: dict[int, list[int]] = {**metadata_stages(traces), **{r: list(all_) for r, _, all_ in annotated.rows()}}
    for r, st in held.items():
        virtual[r] = list(st)
    for r, s, _ in annotated.rows():
        known.setdefault(r, (s, "annotations"))
    notes: list[str] = []
    p2p = pairs.filter(pl.col("channel") == "p2p") if len(known) < len(ranks) else pairs.clear()
    cut: list[Placement] = []
    if p2p.height:  # (without P2P pairs there is no chain: its inputs, a pass over the events, are not built)
        found, n = placements(p2p, *_placement_inputs(events, msgs, pairs))
        notes += n
        # A chain's first rank holds stage 0 only if nothing is upstream of it: one that also exchanges P2P with
        # a rank that has no trace here (a lost file, a run profiled on some ranks only) may have stages before it,
        # and counting positions from it numbers every rank of the chain too low.
        absent = _absent_peers(msgs if msgs is not None else pairs.clear(), ranks)
        cut = [pl_ for pl_ in found if absent.get(pl_.order[0])]
        for pl_ in cut:
            notes.append(
                f"ranks {', '.join(map(str, pl_.order))} form a P2P chain whose first rank ({pl_.order[0]}) also "
                f"exchanges P2P with rank{'s' if len(absent[pl_.order[0]]) > 1 else ''} "
                f"{', '.join(map(str, absent[pl_.order[0]]))}, which has no trace here: the stages before it are not "
                "in the run, so their stage numbers are not determined (give run.json's stage_of_rank, or the "
                "missing traces)")
        for pl_ in (x for x in found if x not in cut):
            held = pl_.stages()
            source = "inferred from P2P chain" if pl_.kind == "single" else f"{PATTERN_SOURCE} ({pl_.kind})"
            guessed = [r for r in pl_.order if r not in known]
            for i, r in enumerate(pl_.order):
                if r not in known:
                    known[r] = (i, source)  # a rank's first stage is its position, in every placement
                    virtual[r] = held[r] or []
            if guessed and pl_.kind != "single":
                notes.append(placement_note(pl_, guessed))
    unknown = [r for r in ranks if r not in known and not any(r in x.order for x in cut)]
    if unknown:
        which, they = ("rank", "it gets") if len(unknown) == 1 else ("ranks", "they get")
        facts = "no run.json" if config is None or not config.has_run_json else "run.json gives no stage_of_rank"
        notes.append(f"stage of {which} {', '.join(map(str, unknown))} could not be determined ({facts}, no "
                     f"annotations, not on a P2P chain): {they} no schedule")
    first = [known.get(r, (None, None))[0] for r in ranks]
    return pl.DataFrame(
        {"rank": ranks, "stage": first, "stage_source": [known.get(r, (None, "unknown"))[1] for r in ranks],
         "stages": [",".join(map(str, virtual.get(r, [] if s is None else [s]))) or None for r, s in zip(ranks, first)]},
        schema={"rank": pl.Int32, "stage": pl.Int32, "stage_source": pl.String, "stages": pl.String},
    ), notes


PATTERN_SOURCE = "inferred from P2P pattern"  # stage_source of ranks whose several stages the P2P pattern showed


def _absent_peers(msgs: pl.DataFrame, ranks: list[int]) -> dict[int, list[int]]:
    """rank -> the P2P peers (channel p2p) it exchanged messages with that have no trace among ``ranks``."""
    if msgs.height == 0 or "peer" not in msgs.columns:
        return {}
    rank_col = "rank" if "rank" in msgs.columns else "src"
    gone = (msgs.lazy().filter((pl.col("channel") == "p2p") & pl.col("peer").is_not_null()
                               & ~pl.col("peer").is_in(ranks) & (pl.col("peer") != pl.col(rank_col)))
            .group_by(rank_col).agg(pl.col("peer").unique().sort()).collect(**iv.COLLECT))
    return {r: p for r, p in gone.rows()}


def several_stages(stages: pl.DataFrame) -> list[int]:
    """Ranks of a ``stage_map`` that hold several stages, or that the P2P pattern shows do (how many unknown)."""
    return sorted(stages.filter(pl.col("stages").str.contains(",", literal=True).fill_null(False)
                                | pl.col("stage_source").str.starts_with(PATTERN_SOURCE))["rank"].to_list())


def _placement_inputs(events: pl.DataFrame, msgs: pl.DataFrame | None, pairs: pl.DataFrame
                      ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """What ``placements`` reads besides the pairs: when each P2P send was issued on the CPU timeline (on a GPU
    rank the kernel's launch: the CPU runs ahead of the GPU), and each rank's first backward op of each step."""
    if msgs is not None:
        sends = msgs.filter((pl.col("dir") == "send") & (pl.col("channel") == "p2p") & pl.col("peer").is_not_null()
                            & pl.col("step").is_not_null()).select(
            "rank", "peer", "step", pl.when(pl.col("on_gpu")).then(pl.col("launch_ns")).otherwise(pl.col("post_ns"))
            .alias("at"))
    else:
        sends = pairs.filter(pl.col("channel") == "p2p").select(
            pl.col("src").alias("rank"), pl.col("dst").alias("peer"), "step", pl.col("send_start_ns").alias("at"))
    first_backward = (
        events.select("rank", "step", "ts_ns", "name", "is_gpu", "kind")  # a filter copies only these columns
        .filter(~pl.col("is_gpu") & (pl.col("kind") == "compute") & pl.col("step").is_not_null())
        .filter(names.backward_like(pl.col("name")))  # the text test on those events only
        .group_by("rank", "step").agg(pl.col("ts_ns").min().alias("at"))
        .select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int32), "at")
    )
    return sends.with_columns(pl.col("rank", "peer", "step").cast(pl.Int32)), first_backward


def placement_note(placement: "Placement", ranks: list[int]) -> str:
    """What the P2P pattern showed about ``ranks`` (of ``placement``'s group), and what it could not tell."""
    p, o = len(placement.order), placement.order
    what = {
        "v": f"a V placement (rank r holds stages r and 2p−1−r, as in ZB-V and DualPipe-V: here {p} ranks, "
             f"{2 * p} stages" + (f", {placement.microbatches} micro-batches" if placement.microbatches else "") + ")",
        "looped": "a looped placement (rank r holds stages r, r+p, …, as in interleaved 1F1B, looped BFS and "
                  "zero-bubble: " + (f"{placement.virtual} stages a rank, {placement.virtual * p} stages"
                                     + (f", {placement.microbatches} micro-batches" if placement.microbatches else "")
                                     if placement.virtual else
                                     "how many stages a rank could not be determined from the message counts")
                  + ")",
        "several": "several stages a rank, in a placement that could not be determined",
    }[placement.kind]
    return (f"ranks {', '.join(map(str, ranks))} (pipeline order {'→'.join(map(str, o))}): the P2P pattern shows "
            f"{what}: {placement.why}")


@dataclass(frozen=True)
class Placement:
    """How the stages of one pipeline group (ranks joined by P2P) sit on its ranks, as its P2P pattern shows."""

    order: tuple[int, ...]  #: the group's ranks in pipeline order: the first holds stage 0
    kind: str  #: single | looped | v | several (several stages a rank, placement unknown)
    virtual: int | None  #: stages per rank; None where the pattern cannot tell
    microbatches: int | None  #: per step, where the message counts tell
    why: str  #: the evidence, for the note

    def stages(self) -> dict[int, list[int] | None]:
        """rank -> every stage it holds (None where that cannot be told)."""
        if self.kind == "single" or (self.kind in ("looped", "v") and self.virtual):
            per = stages_of_ranks(self.kind, len(self.order), self.virtual or 1)
            return {r: per[i] for i, r in enumerate(self.order)}
        return {r: None for r in self.order}


def _majority(values: list) -> object:
    return max(set(values), key=values.count) if values else None


def placements(pairs: pl.DataFrame, sends: pl.DataFrame, first_backward: pl.DataFrame
               ) -> tuple[list[Placement], list[str]]:
    """The placement of every pipeline group, from rank-pair facts (a few rows per step, not events):

    - order: the first message between two neighbours in a step is an activation (every schedule runs micro-batch
      0's forward before any backward), so it points downstream; the neighbours form a chain (one stage per rank,
      or a V) or a ring (a looped placement on 3 or more ranks: the last rank sends to the first), whose head is
      the rank that sends the step's first message.
    - several stages a rank: with one stage per rank, a message to an upstream neighbour is a gradient, sent after
      the sender's first backward work of the step. One sent before it is an activation flowing back (V, or a
      looped placement on 2 ranks).
    - which: the last stage runs the step's first backward (every other backward waits for its gradient). On the
      first rank it is a V (rank r: r, 2p−1−r); on the last a looped placement (rank r: r, r+p, …).
    - how many: a V holds two stages a rank (2m messages each way on each link); on a ring, a link carries v·m
      messages each way and the wrap-around (v−1)·m, so v = n / (n − n_wrap).

    ``pairs``: matched P2P pairs (channel p2p). ``sends``: rank, peer, step, at (when each P2P send was issued, on
    the CPU timeline). ``first_backward``: rank, step, at (the rank's first backward op of the step)."""
    if pairs.height == 0:
        return [], []
    first = (
        pairs.with_columns(pl.min_horizontal("src", "dst").alias("a"), pl.max_horizontal("src", "dst").alias("b"))
        .sort("send_start_ns").group_by("step", "a", "b", maintain_order=True).first()
        .group_by("src", "dst").agg(pl.len().alias("n"))
    )
    # Per neighbour pair, the direction most steps agree on.
    votes: dict[tuple[int, int], int] = {}
    for src, dst, n in first.rows():
        key = (min(src, dst), max(src, dst))
        votes[key] = votes.get(key, 0) + (n if src < dst else -n)
    down: dict[int, list[int]] = {}
    up: dict[int, list[int]] = {}
    for (a, b), vote in votes.items():
        u, d = (a, b) if vote >= 0 else (b, a)
        down.setdefault(u, []).append(d)
        up.setdefault(d, []).append(u)
    # connected components of the neighbour graph: one per pipeline (data-parallel replicas are separate groups)
    comp: dict[int, int] = {}
    for start in sorted(set(down) | set(up)):
        if start in comp:
            continue
        todo = [start]
        while todo:
            r = todo.pop()
            if r not in comp:
                comp[r] = start
                todo += [*down.get(r, []), *up.get(r, [])]
    counts = pairs.group_by("step", "src", "dst").agg(pl.len().alias("n"))
    first_sender = pairs.sort("send_start_ns").group_by("step", maintain_order=True).agg(pl.col("src"))
    bwd0 = {(r, s): t for r, s, t in first_backward.rows()}
    out: list[Placement] = []
    notes: list[str] = []
    for head_of in sorted(set(comp.values())):
        nodes = sorted(r for r, c in comp.items() if c == head_of)
        if any(len(down.get(r, [])) > 1 or len(up.get(r, [])) > 1 for r in nodes):
            notes.append(f"ranks {', '.join(map(str, nodes))}: the P2P neighbour graph is not a chain or a ring (a rank "
                         "talks to several up- or downstream peers): their stages cannot be inferred from it")
            continue
        heads = [r for r in nodes if r not in up]
        ring = not heads
        if ring:  # the step's first message leaves the head
            in_group = [next((x for x in srcs if x in nodes), None) for srcs in first_sender["src"].to_list()]
            heads = [_majority([x for x in in_group if x is not None])]
        order = [heads[0]]
        while len(order) < len(nodes) and down.get(order[-1]) and down[order[-1]][0] not in order:
            order.append(down[order[-1]][0])
        if len(order) < len(nodes):
            notes.append(f"ranks {', '.join(map(str, nodes))}: the P2P neighbour graph is neither a chain nor one "
                         "ring: their stages cannot be inferred from it")
            continue
        pos = {r: i for i, r in enumerate(order)}
        p = len(order)
        # the rank running the step's first backward, in most steps
        steps_ = sorted({s for (r, s) in bwd0 if r in pos})
        firsts = [min((bwd0[(r, s)], r) for r in order if (r, s) in bwd0)[1] for s in steps_]
        loss_rank = _majority(firsts)
        n = {(s, a, b): c for s, a, b, c in counts.filter(pl.col("src").is_in(order)).rows()}
        names_ = ", ".join(map(str, order))
        if ring:
            wrap = [c for (s, a, b), c in n.items() if (a, b) == (order[-1], order[0])]
            links = [c for (s, a, b), c in n.items() if a in pos and b in pos and pos[b] == pos[a] + 1]
            n1, n0 = (sorted(links)[len(links) // 2] if links else 0), (sorted(wrap)[len(wrap) // 2] if wrap else 0)
            v = n1 // (n1 - n0) if n1 > n0 and n1 % (n1 - n0) == 0 else None
            out.append(Placement(tuple(order), "looped", v, n1 // v if v else None,
                                 f"the last rank ({order[-1]}) and the first ({order[0]}) exchange P2P: the neighbours "
                                 "form a ring"))
            continue
        early = (sends.filter(pl.col("rank").is_in(order) & pl.col("peer").is_in(order))
                 .join(first_backward.rename({"at": "_bwd"}), on=["rank", "step"], how="inner")
                 .filter(pl.col("at") < pl.col("_bwd")))
        back = sorted({(r, q) for r, q in early.select("rank", "peer").rows() if pos[q] < pos[r]})
        if not back:
            out.append(Placement(tuple(order), "single", 1, None, "the P2P neighbours form a chain"))
            continue
        why = (", ".join(f"rank {r} sends to rank {q}" for r, q in back) + ", upstream, before any backward work "
               "of its step (so activations flow back towards the first rank, not only gradients)")
        if p > 1 and loss_rank == order[0]:
            both = [c for (s, a, b), c in n.items() if abs(pos[a] - pos[b]) == 1]
            m = both[0] // 2 if both and len(set(both)) == 1 and both[0] % 2 == 0 else None
            out.append(Placement(tuple(order), "v", 2, m, f"{why}, and the step's first backward runs on the first "
                                 f"rank ({order[0]}), which therefore also holds the last stage"))
        elif loss_rank == order[-1]:
            out.append(Placement(tuple(order), "looped", None, None, f"{why}, and the step's first backward runs on "
                                 f"the last rank ({order[-1]}), which holds the last stage"))
        else:
            out.append(Placement(tuple(order), "several", None, None, why))
    return out, notes


def metadata_stages(traces: pl.DataFrame) -> dict[int, list[int]]:
    """Per rank, the stages its trace metadata (the ``traceana`` object our profiler writes) lists under ``stages``,
    sorted; ranks without such a list are absent. One small JSON document per rank, parsed in Python."""
    out: dict[int, list[int]] = {}
    if "meta" in traces.columns:
        for rank, meta in traces.select("rank", "meta").rows():
            try:
                stages = json.loads(meta).get("stages") if meta else None
            except (ValueError, AttributeError):
                continue
            if isinstance(stages, list) and stages and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                           for x in stages):
                out[rank] = sorted(set(stages))
    return out


def virtual_stage_ranks(traces: pl.DataFrame) -> list[int]:
    """Ranks whose trace metadata lists several stages (``metadata_stages``)."""
    return sorted(r for r, st in metadata_stages(traces).items() if len(st) > 1)

