"""Analysis split by pipeline group (traceana.measure.partitioned) equals the single-process analysis of the same run.

The run: 2 pipeline stages × 2 data-parallel replicas (Megatron order: global rank = stage * dp + replica), so the
pipelines are ranks {0, 2} and {1, 3}; they share only the all-reduce. Expected groups are read off that layout by
hand; expected tables are those of ``analyze(load_run(...))``, an independent path (one process, all ranks at once,
no Parquet round trip).
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from traceana.core.errors import BadInputError
from traceana.ingest.run_dir import load_run
from traceana.measure import partitioned
from traceana.measure.analysis import analyze
from traceana.measure.classify import rank_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

TABLES = ("steps", "p2p", "schedule", "attribution", "stage_memory", "stages", "clock_offsets", "segments")


@pytest.fixture(scope="module")
def run_2x2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pp2dp2") / "run"
    write_run(out, ranks=2, dp=2, mb=0.05, microbatches=2, kernels=2)
    return out


@pytest.fixture(scope="module")
def single(run_2x2):
    run = load_run(run_2x2, cache=False)
    return analyze(run), rank_summary(run)


def _assert_same(got, single) -> None:
    want, want_ranks = single
    for name in TABLES:
        g, w = getattr(got, name), getattr(want, name)
        assert g.height > 0, name
        assert g.equals(w), f"{name} differs:\n{g}\n{w}"
    assert got.rank_summary.equals(want_ranks)
    g, w = got.summary, want.summary
    assert (g.steps, g.step_ms, g.bubble_fraction, g.memory_balance) == (w.steps, w.step_ms, w.bubble_fraction,
                                                                          w.memory_balance)
    assert g.per_stage.equals(w.per_stage)
    assert set(want.notes) <= set(got.notes)
    assert got.events is None  # the classified events stay in the workers


def test_pipeline_groups_are_the_p2p_components():
    # 0-2-4 one chain, 1-3 another (3 names 1 only as a peer of its receive), 5 alone, 9 is no rank of the run
    peers = {0: [2], 1: [], 2: [0, 4], 3: [1], 4: [2], 5: [9]}
    assert partitioned.pipeline_groups(peers) == [(0, 2, 4), (1, 3), (5,)]


def test_partitioned_equals_single_process(run_2x2, single, tmp_path):
    got = partitioned.analyze_partitioned(run_2x2, tmp_path / "parts")
    _assert_same(got, single)
    assert any("2 pipeline groups of 2 ranks" in n for n in got.notes)


def test_on_a_dask_local_cluster(run_2x2, single, tmp_path):
    # A real scheduler and two workers; in-process workers (processes=False) keep the test fast: starting worker
    # processes cost ~25 s on the 2-core CI machine. What a process boundary adds, pickling, is checked below.
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c, \
            distributed.Client(c) as client:
        got = partitioned.analyze_partitioned(run_2x2, tmp_path / "parts", map=partitioned.dask_map(client))
        assert len(client.scheduler_info()["workers"]) == 2
    _assert_same(got, single)


def test_tasks_and_results_cross_processes(run_2x2, tmp_path):
    import pickle

    task = partitioned.GroupTask(str(tmp_path / "parts"), (0, 2), None)
    assert pickle.loads(pickle.dumps(task)) == task
    partitioned.analyze_partitioned(run_2x2, tmp_path / "parts")
    result = partitioned.analyze_group(task)
    back = pickle.loads(pickle.dumps(result))
    assert all(back["tables"][k].equals(v) for k, v in result["tables"].items())
    assert pickle.loads(pickle.dumps(partitioned.analyze_group)) is partitioned.analyze_group


def test_cli_dask_bad_address_is_one_line(run_2x2, capsys):
    pytest.importorskip("distributed")
    from traceana.commands.analyze import load_and_analyze

    with pytest.raises(BadInputError, match="Dask scheduler"):
        partitioned.connect("tcp://127.0.0.1:1", timeout=0.5)
    with pytest.raises(BadInputError, match="run directory"):
        load_and_analyze(str(next(run_2x2.glob("rank0*"))), peak_flops=None, workers=None, cache=False,
                         progress=False, dask="tcp://127.0.0.1:1")


def test_group_task_reads_only_its_ranks(run_2x2, tmp_path):
    out = tmp_path / "parts"
    partitioned.analyze_partitioned(run_2x2, out)
    result = partitioned.analyze_group(partitioned.GroupTask(str(out), (1, 3)))
    assert sorted(result["tables"]["steps"]["rank"].unique().to_list()) == [1, 3]
    assert result["tables"]["p2p"].select(pl.col("src").is_in([1, 3]).all()).item()
