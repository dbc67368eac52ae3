"""The large-run paths of the analysis (docs/performance.md "How the analysis stays fast and small") against the
plain ones they replace: the fill of GPU work's peer/size/group held apart from the events, and the per-rank counts
looked at only where a name passes a test, against a plain per-event count written here."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from traceana.core import names
from traceana.ingest.run_dir import load_run
from traceana.measure import classify as cls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

THIRD_PARTY = Path(__file__).resolve().parents[1] / "data" / "third_party" / "hta"


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> Path:
    """Two GPU stages with NCCL send/recv kernels, whose peer and size come from their launching ops."""
    out = tmp_path_factory.mktemp("gpu2") / "run"
    write_run(out, ranks=2, mb=0.05, microbatches=2, kernels=2)
    return out


def _runs(gpu_run):
    yield load_run(gpu_run, cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("nccl_parser_config", "trace_filter", "ns_resolution_trace", "cpu_only"):
            yield load_run(THIRD_PARTY / name, cache=False)


def test_the_fill_apart_gives_the_classified_events(gpu_run):
    """classify_apart's table with its fill written in is classify's; the rows handed to the P2P messages carry the
    filled values (the generated run's kernels take peer and size from their launching op, HTA's nccl trace size
    and group)."""
    keep = pl.col("comm_dir").is_not_null() | pl.col("pp_action").is_in([names.LOAD, names.ACCEPT])
    filled = 0
    for run in _runs(gpu_run):
        whole = cls.classify(run.events)
        apart, fill = cls.classify_apart(run.events)
        assert_frame_equal(cls.apply_fill(apart, fill), whole)
        assert_frame_equal(cls.filled_rows(apart, fill, keep), whole.filter(keep))
        for c in ("peer", "nbytes", "pg"):  # apart: the ingested columns, not copies
            assert apart[c].equals(run.events[c])
        filled += fill.height
    assert filled > 0


def _plain_rank_summary(ev: pl.DataFrame) -> pl.DataFrame:
    """The per-rank counts of classify.rank_summary's docstring, one expression per event."""
    name, cpu = pl.col("name").cast(pl.String), ~pl.col("is_gpu")  # (per event, as text)
    step = pl.when(cpu).then(name.str.extract(names.STEP_PATTERN).cast(pl.Int32, strict=False))
    op = pl.coalesce(*(pl.when(name.str.starts_with(p)).then(name.str.strip_prefix(p))
                       for p in (names.NCCL_OP_PREFIX, names.GLOO_PREFIX)))
    p2p = names.P2P_COLL_NAMES
    return (ev.lazy().with_columns(_step=step).group_by("rank").agg(
        n_events=pl.len(),
        steps=pl.col("_step").drop_nulls().n_unique(),
        first_step=pl.col("_step").min(), last_step=pl.col("_step").max(),
        mean_step_ms=pl.col("dur_ns").filter(pl.col("_step").is_not_null()).mean() / 1e6,
        kernels=(pl.col("cat") == "kernel").sum(),
        nccl_kernels=(pl.col("is_gpu") & (name.str.starts_with("ncclDevKernel") | name.str.starts_with("ncclKernel")))
        .sum(),
        c10d=name.is_in([names.C10D_SEND, names.C10D_RECV]).sum(),
        rpc=((name == names.RECORD_PARAM_COMMS) & pl.col("coll").is_in(list(p2p))).sum(),
        collectives=(cpu & op.is_not_null() & ~op.is_in(list(p2p))).sum(),
    ).with_columns(p2p_ops=pl.when(pl.col("c10d") > 0).then("c10d").otherwise("rpc"))
        .select("rank", "steps", "first_step", "last_step", "mean_step_ms", "n_events", "kernels", "nccl_kernels",
                "p2p_ops", "collectives")
        .with_columns(pl.col("steps", "n_events", "kernels", "nccl_kernels", "p2p_ops", "collectives")
                      .cast(pl.Int64))
        .sort("rank").collect())


def test_rank_summary_counts_what_a_plain_per_event_count_finds(gpu_run):
    for run in _runs(gpu_run):
        got = cls.rank_summary(run)
        want = _plain_rank_summary(run.events)
        assert_frame_equal(got.select(want.columns), want)
        assert_frame_equal(cls.rank_summary(run, by_name=cls.name_table(run.events)), got)
