"""Inference without names on every torch.distributed.pipelining schedule: real runs (tests/collected_runs.py,
collected once per session) rewritten as a foreign trace would come — no PP: or Forward/Backward spans, no
traceana metadata, no run.json (tests/stripped_runs.py) — must be inferred right or refused, never guessed.

Expected placements are torch's (torch/distributed/pipelining/schedules.py and docs/schedules.md): looped — rank r
holds r, r+p, …; V — rank r holds r and 2p−1−r; and the run's own run.json (written by the collector, not read by
the analysis here) says the same.
"""

from __future__ import annotations

import warnings

import polars as pl
import pytest

from stripped_runs import strip_run
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze

pytestmark = pytest.mark.slow

PASSES = ("forward", "backward", "backward_input", "backward_weight", "recompute")


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_run(path, cache=False)


@pytest.fixture(scope="module")
def both(collected_run, tmp_path_factory):
    """``both(name) -> (annotated run, its analysis, the stripped run's analysis)``."""
    root = tmp_path_factory.mktemp("stripped")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            src = collected_run(name)
            stripped = load(strip_run(src, root / name))
            assert stripped.manifest is None and not stripped.events["name"].cast(pl.String).str.starts_with("PP:").any()
            run = load(src)
            cache[name] = (run, analyze(run), analyze(stripped))
        return cache[name]

    return get


def stages_of(a) -> dict[int, str | None]:
    return dict(a.stages.select("rank", "stages").rows())


def claimed(a) -> pl.DataFrame:
    return a.schedule.filter(pl.col("phase").is_in(PASSES))


def assert_refused(a, placement: str) -> None:
    """No forward/backward of any kind claimed, and notes naming the placement and what could not be told."""
    assert claimed(a).height == 0
    att = a.attribution.filter(pl.col("category").cast(pl.String).is_in(PASSES))
    assert att["ns"].sum() == 0
    assert any(f"the P2P pattern shows a {placement} placement" in n for n in a.notes), a.notes
    assert any("which stage, micro-batch and phase each piece of their work belongs to cannot be told" in n
               and "no forward/backward is claimed" in n for n in a.notes), a.notes


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_stage_per_rank_inferred_like_the_annotations(both, schedule):
    run, a, inferred = both(f"pipelining-{schedule}")
    assert stages_of(inferred) == {0: "0", 1: "1", 2: "2", 3: "3"}
    assert set(inferred.stages["stage_source"]) == {"inferred from P2P chain"}
    key = ["rank", "step", "stage", "microbatch", "phase"]
    fb = lambda x: sorted(x.schedule.filter(pl.col("phase").is_in(["forward", "backward"])).select(key).rows())  # noqa: E731
    assert fb(inferred) and fb(inferred) == fb(a)
    # 4 stages × 4 micro-batches × F and B, in every profiled step
    assert len(fb(inferred)) == 4 * 4 * 2 * inferred.schedule["step"].n_unique()


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_placement_named_and_refused(both, schedule):
    run, a, inferred = both(f"pipelining-{schedule}")
    # V on 2 ranks: rank 0 holds the first and the last stage, rank 1 the two middle ones (handed over locally)
    assert stages_of(inferred) == {0: "0,3", 1: "1,2"}
    assert stages_of(inferred) == {r: ",".join(map(str, s)) for r, s in enumerate(run.manifest.stages_of_rank)}
    assert stages_of(a) == stages_of(inferred)  # what the PP: names say
    assert_refused(inferred, "V")
    assert any("4 micro-batches" in n for n in inferred.notes)  # 2·4 messages each way on the one link


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zero-bubble"])
def test_looped_placement_on_two_ranks_named_and_refused(both, schedule):
    run, a, inferred = both(f"pipelining-{schedule}")
    assert stages_of(a) == {0: "0,2", 1: "1,3"}
    # On two ranks the wrap-around from the last rank to the first is the same link as the way down, so the counts
    # cannot tell 2 stages a rank from more: the first stage of each rank is known, how many it holds is not.
    assert dict(inferred.stages.select("rank", "stage").rows()) == {0: 0, 1: 1}
    assert stages_of(inferred) == {0: None, 1: None}
    assert_refused(inferred, "looped")
    assert any("how many stages a rank could not be determined" in n for n in inferred.notes)


def test_looped_placement_on_three_ranks_is_a_ring(both):
    run, a, inferred = both("pipelining-interleaved-1f1b@3")
    # rank r holds r and r+3; the last rank sends stage 2's output to the first (stage 3)
    assert stages_of(inferred) == {0: "0,3", 1: "1,4", 2: "2,5"} == stages_of(a)
    assert_refused(inferred, "looped")
    assert any("neighbours form a ring" in n and "2 stages a rank, 6 stages, 3 micro-batches" in n
               for n in inferred.notes), inferred.notes


def test_v_placement_on_three_ranks(both):
    run, a, inferred = both("pipelining-zbv@3")
    assert stages_of(inferred) == {0: "0,5", 1: "1,4", 2: "2,3"} == stages_of(a)
    assert_refused(inferred, "V")
