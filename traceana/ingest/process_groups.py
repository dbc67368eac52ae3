"""The ranks' process groups (desc, global ranks), derived from the traces table's ``pg_config`` (the JSON text of
each trace's ``distributedInfo.pg_config``), not stored beside it: every rank of a job writes the same pg_config,
whose default group lists every rank, so a per-rank list column held N copies of an N-rank list (16,384² ranks,
1 GB, at 16,384 ranks; a list column cannot share its values, the gathered text column does). Each distinct
config is read once and only the groups a reader keeps are joined to the ranks."""

from __future__ import annotations

import json
from typing import Any

import polars as pl

GROUPS = {"rank": pl.Int32, "desc": pl.String, "ranks": pl.List(pl.Int32)}


def as_int(v: Any) -> int | None:
    """``v`` as an int32 (a rank, a count), or None."""
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return i if -(2**31) <= i < 2**31 else None


def groups_of(pg_config: Any) -> list[dict]:
    """distributedInfo.pg_config's groups as (desc, global ranks), leaving out entries that are not such groups
    (a handful per trace: plain Python)."""
    out = []
    for g in pg_config if isinstance(pg_config, list) else []:
        ranks = g.get("ranks") if isinstance(g, dict) else None
        if isinstance(ranks, list) and all(as_int(r) is not None for r in ranks):
            desc = g.get("pg_desc")
            out.append({"desc": desc if isinstance(desc, str) else None, "ranks": [as_int(r) for r in ranks]})
    return out


def process_groups(traces: pl.DataFrame, keep: pl.Expr | None = None) -> pl.DataFrame:
    """``rank, desc, ranks`` (GROUPS): one row per rank of ``traces`` (a TRACES table) and process group of its
    pg_config, in the table's row order and each rank's groups in pg_config's order; ``keep``, a filter over
    ``desc`` and ``ranks``, is applied to the job's distinct groups before they meet the ranks."""
    configs = traces["pg_config"].drop_nulls().unique(maintain_order=True)
    rows = [{"config": i, "order": j, **g}
            for i, text in enumerate(configs.to_list()) for j, g in enumerate(groups_of(_loaded(text)))]
    groups = pl.DataFrame(rows, schema={"config": pl.UInt32, "order": pl.UInt32, "desc": pl.String,
                                        "ranks": pl.List(pl.Int32)})
    if keep is not None:
        groups = groups.filter(keep)
    if not groups.height:
        return pl.DataFrame(schema=GROUPS)
    index = pl.DataFrame({"pg_config": configs, "config": pl.int_range(len(configs), dtype=pl.UInt32, eager=True)})
    ranks = (traces.select(pl.col("rank").cast(pl.Int32), "pg_config").with_row_index("row")
             .join(index, on="pg_config", how="inner").drop("pg_config"))
    return (ranks.join(groups, on="config", how="inner").sort("row", "order")
            .select(list(GROUPS)).cast(GROUPS))  # type: ignore[arg-type]


def _loaded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # (ingest wrote it with json.dumps: only a hand-made table could hold other text)
        return None
