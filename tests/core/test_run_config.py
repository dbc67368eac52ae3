"""``Analysis.config``: the run's configuration reconciled once from run.json and the traces, each fact with its source
(traceana.core.run_config). Expected values by hand."""

from __future__ import annotations

import json

import polars as pl
import pytest
from tracebuilder import TraceBuilder

from traceana.core.manifest import Manifest, ModelShape
from traceana.core.run_config import DEFAULT, RUN_JSON, TRACE, RunConfig
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze

SHAPE = ModelShape(family="gpt", layers=8, hidden=64, heads=4, seq=16, vocab=64)
STEP_US = 1000.0


def _pipeline(directory, stages: int, *, f_us: float = 100.0, b_us: float = 200.0) -> None:
    """``stages`` ranks, one stage each, one step of STEP_US: micro-batch 0's forward then backward, annotated, in
    pipeline order (forwards down, backwards up), no P2P."""
    for r in range(stages):
        tb = TraceBuilder(rank=r, world_size=stages, pid=10 + r, tid=10 + r)
        tb.step(1, 0, STEP_US)
        f0 = r * f_us
        b0 = stages * f_us + (stages - 1 - r) * b_us
        tb.annotation(f"PP:{r}F0", f0, f_us)
        tb.cpu_op("aten::mm", f0 + 1, f_us - 2)
        tb.annotation(f"PP:{r}B0", b0, b_us)
        tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", b0 + 1, b_us - 2)
        tb.write(directory / f"rank{r}.pt.trace.json.gz")


def test_mfu_counts_each_stage_with_run_json_s_layer_split(tmp_path):
    """A DeepSpeed-style uneven split, layers_per_stage 1, 1, 2, 4 of an 8-layer GPT on 4 stages: MFU (and the
    configuration validate simulates) took the even split 2, 2, 2, 2 and ignored it. By hand (Narayanan et al. 2021
    §5.1: a GPT layer's forward + backward is 72·b·s·h²·(1 + s/(6h)) FLOPs, the last stage adds the logits'
    6·b·s·h·V), b = 2, s = 16, h = 64, V = 64, one micro-batch, steps of 1 ms, peak 1e12 FLOP/s."""
    _pipeline(tmp_path, 4)
    (tmp_path / "run.json").write_text(json.dumps({**json.loads(Manifest(
        world_size=4, pp=4, stage_of_rank=(0, 1, 2, 3), schedule="1f1b", microbatch_size=2, num_microbatches=1,
        model=SHAPE, dtype="float32", attention="sdpa", recompute="none", peak_flops=1e12).to_json()),
        "extra": {"layers_per_stage": [1, 1, 2, 4], "note": "kept"}}))  # as older run.json files hold it
    a = analyze(load_run(tmp_path, cache=False))
    b, s, h, v = 2, 16, 64, 64
    layer = 72 * b * s * h * h * (1 + s / (6 * h))
    want = {0: layer, 1: layer, 2: 2 * layer, 3: 4 * layer + 6 * b * s * h * v}
    got = dict(a.stages.select("rank", "mfu").rows())
    for r, flops in want.items():
        assert got[r] == pytest.approx(flops / (STEP_US * 1e-6 * 1e12), rel=1e-9), (r, got)
    c = a.config
    assert c.layers_per_stage == (1, 1, 2, 4) and c.source("layers_per_stage") == RUN_JSON
    assert c.stage_layers() == (1, 1, 2, 4) and c.training_config().stage_layers() == (1, 1, 2, 4)
    assert c.manifest.extra == {"note": "kept"}  # extra keeps only the keys traceana does not know


def test_config_says_where_each_fact_came_from_and_what_contradicts(tmp_path):
    """run.json says 3 micro-batches; the annotations show one per step: the traces' 1 is used (source trace) and the
    contradiction is noted once, in the notes and in config.conflicts. Facts run.json gives are run.json's; those
    it leaves out, defaults; --peak-flops an option."""
    _pipeline(tmp_path, 2)
    (tmp_path / "run.json").write_text(Manifest(
        world_size=2, pp=2, schedule="1f1b", microbatch_size=2, num_microbatches=3, model=SHAPE,
        dtype="float32").to_json())
    a = analyze(load_run(tmp_path, cache=False), peak_flops=2e12)
    c = a.config
    assert (c.num_microbatches, c.source("num_microbatches")) == (1, TRACE)
    assert (c.microbatch_size, c.source("microbatch_size")) == (2, RUN_JSON)
    assert (c.peak_flops, c.source("peak_flops")) == (2e12, "option")
    assert c.source("attention") == DEFAULT and c.attention is None
    # the stages: run.json lists none, the annotations name them
    assert (dict(c.stages_of_rank), c.source("stages_of_rank")) == ({0: (0,), 1: (1,)}, TRACE)
    assert len(c.conflicts) == 1 and "num_microbatches 3" in c.conflicts[0]
    assert [n for n in a.notes if "num_microbatches" in n] == list(c.conflicts)
    d = c.as_dict()
    assert d["facts"]["num_microbatches"] == {"value": 1, "source": TRACE} and d["conflicts"] == list(c.conflicts)


def _p2p_chain(directory) -> None:
    """Two un-annotated ranks joined by P2P (rank 0 sends an activation to rank 1, which sends a gradient back)."""
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2, pid=10 + r, tid=10 + r)
        tb.step(1, 0, STEP_US)
        if r == 0:
            tb.cpu_op("aten::mm", 0, 100)
            tb.send(peer=1, ts=100, dur=5)
            tb.recv(peer=1, ts=110, dur=300)
            tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", 420, 100)
        else:
            tb.recv(peer=0, ts=0, dur=110)
            tb.cpu_op("aten::mm", 120, 100)
            tb.cpu_op("autograd::engine::evaluate_function: MmBackward0", 230, 100)
            tb.send(peer=0, ts=340, dur=5)
        tb.write(directory / f"rank{r}.pt.trace.json.gz")


def test_run_json_stages_of_rank_is_honoured_when_p2p_peers_exist(tmp_path):
    """run.json with stages_of_rank (as collect writes for torch.distributed.pipelining) and no stage_of_rank: with
    P2P peers in the traces the stage map took the P2P chain's inference instead ('inferred from P2P chain') and
    dropped run.json's lists. Here run.json numbers the two ranks' stages 1 and 0 (rank 1 first): it is what the
    tables follow, as with stage_of_rank."""
    _p2p_chain(tmp_path)
    (tmp_path / "run.json").write_text(Manifest(world_size=2, pp=2, stages_of_rank=((1,), (0,))).to_json())
    a = analyze(load_run(tmp_path, cache=False))
    st = {r: (s, src, listed) for r, s, src, listed in a.stages.select("rank", "stage", "stage_source", "stages").rows()}
    assert st == {0: (1, "run.json", "1"), 1: (0, "run.json", "0")}
    assert dict(a.config.stages_of_rank) == {0: (1,), 1: (0,)} and a.config.source("stages_of_rank") == RUN_JSON
    # without run.json the chain tells: rank 0 sends the step's first message, so it holds stage 0
    (tmp_path / "run.json").unlink()
    b = analyze(load_run(tmp_path, cache=False))
    assert b.stages.filter(pl.col("rank") == 0)["stage_source"].item() == "inferred from P2P chain"
    assert b.config.source("stages_of_rank") == "inferred"
    assert (b.config.pp, b.config.source("pp")) == (2, "inferred")  # two stages, one a rank, from the chain


def test_older_run_json_facts_under_extra_get_their_fields():
    """run.json files written before the facts had fields kept them under "extra": read from there, typed and
    checked; what traceana does not know stays in extra; the file written back holds them at the top level."""
    m = Manifest.from_dict({"world_size": 4, "pp": 4, "extra": {
        "bpipe_inflight": 2, "layers_per_stage": [1, 1, 2, 4], "stages_of_rank": [[0], [1], [2], [3]],
        "nnodes": 1, "grads_in_step": True, "backend": "gloo"}})
    assert (m.bpipe_inflight, m.layers_per_stage, m.nnodes, m.grads_in_step) == (2, (1, 1, 2, 4), 1, True)
    assert m.stages_of_rank == ((0,), (1,), (2,), (3,)) and m.extra == {"backend": "gloo"}
    again = Manifest.from_dict(json.loads(m.to_json()))
    assert again == m and json.loads(m.to_json())["layers_per_stage"] == [1, 1, 2, 4]
    cfg = RunConfig.from_manifest(m)
    assert cfg.bpipe_inflight == 2 and cfg.grads_in_step is True and cfg.source("bpipe_inflight") == RUN_JSON
