"""The OSDI 2025 what-if study's three jobs through traceana's what-if: its artifact's op tables
(github.com/ByteDance-Seed/StragglerAnalysis, ``data/trace-{AR,SE,ST}.parquet``, Apache-2.0; not copied here) read
into traceana's step graph (traceana.causal.graph.StepGraph), and the study's figures (``data/result-*.json``,
``ms-*.json``, ``mw-*.json``) printed beside traceana's.

    python tests/benchmarks/osdi_artifact.py ARTIFACT_DIR [AR ST SE]   (ARTIFACT_DIR: a checkout of the artifact)

The graph, as the artifact's dependency model has it (analyzer/dependency_model.py): every rank's compute
(forward-compute F, backward-compute B, optimizer O) and collectives in start order; a P2P message from the
sender's k-th compute of its kind to the receiver's k-th (the k-th valid send of stage s with the k-th valid
receive of stage s ± 1 in its replica: a receive posted after its stage's last compute of that kind, or a send
ended before its first, is one of the profiler's no-ops), anchored at the receiver's operation before the receive
was posted, in flight from both sides posted to the receive's end (or its consumer's start, if earlier); params-all-gather, grads-reduce-scatter and
separate-grads-all-reduce among the stage's replicas, embedding-grads-all-reduce between the first and the last
stage of a replica, optimizer-clip-main-grad among every rank (the artifact's label_dp_sync) (a collective's work: its end less the last
member's start, the artifact's transfer_duration); an operation's gap: its start less the later of its rank's
previous end and its inputs' arrival (the artifact's launch delay)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from traceana.causal import graph  # noqa: E402
from traceana.causal.whatif import whatif  # noqa: E402

NS = 1e9
COMPUTE = {"forward-compute": "F", "backward-compute": "B", "optimizer": "O"}
DP_SYNC = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")
PER_REPLICA = ("embedding-grads-all-reduce",)
EVERY_RANK = ("optimizer-clip-main-grad",)  # the artifact's label_dp_sync: among a replica's stages and every replica
SINGLE = ("layernorm-grads-all-reduce",)


def step_graph(trace: Path, *, launch_delays: bool = True) -> graph.StepGraph:
    """The artifact's op table as a step graph; ``launch_delays`` False: every gap 0, the study's own convention
    (its S, decompositions, M_S and M_W are all computed on the replay without launch delays, step_t_nodelay)."""
    d = (pl.read_parquet(trace).with_columns(pl.col("optype").cast(pl.String))
         .filter(pl.col("optype") != "gc")
         .with_columns((pl.col("start_ts").cast(pl.Float64) * NS).round().cast(pl.Int64).alias("s"),
                       ((pl.col("start_ts").cast(pl.Float64) + pl.col("duration").cast(pl.Float64)) * NS)
                       .round().cast(pl.Int64).alias("e"),
                       pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int32),
                       pl.col("stage").cast(pl.Int32), pl.col("dp_rank").cast(pl.Int32)))
    pp = int(d["stage"].max()) + 1
    ops = d.filter(pl.col("optype").is_in([*COMPUTE, *DP_SYNC, *PER_REPLICA, *EVERY_RANK, *SINGLE]))
    scope = (pl.when(pl.col("optype").is_in(DP_SYNC)).then(pl.lit("dp ") + pl.col("stage").cast(pl.String))
             .when(pl.col("optype").is_in(PER_REPLICA)).then(pl.lit("mp ") + pl.col("dp_rank").cast(pl.String))
             .when(pl.col("optype").is_in(EVERY_RANK)).then(pl.lit("all")))
    ops = (ops.with_columns(
        pl.when(pl.col("optype").is_in(list(COMPUTE))).then(pl.col("optype").replace_strict(COMPUTE, default=None))
        .otherwise(pl.lit("C")).alias("action"),
        pl.when(scope.is_not_null()).then(pl.concat_str(pl.col("step").cast(pl.String), scope, "optype",
                                                         pl.col("seq_id").cast(pl.String), separator="|"))
        .alias("group"))
        .sort("rank", "step", "s", "e")
        .with_columns(pl.int_range(pl.len()).over("rank", "step").cast(pl.Int32).alias("seq")))
    # a collective's work: its end less its last member's start
    ops = ops.with_columns(pl.when(pl.col("group").is_not_null())
                           .then((pl.col("e") - pl.col("s").max().over("group")).clip(lower_bound=0))
                           .otherwise(pl.col("e") - pl.col("s")).alias("work_ns"),
                           pl.col("group").count().over("group").cast(pl.Int32).alias("members"))
    edges = _messages(d, ops, pp)
    # the gap: start less the later of the previous end and the inputs' arrival
    arrive = (edges.join(ops.select(pl.col("rank").alias("src"), "step", pl.col("seq").alias("src_seq"),
                                    pl.col("e").alias("_pe")), on=["src", "step", "src_seq"])
              .join(ops.select(pl.col("rank").alias("dst"), "step", pl.col("seq").alias("anchor_seq"),
                               pl.col("e").alias("_ae")), on=["dst", "step", "anchor_seq"], how="left")
              .with_columns((pl.max_horizontal(pl.col("_pe") + pl.col("send_lag_ns"),
                                               pl.col("_ae").fill_null(0) + pl.col("post_lag_ns"))
                             + pl.col("transfer_ns")).alias("_arr"))
              .group_by(pl.col("dst").alias("rank"), "step", pl.col("dst_seq").alias("seq"))
              .agg(pl.col("_arr").max()))
    ops = (ops.join(arrive, on=["rank", "step", "seq"], how="left")
           .with_columns(pl.col("e").shift(1).over("rank", "step").alias("_prev"))
           .with_columns(pl.max_horizontal(pl.col("_prev"), pl.col("_arr")).alias("_ready"))
           .with_columns((pl.col("s") - pl.col("_ready").fill_null(pl.col("s"))).alias("_g")))
    ops = ops.with_columns(pl.col("_g").clip(lower_bound=0).alias("gap_ns"),
                           (pl.col("_g") < -graph.ARRIVAL_SLACK_NS).alias("contradicted"))
    o = ops.select("rank", "step", "seq", "action", pl.col("optype").alias("phase"), "stage",
                   pl.col("mb_id").cast(pl.Int32).alias("microbatch"), pl.col("s").alias("start_ns"),
                   pl.col("e").alias("end_ns"), "work_ns", "gap_ns", "group", "members",
                   pl.lit("osdi").alias("source"), "contradicted").cast(graph.OPS)
    o = o.with_columns(pl.when(pl.col("microbatch") < 0).then(None).otherwise("microbatch").alias("microbatch"))
    ranks = (ops.group_by("rank", "step").agg(pl.col("s").min().alias("start_ns"),
                                             pl.col("e").max().alias("end_ns"), pl.col("stage").first(),
                                             pl.col("dp_rank").first().alias("replica"))
             .with_columns(pl.lit(0, pl.Int64).alias("tail_ns")).select(list(graph.RANK_STEPS))
             .cast(graph.RANK_STEPS).sort("step", "rank"))
    # every rank starts its step when the step's first operation did (the artifact's step start)
    ranks = ranks.with_columns(pl.col("start_ns").min().over("step").alias("start_ns"))
    first = o.join(ranks.select("rank", "step", pl.col("start_ns").alias("_w")), on=["rank", "step"])
    o = first.with_columns(pl.when(pl.col("seq") == 0).then(pl.col("start_ns") - pl.col("_w"))
                           .otherwise("gap_ns").alias("gap_ns")).drop("_w")
    if not launch_delays:
        o = o.with_columns(pl.lit(0, pl.Int64).alias("gap_ns"))
    return graph.StepGraph(ops=o, edges=edges.select(list(graph.EDGES)).cast(graph.EDGES), ranks=ranks,
                           steps=tuple(sorted(o["step"].unique().to_list())))


def _messages(d: pl.DataFrame, ops: pl.DataFrame, pp: int) -> pl.DataFrame:
    comp = ops.filter(pl.col("action").is_in(["F", "B"]))
    comp = comp.with_columns(pl.int_range(pl.len()).over("rank", "step", "action").alias("k"))
    rows = []
    for kind, a, delta in (("forward", "F", 1), ("backward", "B", -1)):
        c = comp.filter(pl.col("action") == a)
        bounds = c.group_by("rank", "step").agg(pl.col("s").max().alias("_last_s"),
                                                pl.col("e").min().alias("_first_e"))
        sends = (d.filter(pl.col("optype") == f"{kind}-send").join(bounds, on=["rank", "step"])
                 .filter(pl.col("e") >= pl.col("_first_e") - 500_000).sort("rank", "step", "s")
                 .with_columns(pl.int_range(pl.len()).over("rank", "step").alias("k")))
        recvs = (d.filter(pl.col("optype") == f"{kind}-recv").join(bounds, on=["rank", "step"])
                 .filter(pl.col("s") <= pl.col("_last_s") + 500_000).sort("rank", "step", "s")
                 .with_columns(pl.int_range(pl.len()).over("rank", "step").alias("k")))
        # the receiver: the same replica, the next (forward) or previous (backward) stage
        sends = sends.with_columns((pl.col("stage") + delta).alias("peer_stage"))
        recvs = recvs.with_columns(pl.col("stage").alias("peer_stage"))
        pair = sends.join(recvs, on=["step", "dp_rank", "peer_stage", "k"], suffix="_r")
        if pair.height == 0:
            continue
        # the stage's k-th compute of the kind makes it (sender), the receiver's k-th needs it; the receiver's
        # operation before the receive was posted anchors it
        prod = c.select(pl.col("rank").alias("src"), "step", "k", pl.col("seq").alias("src_seq"),
                        pl.col("e").alias("_pe"))
        cons = c.select(pl.col("rank").alias("dst"), "step", "k", pl.col("seq").alias("dst_seq"),
                        pl.col("s").alias("_cs"))
        m = (pair.select(pl.col("rank").alias("src"), pl.col("rank_r").alias("dst"), "step", "k",
                         pl.col("s").alias("_ss"), pl.col("s_r").alias("_rs"), pl.col("e_r").alias("_re"))
             .join(prod, on=["src", "step", "k"]).join(cons, on=["dst", "step", "k"]))
        anchors = (ops.select(pl.col("rank").alias("dst"), "step", pl.col("seq").alias("anchor_seq"),
                              pl.col("s").alias("_as"), pl.col("e").alias("_ae")).sort("_as"))
        m = m.sort("_rs").join_asof(anchors, left_on="_rs", right_on="_as", by=["dst", "step"],
                                    strategy="backward", check_sortedness=False)
        rows.append(m.select(
            "step", pl.lit("p2p").alias("channel"), "src", "src_seq", "dst", "dst_seq", "anchor_seq",
            (pl.col("_ss") - pl.col("_pe")).clip(lower_bound=0).alias("send_lag_ns"),
            (pl.col("_rs") - pl.col("_ae").fill_null(pl.col("_rs"))).clip(lower_bound=0).alias("post_lag_ns"),
            # in flight from both sides posted until the receive ended, or its consumer began if earlier (the
            # receive's span on its own stream can end after the compute that needed it started)
            (pl.min_horizontal("_re", "_cs") - pl.max_horizontal("_ss", "_rs")).clip(lower_bound=0)
            .alias("transfer_ns")))
    return pl.concat(rows).cast({k: v for k, v in graph.EDGES.items()})


def main(root: Path, jobs: list[str]) -> None:
    for job, delays in [(j, d) for j in jobs for d in (True, False)]:
        g = step_graph(root / "data" / f"trace-{job}.parquet", launch_delays=delays)
        w = whatif(SimpleNamespace(run=SimpleNamespace(path=f"osdi {job}")), graph=g)
        s = w.summary
        res = json.loads((root / "data" / f"result-{job}.json").read_text())
        ms_ = json.loads((root / "data" / f"ms-{job}.json").read_text())
        mw = json.loads((root / "data" / f"mw-{job}.json").read_text())

        def top(grp):
            t = w.groups.filter((pl.col("group") == grp) & pl.col("slowdown").is_not_null()).sort(
                "slowdown", descending=True)
            return f"{t['id'][0]} ({t['slowdown'][0]:.3f})" if t.height else "–"

        def ptop(key):
            v = res.get(key) or {}
            k = max(v, key=v.get) if v else None
            return f"{k} ({v[k]:.3f})" if k is not None else "–"

        r0 = w.groups.filter((pl.col("group") == "rank") & (pl.col("id") == "0")).row(0, named=True)
        print(f"{job} ({'launch delays as host gaps' if delays else 'launch delays 0, as the study'}): "
              f"{g.ops.height} operations, {g.edges.height} messages, {len(g.steps)} steps, "
              f"{int(g.ops['contradicted'].sum())} contradicted")
        print(f"  traceana: step {s['replayed_step_ms'] / 1e3:.3f} s (measured {s['measured_step_ms'] / 1e3:.3f}), "
              f"ideal {s['ideal_step_ms'] / 1e3:.3f} s, S {s['slowdown']:.3f}, S host 0 "
              f"{s['slowdown_without_host']:.3f}, top stage {top('stage')}, top replica {top('replica')}, "
              f"top kind {top('kind')}, M_S {s['m_s']}, M_W {s['m_w']} (ranks {s['m_w_ranks']}), rank 0 made ideal "
              f"{r0['if_ideal_step_ms'] / 1e3:.3f} s, at its peers' speed {r0['if_peers_step_ms'] / 1e3:.3f} s; "
              f"within-stage slowdown {s['within_stage']['slowdown']:.3f}; {s['diagnosis']}")
        base = sum(res["step_t_nodelay"].values()) / len(res["step_t_nodelay"])
        ideal = sum(res["step_t_noblk"].values()) / len(res["step_t_noblk"])
        print(f"  the study: step {base:.3f} s (no launch delay), ideal {ideal:.3f} s, "
              f"S {res['blocking_slowdown']:.3f}, "
              f"top stage {ptop('blocking_decompose_by_stage')}, top replica {ptop('blocking_decompose_by_dp_rank')}, "
              f"top kind {ptop('blocking_decompose_by_optype')}, M_S {ms_['Ms']:.3f}, M_W {mw['Mw']:.3f} "
              f"(t_rem {mw['trem']:.3f} s)")
        for n in w.notes:
            print("  note:", n)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["ST", "AR", "SE"])
