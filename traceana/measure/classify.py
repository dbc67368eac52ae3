"""A kind per event (schema.KINDS), plus the columns later stages need: P2P direction and channel, the launch
time of GPU work, pipeline-annotation fields, and the step each event belongs to.

Rules (docs/architecture.md "Classification and attribution", docs/field-notes.md):
- GPU: NCCL kernels (``ncclDevKernel_*``, ``ncclKernel_*``) are communication; a SendRecv kernel is P2P when the
  cpu op that launched it (same External id) is a send/recv, else a collective (all_to_all also runs SendRecv
  kernels). Other kernels are compute; memcpy/memset keep their own kinds.
- CPU: ``c10d::send`` / ``c10d::recv_`` / ``nccl:send|recv`` / ``record_param_comms`` with a send/recv name are P2P
  posts; ``gloo:send`` / ``gloo:recv`` spans run from the post to the return of wait() (they break nesting);
  any other ``c10d::`` / ``gloo:`` / ``nccl:`` op and other record_param_comms are collectives.
- BPipe: communication and compute inside our EVICT/LOAD/ACCEPT/RETURN spans, or on the BPipe process group, is
  ``bpipe_transfer`` (channel "bpipe"); its P2P direction is kept in ``comm_dir``.
- Python frames (``python_function``, recorded with ``with_stack=True``) are spans like annotations, not work: the
  ops inside them are the work.
- Name rules (``names.NameRules``: the built-in conventions of Megatron-LM, DeepSpeed, DualPipe and DeepEP, and a
  user's rules file, docs/naming.md) give CPU spans a phase, stage and micro-batch where the PP: contract does not,
  and any event a kind (DeepEP's kernels: collective, channel "ep"); evaluated once per distinct name.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from traceana.core import intervals as iv
from traceana.core import names
from traceana.core.schema import KINDS, Kind
from traceana.core.units import NS_PER_MS
from traceana.ingest import Run

# Columns classify adds to schema.EVENTS.
CLASSIFIED = {
    "kind": Kind,
    # comm_dir, channel and pp_action are null on nearly every event: as text they would hold a 16-byte string
    # view per event, as an enum or categorical 1 or 4 bytes (docs/performance.md "How the analysis stays small").
    # They compare with text literals as strings do; cast to pl.String before .str functions.
    "comm_dir": pl.Enum(["send", "recv"]),  # P2P posts, spans and kernels
    "channel": pl.Categorical(),  # "p2p" | "bpipe" for P2P traffic; a name rule's label for a collective ("ep")
    "launch_ns": pl.Int64,  # GPU work: start of the cuda_runtime call that launched it; CPU: ts_ns
    "pp_stage": pl.Int32,
    "pp_action": pl.Categorical(),
    "pp_microbatch": pl.Int32,
    "pp_order": pl.Boolean,  # a name rule numbers this span's micro-batch in order of appearance (number_in_order)
}

# Rules compare categories and names many times per event, so each is looked up once per event and the rules
# compare small integers: a category becomes a class, a name a row of rules evaluated once per distinct name (a few
# hundred names in a million events).
_KERNEL, _MEMCPY, _MEMSET, _RUNTIME, _ANNOTATION, _GPU_ANNOTATION, _CPU_OP, _OTHER_OP, _PY_FRAME, _OTHER_CAT = range(10)
_CAT_CLASS = {
    "kernel": _KERNEL, "gpu_memcpy": _MEMCPY, "gpu_memset": _MEMSET, "memcpy": _MEMCPY, "memset": _MEMSET,
    "cuda_runtime": _RUNTIME, "cuda_driver": _RUNTIME, "hip_runtime": _RUNTIME, "runtime": _RUNTIME,
    "user_annotation": _ANNOTATION, "gpu_user_annotation": _GPU_ANNOTATION,
    "cpu_op": _CPU_OP, "operator": _OTHER_OP, "python_function": _PY_FRAME,
}
_SEND, _RECV = range(2)  # comm_dir codes
_COMM_DIRS = pl.Series(["send", "recv"], dtype=CLASSIFIED["comm_dir"])
_CHANNELS = pl.Series(["p2p", "bpipe"], dtype=CLASSIFIED["channel"])
_KINDS = pl.Series(KINDS, dtype=Kind)
_K = {k: pl.lit(i, pl.UInt8) for i, k in enumerate(KINDS)}  # kind codes
_MOVABLE = [KINDS.index(k) for k in ("p2p_send", "p2p_recv", "compute", "memcpy", "collective")]  # BPipe's if so


def _starts_with_any(col: pl.Expr, prefixes: tuple[str, ...]) -> pl.Expr:
    out = pl.lit(False)
    for p in prefixes:
        out = out | col.str.starts_with(p)
    return out


def _dir_of(col: pl.Expr, sends: list[str], recvs: list[str]) -> pl.Expr:
    return pl.when(col.is_in(sends)).then(pl.lit(_SEND, pl.UInt8)).when(col.is_in(recvs)).then(pl.lit(_RECV, pl.UInt8))


@dataclass(frozen=True)
class NameTable:
    """An events frame's distinct names (``distinct_names``) and every rule of ``rules`` that reads only the name,
    evaluated on them (``table``: one row per distinct name, in that order). ``classify`` and ``rule_notes`` both
    read it: an analysis builds it once (``name_table``) and hands it to both, instead of trying the rules' regular
    expressions twice (a few ms even on a tiny trace, docs/performance.md "Fixed cost")."""

    rules: names.NameRules
    distinct: pl.Series
    table: pl.DataFrame


def name_table(events: pl.DataFrame, rules: names.NameRules = names.DEFAULT_RULES) -> NameTable:
    distinct = distinct_names(events)
    return NameTable(rules, distinct, _name_rules(distinct, rules))


def _given_table(events: pl.DataFrame, rules: names.NameRules, given: NameTable | None) -> NameTable:
    if given is None:
        return name_table(events, rules)
    if given.rules is not rules:
        raise ValueError("the NameTable was built with other name rules")
    return given


def _name_rules(distinct: pl.Series, rules: names.NameRules) -> pl.DataFrame:
    """Every rule that reads only the event name, one row per distinct name."""
    name = pl.col("name")
    return pl.DataFrame({"name": distinct}, schema={"name": pl.String}).select(
        name.str.contains(names.STEP_PATTERN).alias("_step"),
        pl.any_horizontal(name.str.contains(p) for p in names.COMM_KERNEL_PATTERNS).alias("_nccl"),
        _dir_of(name, [names.C10D_SEND, names.NCCL_SEND, names.GLOO_SEND],
                [names.C10D_RECV, names.NCCL_RECV, names.GLOO_RECV]).alias("_name_dir"),
        (name == names.RECORD_PARAM_COMMS).alias("_rpc"),
        _starts_with_any(name, (names.C10D_PREFIX, names.GLOO_PREFIX, names.NCCL_OP_PREFIX)).alias("_comm_op"),
        **names.pp_columns(name),
        **names.rule_columns(name, rules),
    ).with_columns(
        # The PP: contract first; a name rule only where it says nothing.
        *(pl.when(pl.col("pp_action").is_null()).then(pl.col(r)).otherwise(pl.col(c)).alias(c)
          for c, r in (("pp_stage", "_rule_stage"), ("pp_microbatch", "_rule_mb"), ("pp_action", "_rule_action"))),
        (pl.col("pp_action").is_null() & pl.col("_rule_order").fill_null(False)).alias("pp_order"),
    )


def _spread(n: int, rows: pl.Series, values: pl.Series) -> pl.Series:
    """A column of ``n`` rows holding ``values`` at ``rows`` and null elsewhere."""
    return pl.repeat(None, n, dtype=values.dtype, eager=True).scatter(rows, values).alias(values.name)


def _launches(f: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """What GPU work learns from the CPU side: ``(by_ext, by_corr)``, each keyed by ``_row`` (the GPU event's row).

    ``by_ext``: the direction, peer, size and process group of the cpu op that launched it (same External id; the
    first of each among that id's ops). ``by_corr``: ``_launch_ts``, the start of the runtime call that launched
    it (same correlation id; the earliest), and ``_launch_track``, that call's thread. Only the few cpu ops that
    carry one of those facts are grouped, and calls are matched by a binary search of the sorted (rank, id) keys
    (else a sorted as-of join on the exact id) rather than a hash join: on a GPU run both sides hold a third of the
    events.
    """
    rows = f["is_gpu"].arg_true()
    gpu = f.select(rows.alias("_row"), *(pl.col(c).gather(rows) for c in ("rank", "ext_id", "corr_id")))
    # (The few events with one of those facts first, by their columns' validity alone; the other tests on them.)
    carry = f.select(pl.any_horizontal(pl.col("_cpu_dir", "peer", "nbytes", "pg").is_not_null())).to_series()
    facts = (
        f[carry.arg_true()]
        .filter(~pl.col("is_gpu") & pl.col("ext_id").is_not_null() & (pl.col("ext_id") != 0)
                & pl.col("_cat").is_in([_CPU_OP, _ANNOTATION]))
        .group_by("rank", "ext_id")
        .agg(*(pl.col(c).drop_nulls().first().alias(f"_launch_{c.lstrip('_')}")
               for c in ("_cpu_dir", "peer", "nbytes", "pg")))
    )
    by_ext = gpu.filter(pl.col("ext_id").is_in(facts["ext_id"].implode())).join(facts, on=["rank", "ext_id"])
    calls = (
        f.select("rank", pl.col("corr_id").alias("_call"), pl.col("ts_ns").alias("_launch_ts"),
                 pl.col("track").alias("_launch_track"))
        .filter((f["_cat"] == _RUNTIME) & f["corr_id"].is_not_null() & (f["corr_id"] != 0))
    )
    in_order = iv.in_time_order(calls, "rank", "_launch_ts")
    axis = iv.group_axis([gpu["rank"], calls["rank"]], [gpu["corr_id"], calls["_call"]])
    if axis is not None:
        # (rank, id) as one key: the calls sorted by it (by time among a rank's calls with one id), each GPU event's
        # call is the first at or after its key, found by a binary search (no sort of the GPU events, no as-of
        # join's grouping). Calls come from ingest in (rank, time) order, and ids grow with time: often sorted.
        calls = calls.select(axis.key("rank", "_call").alias("_key"), "_launch_ts", "_launch_track")
        if calls["_key"].null_count():  # a call without a rank launches nothing
            calls = calls.filter(pl.col("_key").is_not_null())
        if not in_order:
            calls = calls.sort("_key", "_launch_ts")
        elif not calls["_key"].is_sorted():
            calls = calls.sort("_key", maintain_order=True)
        key = gpu.select(axis.key("rank", "corr_id")).to_series()
        i = calls["_key"].search_sorted(key, side="left")
        hit = calls.gather(i.clip(upper_bound=max(calls.height - 1, 0))) if calls.height else None
        if hit is None:
            return by_ext, gpu.head(0).select("_row", pl.lit(None, pl.Int64).alias("_launch_ts"),
                                              pl.lit(None, calls.schema["_launch_track"]).alias("_launch_track"))
        match = (hit["_key"] == key).fill_null(False)
        return by_ext, pl.DataFrame([gpu["_row"], hit["_launch_ts"], hit["_launch_track"]]).filter(match)
    # By id, and by time among a rank's calls with one id: a stable sort by id does both when the calls come in
    # (rank, time) order, as from ingest, at a fraction of a two-key sort's cost.
    if in_order:
        calls = calls.sort("_call", maintain_order=True)
    else:
        calls = calls.sort("_call", "_launch_ts")
    by_corr = (
        gpu.filter(pl.col("corr_id").is_not_null()).sort("corr_id")
        .join_asof(calls, left_on="corr_id", right_on="_call", by="rank", strategy="forward",
                   check_sortedness=False)
        .filter(pl.col("_call") == pl.col("corr_id"))
    )
    return by_ext, by_corr


def _update(column: pl.Series, rows: pl.Series, values: pl.Series) -> pl.Series:
    """``column`` with ``values`` at ``rows``."""
    return column.clone().scatter(rows, values)


def _kind() -> pl.Expr:
    """The kind code of each event, from its category class, name rules and ``_dir`` (comm direction code)."""
    is_gpu, cat = pl.col("is_gpu"), pl.col("_cat")
    is_cpu_coll = ~is_gpu & pl.col("_cpu_dir").is_null() & (pl.col("_comm_op") | pl.col("_rpc"))
    return (
        pl.when(~is_gpu & pl.col("_step")).then(_K["step"])
        .when(pl.col("_dir") == _SEND).then(_K["p2p_send"])
        .when(pl.col("_dir") == _RECV).then(_K["p2p_recv"])
        .when(pl.col("_rule_kind_code").is_not_null()).then(pl.col("_rule_kind_code"))
        .when(((cat == _KERNEL) & pl.col("_nccl")) | is_cpu_coll).then(_K["collective"])
        .when(cat == _KERNEL).then(_K["compute"])
        .when(cat == _MEMCPY).then(_K["memcpy"])
        .when(cat == _MEMSET).then(_K["memset"])
        .when(cat == _RUNTIME).then(_K["runtime"])
        .when(cat.is_in([_ANNOTATION, _GPU_ANNOTATION, _PY_FRAME])).then(_K["annotation"])
        .when(cat.is_in([_CPU_OP, _OTHER_OP])).then(_K["compute"])
        .otherwise(_K["other"])
    )


def classify(events: pl.DataFrame, rules: names.NameRules = names.DEFAULT_RULES, *,
             by_name: NameTable | None = None) -> pl.DataFrame:
    """Add ``CLASSIFIED`` columns to an EVENTS frame (no step yet; see ``timeline.assign_steps``), with the name
    ``rules`` (default: the built-in conventions). ``by_name``: ``name_table(events, rules)``, if the caller has
    it already."""
    return apply_fill(*classify_apart(events, rules, by_name=by_name))


def apply_fill(events: pl.DataFrame, fill: pl.DataFrame) -> pl.DataFrame:
    """``events`` with ``classify_apart``'s fill written at its rows (``_row``)."""
    return events.with_columns(_update(events[c], fill["_row"], fill[c]) for c in fill.columns if c != "_row")


def filled_rows(events: pl.DataFrame, fill: pl.DataFrame, keep: pl.Expr) -> pl.DataFrame:
    """The rows of ``events`` where ``keep`` holds, in order, with ``classify_apart``'s fill written where it has
    them: what ``classify`` gives for those rows, without a copy of the filled columns of every event."""
    rows = events.select(keep.fill_null(False)).to_series().arg_true()
    part = events[rows]
    if fill.width < 2 or not rows.len() or not fill.height:
        return part
    at = rows.search_sorted(fill["_row"], side="left")
    hit = (at < rows.len()) & (rows.gather(at.clip(upper_bound=rows.len() - 1)) == fill["_row"])
    return apply_fill(part, fill.filter(hit).with_columns(at.filter(hit).alias("_row")))


def classify_apart(events: pl.DataFrame, rules: names.NameRules = names.DEFAULT_RULES, *,
                   by_name: NameTable | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``classify``'s table with the ingested ``peer``, ``nbytes`` and ``pg``, and apart from it the fill: ``_row``
    and those of the three columns GPU work takes from its launching op where its own args lack them (a few
    thousand rows of a GPU run). ``apply_fill`` of both is ``classify``'s table; an analysis holds the two until
    its largest frames are gone, instead of a copy of three columns of every event (docs/performance.md "How the
    analysis stays fast and small")."""
    # One chunk per column: every later step filters and gathers these columns, which is slower across chunks
    # (the Parquet cache yields several).
    events = events.rechunk()
    n = events.height
    by_name = _given_table(events, rules, by_name)
    distinct, table = by_name.distinct, by_name.table
    # A name rule's kind as a kind code, so that no text column is gathered per event (its channel is looked up
    # from the rule's index, on the few events it labels). Gathered by the rule's index, as the rule's kind text is
    # (a replace of that text is a join: ~2 ms the first time, docs/performance.md "Fixed cost").
    codes = [KINDS.index(r.kind) if r.kind in names.RULE_KINDS else None for r in rules.all]
    table = table.with_columns((pl.lit(pl.Series(codes, dtype=pl.UInt8)).gather("_kind_rule") if codes
                                else pl.lit(None, pl.UInt8)).alias("_rule_kind_code"))
    # Classes looked up per distinct category (a handful), then gathered by each event's category code (its
    # physical code: a table as long as the largest code, no text per event).
    cats = events["cat"].unique().drop_nulls()
    classes = pl.repeat(_OTHER_CAT, int(cats.to_physical().max() or 0) + 1, dtype=pl.UInt8, eager=True).scatter(
        cats.to_physical(), cats.cast(pl.String).replace_strict(_CAT_CLASS, default=_OTHER_CAT, return_dtype=pl.UInt8))
    cat_class = classes.gather(events["cat"].to_physical()).fill_null(_OTHER_CAT).alias("_cat")
    # Most events' kind follows from their category alone: a name that no rule below reads (no step, NCCL kernel,
    # communication op or name rule's kind) leaves every branch of ``_kind`` but the category's. Only the events
    # with such a name, or with a pipeline field in their name (a few percent of a GPU run), are looked at one by
    # one (``named``: their rows, in order), and their kinds, directions and fields written at their rows.
    reads = table.select(
        special=pl.col("_step") | pl.col("_nccl") | pl.col("_name_dir").is_not_null() | pl.col("_rpc")
        | pl.col("_comm_op") | pl.col("_rule_kind_code").is_not_null(),
        pp=pl.any_horizontal(pl.col("pp_stage", "pp_action", "pp_microbatch").is_not_null())
        | pl.col("pp_order").fill_null(False))
    # (Found by one membership test of the names: cheaper than coding every event's name, which only these need.)
    rows = events["name"].is_in(distinct.filter(reads["special"] | reads["pp"]).implode()).arg_true().alias("_row")
    name_code = events["name"].gather(rows).cast(pl.Enum(distinct)).to_physical()
    per_name = table.select("_step", "_nccl", "_name_dir", "_rpc", "_comm_op", "_rule_kind_code", "_kind_rule",
                            "pp_stage", "pp_action", "pp_microbatch", "pp_order").with_columns(
        reads["special"].alias("_special"), reads["pp"].alias("_pp"))
    named = pl.DataFrame([rows, events["is_gpu"].gather(rows), events["coll"].gather(rows), cat_class.gather(rows),
                          *per_name.select(pl.all().gather(name_code))])
    # Pipeline annotations are CPU-side record_function ranges (their GPU mirrors are ignored), or Python frames
    # a name rule reads. Their fields are written at their rows into columns that are null elsewhere (pp_order
    # False).
    pp_cols = ("pp_stage", "pp_action", "pp_microbatch", "pp_order")
    pp_found = named.filter(~pl.col("is_gpu") & pl.col("_cat").is_in([_ANNOTATION, _PY_FRAME]) & pl.col("_pp")).select(
        "_row", *pp_cols).with_columns(pl.col("pp_action").cast(CLASSIFIED["pp_action"]))
    pp_rows = pp_found["_row"]
    pp = [_spread(n, pp_rows, pp_found[c]) for c in pp_cols[:3]]
    pp.append(pl.repeat(False, n, dtype=pl.Boolean, eager=True).scatter(pp_rows, pp_found["pp_order"].fill_null(False))
              .alias("pp_order"))
    pp = pl.DataFrame(pp)
    # record_param_comms is a P2P post when its collective name says so.
    named = named.filter("_special").with_columns(pl.col("_name_dir").fill_null(
        pl.when(pl.col("_rpc")).then(_dir_of(pl.col("coll").cast(pl.String).str.to_lowercase(), ["send", "isend"],
                                              ["recv", "irecv"]))).alias("_cpu_dir"))
    dirs = named.filter(pl.col("_cpu_dir").is_not_null())
    f = pl.DataFrame([*events.select("rank", "is_gpu", "ts_ns", "corr_id", "ext_id", "peer", "nbytes", "pg", "track"),
                      cat_class, _spread(n, dirs["_row"], dirs["_cpu_dir"]).alias("_cpu_dir")])
    # GPU work: launched when its runtime call started; peer, size and group from its launching op where its own
    # args lack them; an NCCL kernel's direction is its launching op's.
    launch_ns = events["ts_ns"]
    launch_dir = pl.DataFrame(schema={"_row": pl.UInt32, "_launch_dir": pl.UInt8})
    fill = pl.DataFrame(schema={"_row": pl.UInt32})
    by_corr = None
    if bool(events["is_gpu"].any()):  # a CPU-only run launches nothing
        by_ext, by_corr = _launches(f)
        launch_ns = _update(launch_ns, by_corr["_row"], by_corr["_launch_ts"])
        launch_dir = by_ext.select(pl.col("_row").cast(pl.UInt32), pl.col("_launch_cpu_dir").alias("_launch_dir"))
        rows = by_ext["_row"]
        fill = [rows.cast(pl.UInt32).alias("_row")]
        for c in ("peer", "nbytes", "pg"):
            own = f[c].gather(rows)
            filled = own.fill_null(by_ext[f"_launch_{c}"])
            if filled.null_count() < own.null_count():  # else nothing to fill
                fill.append(filled.alias(c))
        fill = pl.DataFrame(fill)
    f = f.with_columns(launch_ns.alias("launch_ns"))
    nccl_kernel = (pl.col("_cat") == _KERNEL) & pl.col("_nccl")
    named = named.join(launch_dir, on="_row", how="left", maintain_order="left").with_columns(
        pl.when(pl.col("is_gpu")).then(pl.when(nccl_kernel).then("_launch_dir")).otherwise("_cpu_dir").alias("_dir"),
    ).with_columns(_kind().alias("_kind"))
    # Every other event's kind is its category class's.
    by_class = pl.DataFrame({"_cat": range(_OTHER_CAT + 1)}, schema={"_cat": pl.UInt8}).with_columns(
        _step=False, _dir=pl.lit(None, pl.UInt8), _rule_kind_code=pl.lit(None, pl.UInt8), _nccl=False, _rpc=False,
        _comm_op=False, _cpu_dir=pl.lit(None, pl.UInt8), is_gpu=False).select(_kind())
    kind = by_class.to_series().gather(cat_class).scatter(named["_row"], named["_kind"])
    # BPipe: communication and compute inside its annotated spans or on its process group.
    annotated = events.select("rank", "ts_ns", "dur_ns").gather(pp_rows).with_columns(pp_found["pp_action"])
    spans = bpipe_spans(annotated.filter(pl.col("pp_action").is_not_null()))
    # pg is categorical (schema.EVENTS): the few distinct groups are matched as text, the events by membership.
    groups = (pl.concat([f["pg"], fill["pg"]]) if "pg" in fill.columns else f["pg"]).unique().drop_nulls()
    bpipe_groups = groups.filter(groups.cast(pl.String).str.contains(names.BPIPE_GROUP_DESC, literal=True))
    bpipe = pl.repeat(False, 0, dtype=pl.Boolean, eager=True)
    if spans.height or bpipe_groups.len():
        in_span = inside(f, "launch_ns", spans)
        pg = pl.lit(_update(f["pg"], fill["_row"], fill["pg"]) if "pg" in fill.columns else f["pg"])
        on_group = pg.is_not_null() & pg.is_in(bpipe_groups.implode())
        bpipe = f.select((pl.lit(in_span) | on_group) & pl.lit(kind).is_in(_MOVABLE)).to_series()
        kind = kind.scatter(bpipe.arg_true(), KINDS.index("bpipe_transfer"))
    # (after BPipe's: work BPipe's spans or group claim stays BPipe's)
    if by_corr is not None and by_corr.height:
        kind = _launched_in_communication(events, cat_class, kind, by_corr)
    # comm_dir and channel: text on the few communication events only, written into null columns (as pp above).
    comm = named.filter(pl.col("_dir").is_not_null() | (pl.col("_kind") == _K["collective"]))
    comm = comm.with_columns((bpipe.gather(comm["_row"]) if bpipe.len() else pl.lit(False)).alias("_bpipe")).select(
        "_row",
        pl.lit(_COMM_DIRS).gather("_dir").alias("comm_dir"),
        pl.coalesce(pl.lit(_CHANNELS).gather(pl.when(pl.col("_dir").is_not_null())
                                             .then(pl.col("_bpipe").cast(pl.UInt8))),
                    pl.when(pl.col("_kind") == _K["collective"])
                    .then(pl.lit(pl.Series([r.channel for r in rules.all], dtype=CLASSIFIED["channel"]))
                          .gather("_kind_rule")))
        .alias("channel"),
    )
    comm_rows = comm["_row"]
    return pl.DataFrame([
        *events, *pp, f["launch_ns"], pl.select(pl.lit(_KINDS).gather(kind)).to_series().alias("kind"),
        _spread(n, comm_rows, comm["comm_dir"]), _spread(n, comm_rows, comm["channel"]),
    ]), fill


# Kinds of the CPU ops and spans that are communication calls, and what GPU work launched inside them becomes.
_COMM_CALL_KINDS = ("collective", "p2p_send", "p2p_recv", "p2p_call")
_P2P_CALL_KINDS = ("p2p_send", "p2p_recv", "p2p_call")
_LAUNCHED_WORK = ("compute", "memcpy", "memset")


def _launched_in_communication(events: pl.DataFrame, cat_class: pl.Series, kind: pl.Series,
                               by_corr: pl.DataFrame) -> pl.Series:
    """``kind`` with GPU work launched inside a communication call made communication (issue 26): a kernel, copy or
    memset whose launching runtime call (same correlation id) lies, on the same thread, inside a c10d op,
    ``record_param_comms``, an ``nccl:`` span or a span a name rule calls a collective or a P2P helper (torch's
    ``all_to_all`` frame, Megatron's ``send_forward``, DeepSpeed's ``_exec_reduce_grads``) is that call's work
    (the packing copies of an all-to-all, a library's own kernels under any name). Inside a P2P call it becomes
    ``p2p_call`` (counted as P2P transfer), else ``collective``. gloo's spans run from a post to the return of its
    wait() (they break nesting), so they do not claim the work launched meanwhile."""
    code = {k: KINDS.index(k) for k in (*_COMM_CALL_KINDS, *_LAUNCHED_WORK)}
    key = (pl.col("rank").cast(pl.Int64) * (1 << 32) + pl.col("track").to_physical().cast(pl.Int64)).alias("_key")
    calls = (
        events.select("rank", "track", "is_gpu", "name", "ts_ns", "dur_ns").with_columns(
            pl.lit(kind).alias("_kind"), pl.lit(cat_class).alias("_cat"))
        .filter(~pl.col("is_gpu") & pl.col("_kind").is_in([code[k] for k in _COMM_CALL_KINDS])
                & pl.col("_cat").is_in([_CPU_OP, _ANNOTATION, _PY_FRAME]) & (pl.col("dur_ns") > 0))
    )
    if calls.height == 0:
        return kind
    calls = calls.filter(~names.name_test(pl.col("name"), lambda t: t.str.starts_with(names.GLOO_PREFIX)))
    work = pl.DataFrame([by_corr["_row"], by_corr["_launch_ts"], events["rank"].gather(by_corr["_row"]),
                         by_corr["_launch_track"].alias("track")]).filter(
        pl.lit(kind.gather(by_corr["_row"])).is_in([code[k] for k in _LAUNCHED_WORK])
        & pl.col("track").is_not_null() & pl.col("_launch_ts").is_not_null())
    if work.height == 0 or calls.height == 0:
        return kind
    work = work.with_columns(key).sort("_key", "_launch_ts")
    found = {}
    for group in ("collective", "p2p"):
        which = [code[k] for k in (_P2P_CALL_KINDS if group == "p2p" else ("collective",))]
        spans = iv.merge(calls.filter(pl.col("_kind").is_in(which)).select(
            key, pl.col("ts_ns").alias("start"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("end")), "_key")
        found[group] = (pl.repeat(False, work.height, dtype=pl.Boolean, eager=True) if spans.height == 0 else
                        iv.containing(work, "_launch_ts", spans, by="_key", columns=["start"])["start"].is_not_null())
    p2p, coll = found["p2p"], found["collective"] & ~found["p2p"]
    kind = kind.scatter(work["_row"].filter(p2p), code["p2p_call"])
    return kind.scatter(work["_row"].filter(coll), code["collective"])


def number_in_order(events: pl.DataFrame, *, skip_ranks: list[int] | tuple[int, ...] = ()) -> pl.DataFrame:
    """Micro-batches of the spans a name rule numbers in order (``pp_order``): 0, 1, … by start time per (rank,
    step, stage, action). Needs steps (``timeline.assign_steps``). Ranks in ``skip_ranks`` (several virtual stages:
    their spans of one phase alternate between stages the name does not give) keep a null micro-batch."""
    rows = (events.select("rank", "step", "pp_stage", "pp_action", "ts_ns", "pp_order").with_row_index("_row")
            .filter(pl.col("pp_order") & pl.col("step").is_not_null() & ~pl.col("rank").is_in(list(skip_ranks))))
    if rows.height == 0:
        return events
    rows = rows.sort("ts_ns").with_columns(
        pl.int_range(pl.len(), dtype=pl.Int32).over("rank", "step", "pp_stage", "pp_action").alias("_mb"))
    return events.with_columns(_update(events["pp_microbatch"], rows["_row"], rows["_mb"]).alias("pp_microbatch"))


def distinct_names(events: pl.DataFrame) -> pl.Series:
    """The distinct event names (nulls dropped) as text, the keys of every rule evaluated once per name."""
    return events["name"].unique(maintain_order=True).drop_nulls().cast(pl.String)


def rule_notes(events: pl.DataFrame, rules: names.NameRules, *, by_name: NameTable | None = None) -> list[str]:
    """One note per name rule that labelled events: which convention, how many spans got a phase and how many
    events a kind, so a reader sees what came from names rather than from the PP: contract. Rules are tried on the
    distinct names (``by_name``: ``name_table`` of these events' names, if the caller has it); events are counted
    only when one matched."""
    by_name = _given_table(events, rules, by_name)
    table = by_name.table.select("_phase_rule", "_kind_rule", "pp_action", "_rule_action") \
        .with_columns(by_name.distinct.alias("name"))
    hit = table.filter((pl.col("_phase_rule").is_not_null() & (pl.col("pp_action") == pl.col("_rule_action")))
                       | pl.col("_kind_rule").is_not_null())
    if hit.height == 0:
        return []
    counted = (events.filter(pl.col("name").is_in(hit["name"].implode()))
               .select("name", "kind", "pp_action", "is_gpu")
               .join(hit.select(pl.col("name").cast(events.schema["name"]), "_phase_rule", "_kind_rule"), on="name"))
    every = rules.all
    notes = []
    for source in dict.fromkeys(r.source for r in every):
        ids = [i for i, r in enumerate(every) if r.source == source]
        spans = counted.filter(pl.col("_phase_rule").is_in(ids) & pl.col("pp_action").is_not_null()).height
        kinds = counted.filter(pl.col("_kind_rule").is_in(ids)).group_by("kind").len().sort("kind").rows()
        if spans or kinds:
            parts = ([f"{spans:,} spans given a phase"] if spans else []) + [f"{k:,} events as {kind}"
                                                                             for kind, k in kinds]
            notes.append(f"name rules ({source}): {', '.join(parts)} (docs/naming.md)")
    return notes


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


def rank_summary(run: Run, *, by_name: NameTable | None = None) -> pl.DataFrame:
    """One row per rank: devices, steps found and their mean duration, events, kernels, P2P and collective ops.

    P2P ops are ``c10d::send``/``c10d::recv_`` (any backend), else NCCL ``record_param_comms`` send/recv.
    Collective ops are the CPU-side ``nccl:*``/``gloo:*`` spans c10d records around each collective, P2P excluded.
    ``by_name``: ``name_table(run.events, …)``, if the caller has it (its distinct names are read).
    """
    ev = run.events
    # The name tests run once per distinct name. Only events whose name passes one of them (steps, NCCL kernels,
    # P2P and collective ops: a few percent of a GPU run) are looked at one by one, found by one membership test
    # of the names; the whole table is read only for what every event counts in (events, kernels, devices)
    # (docs/performance.md "How the analysis stays fast and small").
    name = pl.col("name")
    coll_prefix = pl.coalesce(*(pl.when(name.str.starts_with(pre)).then(name.str.strip_prefix(pre))
                                for pre in (names.NCCL_OP_PREFIX, names.GLOO_PREFIX)))
    distinct = distinct_names(ev) if by_name is None else by_name.distinct
    by_name = pl.DataFrame({"name": distinct}, schema={"name": pl.String}).with_columns(
        _step_no=name.str.extract(names.STEP_PATTERN).cast(pl.Int32, strict=False),
        _nccl=name.str.starts_with(names.NCCL_KERNEL_PREFIXES[0]) | name.str.starts_with(names.NCCL_KERNEL_PREFIXES[1]),
        _c10d_p2p=name.is_in([names.C10D_SEND, names.C10D_RECV]),
        _rpc=name == names.RECORD_PARAM_COMMS,
        _coll=coll_prefix.is_not_null() & ~coll_prefix.is_in(list(names.P2P_COLL_NAMES)),
    ).filter(pl.col("_step_no").is_not_null() | pl.any_horizontal("_nccl", "_c10d_p2p", "_rpc", "_coll"))
    cpu = ~pl.col("is_gpu")
    every = ev.lazy().group_by("rank").agg(
        n_events=pl.len(),
        devices=pl.col("device").filter(pl.col("is_gpu")).drop_nulls().unique().sort().cast(pl.String).str.join(","),
        kernels=(pl.col("cat") == "kernel").sum(),
    )
    named = (
        ev.lazy().select("rank", "is_gpu", "name", "dur_ns", "coll").filter(name.is_in(by_name["name"].implode()))
        .join(by_name.lazy().with_columns(name.cast(ev.schema["name"])), on="name")
        .select("rank", "dur_ns", step_no=pl.when(cpu).then("_step_no"),  # ProfilerStep spans on the CPU
                nccl_kernel=pl.col("is_gpu") & pl.col("_nccl"), c10d_p2p="_c10d_p2p",
                rpc_p2p=pl.col("_rpc") & pl.col("coll").is_in(list(names.P2P_COLL_NAMES)),
                collective=cpu & pl.col("_coll"))
        .group_by("rank")
        .agg(
            steps=pl.col("step_no").drop_nulls().n_unique(),
            first_step=pl.col("step_no").min(),
            last_step=pl.col("step_no").max(),
            mean_step_ms=(pl.col("dur_ns").filter(pl.col("step_no").is_not_null()).mean() / NS_PER_MS),
            nccl_kernels=pl.col("nccl_kernel").sum(),
            c10d_p2p=pl.col("c10d_p2p").sum(),
            rpc_p2p=pl.col("rpc_p2p").sum(),
            collectives=pl.col("collective").sum(),
        )
    )
    per_rank = (
        every.join(named, on="rank", how="left")
        .with_columns(p2p_ops=pl.when(pl.col("c10d_p2p") > 0).then("c10d_p2p").otherwise("rpc_p2p"))
        .drop("c10d_p2p", "rpc_p2p")
    )
    traces = run.traces.lazy().select("rank", "world_size", "backend", "truncated", "path")
    return (
        traces.join(per_rank, on="rank", how="left")
        .with_columns(devices=pl.when(pl.col("devices").fill_null("") == "").then(pl.lit("cpu"))
                      .otherwise(pl.col("devices")))
        .with_columns(pl.col("n_events", "steps", "kernels", "nccl_kernels", "p2p_ops", "collectives")
                      .fill_null(0).cast(pl.Int64))
        .select("rank", "world_size", "backend", "devices", "steps", "first_step", "last_step", "mean_step_ms",
                "n_events", "kernels", "nccl_kernels", "p2p_ops", "collectives", "truncated", "path")
        .sort("rank")
        .collect(**iv.COLLECT)
    )
