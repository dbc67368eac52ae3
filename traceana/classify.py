"""A kind per event (schema.KINDS), plus the columns later stages need: P2P direction and channel, the launch
time of GPU work, pipeline-annotation fields, and the step each event belongs to.

Rules (ARCHITECTURE.md "Classification and attribution", FIELD-NOTES.md):
- GPU: NCCL kernels (``ncclDevKernel_*``, ``ncclKernel_*``) are communication; a SendRecv kernel is P2P when the
  cpu op that launched it (same External id) is a send/recv, else a collective (all_to_all also runs SendRecv
  kernels). Other kernels are compute; memcpy/memset keep their own kinds.
- CPU: ``c10d::send`` / ``c10d::recv_`` / ``nccl:send|recv`` / ``record_param_comms`` with a send/recv name are P2P
  posts; ``gloo:send`` / ``gloo:recv`` spans run from the post to the return of wait() (they break nesting);
  any other ``c10d::`` / ``gloo:`` / ``nccl:`` op and other record_param_comms are collectives.
- BPipe: communication and compute inside our EVICT/LOAD/ACCEPT/RETURN spans, or on the BPipe process group, is
  ``bpipe_transfer`` (channel "bpipe"); its P2P direction is kept in ``comm_dir``.
"""

from __future__ import annotations

import polars as pl

from traceana import intervals as iv
from traceana import names
from traceana.schema import Kind

# Columns classify adds to schema.EVENTS.
CLASSIFIED = {
    "kind": Kind,
    "comm_dir": pl.String,  # "send" | "recv" for P2P posts, spans and kernels
    "channel": pl.String,  # "p2p" | "bpipe" for P2P traffic
    "launch_ns": pl.Int64,  # GPU work: start of the cuda_runtime call that launched it; CPU: ts_ns
    "pp_stage": pl.Int32,
    "pp_action": pl.String,
    "pp_microbatch": pl.Int32,
}

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "hip_runtime", "runtime")
_CPU_OP_CATS = ("cpu_op", "operator", "python_function")


def _starts_with_any(col: pl.Expr, prefixes: tuple[str, ...]) -> pl.Expr:
    out = pl.lit(False)
    for p in prefixes:
        out = out | col.str.starts_with(p)
    return out


def _cpu_comm_dir(name: pl.Expr, coll: pl.Expr) -> pl.Expr:
    coll_l = coll.str.to_lowercase()
    is_send = name.is_in([names.C10D_SEND, names.NCCL_SEND, names.GLOO_SEND]) | (
        (name == names.RECORD_PARAM_COMMS) & coll_l.is_in(["send", "isend"])
    )
    is_recv = name.is_in([names.C10D_RECV, names.NCCL_RECV, names.GLOO_RECV]) | (
        (name == names.RECORD_PARAM_COMMS) & coll_l.is_in(["recv", "irecv"])
    )
    return pl.when(is_send).then(pl.lit("send")).when(is_recv).then(pl.lit("recv"))


def _lookup(frame: pl.DataFrame, table: pl.DataFrame, on: list[str]) -> list[pl.Series]:
    """The columns of ``table`` (unique on ``on``) for every row of ``frame``, in ``frame``'s order (null: none)."""
    out = frame.select(on).join(table, on=on, how="left", maintain_order="left").drop(on)
    assert out.height == frame.height, "lookup table keys must be unique"
    return out.get_columns()


def classify(events: pl.DataFrame) -> pl.DataFrame:
    """Add ``CLASSIFIED`` columns to an EVENTS frame (no step yet; see ``timeline.assign_steps``)."""
    name, cat = pl.col("name"), pl.col("cat")
    is_nccl_kernel = (cat == "kernel") & _starts_with_any(name, names.NCCL_KERNEL_PREFIXES)
    # Names repeat a lot: parse the PP: annotation names once per distinct name, not once per event.
    pp = (
        events.filter(~pl.col("is_gpu") & (cat == "user_annotation")).select("name").unique()
        .with_columns(**names.pp_columns(name)).filter(pl.col("pp_action").is_not_null())
        .with_columns(pl.lit(True).alias("_pp"))
    )
    # Lookups join a narrow frame of keys (order kept) and stack the looked-up columns beside the events: joining
    # the whole table would gather every one of its columns again (measured: 2-3x slower on 450k events).
    ev = (
        events.hstack(_lookup(events, pp, ["name"]))
        .with_columns(
            _cpu_comm_dir(name, pl.col("coll")).alias("_cpu_dir"),
            # Pipeline annotations are CPU-side record_function ranges (their GPU mirrors are ignored).
            *(pl.when(pl.col("_pp") & ~pl.col("is_gpu") & (cat == "user_annotation")).then(pl.col(k)).alias(k)
              for k in ("pp_stage", "pp_action", "pp_microbatch")),
        )
        .drop("_pp")
    )
    # GPU work: the cpu op that launched it (same External id) and the launch call (same correlation id).
    # Grouped without first narrowing to the ids GPU events carry: the lookup picks those, and a semi-join costs
    # more than it saves (a GPU run launches nearly every id); a CPU-only run skips both.
    any_gpu = bool(ev["is_gpu"].any())
    cpu_by_ext = (
        ev.filter(pl.lit(any_gpu) & ~pl.col("is_gpu") & pl.col("ext_id").is_not_null() & (pl.col("ext_id") != 0)
                  & cat.is_in(["cpu_op", "user_annotation"]))
        .group_by("rank", "ext_id")
        .agg(pl.col("_cpu_dir").drop_nulls().first().alias("_launch_dir"),
             pl.col("coll").drop_nulls().first().alias("_launch_coll"),
             pl.col("peer").drop_nulls().first().alias("_launch_peer"),
             pl.col("nbytes").drop_nulls().first().alias("_launch_nbytes"),
             pl.col("pg").drop_nulls().first().alias("_launch_pg"))
    )
    launches = (
        ev.filter(pl.lit(any_gpu) & cat.is_in(_RUNTIME_CATS) & pl.col("corr_id").is_not_null()
                  & (pl.col("corr_id") != 0))
        .group_by("rank", "corr_id")
        .agg(pl.col("ts_ns").min().alias("_launch_ts"))
    )
    ev = (
        ev.hstack(_lookup(ev, cpu_by_ext, ["rank", "ext_id"]) + _lookup(ev, launches, ["rank", "corr_id"]))
        .with_columns(
            pl.when(pl.col("is_gpu")).then(pl.coalesce("peer", "_launch_peer")).otherwise("peer").alias("peer"),
            pl.when(pl.col("is_gpu")).then(pl.coalesce("nbytes", "_launch_nbytes")).otherwise("nbytes")
            .alias("nbytes"),
            pl.when(pl.col("is_gpu")).then(pl.coalesce("pg", "_launch_pg")).otherwise("pg").alias("pg"),
            pl.when(pl.col("is_gpu")).then(pl.coalesce("_launch_ts", "ts_ns")).otherwise("ts_ns")
            .alias("launch_ns"),
        )
    )
    gpu_dir = pl.when(is_nccl_kernel).then(pl.col("_launch_dir"))
    comm_dir = pl.when(pl.col("is_gpu")).then(gpu_dir).otherwise(pl.col("_cpu_dir"))
    is_cpu_coll = (~pl.col("is_gpu")) & pl.col("_cpu_dir").is_null() & (
        _starts_with_any(name, (names.C10D_PREFIX, names.GLOO_PREFIX, names.NCCL_OP_PREFIX))
        | (name == names.RECORD_PARAM_COMMS)
    )
    kind = (
        pl.when(~pl.col("is_gpu") & name.str.contains(names.STEP_PATTERN)).then(pl.lit("step"))
        .when(comm_dir == "send").then(pl.lit("p2p_send"))
        .when(comm_dir == "recv").then(pl.lit("p2p_recv"))
        .when(is_nccl_kernel | is_cpu_coll).then(pl.lit("collective"))
        .when(cat == "kernel").then(pl.lit("compute"))
        .when(cat == "gpu_memcpy").then(pl.lit("memcpy"))
        .when(cat == "gpu_memset").then(pl.lit("memset"))
        .when(cat.is_in(_RUNTIME_CATS)).then(pl.lit("runtime"))
        .when(cat.is_in(["user_annotation", "gpu_user_annotation"])).then(pl.lit("annotation"))
        .when(cat.is_in(_CPU_OP_CATS)).then(pl.lit("compute"))
        .otherwise(pl.lit("other"))
    )
    ev = ev.with_columns(kind.cast(Kind).alias("kind"), comm_dir.alias("comm_dir"))
    ev = _mark_bpipe(ev)
    return ev.drop("_cpu_dir", "_launch_dir", "_launch_coll", "_launch_peer", "_launch_nbytes", "_launch_pg",
                   "_launch_ts")


def bpipe_spans(events: pl.DataFrame) -> pl.DataFrame:
    """Merged EVICT/LOAD/ACCEPT/RETURN annotation spans per rank: ``rank, start, end``."""
    return iv.merge(
        events.filter(pl.col("pp_action").is_in(list(names.BPIPE_ACTIONS)))
        .select("rank", pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")),
        "rank",
    )


def inside(points: pl.DataFrame, at: str, spans: pl.DataFrame, *, by: str = "rank") -> pl.Series:
    """Boolean per row of ``points``: is ``points[at]`` inside one of the (merged, non-overlapping) ``spans``?"""
    if spans.height == 0:
        return pl.repeat(False, points.height, dtype=pl.Boolean, eager=True).alias("inside")
    return iv.containing(points, at, spans, by=by, columns=["start"])["start"].is_not_null().alias("inside")


def _mark_bpipe(ev: pl.DataFrame) -> pl.DataFrame:
    spans = bpipe_spans(ev)
    on_group = pl.col("pg").is_not_null() & pl.col("pg").str.contains(names.BPIPE_GROUP_DESC, literal=True)
    in_span = inside(ev, "launch_ns", spans)
    movable = pl.col("kind").is_in(["p2p_send", "p2p_recv", "compute", "memcpy", "collective"])
    is_bpipe = (pl.lit(in_span) | on_group) & movable
    return ev.with_columns(
        pl.when(is_bpipe).then(pl.lit("bpipe_transfer").cast(Kind)).otherwise("kind").alias("kind"),
        pl.when(pl.col("comm_dir").is_null()).then(None)
        .when(is_bpipe).then(pl.lit("bpipe")).otherwise(pl.lit("p2p")).alias("channel"),
    )
