"""The replayed step's critical path and every operation's slack (``critical_path``, from causal.replay's ``Replay``
of a causal.graph ``StepGraph``), and the time on the paths of several steps by kind, stage and rank (``on_path``).
"""

from __future__ import annotations

import polars as pl

from traceana.causal.graph import EDGE_ORDER, KIND_OF_ACTION, StepGraph
from traceana.causal.replay import Replay, _in_plan_order, _message_terms, _plan
from traceana.core.units import NS_PER_MS


def critical_path(g: StepGraph, r: Replay) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The replayed step's critical path and every operation's slack.

    The path runs back from the end of the slowest rank's step (the step time): each operation to what set its start
    (``Replay.ops.bound``): the rank's previous operation (the gap between them is host time), a message's producer
    (its lag and transfer are P2P time) or the receiver's own operation that posted the receive, or a collective's
    last member to join. Returns (``path``: one row per piece of time on it — rank, stage, seq (null for time
    between operations), kind (forward, backward, optimizer, collective, other, p2p, host), start_ns, end_ns,
    ms; ``slack``: rank, seq, slack_ns — how much later the operation could end without lengthening the step: the
    latest end allowed by everything that waits on it (each rank's step may end at its start + the step time), less
    its replayed end)."""
    step = r.step
    own = g.ops.filter(pl.col("step") == step)
    # what the replay put before each operation: its host gap and its wait (scaled as the replay scaled it: the
    # replayed start less the later of its previous end and its inputs' arrival is what the walk below reads)
    ops = (own.select("rank", "seq", "action", "stage", "work_ns", "gap_ns", "group",
                      (pl.col("wait_ns") if "wait_ns" in own.columns else pl.lit(0, pl.Int64)).alias("_wait"))
           .join(r.ops, on=["rank", "seq"]))
    edges = g.edges.filter(pl.col("step") == step)
    win = g.ranks.filter(pl.col("step") == step).join(r.ranks.select("rank", pl.col("end_ns").alias("_end")),
                                                      on="rank")
    info = {(rk, sq): (a, st, w, gp, grp, s0, e0, b, fr, fs)
            for rk, sq, a, st, w, gp, grp, s0, e0, b, fr, fs in ops.select(
                "rank", "seq", "action", "stage", "work_ns", pl.col("gap_ns") + pl.col("_wait"), "group", "start_ns",
                "end_ns", "bound", "from_rank", "from_seq").iter_rows()}
    wait_of = dict(((rk, sq), wt) for rk, sq, wt in ops.select("rank", "seq", "_wait").iter_rows())

    def before_op(rk: int, st, sq: int, t0: int, t1: int) -> None:
        """The time [t0, t1) before operation (rk, sq) on the path: its wait no edge explains first, then host."""
        if t1 <= t0:
            return
        wt = min(wait_of.get((rk, sq), 0), t1 - t0)
        if wt > 0:
            pieces.append((rk, st, None, "wait", t0, t0 + wt))
        if t1 > t0 + wt:
            pieces.append((rk, st, None, "host", t0 + wt, t1))
    start_of = dict(win.select("rank", "start_ns").iter_rows())
    tail = dict(win.select("rank", "tail_ns").iter_rows())
    last_seq = dict(ops.group_by("rank").agg(pl.col("seq").max()).iter_rows())
    step_ns = int((win["_end"] - win["start_ns"]).max())
    # --- slack: latest finishes, from the last operations back (max-plus constraints of the replay) ---
    # op -> (successor, lag before its gap) of the messages it feeds; its rank's next operation (lag 0), first, is
    # not listed (a list an operation: 60 MB at 270,336 operations)
    after: dict[tuple[int, int], list[tuple[tuple[int, int], float]]] = {}
    # each message's inputs as the replay has them (_message_terms on the measured durations: a post that waited on
    # a receive has the awaited message's producers among them), for its consumer and, sent blocking, its sender's
    # next operation; each message's terms dropped after their last use (they and ``after`` were the peak)
    plan = _plan(g, step)
    t_meas = (_in_plan_order(own.select("step", "rank", "seq"), edges.select("step", *EDGE_ORDER, "transfer_ns"))[1]  # (edges only)
              ["transfer_ns"].cast(pl.Float64).to_list())
    terms = _message_terms(plan, [1.0] * len(plan["ranks"]), t_meas)
    blocking = list(plan["blocking"])
    last_use = {j: i for i, (_, j) in enumerate(blocking)}
    for held, drop in (([(plan["messages"][j][0], j) for j in range(len(terms))], lambda i, j: j not in last_use),
                       (blocking, lambda i, j: last_use[j] == i)):
        for i, (consumer, j) in enumerate(held):
            for k, lag in terms[j]:
                if k[2] >= 0:  # (not a rank's step start)
                    after.setdefault((k[1], k[2]), []).append((consumer, lag + t_meas[j]))
            if drop(i, j):
                terms[j] = ()
        del held
    del terms, blocking, last_use
    # a rank running several lanes at once (replay._lanes): its operations' successors on the rank are the next one
    # of their lane and those of other lanes that came after them; each lane's last operation ends the rank's step
    lane_prev = plan["lane_prev"]
    rank_next: dict[tuple[int, int], list[tuple[int, int]]] = {}
    lane_last: dict[tuple[int, int], tuple[int, int]] = {}
    for (rk, sq), (ln, lp) in lane_prev.items():
        if lp is not None:
            rank_next.setdefault((rk, lp), []).append((rk, sq))
        lane_last[(rk, ln)] = (rk, sq)
    for (rk, sq), seqs in plan["cross"].items():
        for a in seqs:
            rank_next.setdefault((rk, a), []).append((rk, sq))
    ends_lane = set(lane_last.values())
    members: dict[str, list[tuple[int, int]]] = {}
    for key, v in info.items():
        if v[4] is not None:
            members.setdefault(v[4], []).append(key)
    latest_finish: dict[tuple[int, int], float] = {}
    group_start: dict[str, float] = {}  # a collective's, once every member has its latest finish (set once each)

    def latest_start(key: tuple[int, int]) -> float:
        grp = info[key][4]
        if grp is None:
            return latest_finish[key] - info[key][2]
        # a collective starts when its last member joins: the same for every member (asked by each member's
        # predecessors: at 512 members, 512 x 512 terms a collective when made each time)
        if grp not in group_start:  # (a member without its latest finish yet raises KeyError: not kept)
            group_start[grp] = min(latest_finish[k] - info[k][2] for k in members[grp])
        return group_start[grp]

    for key in sorted(info, key=lambda k: (info[k][5], info[k][6]), reverse=True):
        rk, sq = key
        ends_step = key in ends_lane if key in lane_prev else sq == last_seq[rk]
        bound = start_of[rk] + step_ns - tail[rk] if ends_step else float("inf")
        succs = after.get(key, ())
        if key in lane_prev:
            succs = (*((k, 0) for k in rank_next.get(key, ())), *succs)
        elif (rk, sq + 1) in info:
            succs = (((rk, sq + 1), 0), *succs)
        for succ, lag in succs:
            try:  # (every successor starts later, so it came first; a member of a collective, all of them)
                bound = min(bound, latest_start(succ) - info[succ][3] - lag)
            except KeyError:
                continue
        latest_finish[key] = bound
    # (replayed times are whole nanoseconds: a few ns below zero is rounding)
    slack = pl.DataFrame({"rank": [k[0] for k in info], "seq": [k[1] for k in info],
                          "slack_ns": [max(0, int(latest_finish[k] - v[6])) for k, v in info.items()]},
                         schema={"rank": pl.Int32, "seq": pl.Int32, "slack_ns": pl.Int64})
    del after, latest_finish, group_start, members
    post_lag_of = {(dst, d_seq, a_seq): post_lag for dst, d_seq, a_seq, post_lag in
                   edges.select("dst", "dst_seq", "anchor_seq", "post_lag_ns").iter_rows() if a_seq is not None}
    # --- the path: back from the slowest rank's last operation ---
    stage_of = dict(win.select("rank", "stage").iter_rows())
    end_rank = int(win.sort(pl.col("_end") - pl.col("start_ns"), descending=True)["rank"][0])
    pieces: list[tuple] = []
    key = (end_rank, last_seq[end_rank])
    if key in lane_prev:  # (several lanes: the one that ended last)
        key = max((k for k in ends_lane if k[0] == end_rank), key=lambda k: info[k][6])
    end_t = int(win.filter(pl.col("rank") == end_rank)["_end"][0])
    a, st, w, gp, grp, s0, e0, b, fr, fs = info[key]
    if end_t > e0:
        pieces.append((end_rank, stage_of.get(end_rank), None, "host", e0, end_t))
    seen = set()
    joined = False  # the walk jumped to a collective's last member: its time is on the path once
    while key is not None and key not in seen:
        seen.add(key)
        rk, sq = key
        a, st, w, gp, grp, s0, e0, b, fr, fs = info[key]
        if not joined:
            pieces.append((rk, st, sq, KIND_OF_ACTION[a], s0, e0))
        joined = b == "group"
        if b == "device":
            prev = ((fr, fs) if fs is not None else (rk, sq - 1) if (rk, sq - 1) in info and key not in lane_prev
                    else None)
            before_op(rk, st, sq, info[prev][6] if prev else start_of[rk], s0)
            key = prev
        elif b == "group":
            key = (fr, fs)
        else:  # an input: the gap after it arrived is host; before, the message's transfer is P2P, and the time
            # from the producer's end to the send (or from the receiver's operation to its posting the receive) too
            src_end = info[(fr, fs)][6] if fs >= 0 else start_of[fr]  # (-1: the rank's step start)
            arrive = s0 - gp
            before_op(rk, st, sq, arrive, s0)
            lag = post_lag_of.get((rk, sq, fs)) if fr == rk else None
            if lag is not None and lag > 0:  # the receiver's own time before it posted the receive
                pieces.append((rk, st, None, "host", src_end, min(arrive, src_end + lag)))
                src_end = min(arrive, src_end + lag)
            if arrive > src_end:
                pieces.append((rk, st, None, "p2p", src_end, arrive))
            key = (fr, fs) if fs >= 0 else None
    # the path spans the slowest rank's step: from its start (a path that begins on a rank that started later
    # begins with that rank's wait on the previous step; time before the slowest rank's start is not in its step)
    # to its end, so the time on it is the step printed beside it
    first = start_of[end_rank]
    begin = min((p[4] for p in pieces), default=first)
    if begin > first:
        at = min(pieces, key=lambda p: p[4])
        pieces.append((at[0], at[1], None, "previous step", first, begin))
    pieces = [(*p[:4], max(p[4], first), p[5]) for p in pieces if p[5] > first]
    path = pl.DataFrame(pieces, schema={"rank": pl.Int32, "stage": pl.Int32, "seq": pl.Int32, "kind": pl.String,
                                        "start_ns": pl.Int64, "end_ns": pl.Int64}, orient="row").sort("start_ns")
    path = path.with_columns(((pl.col("end_ns") - pl.col("start_ns")) / NS_PER_MS).alias("ms"),
                             pl.lit(step, pl.Int32).alias("step"))
    return path, slack


def on_path(paths: list[pl.DataFrame]) -> pl.DataFrame:
    """Time on the critical path per step, mean over the steps given: group (kind, stage, rank), id, ms, fraction
    (of the path)."""
    if not paths:
        return pl.DataFrame(schema={"group": pl.String, "id": pl.String, "ms": pl.Float64, "fraction": pl.Float64})
    both = pl.concat(paths)
    n = len(paths)
    total = both["ms"].sum() / n
    out = []
    for grp in ("kind", "stage", "rank"):
        out.append(both.group_by(grp).agg((pl.col("ms").sum() / n).alias("ms"))
                   .select(pl.lit(grp).alias("group"), pl.col(grp).cast(pl.String).alias("id"), "ms")
                   .sort("ms", descending=True))
    return pl.concat(out).with_columns((pl.col("ms") / total if total else pl.lit(None)).alias("fraction"))
