"""Every table traceana passes between stages, declared once and checked at boundaries.

Times are int64 nanoseconds on the trace's wall clock (Kineto µs floats are converted once, at ingest).
Sparse columns are null where they do not apply.
"""

from __future__ import annotations

import polars as pl

from traceana.core.errors import TraceanaError

# Event kinds assigned by traceana.measure.classify.
KINDS = (
    "compute", "p2p_send", "p2p_recv", "bpipe_transfer", "collective", "memcpy", "memset",
    "annotation", "step", "runtime", "other",
    "p2p_call",  # a framework's P2P helper (its Python frame, by a name rule): host time inside it is P2P's
)
Kind = pl.Enum(list(KINDS))

# Attribution categories of one (rank, step): disjoint, summing to the step's wall time.
CATEGORIES = (
    "forward", "backward", "backward_input", "backward_weight", "recompute", "optimizer", "other_compute",
    "p2p", "bpipe", "collective",
    "bubble_warmup", "bubble_cooldown", "bubble_stall", "host",
)
Category = pl.Enum(list(CATEGORIES))
COMPUTE_CATEGORIES = CATEGORIES[:7]
BUBBLE_CATEGORIES = ("bubble_warmup", "bubble_cooldown", "bubble_stall")
BLOCKED_CATEGORIES = (*BUBBLE_CATEGORIES, "p2p")  # "blocked": the bubble plus exposed P2P
# What every table, legend and hover calls each category (the CLI's tables and the report's alike).
CATEGORY_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "backward_input": "backward: input gradients (I)",
    "backward_weight": "backward: weight gradients (W)",
    "recompute": "recompute",
    "optimizer": "optimizer",
    "other_compute": "other compute",
    "p2p": "P2P (exposed)",
    "bpipe": "BPipe transfer (exposed)",
    "collective": "collective (exposed)",
    "bubble_warmup": "bubble: warm-up",
    "bubble_stall": "bubble: stall",
    "bubble_cooldown": "bubble: cool-down",
    "host": "host / unexplained idle",
}

# --- ingest ------------------------------------------------------------------------------------------------------
# One row per complete ("X") trace event. GPU events (kernels, memcpy, memset, gpu annotations) have device/stream.
# The text columns with few distinct values (threads, tracks, categories, collectives, groups) are pl.Categorical:
# 4 bytes per event instead of a 16-byte string view (docs/performance.md "Memory"). polars' categories are one
# global mapping, so frames of different ranks concat and join on them, and a filter by a literal works as on text;
# string functions (.str.*) and joins with a String column need .cast(pl.String) first. ``name`` is categorical
# too (a few hundred distinct names in a million events): a test of its text runs once per distinct name
# (names.name_test) or on a few rows' text (names.text), never as a string per event.
EVENTS = {
    "rank": pl.Int32,
    "pid": pl.Categorical(),  # OS pid as text (Kineto also uses strings such as "Spans")
    "tid": pl.Categorical(),
    "track": pl.Categorical(),  # "cpu:{pid}:{tid}" or "gpu:{device}:{stream}"
    "is_gpu": pl.Boolean,
    "cat": pl.Categorical(),  # Kineto category: cpu_op, user_annotation, kernel, gpu_memcpy, cuda_runtime, …
    "name": pl.Categorical(),
    "ts_ns": pl.Int64,
    "dur_ns": pl.Int64,
    "corr_id": pl.Int64,  # args.correlation (GPU op ↔ runtime launch)
    "ext_id": pl.Int64,  # args["External id"] (GPU op / launch ↔ cpu_op)
    "device": pl.Int32,
    "stream": pl.Int32,
    "peer": pl.Int32,  # P2P peer rank (c10d Concrete Inputs[2], or record_param_comms src/dst)
    "tag": pl.Int32,  # P2P tag (c10d Concrete Inputs[3])
    "nbytes": pl.Int64,  # message size where the trace says it
    "coll": pl.Categorical(),  # record_param_comms "Collective name" (send, recv, allreduce, …)
    "pg": pl.Categorical(),  # process group name or description, where the trace says it
}

# One row per allocator instant ("[memory]").
MEMORY = {
    "rank": pl.Int32,
    "ts_ns": pl.Int64,
    "device": pl.Int32,  # -1 = CPU
    "allocated_bytes": pl.Int64,
    "delta_bytes": pl.Int64,
    # the block's address (args "Addr"): an allocation and its free share it (traceana.measure.memory pairs them); null
    # where the trace has none (older torch, hand-written traces)
    "addr": pl.Int64,
}

# One row per trace file (rank).
TRACES = {
    "rank": pl.Int32,
    "path": pl.String,
    "world_size": pl.Int32,
    "backend": pl.String,
    "base_time_ns": pl.Int64,
    "n_events": pl.Int64,
    "n_bytes": pl.Int64,  # raw (uncompressed) JSON bytes
    "truncated": pl.Boolean,
    "stage": pl.Int32,  # from the trace's own traceana metadata, if a collector wrote it
    "rank_source": pl.String,  # distributedInfo | traceana_meta | filename | single
    "devices": pl.String,  # JSON of deviceProperties
    "pg_config": pl.String,  # JSON of distributedInfo.pg_config (its groups: traceana.ingest.process_groups)
    "meta": pl.String,  # JSON of the trace's top-level "traceana" metadata
}

# --- analysis ----------------------------------------------------------------------------------------------------
STEPS = {
    "rank": pl.Int32,
    "step": pl.Int32,
    "start_ns": pl.Int64,
    "end_ns": pl.Int64,
    "dur_ns": pl.Int64,
}

P2P = {
    "src": pl.Int32,
    "dst": pl.Int32,
    "tag": pl.Int32,
    "seq": pl.Int32,  # k-th message src→dst (per tag) in the step
    "step": pl.Int32,
    "channel": pl.String,  # "p2p" or "bpipe"
    "nbytes": pl.Int64,
    "send_start_ns": pl.Int64,
    "recv_post_ns": pl.Int64,
    "data_ready_ns": pl.Int64,  # max(recv_post_ns, send_start_ns): the data could exist from here on
    "recv_end_ns": pl.Int64,
    "wait_ns": pl.Int64,  # data_ready_ns − recv_post_ns: waiting for the peer
    "transfer_ns": pl.Int64,  # recv_end_ns − data_ready_ns: moving bytes
}

SCHEDULE = {
    "rank": pl.Int32,
    "step": pl.Int32,
    "stage": pl.Int32,
    "microbatch": pl.Int32,
    "phase": pl.String,  # forward | backward | backward_input | backward_weight | recompute | optimizer
    "start_ns": pl.Int64,
    "end_ns": pl.Int64,
    "source": pl.String,  # annotated | inferred (P2P order) | autograd (torch.profiler's defaults) | simulated
}

ATTRIBUTION = {
    "rank": pl.Int32,
    "step": pl.Int32,
    "stage": pl.Int32,
    "category": Category,
    "ns": pl.Int64,
    "fraction": pl.Float64,
}

STAGE_MEMORY = {
    "rank": pl.Int32,
    "stage": pl.Int32,
    "step": pl.Int32,
    "baseline_bytes": pl.Int64,  # allocated at the step's start
    "peak_bytes": pl.Int64,
    # most bytes alive at once among the step's transient blocks (allocated and freed in it: traceana.measure.memory);
    # peak − baseline for a rank whose samples carry no block address
    "activation_peak_bytes": pl.Int64,
}


class SchemaError(TraceanaError):
    """A table does not have the declared columns or types: a bug in traceana, not bad input."""


def empty(schema: dict[str, pl.DataType]) -> pl.DataFrame:
    return pl.DataFrame(schema=schema)


def nulls(name: str, n: int, dtype: pl.DataType) -> pl.Series:
    """A column of ``n`` nulls whose value buffer is never written: its pages stay untouched (not in RSS) until
    something writes them. ``pl.repeat(None, ...)``, a gather of nulls or a concatenation writes every value (e.g.
    an NCCL run's ``tag``, null on every event: 4 bytes an event; docs/performance.md "Memory")."""
    return pl.DataFrame(schema={name: dtype}).clear(n).to_series()


def conform(frame: pl.DataFrame, schema: dict[str, pl.DataType]) -> pl.DataFrame:
    """Select the schema's columns in order, adding missing ones as nulls and casting to the declared types (a
    LazyFrame gives a LazyFrame: one step of a larger query). A DataFrame already so is returned as it is: a select
    would copy a frame of several chunks (the attribution's segments, concatenated from batches, are a million
    rows)."""
    if isinstance(frame, pl.LazyFrame):
        have = frame.collect_schema().names()
    elif list(frame.schema.items()) == list(schema.items()):
        return frame
    else:
        have = frame.columns
    return frame.select(
        [
            (pl.col(c) if c in have else pl.lit(None)).cast(t).alias(c)
            for c, t in schema.items()
        ]
    )


def check(frame: pl.DataFrame, schema: dict[str, pl.DataType], where: str) -> pl.DataFrame:
    """Raise SchemaError unless ``frame`` has exactly the schema's columns and types (extra columns allowed)."""
    got = frame.schema
    bad = [f"{c}: expected {t}, got {got.get(c, 'missing')}" for c, t in schema.items() if got.get(c) != t]
    if bad:
        raise SchemaError(f"table {where} does not match its schema: " + "; ".join(bad))
    return frame
