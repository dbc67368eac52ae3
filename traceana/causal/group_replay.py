"""The measured step's replay, one pipeline group (a data-parallel replica's ranks) a task: the same numbers as
``causal.replay`` (``replay_steps_ns``, ``replay_variants``), with no task holding more than one group's graph.

Why it splits exactly. Every figure in a replay is a max or a sum (causal.replay: an operation starts at
max(previous end, its inputs' arrivals) + gap, a collective when its last member joins). Replicas meet only in the
collectives whose members span replicas (each stage's gradient all-reduce, the optimizer's): call them *boundary*
collectives and their starts s_1 … s_C. Within a group, with those starts unknown, each end is then
max(a_0, a_1 + s_1, …, a_C + s_C): max-plus linear in the starts. A group's replay with one column per start (a_0:
the group's own ranks' starts, the others −∞; a_c: s_c = 0, the others −∞), as ``replay_variants`` evaluates one
column per variant, gives that matrix for the group's arrival at each boundary collective (its latest member's
ready time) and for each rank's last end (``replay._evaluate``'s ``split``). The parent keeps only those
matrices: a collective's arrival is the element-wise max of the groups' rows; its start follows in dependency order
(s_c = max_k(arrival_c[k] + s_k) over the starts it depends on, a collective after another exactly so); each rank's
end is max_k(its row[k] + s_k). The step-wide ratios a variant scales the time no operation holds with (rho, each
rank's host ratio over the run: ``replay._scales``) and the ranks' start offsets are computed on the whole job first
and passed to every group. On whole-nanosecond figures (the measured durations; every ratio 1) each sum is exact
and the result is the engine's to the nanosecond; on a variant's scaled lags the parent adds a start to a group's
partial sum where the engine adds the partial sums to the start, which gave the same floats in every case the tests
check (every run in tests/data with replicas, a generated job of 12 replicas, the what-if's variants), and each
call compares the graph's own durations and their double with the engine (``replay._check_measured``).

Each group's matrix is one task handed to a ``map`` (builtin ``map``; ``measure.partitioned.dask_map`` for a
``dask.distributed`` cluster, as ``analyze --dask`` uses): ``group_task`` takes a ``GroupReplayTask`` (plain
frames and arrays, picklable) and returns the group's arrival and end matrices.

What splits: a run whose ranks all have a replica (``StepGraph.ranks``' replica, from the P2P components) and no
P2P message between replicas; else ``GroupSplitError`` (one line: what, why). A job of one replica is one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from traceana.causal import replay
from traceana.causal.graph import EDGE_ORDER, StepGraph, renumbered
from traceana.causal.replay import VARIANT_CELLS, _check_measured, _evaluate, _host_columns, _in_plan_order, \
    _levels, _plan, _run_host, replay_steps_ns as _engine_steps_ns
from traceana.core.errors import AnalysisError


# The most figures (ranks × boundary starts + 1 × variants) of the groups' end matrices the parent holds at once:
# more variants go in rounds (each round builds every group's graph again). The diagnosis' ~30 variants of the
# generated 16,384-rank job (one boundary collective a step: 2 columns) are one round.
GROUP_CELLS = 8_000_000


class GroupSplitError(AnalysisError):
    """The run's graph cannot be replayed one pipeline group a task (unknown replicas, messages between them)."""


@dataclass(frozen=True)
class GroupReplayTask:
    """One pipeline group's part of the replay (plain values: picklable). ``graph``: the group's ranks' rows of the
    job's graph (edge indices renumbered); ``ops``/``edges``: its rows of the frames the variants read, in the
    plan's order; ``variants``: (work, gap, transfer) expressions over them (row by row, as the what-if's are); per
    step (in ``graph.steps``' order) the job's ratios per variant (rho; host: variants × the group's ranks), the
    ranks' starts per variant, and the step's boundary collectives (name → index)."""

    graph: StepGraph
    ops: pl.DataFrame
    edges: pl.DataFrame
    variants: tuple
    steps: tuple  # per step: (rho, host, starts, {collective name: c})


def _matrix(frame: pl.DataFrame, exprs: list):
    """Variants × rows of ``frame``: the expressions evaluated, as float64 (``replay.replay_variants``' matrix)."""
    import numpy as np

    if frame.height == 0:
        return np.zeros((len(exprs), 0))
    m = frame.select([x.cast(pl.Float64).alias(f"_{i}") for i, x in enumerate(exprs)]).to_numpy()
    return np.ascontiguousarray(m.T, dtype=np.float64)


def pipeline_groups(g: StepGraph) -> list[tuple[int, ...]]:
    """The graph's pipeline groups: each replica's ranks (``StepGraph.ranks``' replica), in replica order; one
    group when the job has one replica. GroupSplitError where a rank has no replica (its P2P messages were left
    unpaired or it has none: the pipelines are not known) or a message joins two replicas."""
    rr = g.ranks.select("rank", "replica").unique().sort("rank")
    if rr["replica"].null_count():
        if rr["replica"].null_count() == rr.height and g.edges.height == 0:
            return [tuple(rr["rank"].to_list())]  # (no P2P at all: one group, the whole job)
        raise GroupSplitError(
            "the run's pipeline replicas are not known (some P2P messages are unpaired, so the pipelines cannot be "
            "told apart): it cannot be replayed one pipeline group a task",
            fix="replay it in one process (drop --per-group)")
    replica = dict(rr.iter_rows())
    if g.edges.height:
        cross = g.edges.select(pl.col("src").replace_strict(replica, default=None).alias("a"),
                               pl.col("dst").replace_strict(replica, default=None).alias("b")
                               ).filter(pl.col("a") != pl.col("b")).height
        if cross:
            raise GroupSplitError(f"{cross} P2P messages go between pipeline replicas: the replicas are not "
                                  "independent pipelines and cannot be replayed one group a task",
                                  fix="replay it in one process (drop --per-group)")
    groups = rr.group_by("replica").agg(pl.col("rank").sort()).sort("replica")
    return [tuple(x) for x in groups["rank"].to_list()]


def boundary_collectives(g: StepGraph, groups: list[tuple[int, ...]]) -> dict[int, dict[str, int]]:
    """Per step the collectives whose members span groups (name → index, by name): the starts the groups' matrices
    are linear in."""
    of = {r: i for i, ranks in enumerate(groups) for r in ranks}
    c = (g.ops.filter(pl.col("group").is_not_null())
         .select("step", "group", pl.col("rank").replace_strict(of, default=None).alias("_g"))
         .group_by("step", "group").agg(pl.col("_g").n_unique().alias("n")).filter(pl.col("n") > 1)
         .sort("step", "group"))
    out: dict[int, dict[str, int]] = {s: {} for s in g.steps}
    for step, name in c.select("step", "group").iter_rows():
        out[step][name] = len(out[step])
    return out


def _group_graphs(g: StepGraph, groups: list[tuple[int, ...]]):
    """Each group's rows of the graph as a StepGraph of its own, edge indices (the step's message numbers in the
    replay's order: BLOCKING, AFTER_RECEIVE, LAG_WAIT) renumbered to the group's messages; one at a time."""
    of = {r: i for i, ranks in enumerate(groups) for r in ranks}
    gi = pl.col("rank").replace_strict(of, default=None).alias("_g")
    _, edges = _in_plan_order(g.ops.head(0), g.edges)
    edges = edges.with_columns(pl.int_range(pl.len()).over("step").cast(pl.Int32).alias("_old"),
                               pl.col("dst").replace_strict(of, default=None).alias("_g"))
    edges = edges.with_columns(pl.int_range(pl.len()).over("step", "_g").cast(pl.Int32).alias("_new"))
    ops = g.ops.with_columns(gi).partition_by("_g", as_dict=True, include_key=False)
    ranks = g.ranks.with_columns(gi).partition_by("_g", as_dict=True, include_key=False)
    per_edges = edges.partition_by("_g", as_dict=True, include_key=False)

    for k, ranks_k in enumerate(groups):
        e = per_edges.get((k,), edges.head(0).drop("_g"))
        new_of = e.select("step", "_old", "_new")
        e = e.drop("_old", "_new")
        yield ranks_k, StepGraph(
            ops=ops[(k,)], edges=e, ranks=ranks[(k,)], steps=g.steps, notes=(), unpaired=0,
            data_parallel=g.data_parallel,
            blocking=renumbered(g.blocking, new_of, ("edge",)),
            after_receive=renumbered(g.after_receive, new_of, ("edge", "via")),
            lag_wait=renumbered(g.lag_wait, new_of, ("edge",)),
            # (a GPU rank's lanes: its own operations, numbered as in the whole graph)
            after=None if g.after is None else g.after.filter(pl.col("rank").is_in(ranks_k)))


def group_task(task: GroupReplayTask) -> list | None:
    """In a worker: one group's max-plus matrices per step — (arrivals: (the boundary collectives it holds members
    of, their rows: those × columns, its latest member's ready time), ends: columns × the group's ranks, each one's
    last operation's end, unrounded), a column being (variant, k) with k = 0 the group's own starts and k = c + 1
    collective c's start (−∞: not reached from it). None where the group's graph is one the batched evaluator does
    not take (a cycle, chains too long: ``replay._levels``)."""
    try:
        return _group_matrices(task)
    finally:  # (the group's plan is not kept: in one process it would push the job's own plans out of the cache)
        replay._PLANS.pop(id(task.graph), None)


def _group_matrices(task: GroupReplayTask) -> list | None:
    import numpy as np

    g = task.graph
    work_all = _matrix(task.ops, [w for w, _, _ in task.variants])
    gap_all = _matrix(task.ops, [gp for _, gp, _ in task.variants])
    transfer_all = _matrix(task.edges, [t for _, _, t in task.variants])
    o_steps, e_steps = task.ops["step"].to_numpy(), task.edges["step"].to_numpy()
    out = []
    for step, (rho, host, starts, names) in zip(g.steps, task.steps):
        levels = _levels(g, step)
        if levels is None:
            return None
        oi, ei = np.flatnonzero(o_steps == step), np.flatnonzero(e_steps == step)
        work, gap, transfer = work_all[:, oi], gap_all[:, oi], transfer_all[:, ei]
        plan = _plan(g, step)
        n_c = len(names)
        k = n_c + 1
        cols = work.shape[0] * k
        unit = np.full((cols, max(n_c, 1)), -np.inf)
        for c in range(n_c):
            unit[c + 1::k, c] = 0.0
        free0 = np.full((cols, starts.shape[1]), -np.inf)
        free0[0::k] = starts
        # each level's boundary collectives: (their positions among the level's collectives, their indices)
        pos = {key: i for i, key in enumerate(plan["keys"])}
        gid: dict[str, int] = {}
        grp = np.full(len(plan["keys"]), -1, dtype=np.int64)
        for op, (name, _members) in plan["groups"].items():
            grp[pos[(op[1], op[2])]] = gid.setdefault(name, len(gid))
        c_of = np.full(len(gid) + 1, -1, dtype=np.int64)
        for name, i in gid.items():
            c_of[i] = names.get(name, -1)
        where = []
        for nodes, *_, gpos, g_starts, _counts, _folds in levels[1]:
            cs = c_of[grp[nodes[gpos[g_starts]]]] if gpos.size else np.zeros(0, dtype=np.int64)
            where.append((np.flatnonzero(cs >= 0), cs[cs >= 0]))
        arrivals = np.full((n_c, cols), -np.inf)

        def at_collective(i: int, joined, where=where, arrivals=arrivals, unit=unit):
            segs, cs = where[i]
            if segs.size:
                arrivals[cs] = joined[:, segs].T
                joined[:, segs] = unit[:, cs]
            return joined

        ends = _evaluate(levels, np.repeat(work, k, axis=0), np.repeat(gap, k, axis=0),
                         np.repeat(transfer, k, axis=0), run_host=None,
                         split=(np.repeat(rho, k), np.repeat(host, k, axis=0), free0, at_collective))
        member = np.flatnonzero(np.isfinite(arrivals).any(axis=1)) if n_c else np.zeros(0, dtype=np.int64)
        out.append(((member, arrivals[member]), ends))
    return out


def _step_facts(g: StepGraph) -> dict[int, dict]:
    """Per step what ``replay._plan`` gives the whole step (its ranks, their start offsets from the step's first
    start, tails, and the measured total rho divides), read from the frames without the plan's per-operation
    structures (the parent never builds the job's plan)."""
    o = g.ops.group_by("step").agg((pl.col("work_ns").sum() + pl.col("gap_ns").sum()).alias("_o"))
    e = g.edges.group_by("step").agg(pl.col("transfer_ns").sum().alias("_e"))
    tot = {s: int(a or 0) for s, a in o.iter_rows()}
    for s, b in e.iter_rows():
        tot[s] = tot.get(s, 0) + int(b or 0)
    out = {}
    for step in g.steps:
        win = g.ranks.filter(pl.col("step") == step).sort("rank")
        origin = int(win["start_ns"].min())
        out[step] = {"ranks": win["rank"].to_list(), "tail": win["tail_ns"].to_list(),
                     "offset": [float(x - origin) for x in win["start_ns"].to_list()],
                     "total0": float(tot.get(step, 0))}
    return out


def _order(arrival, n_c: int) -> list[int] | None:
    """The boundary collectives in dependency order (c after c' where c's arrival depends on s_c'); None on a
    cycle (the one-process engine has the same graph: it never occurs for a graph ``_levels`` orders)."""
    import numpy as np

    dep = [set(np.flatnonzero(np.isfinite(arrival[c, :, 1:]).any(axis=0)).tolist()) for c in range(n_c)]
    order, done = [], set()
    while len(order) < n_c:
        ready = [c for c in range(n_c) if c not in done and dep[c] <= done]
        if not ready:
            return None
        order += ready
        done.update(ready)
    return order


def replay_variants(g: StepGraph, ops: pl.DataFrame, edges: pl.DataFrame, variants: list, *, map=map,
                    check: bool = True, chunk: int = 64) -> list[list[int]] | None:
    """``replay.replay_variants`` one pipeline group a task (``map``, as ``measure.partitioned``'s: builtin ``map``
    or ``partitioned.dask_map(client)``): per variant the replayed step (ns) of every step of the graph. With
    ``check`` the first chunk also replays the graph's own durations and their double, which must give the
    engine's (``replay._check_measured``: EngineMismatch, a bug, if not). None where a group's graph is one the
    batched evaluator does not take (the caller replays in one process). GroupSplitError where the run does not
    split (``pipeline_groups``)."""
    got = rank_steps_variants(g, ops, edges, variants, map=map, check=check, chunk=chunk)
    return None if got is None else [[max(r) for r in v] for v in got]


def rank_steps_variants(g: StepGraph, ops: pl.DataFrame, edges: pl.DataFrame, variants: list, *, map=map,
                        check: bool = True, chunk: int = 64):
    """Per variant, per step, every rank's replayed step (ns; ranks in the step's order: by rank). The parent
    evaluates the variants' durations only to sum them (rho), ``chunk`` variants at a time within
    ``replay.VARIANT_CELLS`` as ``replay.replay_variants`` does; each group's task evaluates its own rows of them
    and replays all the variants at once."""
    import numpy as np

    if not variants:
        return []
    groups = pipeline_groups(g)
    names = boundary_collectives(g, groups)
    o_keys, e_keys = ["step", "rank", "seq"], ["step", *EDGE_ORDER]
    need_o = set(o_keys).union(*(x.meta.root_names() for w, gp, _ in variants for x in (w, gp)))
    need_e = set(e_keys).union(*(t.meta.root_names() for _, _, t in variants))
    o, e = _in_plan_order(ops.select([c for c in ops.columns if c in need_o]),
                          edges.select([c for c in edges.columns if c in need_e]))
    g_o, g_e = _in_plan_order(g.ops.select(*o_keys, "work_ns", "gap_ns"), g.edges.select(*e_keys, "transfer_ns"))
    if not (o.select(o_keys).equals(g_o.select(o_keys)) and e.select(e_keys).equals(g_e.select(e_keys))):
        raise ValueError("group_replay.replay_variants was given frames that are not the graph's own rows")
    o = o.with_columns(g_o["work_ns"].alias("_own_work"), g_o["gap_ns"].alias("_own_gap"))
    e = e.with_columns(g_e["transfer_ns"].alias("_own_transfer"))
    del g_o, g_e
    probes = ([(pl.col("_own_work") * k, pl.col("_own_gap") * k, pl.col("_own_transfer") * k) for k in (1, 2)]
              if check else [])
    rows = [*probes, *variants]
    facts = _step_facts(g)
    o_steps, e_steps = o["step"].to_numpy(), e["step"].to_numpy()
    o_idx = {step: np.flatnonzero(o_steps == step) for step in g.steps}
    e_idx = {step: np.flatnonzero(e_steps == step) for step in g.steps}
    of = {r: i for i, ranks in enumerate(groups) for r in ranks}
    r_grp = {step: np.array([of[r] for r in facts[step]["ranks"]], dtype=np.int64) for step in g.steps}
    gi = pl.col("rank").replace_strict(of, default=None).alias("_g")
    o_parts = o.with_columns(gi).partition_by("_g", as_dict=True, include_key=False)
    e_parts = e.with_columns(pl.col("dst").replace_strict(of, default=None).alias("_g")).partition_by(
        "_g", as_dict=True, include_key=False)
    e_empty = e.head(0)
    # variants a round: the parent's rho matrices within VARIANT_CELLS (as replay_variants'), the groups' end and
    # arrival matrices it holds (ranks × columns) within GROUP_CELLS
    width = max(len(facts[s_]["ranks"]) * (len(names[s_]) + 1) for s_ in g.steps)
    chunk = max(1, min(chunk, VARIANT_CELLS // max(ops.height, edges.height, 1)))
    per_round = max(1, GROUP_CELLS // max(width, 1))
    got_all: list[list] = [[] for _ in g.steps]  # per step: variants × ranks
    for r0 in range(0, len(rows), per_round):
        part_rows = rows[r0:r0 + per_round]
        got = _round(g, groups, names, facts, o, e, o_idx, e_idx, r_grp, o_parts, e_parts, e_empty, part_rows,
                     chunk, map)
        if got is None:
            return None
        for si, x in enumerate(got):
            got_all[si].append(x)
    got = [np.concatenate(x, axis=0) for x in got_all]
    if check:
        _check_measured(g, [s_[0] for s_ in got], [s_[1] for s_ in got])
        got = [s_[2:] for s_ in got]
    return [[s_[i].tolist() for s_ in got] for i in range(len(variants))]


def _round(g, groups, names, facts, o, e, o_idx, e_idx, r_grp, o_parts, e_parts, e_empty, rows, chunk, map):
    """One round of ``rank_steps_variants``: ``rows`` (variants) through every group's task; per step variants ×
    ranks, or None (a group's graph the batched evaluator does not take; a cycle among the collectives)."""
    import numpy as np

    v = len(rows)
    # the step-wide figures, on the whole job, in replay._evaluate's order of additions: rho (a chunk of variants'
    # durations at a time, then let go), each rank's host ratio (replay._run_host: sums per rank), the starts
    rho = {step: np.empty(v) for step in g.steps}
    for c0 in range(0, v, chunk):
        part = rows[c0:c0 + chunk]
        work, gap = _matrix(o, [w for w, _, _ in part]), _matrix(o, [gp for _, gp, _ in part])
        transfer = _matrix(e, [t for _, _, t in part])
        for step in g.steps:
            oi, ei, total0 = o_idx[step], e_idx[step], facts[step]["total0"]
            rho[step][c0:c0 + len(part)] = ((work[:, oi].sum(axis=1) + gap[:, oi].sum(axis=1)
                                             + transfer[:, ei].sum(axis=1)) / total0 if total0 > 0
                                            else np.ones(len(part)))
        del work, gap, transfer
    run_host = _run_host(g, o, [gp for _, gp, _ in rows])
    per_step = {}
    for step in g.steps:
        f = facts[step]
        sums, h0 = _host_columns(run_host, f["ranks"], v)
        host = np.where(h0[None, :] > 0, sums / np.where(h0 > 0, h0, 1.0)[None, :], rho[step][:, None])
        starts = np.round(np.array(f["offset"])[None, :] * rho[step][:, None])
        per_step[step] = (host, starts)
    del run_host

    def tasks():
        for k, (_ranks, sub) in enumerate(_group_graphs(g, groups)):
            parts = []
            for step in g.steps:
                host, starts = per_step[step]
                dk = np.flatnonzero(r_grp[step] == k)
                parts.append((rho[step], host[:, dk], starts[:, dk], names[step]))
            yield GroupReplayTask(graph=sub, ops=o_parts[(k,)], edges=e_parts.get((k,), e_empty),
                                  variants=tuple(rows), steps=tuple(parts))

    # the groups' results folded as they come: the arrivals' element-wise max, each group's ends kept
    arrival = {step: np.full((len(names[step]), v * (len(names[step]) + 1)), -np.inf) for step in g.steps}
    ends: list[list] = []
    for res in map(group_task, tasks()):
        if res is None:
            return None
        for si, step in enumerate(g.steps):
            cs, arr = res[si][0]
            if cs.size:
                arrival[step][cs] = np.maximum(arrival[step][cs], arr)
        ends.append([x[1] for x in res])
    got = []
    for si, step in enumerate(g.steps):
        n_c = len(names[step])
        k = n_c + 1
        arr = arrival[step].reshape(n_c, v, k)
        order = _order(arr, n_c)
        if order is None:
            return None
        s = np.full((v, k), -np.inf)
        s[:, 0] = 0.0
        for c in order:  # a collective's start: its latest member's, over every group (s_c after what it awaits)
            s[:, c + 1] = (arr[c] + s).max(axis=1)
        end = np.empty((v, len(facts[step]["ranks"])))
        for kk, e_k in enumerate(ends):
            dk = np.flatnonzero(r_grp[step] == kk)
            end[:, dk] = (e_k[si].reshape(v, k, dk.size) + s[:, :, None]).max(axis=1)
        host, starts = per_step[step]
        tail = np.array(facts[step]["tail"], dtype=np.float64)
        got.append(np.round(end).astype(np.int64) + np.round(tail[None, :] * host).astype(np.int64)
                   - starts.astype(np.int64))
    return got


def rank_steps_ns(g: StepGraph, *, map=map) -> list[list[int]] | None:
    """The graph's own durations replayed one group a task: per step every rank's replayed step (ns, by rank), the
    engine's (``replay.replay``'s ``ranks.step_ns``) to the nanosecond. None as ``replay_variants``."""
    got = rank_steps_variants(g, g.ops, g.edges, [(pl.col("work_ns"), pl.col("gap_ns"), pl.col("transfer_ns"))],
                              map=map, check=False)
    return None if got is None else got[0]


def replay_steps_ns(g: StepGraph, *, map=map) -> list[int]:
    """``replay.replay_steps_ns`` (every step's replayed step, ns) one group a task; in one process where a group's
    graph is one the batched evaluator does not take."""
    got = rank_steps_ns(g, map=map)
    return _engine_steps_ns(g) if got is None else [max(r) for r in got]
