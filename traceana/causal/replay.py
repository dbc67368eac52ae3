"""The measured step's replay (causal.graph's StepGraph) on the one engine, causal.scheduler.run_schedule, and many
variants of its durations at once on the same semantics.

The replay re-runs the graph's operations and messages with the measured durations through
``causal.scheduler.run_schedule`` (the same engine that runs the rules' planned orders): each operation starts at
max(previous end, inputs' arrival) + its gap — on a GPU rank that ran streams at once, its lane's previous end and
the ends of the other lanes' operations it came after (``_lanes``; causal.gpu_edges.lane_order). Every rank starts its step when it did. Nothing is frozen in a variant
(``_scales``): a rank's send/post lags and its tail (to its last CPU event, not the ProfilerStep end) scale with its
host time, its late start and its waits with the step's work. On the measured durations the replay reproduces each
rank's step exactly unless an edge contradicts the timeline: an operation that started before the input the graph gives
it could have arrived (``contradicted``: its gap is taken as 0 and its replay starts late), which is counted and said.

What is here: a step's plan (``_plan``: the ranks' orders, the collectives, each message's consumer, producer,
anchor and lags: what does not change between replays), a variant's durations in the plan's order (``_values``), what
the time no operation holds scales with (``_scales``, ``_run_host``), each message's terms (``_message_terms``;
unevaluated, ``_chained_terms``), the engine adapter (``_run``), ``replay`` and ``replay_steps_ns``, and the batched
evaluator (``replay_variants``: ``_levels`` compiles the plan the engine runs, ``_evaluate`` runs it in numpy) with
its run-time invariant (``_check_measured``; ``EngineMismatch``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import polars as pl

from traceana.causal.graph import EDGE_ORDER, StepGraph
from traceana.causal.scheduler import Costs, NullRecorder, Policy, StageTimes, Trace, product, run_schedule


class EngineMismatch(RuntimeError):
    """The batched evaluator (``replay_variants``) and the engine (``causal.scheduler.run_schedule``) disagree on the
    graph's own durations: one semantics is broken — a bug in traceana, not in the run."""


@dataclass(frozen=True)
class Replay:
    """One step replayed: per rank its start, replayed end and step (``ranks``: rank, start_ns, end_ns, step_ns),
    every operation's replayed start and end (``ops``: rank, seq, start_ns, end_ns, bound: what set its start —
    "device" (the rank's previous operation; on a rank running several lanes at once, ``from_rank``/``from_seq``:
    its lane's previous one or the other lane's it came after), "input" (``from_rank``/``from_seq``: the message's producer, or the
    receiver's own operation after which it posted the receive), "group" (a collective: ``from_*`` the member that
    joined last)), on the run's clock."""

    step: int
    ranks: pl.DataFrame
    ops: pl.DataFrame

    @property
    def step_ns(self) -> int:
        """The pipeline's step: its slowest rank's (summary's step time)."""
        return int(self.ranks["step_ns"].max())


def _in_plan_order(ops: pl.DataFrame, edges: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``ops`` and ``edges`` in the order ``_plan`` numbers them (operations by step, rank, seq; messages by step,
    EDGE_ORDER): the one order in which the engine (``_values``) and the batched evaluator (``replay_variants``)
    read a variant's durations, and the critical path the measured transfers."""
    return (ops.sort("step", "rank", "seq"),
            edges.sort(["step", *EDGE_ORDER], nulls_last=True, maintain_order=True))

_PLANS: dict[int, tuple["StepGraph", dict]] = {}  # a graph's replay structure per step (what-ifs replay it often)


def _plan(g: StepGraph, step: int) -> dict:
    """What does not change between replays of one step: the ranks, each one's order, what each operation makes,
    the collectives, and each message's consumer, producer, anchor and lags (in EDGE_ORDER)."""
    entry = _PLANS.get(id(g))
    if entry is None or entry[0] is not g:
        if len(_PLANS) >= 8:
            _PLANS.clear()
        entry = _PLANS[id(g)] = (g, {})
    if step in entry[1]:
        return entry[1][step]
    ops, edges = _in_plan_order(g.ops.filter(pl.col("step") == step), g.edges.filter(pl.col("step") == step))
    win = g.ranks.filter(pl.col("step") == step).sort("rank")
    ranks = win["rank"].to_list()
    dev = {r: i for i, r in enumerate(ranks)}
    orders: list[list[tuple]] = [[("X", r, -1)] for r in ranks]
    groups: dict[tuple, tuple[str, int]] = {}
    key_of: dict[tuple[int, int], tuple] = {}
    keys = []
    for r, seq, action, grp, members in ops.select("rank", "seq", "action", "group", "members").iter_rows():
        op = (action, r, seq)
        orders[dev[r]].append(op)
        keys.append((r, seq))
        key_of[(r, seq)] = product(op)
        if grp is not None:
            groups[op] = (grp, members)
    messages = [((dst, d_seq), key_of[(src, s_seq)], float(send_lag),
                 key_of[(dst, a_seq)] if a_seq is not None else ("X", dst, -1), float(post_lag))
                for src, s_seq, dst, d_seq, a_seq, send_lag, post_lag in edges.select(
                    "src", "src_seq", "dst", "dst_seq", "anchor_seq", "send_lag_ns", "post_lag_ns").iter_rows()]
    msg_dev = [(dev[src], dev[dst]) for src, dst in edges.select("src", "dst").iter_rows()]
    # a post after a receive that blocked its rank: the wait leaves the message's own lag and the message waits on
    # the awaited one (its arrival + the host work after it): {message: [(side, awaited message, lag)]}
    chains: dict[int, list[tuple[str, int, float]]] = {}
    if g.after_receive is not None:
        for j, side, via, lag, blocked in g.after_receive.filter(pl.col("step") == step).select(
                "edge", "side", "via", "lag_ns", "blocked_ns").iter_rows():
            c, made, send_lag, anchor, post_lag = messages[j]
            messages[j] = ((c, made, max(0.0, send_lag - blocked), anchor, post_lag) if side == "send"
                           else (c, made, send_lag, anchor, max(0.0, post_lag - blocked)))
            chains.setdefault(j, []).append((side, via, float(lag)))
    # a lag's time inside P2P calls no edge explains is a wait (scaled with rho): out of the host lag, {message:
    # (send side's, post side's)}; where the side waited on a receive, the wait lies after the awaited arrival
    lag_wait: dict[int, list[float]] = {}
    if g.lag_wait is not None:
        for j, side, w in g.lag_wait.filter(pl.col("step") == step).select("edge", "side", "wait_ns").iter_rows():
            c, made, send_lag, anchor, post_lag = messages[j]
            w = float(w)
            at = lag_wait.setdefault(j, [0.0, 0.0])
            if side == "send":
                w = min(w, send_lag)
                messages[j] = (c, made, send_lag - w, anchor, post_lag)
                at[0] = w
            else:
                w = min(w, post_lag)
                messages[j] = (c, made, send_lag, anchor, post_lag - w)
                at[1] = w
            chains[j] = [(sd_, via, max(0.0, lag - w) if sd_ == side else lag) for sd_, via, lag in chains.get(j, [])]
    lag_wait = {j: tuple(w) for j, w in lag_wait.items()}
    # a blocking send's message is also an input of its sender's next operation: (that operation, the message)
    blocking = ([((r, seq), j) for j, r, seq in g.blocking.filter(pl.col("step") == step)
                 .select("edge", "rank", "seq").iter_rows()] if g.blocking is not None else [])
    origin = int(win["start_ns"].min())
    lanes, lane_prev, cross = _lanes(g, step, ops, key_of)
    # waits no edge explains, in keys' order
    wait = [float(x) for x in ops["wait_ns"].to_list()] if "wait_ns" in ops.columns else [0.0] * ops.height
    total0 = float(ops["work_ns"].sum() + ops["gap_ns"].sum() + edges["transfer_ns"].sum())
    plan = {"win": win, "ranks": ranks, "dev": dev, "orders": orders, "groups": groups, "keys": keys,
            "messages": messages, "msg_dev": msg_dev, "blocking": blocking,
            "chains": {j: c for j, c in chains.items() if c}, "lag_wait": lag_wait,
            "origin": origin, "lanes": lanes, "lane_prev": lane_prev, "cross": cross,
            "total0": total0, "wait": wait,
            "offset": [float(x - origin) for x in win["start_ns"].to_list()], "tail": win["tail_ns"].to_list(),
            "member_seq": {(grp, r): seq for (_, r, seq), (grp, _n) in groups.items()}}
    entry[1][step] = plan
    return plan


def _lanes(g: StepGraph, step: int, ops: pl.DataFrame, key_of: dict) -> tuple[dict, dict, dict]:
    """The ranks of ``step`` that run operations at once on several lanes (a GPU rank's streams: ``g.after``,
    causal.gpu_edges.lane_order): for the engine ``{op: (lane, products it comes after)}``; for the batched evaluator
    and the critical path each operation's lane and previous one there (``{(rank, seq): (lane, seq or None)}``) and the
    operations of other lanes it comes after (``{(rank, seq): [seq, ...]}``). Empty where every rank has one lane."""
    if "lane" not in ops.columns:
        return {}, {}, {}
    multi = ops.group_by("rank").agg(pl.col("lane").n_unique().alias("_n")).filter(pl.col("_n") > 1)["rank"]
    if multi.len() == 0:
        return {}, {}, {}
    multi = multi.implode()
    after = (g.after.filter(pl.col("step") == step) if g.after is not None
             else pl.DataFrame(schema={"rank": pl.Int32, "seq": pl.Int32, "after_seq": pl.Int32}))
    mine = (ops.filter(pl.col("rank").is_in(multi)).select("rank", "seq", "action", "lane")
            .with_columns(pl.col("seq").shift(1).over("rank", "lane").alias("_lp")))
    cross: dict[tuple[int, int], list[int]] = {}
    for r, seq, a in after.select("rank", "seq", "after_seq").iter_rows():
        cross.setdefault((r, seq), []).append(a)
    lanes, lane_prev = {}, {}
    for r, seq, action, lane, lp in mine.iter_rows():
        lanes[(action, r, seq)] = (lane, tuple(key_of[(r, a)] for a in cross.get((r, seq), ())))
        lane_prev[(r, seq)] = (lane, lp)
    return lanes, lane_prev, cross


def _values(g: StepGraph, ops: pl.DataFrame | None, edges: pl.DataFrame | None
            ) -> dict[int, tuple[list[float], list[float], list[float]]]:
    """Per step the operations' work and gaps (in _plan's order) and the messages' transfers (in EDGE_ORDER): one
    sort of each frame for all the steps."""
    o, e = _in_plan_order(g.ops if ops is None else ops, g.edges if edges is None else edges)
    o = o.select("step", pl.col("work_ns", "gap_ns").cast(pl.Float64))
    e = e.select("step", pl.col("transfer_ns").cast(pl.Float64))
    steps, work, gap = o["step"].to_list(), o["work_ns"].to_list(), o["gap_ns"].to_list()
    e_steps, transfer = e["step"].to_list(), e["transfer_ns"].to_list()
    out: dict[int, tuple[list[float], list[float], list[float]]] = {}
    i = j = 0
    for step in sorted(set(steps) | set(e_steps)):
        i2, j2 = i, j
        while i2 < len(steps) and steps[i2] == step:
            i2 += 1
        while j2 < len(e_steps) and e_steps[j2] == step:
            j2 += 1
        out[step] = (work[i:i2], gap[i:i2], transfer[j:j2])
        i, j = i2, j2
    return out


def _scales(plan: dict, w_list: list[float], g_list: list[float], t_list: list[float],
            run_host: dict[int, tuple[float, float]]) -> tuple[list[float], float]:
    """What the time the graph holds no operation for scales with in a variant (docs/whatif.md "No frozen time"):
    per rank its host ratio (its host gaps in the variant over the measured ones, summed over all the graph's steps:
    ``run_host``, from ``_run_host``; the step's ratio where it measured none) — the rank's lags before a send or a
    receive's post and its tail after its last operation are its CPU's host work — and the step's ratio ``rho`` (all
    its work, gaps and transfers in the variant over the measured ones): a rank that started the step late waited on
    the previous step, taken to shrink as this one does.

    Why over all steps: one step's host gaps can be a few hundred µs beside tens of ms of lags; a variant that gives
    that rank its typical gaps (the ideal: medians over steps) then multiplied the lags by 35 (a 1F1B step replayed at
    2,429 ms instead of 1,056 from one 5 ms gap, at load 10). Over the run the ratio is what the variant does to the
    rank's host work, not one step's noise; a single step, doubled durations or ``host*k`` are unchanged by it."""
    total0 = plan["total0"]
    rho = (sum(w_list) + sum(g_list) + sum(t_list)) / total0 if total0 > 0 else 1.0
    ratios = [run_host.get(r, (0.0, 0.0)) for r in plan["ranks"]]
    host = [x / h if h > 0 else rho for x, h in ratios]
    return host, rho


def _run_host(g: StepGraph, ops: pl.DataFrame | None, gaps: list[pl.Expr] | None = None
              ) -> dict[int, tuple[list[float], float]]:
    """Per rank its host gaps summed over the graph's steps: (in each variant: the expressions ``gaps`` over ``ops``,
    or ``ops``' gap_ns; the graph's measured), what ``_scales``' host ratio divides."""
    gaps = [pl.col("gap_ns")] if gaps is None else gaps
    frame = g.ops if ops is None else ops
    var = frame.group_by("rank").agg([x.cast(pl.Float64).sum().alias(f"_{i}") for i, x in enumerate(gaps)])
    meas = g.ops.group_by("rank").agg(pl.col("gap_ns").cast(pl.Float64).sum().alias("_m"))
    both = var.join(meas, on="rank", how="left")
    cols = [f"_{i}" for i in range(len(gaps))]
    return {r: (list(v), float(m or 0.0)) for r, *v, m in both.select("rank", *cols, "_m").iter_rows()}


def _own_pieces(plan: dict, j: int) -> list[tuple[tuple, list[tuple]]]:
    """Message ``j``'s own two terms unevaluated (``_chained_terms``): its producer + send lag, its anchor + post lag,
    each lag its host part ("h") and, where part of it was a wait inside a P2P call (``plan["lag_wait"]``), that
    wait ("r": × rho)."""
    _, made, send_lag, anchor, post_lag = plan["messages"][j]
    sd, dd = plan["msg_dev"][j]
    w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
    return [(made, [("h", send_lag, sd)] + ([("r", w_s)] if w_s else [])),
            (anchor, [("h", post_lag, dd)] + ([("r", w_p)] if w_p else []))]


def _folded(plan: dict) -> list[int]:
    """The messages whose terms are not the plain two (a post that waited on a receive, a wait inside a lag)."""
    return sorted(set(plan["chains"]) | set(plan["lag_wait"]))


def _awaited_first(plan: dict, done) -> Iterator[int]:
    """The folded messages (``_folded``), each after the messages its posts waited on (depth first; a loop is cut):
    ``done(j)`` says whether j has its terms already — the caller fills them in as each is yielded. The one order
    the engine's terms (``_message_terms``) and the batched evaluator's (``_chained_terms``) are built in."""
    chains = plan["chains"]
    for j0 in _folded(plan):
        stack, on = [j0], {j0}
        while stack:
            j = stack[-1]
            todo = [v for _, v, _ in chains.get(j, ()) if not done(v) and v not in on]
            if todo:
                stack += todo
                on.update(todo)
                continue
            stack.pop()
            on.discard(j)
            if not done(j):
                yield j


def _chained_terms(plan: dict, limit: int) -> dict[int, list[tuple[tuple, list[tuple]]]] | None:
    """``_message_terms`` unevaluated, for the ``_folded`` messages: per message its terms as (product, pieces), a
    term's lag being the left fold of its pieces — ("h", lag, device): lag × that device's host ratio, ("t",
    message): that message's transfer, ("r", ns): ns × the step's rho — in the engine's order of additions.
    Duplicates are kept (the engine's latest-per-product is the same maximum: rounding is monotone). None past
    ``limit`` terms in all."""
    chains = plan["chains"]
    out: dict[int, list[tuple[tuple, list[tuple]]]] = {}
    total = 0
    for j in _awaited_first(plan, out.__contains__):
        sd, dd = plan["msg_dev"][j]
        w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
        terms = _own_pieces(plan, j)
        for side, via, lag in chains.get(j, ()):
            if via not in out:  # (a loop: cut, as the engine cuts it)
                continue
            scale, w = (sd, w_s) if side == "send" else (dd, w_p)
            tail = [("t", via), ("h", lag, scale)] + ([("r", w)] if w else [])
            terms += [(k, [*pieces, *tail]) for k, pieces in out[via]]
        total += len(terms)
        if total > limit:
            return None
        out[j] = terms
    return out


def _fold(pieces: list[tuple], host: list[float], t_list: list[float], rho: float) -> float:
    """A term's lag: its pieces added left to right (``_chained_terms``)."""
    v = 0.0
    for i, p in enumerate(pieces):
        x = p[1] * host[p[2]] if p[0] == "h" else t_list[p[1]] if p[0] == "t" else p[1] * rho
        v = x if i == 0 else v + x
    return v


def _message_terms(plan: dict, host: list[float], t_list: list[float], rho: float = 1.0) -> list[tuple]:
    """Each message's terms for the engine (``Input``): (product, lag) pairs whose latest end + lag is when both sides
    had posted it — its producer's end + send lag, its anchor's end + post lag, and for a post that waited on a
    receive of its rank (``plan["chains"]``) the awaited message's terms + its transfer + the lag after it
    (recursively, the latest lag per product kept; an awaited message is always earlier, a loop is cut); a lag's wait
    inside a P2P call (``plan["lag_wait"]``) scales with ``rho``."""
    msgs, dev_of, chains = plan["messages"], plan["msg_dev"], plan["chains"]
    folded = set(_folded(plan))
    out: list[tuple | None] = [None] * len(msgs)
    for j, (_, made, send_lag, anchor, post_lag) in enumerate(msgs):
        if j not in folded:
            sd, dd = dev_of[j]
            out[j] = ((made, send_lag * host[sd]), (anchor, post_lag * host[dd]))
    for j in _awaited_first(plan, lambda v: out[v] is not None):
        sd, dd = dev_of[j]
        w_s, w_p = plan["lag_wait"].get(j, (0.0, 0.0))
        best: dict[tuple, float] = {}
        for k, pieces in _own_pieces(plan, j):
            lag = _fold(pieces, host, t_list, rho)
            best[k] = max(best.get(k, lag), lag)
        for side, via, lag in chains.get(j, ()):
            if out[via] is None:  # (a loop: the timeline contradicts the pairing there; the link is cut)
                continue
            scale, w = (host[sd], w_s) if side == "send" else (host[dd], w_p)
            for k, t in out[via]:
                x = t + t_list[via] + lag * scale
                if w:
                    x = x + w * rho
                best[k] = max(best.get(k, x), x)
        out[j] = tuple(best.items())
    return out  # type: ignore[return-value]


def _run(g: StepGraph, step: int, ops: pl.DataFrame | None, edges: pl.DataFrame | None, values=None,
         run_host=None):
    """The engine on one step: (plan, the engine's Trace, when each device is free at the end)."""
    plan = _plan(g, step)
    w_list, g_list, t_list = (values or _values(g, ops, edges)).get(step, ([], [], []))
    if run_host is None:
        run_host = _run_host(g, ops)
    host, rho = _scales(plan, w_list, g_list, t_list, {r: (v[0], m) for r, (v, m) in run_host.items()})
    work = dict(zip(plan["keys"], w_list))
    gaps = {k: (x + w * rho, x + w * rho) for k, x, w in zip(plan["keys"], g_list, plan["wait"])}
    inputs: dict[tuple, list] = {}
    terms = _message_terms(plan, host, t_list, rho)
    for j, ((consumer, *_), transfer) in enumerate(zip(plan["messages"], t_list)):
        inputs.setdefault(consumer, []).append((terms[j], transfer))
    for consumer, j in plan["blocking"]:
        inputs.setdefault(consumer, []).append((terms[j], t_list[j]))
    trace = Trace()
    starts = [float(round(o * rho)) for o in plan["offset"]]
    tails = [round(t * h) for t, h in zip(plan["tail"], host)]
    _, free = run_schedule(
        plan["orders"], rec=NullRecorder(), policy=Policy(), times=StageTimes(forward_ns=(0.0,), backward_ns=(0.0,)),
        costs=Costs(), pp=len(plan["ranks"]), virtual_stages=1, schedule="measured", num_microbatches=1,
        dur=lambda a, r, seq: 0.0 if a == "R" or seq < 0 else work[(r, seq)],
        inputs=lambda d, op: inputs.get((op[1], op[2]), ()),
        gap=lambda d, i, op: gaps.get((op[1], op[2]), (0.0, 0.0)), groups=plan["groups"], trace=trace,
        free0=starts, lanes=plan["lanes"] or None)
    return plan, trace, free, starts, tails


def replay_steps_ns(g: StepGraph, *, ops: pl.DataFrame | None = None, edges: pl.DataFrame | None = None
                    ) -> list[int]:
    """``replay(...).step_ns`` of every step of the graph, without the per-operation tables (what a what-if needs)."""
    values = _values(g, ops, edges)
    run_host = _run_host(g, ops)
    out = []
    for step in g.steps:
        plan, _, free, starts, tails = _run(g, step, None, None, values, run_host)
        per_rank = _rank_steps_ns(free, tails, starts)
        out.append(max(per_rank))
        if ops is None and edges is None:
            plan["engine_ns"] = per_rank  # the measured durations' replay, for replay_variants' invariant
    return out


def _rank_steps_ns(free: list[float], tails: list[int], starts: list[float]) -> list[int]:
    """Each rank's replayed step (ns) from the engine's end state: its end rounded, plus its tail, less its start."""
    return [round(f) + t - int(s0) for f, t, s0 in zip(free, tails, starts)]


def _engine_measured(g: StepGraph) -> list[list[int]]:
    """The engine's replay of the graph's own durations, every step's every rank (in ``_plan``'s order of ranks),
    kept in the plans once computed (a what-if replays them anyway: ``replay``)."""
    have = [_plan(g, step).get("engine_ns") for step in g.steps]
    if None in have:
        replay_steps_ns(g)
        have = [_plan(g, step)["engine_ns"] for step in g.steps]
    return have


# Below this many operations ``replay_variants`` replays each variant on the engine itself (a tiny run's what-if in a
# few ms, without importing numpy); above it, all variants at once.
BATCH_FROM_OPS = 2_000
# replay_variants' durations held at once per kind (variants × operations): 64 variants of a 4,096-rank step (270,336
# operations) held ~1.3 GB of matrices and their frames; at 8 M (29 variants) the diagnosis' what-if peaked there
# at ~600 MB over the graph; at this many, 7 variants a chunk (docs/performance.md "Thousands of small ranks")
VARIANT_CELLS = 2_000_000


def replay_variants(g: StepGraph, ops: pl.DataFrame, edges: pl.DataFrame,
                    variants: list[tuple[pl.Expr, pl.Expr, pl.Expr]], *, chunk: int = 64) -> list[list[int]]:
    """``replay_steps_ns`` of many variants of the graph's durations at once: each variant is (work, gap, transfer),
    polars expressions over ``ops`` (the graph's ops, what-if columns added) and ``edges``, giving work_ns, gap_ns and
    transfer_ns. Returns per variant the replayed step (ns) of every step of the graph.

    The engine (``replay_steps_ns``: causal.scheduler.run_schedule) defines what a replay is; this evaluates the same
    thing for many variants together. With each rank's order, the messages and the collectives fixed (``_plan``: the
    orders, inputs and groups the engine is given), a replay is a longest path through a fixed acyclic graph: every
    operation starts at max(its previous operation's end (its lane's, and what it came after on the rank's other
lanes), each input's max(producer's end + send lag, anchor's end +
    post lag) + transfer) + gap (a collective: the latest of its members'), ends at start + work. numpy evaluates it
    level by level (an operation's level: one more than its inputs'), one column per variant, with the engine's own
    float additions in the engine's order, so the result is the engine's to the nanosecond (tests/causal/test_whatif.py
    checks every variant of the runs in tests/data, test_one_engine.py graphs of over 10^4 operations from traces). At
    run time every call also evaluates the graph's own durations, which must give the engine's replay of them rank by
    rank (``_check_measured``; EngineMismatch, a bug, if not). A graph whose dependencies form a cycle, or whose chains
    of posts that waited on receives are too long to unfold (``_chained_terms``), goes to the engine, which says so, and
    so does a small graph (under ``BATCH_FROM_OPS`` operations: the engine's
    few milliseconds a replay cost less than importing numpy, docs/performance.md "Fixed cost")."""
    if not variants:
        return []
    levels = {step: _levels(g, step) for step in g.steps} if ops.height >= BATCH_FROM_OPS else {None: None}
    if any(lv is None for lv in levels.values()):
        return [replay_steps_ns(g, ops=ops.with_columns(w.alias("work_ns"), gp.alias("gap_ns")),
                                edges=edges.with_columns(t.alias("transfer_ns"))) for w, gp, t in variants]
    import numpy as np

    # (variants a chunk: at most VARIANT_CELLS durations of each kind at once, the matrices' memory bounded on big
    # graphs; each variant's column is evaluated alone, so the chunks do not change a result)
    chunk = max(1, min(chunk, VARIANT_CELLS // max(ops.height, edges.height, 1)))
    o_keys, e_keys = ["step", "rank", "seq"], ["step", *EDGE_ORDER]

    def used(frame: pl.DataFrame, exprs: list[pl.Expr], keys: list[str]) -> pl.DataFrame:
        """(only the columns the variants read are sorted and held: a 4,096-rank what-if's ops carry ~40)"""
        need = set(keys).union(*(x.meta.root_names() for x in exprs))
        return frame.select([c for c in frame.columns if c in need])

    o, e = _in_plan_order(used(ops, [x for w, gp, _ in variants for x in (w, gp)], o_keys),
                          used(edges, [t for _, _, t in variants], e_keys))
    o_steps, e_steps = o["step"].to_numpy(), e["step"].to_numpy()
    # The run-time invariants (one semantics), on every call: the first chunk also evaluates the graph's own
    # durations, which must give the engine's replay of them (replay_steps_ns), every rank to the nanosecond, and
    # those durations all doubled, which must give twice that (_check_measured); else a bug, said as one. The
    # variants' frames must be the graph's rows (the levels index them): said as a bug too.
    g_o, g_e = _in_plan_order(g.ops.select(*o_keys, "work_ns", "gap_ns"), g.edges.select(*e_keys, "transfer_ns"))
    if not (o.select(o_keys).equals(g_o.select(o_keys)) and e.select(e_keys).equals(g_e.select(e_keys))):
        raise EngineMismatch(f"replay_variants was given {ops.height:,} operations and {edges.height:,} messages that "
                             f"are not the graph's ({g.ops.height:,}, {g.edges.height:,}): the variants' frames must "
                             "be the graph's own rows, columns added — a bug, report it")

    def matrix(frame: pl.DataFrame, exprs: list[pl.Expr]) -> np.ndarray:
        if frame.height == 0:
            return np.zeros((len(exprs), 0))
        m = frame.select([x.cast(pl.Float64).alias(f"_{i}") for i, x in enumerate(exprs)]).to_numpy()
        return np.ascontiguousarray(m.T, dtype=np.float64)  # variants × rows (polars gives columns whole)

    # (the graph's own durations beside the variants' frames, row for row: the keys are the same, in the same order)
    o = o.with_columns(g_o["work_ns"].alias("_own_work"), g_o["gap_ns"].alias("_own_gap"))
    e = e.with_columns(g_e["transfer_ns"].alias("_own_transfer"))
    probes = [(pl.col("_own_work") * k, pl.col("_own_gap") * k, pl.col("_own_transfer") * k) for k in (1, 2)]
    o_idx = [np.flatnonzero(o_steps == step) for step in g.steps]
    e_idx = [np.flatnonzero(e_steps == step) for step in g.steps]
    out: list[list[int]] = []
    for c0 in range(0, len(variants), chunk):
        part = variants[c0:c0 + chunk]
        rows = [*probes, *part] if c0 == 0 else part
        work = matrix(o, [w for w, _, _ in rows])
        gap = matrix(o, [gp for _, gp, _ in rows])
        transfer = matrix(e, [t for _, _, t in rows])
        run_host = _run_host(g, o, [gp for _, gp, _ in rows])
        per_step = [_evaluate(levels[step], work[:, oi], gap[:, oi], transfer[:, ei],
                              run_host=_host_columns(run_host, _plan(g, step)["ranks"], len(rows)))
                    for step, oi, ei in zip(g.steps, o_idx, e_idx)]
        if c0 == 0:
            _check_measured(g, [s[0] for s in per_step], [s[1] for s in per_step])
            per_step = [s[2:] for s in per_step]
        out += [[int(s[v].max()) for s in per_step] for v in range(len(part))]
    return out


def _levels(g: StepGraph, step: int):
    """The fixed graph the engine replays for ``step`` (``_plan``'s orders, inputs and groups) as arrays for
    ``_evaluate``, grouped by level; None when its dependencies form a cycle."""
    import numpy as np

    plan = _plan(g, step)
    if "levels" in plan:
        return plan["levels"]
    chained = _chained_terms(plan, 64 * len(plan["messages"]) + 1_000) if _folded(plan) else {}
    if chained is None:  # (posts waiting on receives in chains too long to unfold: the engine replays them)
        plan["levels"] = None
        return None
    keys, dev, n = plan["keys"], plan["dev"], len(plan["keys"])
    r_of = np.array([dev[r] for r, _ in keys], dtype=np.int64)
    # node n + d: device d's start (its free0); a rank's first operation follows it, a receive posted before the
    # step's first operation is anchored on it
    pos = {k: i for i, k in enumerate(keys)}
    node_of = {product(op): pos[(op[1], op[2])] for order in plan["orders"] for op in order[1:]}
    node_of.update({("X", r, -1): n + d for r, d in dev.items()})
    prev = np.arange(-1, n - 1, dtype=np.int64)
    first = np.ones(n, dtype=bool)
    first[1:] = r_of[1:] != r_of[:-1]
    prev[first] = n + r_of[first]
    # a rank on several lanes (_lanes): each operation after its lane's previous one and the other lanes' it came
    # after (rows: the operation, the one it comes after, by the operation)
    for (r, seq), (_lane, lp) in plan["lane_prev"].items():
        prev[pos[(r, seq)]] = pos[(r, lp)] if lp is not None else n + dev[r]
    c_pairs = sorted((pos[(r, seq)], pos[(r, a)]) for (r, seq), seqs in plan["cross"].items() for a in seqs)
    c_dst = np.array([x for x, _ in c_pairs], dtype=np.int64)
    c_src = np.array([y for _, y in c_pairs], dtype=np.int64)
    m_dst = np.array([pos[c] for c, *_ in plan["messages"]], dtype=np.int64)
    m_src = np.array([node_of[made] for _, made, *_ in plan["messages"]], dtype=np.int64)
    m_anc = np.array([node_of[anchor] for _, _, _, anchor, _ in plan["messages"]], dtype=np.int64)
    m_sl = np.array([sl for _, _, sl, _, _ in plan["messages"]], dtype=np.float64)
    m_pl = np.array([p for *_, p in plan["messages"]], dtype=np.float64)
    m_sd = np.array([sd for sd, _ in plan["msg_dev"]], dtype=np.int64)
    m_dd = np.array([dd for _, dd in plan["msg_dev"]], dtype=np.int64)
    t_col = np.arange(len(plan["messages"]), dtype=np.int64)  # each input's transfer: its message's column
    # a post that waited on a receive: one more input row per term of the awaited messages (both sides its
    # product, its lag the fold of its pieces, evaluated per variant in _evaluate), with the message's transfer
    folds: list[list[tuple]] = [[] for _ in plan["messages"]]
    x_dst, x_node, x_col = [], [], []
    for j, terms in chained.items():
        # (its first term in the message's own row, both sides that product; the others rows of their own)
        folds[j] = terms[0][1]
        m_anc[j] = m_src[j]
        for k, pieces in terms[1:]:
            x_dst.append(m_dst[j])
            x_node.append(node_of[k])
            x_col.append(j)
            folds.append(pieces)
    if x_dst:
        nx = np.array(x_node, dtype=np.int64)
        m_dst, m_src, m_anc = np.r_[m_dst, x_dst], np.r_[m_src, nx], np.r_[m_anc, nx]
        m_sl, m_pl = np.r_[m_sl, np.zeros(nx.size)], np.r_[m_pl, np.zeros(nx.size)]
        m_sd, m_dd, t_col = np.r_[m_sd, np.zeros(nx.size, np.int64)], np.r_[m_dd, np.zeros(nx.size, np.int64)], np.r_[
            t_col, np.array(x_col, dtype=np.int64)]
    msg_rows: dict[int, list[int]] = {}
    for i, j in enumerate(t_col.tolist()):
        msg_rows.setdefault(j, []).append(i)
    if plan["blocking"]:  # a blocking send's message, again, as an input of its sender's next operation
        rows_b = [(c, i) for c, j in plan["blocking"] for i in msg_rows[j]]
        bj = np.array([i for _, i in rows_b], dtype=np.int64)
        folds += [folds[i] for i in bj.tolist()]
        m_dst = np.r_[m_dst, np.array([pos[c] for c, _ in rows_b], dtype=np.int64)]
        m_src, m_anc, m_sl, m_pl = np.r_[m_src, m_src[bj]], np.r_[m_anc, m_anc[bj]], np.r_[m_sl, m_sl[bj]], np.r_[
            m_pl, m_pl[bj]]
        m_sd, m_dd, t_col = np.r_[m_sd, m_sd[bj]], np.r_[m_dd, m_dd[bj]], np.r_[t_col, t_col[bj]]
    # the folds as padded columns: piece p of every row that has one (kind 0 host, 1 transfer), rows in m_dst's order
    width = max((len(f) for f in folds), default=0)
    fold_cols = []
    for p in range(width):
        rows_p = [i for i, f in enumerate(folds) if len(f) > p]
        kinds = [folds[i][p][0] for i in rows_p]
        fold_cols.append((np.array(rows_p, dtype=np.int64),
                          np.array([{"h": 0, "t": 1, "r": 2}[k] for k in kinds], dtype=np.int64),
                          np.array([folds[i][p][1] if k == "t" else 0 for i, k in zip(rows_p, kinds)], dtype=np.int64),
                          np.array([folds[i][p][1] if k != "t" else 0.0 for i, k in zip(rows_p, kinds)]),
                          np.array([folds[i][p][2] if k == "h" else 0 for i, k in zip(rows_p, kinds)],
                                   dtype=np.int64)))
    has_fold = np.array([bool(f) for f in folds], dtype=bool)
    gid = {}
    grp = np.full(n, -1, dtype=np.int64)
    for op, (name, _members) in plan["groups"].items():
        grp[pos[(op[1], op[2])]] = gid.setdefault(name, len(gid))
    # levels (Kahn's order over units: an operation, or a collective's members together)
    unit = np.where(grp >= 0, n + grp, np.arange(n))
    preds: list[list[int]] = [[] for _ in range(n + len(gid))]
    for a, b in zip(np.concatenate([prev, m_src, m_anc, c_src]).tolist(),
                    np.concatenate([np.arange(n), m_dst, m_dst, c_dst]).tolist()):
        if a < n:
            preds[unit[b]].append(int(unit[a]))
    succ: list[list[int]] = [[] for _ in preds]
    need = [0] * len(preds)
    for u, ps in enumerate(preds):
        for p in set(ps):
            if p == u:
                plan["levels"] = None
                return None
            succ[p].append(u)
            need[u] += 1
    level = [0] * len(preds)
    ready = [u for u in range(len(preds)) if need[u] == 0 and (u >= n or grp[u] < 0)]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for s in succ[u]:
            level[s] = max(level[s], level[u] + 1)
            need[s] -= 1
            if need[s] == 0:
                ready.append(s)
    if seen != len(set(unit.tolist())):
        plan["levels"] = None
        return None
    lv = np.array(level, dtype=np.int64)[unit]
    by_level = []
    e_lv = lv[m_dst] if m_dst.size else m_dst
    for L in np.unique(lv).tolist():
        nodes = np.flatnonzero(lv == L)
        es = np.flatnonzero(e_lv == L)
        es = es[np.argsort(m_dst[es], kind="stable")]
        d = m_dst[es]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]]) if d.size else d
        at = np.searchsorted(nodes, d[starts]) if d.size else d
        gm = nodes[grp[nodes] >= 0]
        gm = gm[np.argsort(grp[gm], kind="stable")]
        gs = grp[gm]
        g_starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]]) if gs.size else gs
        g_counts = np.diff(np.r_[g_starts, gs.size]) if gs.size else gs
        fp = np.flatnonzero(has_fold[es]) if es.size else es  # (rows whose lag is a fold: their global index)
        cs = np.flatnonzero(lv[c_dst] == L) if c_dst.size else c_dst  # (c_pairs are sorted by operation)
        cd = c_dst[cs]
        c_starts = np.flatnonzero(np.r_[True, cd[1:] != cd[:-1]]) if cd.size else cd
        cross = (np.searchsorted(nodes, cd[c_starts]) if cd.size else cd, c_src[cs], c_starts)
        by_level.append((nodes, prev[nodes], cross, t_col[es], m_src[es], m_anc[es], m_sl[es], m_pl[es], m_sd[es], m_dd[es],
                         starts, at, np.searchsorted(nodes, gm), g_starts, g_counts, (fp, es[fp])))
    win = plan["win"]
    last = np.array([n + d for d in range(len(plan["ranks"]))], dtype=np.int64)
    is_last = np.r_[r_of[1:] != r_of[:-1], True] if n else np.zeros(0, dtype=bool)
    last[r_of[is_last]] = np.flatnonzero(is_last)  # each device's last operation (its start where it has none)
    # (a rank on several lanes ends with its last lane: every lane's last operation beside it)
    lane_last = {}
    for (r, seq), (lane, _lp) in plan["lane_prev"].items():  # (in each rank's order: the last one stays)
        lane_last[(r, lane)] = pos[(r, seq)]
    ex_d = np.array([dev[r] for r, _ in lane_last], dtype=np.int64)
    ex_n = np.array(list(lane_last.values()), dtype=np.int64)
    last = (last, ex_d, ex_n)
    plan["levels"] = (n, by_level, np.array(plan["offset"]), last, plan["origin"],
                      np.array(plan["tail"], dtype=np.float64), plan["total0"],
                      np.array(plan["wait"], dtype=np.float64), (m_dst.size, fold_cols))
    return plan["levels"]


def _host_columns(run_host: dict, ranks: list[int], v: int):
    """``_run_host``'s sums as _evaluate reads them: (variants × this step's ranks, the measured per rank)."""
    import numpy as np

    none = ([0.0] * v, 0.0)
    var = np.array([run_host.get(r, none)[0] for r in ranks], dtype=np.float64).reshape(len(ranks), v).T
    meas = np.array([run_host.get(r, none)[1] for r in ranks], dtype=np.float64)
    return var, meas


def _check_measured(g: StepGraph, batched: list, doubled: list) -> None:
    """``replay_variants``' run-time invariants, per step on each rank's step (ns): the batched evaluator's replay of
    the graph's own durations is the engine's (``_engine_measured``, which a what-if has made anyway: ``replay``),
    and its replay of them all doubled is twice that. The second holds because nothing in a replay is frozen
    (docs/whatif.md "No frozen time": lags, tails, late starts and waits scale with the host ratio and rho, both then
    exactly 2), and exactly, every figure being a whole number of ns far below 2**53; it checks the scaling the
    measured durations (ratios of 1) cannot, at the cost of one more variant row. EngineMismatch naming the step,
    the first rank that differs and both figures."""
    engine = _engine_measured(g)
    for what, got, want in (("the measured durations", batched, engine),
                            ("the measured durations all doubled (twice the engine's replay of them)", doubled,
                             [[2 * x for x in e] for e in engine])):
        for step, b, e in zip(g.steps, got, want):
            b = [int(x) for x in b]
            if got is doubled and not _plan(g, step)["total0"] > 0:
                continue  # (a step of no work, gaps or transfers at all: its ratios are 1, not 2, by _scales' rule)
            if b != e:
                ranks = _plan(g, step)["ranks"]
                bad = [i for i, (x, y) in enumerate(zip(b, e)) if x != y]
                i = bad[0]
                raise EngineMismatch(
                    f"the batched replay and the engine disagree on {what}: step {step}, rank {ranks[i]}: batched "
                    f"{b[i]:,} ns, engine {e[i]:,} ns ({len(bad)} of {len(e)} ranks differ; the step: batched "
                    f"{max(b):,} ns, engine {max(e):,} ns): one semantics is broken (replay._evaluate against "
                    "causal.scheduler.run_schedule) — a bug, report it")


def _evaluate(levels, work, gap, transfer, *, run_host, split=None):
    """_levels' graph with ``work``/``gap`` (variants × operations) and ``transfer`` (variants × messages): each
    variant's every rank's step (ns; variants × ranks, in ``_plan``'s order), as ``replay_steps_ns`` computes it
    (``replay_variants``; the step is the slowest rank's).

    ``split`` (causal.group_replay: one pipeline group's part of a larger step, its columns max-plus terms):
    (rho, host, starts, at_collective): the step's ratios computed on the whole job (per column; per column and
    rank), the ranks' start nodes (columns × ranks), and ``at_collective(i, joined)``, called at level ``i`` with
    each collective's latest member (columns × the level's collectives), which returns the collectives' starts;
    the result is then each rank's last operation's end, unrounded (columns × ranks)."""
    import numpy as np

    n, by_level, offset, last, origin, tail, total0, wait, (n_rows, fold_cols) = levels
    v = work.shape[0]
    if split is not None:
        rho, host, starts, at_collective = split
    else:
        # _scales, per variant: the ranks' host ratios (over the run's steps: _run_host, as _host_columns lays it
        # out) and the step's
        sums, h0 = run_host
        rho = ((work.sum(axis=1) + gap.sum(axis=1) + transfer.sum(axis=1)) / total0 if total0 > 0
               else np.ones(v))
        host = np.where(h0[None, :] > 0, sums / np.where(h0 > 0, h0, 1.0)[None, :], rho[:, None])
        starts = np.round(offset[None, :] * rho[:, None])
    end = np.empty((v, n + offset.size))
    end[:, n:] = starts
    # the lags that are folds (a post that waited on a receive: _chained_terms), left to right as the engine adds
    fold = np.zeros((v, n_rows)) if fold_cols else None
    for p, (rows_p, kind, col, lag, dev) in enumerate(fold_cols):
        piece = np.where(kind[None, :] == 1, transfer[:, col],
                         np.where(kind[None, :] == 2, lag[None, :] * rho[:, None], lag[None, :] * host[:, dev]))
        fold[:, rows_p] = piece if p == 0 else fold[:, rows_p] + piece
    last, ex_d, ex_n = last
    for i, (nodes, prev, (c_at, c_src, c_starts), es, src, anc, sl, pl_, sd, dd, m_starts, at, gpos, g_starts,
            g_counts, (fp, fi)) in enumerate(by_level):
        t = end[:, prev]
        if c_at.size:  # (what it came after on its rank's other lanes)
            t[:, c_at] = np.maximum(t[:, c_at], np.maximum.reduceat(end[:, c_src], c_starts, axis=1))
        if es.size:
            lag_s, lag_p = sl[None, :] * host[:, sd], pl_[None, :] * host[:, dd]
            if fp.size:
                lag_s[:, fp] = fold[:, fi]
                lag_p[:, fp] = fold[:, fi]
            arrive = np.maximum(end[:, src] + lag_s, end[:, anc] + lag_p) + transfer[:, es]
            ready = np.maximum.reduceat(arrive, m_starts, axis=1)
            t[:, at] = np.maximum(t[:, at], ready)
        t += gap[:, nodes] + wait[None, nodes] * rho[:, None]
        if gpos.size:  # a collective starts when its last member joins
            joined = np.maximum.reduceat(t[:, gpos], g_starts, axis=1)
            if split is not None:
                joined = at_collective(i, joined)
            t[:, gpos] = np.repeat(joined, g_counts, axis=1)
        t += work[:, nodes]
        end[:, nodes] = t
    last_end = end[:, last]
    if ex_n.size:  # a rank on several lanes ends with its last lane
        np.maximum.at(last_end.T, ex_d, end[:, ex_n].T)
    if split is not None:
        return last_end
    steps = (np.round(last_end).astype(np.int64) + np.round(tail[None, :] * host).astype(np.int64)
             - starts.astype(np.int64))
    return steps


def replay(g: StepGraph, step: int, *, ops: pl.DataFrame | None = None, edges: pl.DataFrame | None = None) -> Replay:
    """Replay ``step`` of the graph on the scheduler's engine (causal.scheduler.run_schedule), with ``ops``'
    work_ns/gap_ns and ``edges``' transfer_ns (default: the graph's own, as measured; a what-if passes changed ones,
    the same rows)."""
    plan, trace, free, starts, tails = _run(g, step, ops, edges)
    ranks, origin, member_seq = plan["ranks"], plan["origin"], plan["member_seq"]
    if ops is None and edges is None:
        plan["engine_ns"] = _rank_steps_ns(free, tails, starts)

    lane_prev = plan["lane_prev"]

    def source(bound, op) -> tuple[str, int | None, int | None]:
        if bound == "device":  # (on a rank of several lanes: its lane's previous operation)
            lp = lane_prev.get((op[1], op[2]))
            return ("device", None, None) if lp is None or lp[1] is None else ("device", op[1], lp[1])
        if bound[0] == "after":  # an operation of another lane of its rank
            return "device", bound[1], bound[2]
        if bound[0] == "group":  # the member that joined last: the path goes on through its own collective
            last = ranks[bound[2]]
            return "group", last, member_seq[(bound[1], last)]
        return "input", bound[1], bound[2]

    rows = [(op[1], op[2], origin + round(start), origin + round(end), *source(bound, op))
            for (d, i), (op, _f, _ready, start, end, bound) in trace.ops.items() if op[2] >= 0]
    op_rows = pl.DataFrame(rows, schema={"rank": pl.Int32, "seq": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64,
                                         "bound": pl.String, "from_rank": pl.Int32, "from_seq": pl.Int32},
                           orient="row").sort("rank", "seq")
    rank_rows = pl.DataFrame(
        {"rank": ranks, "start_ns": [origin + int(s) for s in starts],
         "end_ns": [origin + round(f) + t for f, t in zip(free, tails)]},
        schema={"rank": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64},
    ).with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("step_ns"))
    return Replay(step=step, ranks=rank_rows, ops=op_rows)
