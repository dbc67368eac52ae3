"""The one configuration of a run (issue 34, item 3): hand-written run.json files and trace tables, and the
reconciled fact with its source that each must give. Expected values are read off the inputs by hand."""

from __future__ import annotations

import polars as pl

from traceana.core.manifest import Manifest
from traceana.core.run_config import DEFAULT, RUN_JSON, TRACE
from traceana.core.schema import SCHEDULE
from traceana.measure.p2p import link_bandwidth, transfer_ceiling
from traceana.measure.reconcile import run_config, run_facts


def _manifest(**facts) -> Manifest:
    return Manifest.from_dict({"world_size": 2, **facts})


def test_link_and_host_facts_come_from_the_one_configuration():
    # run.json: one node, a 1 GB/s link, 5 µs a message -> the pairing's floor and ceiling use exactly these
    cfg = run_facts(_manifest(pp=2, nnodes=1, link_bytes_per_s=1e9, p2p_latency_ns=5000))
    assert (cfg.same_host, cfg.source("same_host")) == (True, RUN_JSON)
    assert (cfg.link_bytes_per_s, cfg.source("link_bytes_per_s")) == (1e9, RUN_JSON)
    assert link_bandwidth(cfg) == 1e9 and transfer_ceiling(cfg) == (1e9, 5000)


def test_same_host_from_the_traces_metadata_when_run_json_does_not_say():
    one = pl.DataFrame({"rank": [0, 1], "host": ["node-a", "node-a"]})
    two = pl.DataFrame({"rank": [0, 1], "host": ["node-a", "node-b"]})
    partly = pl.DataFrame({"rank": [0, 1], "host": ["node-a", None]})
    assert (lambda c: (c.same_host, c.source("same_host")))(run_facts(_manifest(), one)) == (True, TRACE)
    for traces in (two, partly, None):  # two names, or a trace that does not say: not told
        c = run_facts(_manifest(), traces)
        assert (c.same_host, c.source("same_host")) == (None, DEFAULT)
    # run.json's one host name is told before the traces are asked
    c = run_facts(_manifest(hosts=["n1", "n1"]), two)
    assert (c.same_host, c.source("same_host")) == (True, RUN_JSON)
    # no run.json at all: the traces still tell
    assert run_facts(None, one).same_host is True


def _forwards(microbatches: int) -> pl.DataFrame:
    """Rank 0, stage 0, step 0: ``microbatches`` annotated forwards, 10 ns apart, then their backwards."""
    rows = [(0, 0, 0, mb, phase, 10 * i, 10 * i + 5, "annotated")
            for i, (phase, mb) in enumerate([("forward", m) for m in range(microbatches)]
                                            + [("backward", m) for m in range(microbatches)])]
    return pl.DataFrame(rows, schema={k: SCHEDULE[k] for k in ("rank", "step", "stage", "microbatch", "phase",
                                                                  "start_ns", "end_ns", "source")}, orient="row")


def test_the_traces_micro_batches_overrule_run_json_and_keep_what_it_said():
    # run.json says 2 micro-batches; the annotations show forwards of 4 (micro-batches 0..3) in one step
    start = run_facts(_manifest(pp=2, num_microbatches=2, nnodes=1))
    cfg = run_config(start, _forwards(4))
    assert (cfg.num_microbatches, cfg.source("num_microbatches")) == (4, TRACE)
    assert cfg.overruled == {"num_microbatches": 2}
    # the facts reconciled before the schedule (the hosts) are the same configuration's, not rebuilt
    assert (cfg.same_host, cfg.source("same_host")) == (True, RUN_JSON)
    assert any("num_microbatches 2" in c for c in cfg.conflicts)
    agree = run_config(start, _forwards(2))
    assert (agree.num_microbatches, agree.source("num_microbatches"), agree.overruled) == (2, RUN_JSON, {})


def test_which_run_json_lists_every_stage_of_a_rank():
    # stage_of_rank alone: the first stage of each rank only (the traces may show more)
    assert not run_facts(_manifest(pp=2, stage_of_rank=[0, 1])).run_json_lists_stages()
    # stages_of_rank: every stage (here a V: rank 0 holds 0 and 3)
    v = run_facts(_manifest(pp=4, schedule="zbv", stages_of_rank=[[0, 3], [1, 2]]))
    assert v.run_json_lists_stages() and dict(v.stages_of_rank) == {0: (0, 3), 1: (1, 2)}
    assert v.stage_of_rank is None
    # both, and stages_of_rank says more than the first stages
    both = run_facts(_manifest(pp=4, schedule="interleaved-1f1b", stage_of_rank=[0, 1],
                               stages_of_rank=[[0, 2], [1, 3]]))
    assert both.run_json_lists_stages() and both.stage_of_rank == (0, 1)
    assert not run_facts(None).run_json_lists_stages() and not run_facts(None).has_run_json
