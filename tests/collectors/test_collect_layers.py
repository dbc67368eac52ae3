"""``traceana collect --layers-per-stage`` (the transformer blocks split unevenly over the stages) and the known
workload's per-layer holds (``--layer-holds per-layer``: the stated times are each block's), docs/known-workload.md.
Expected values by hand: the blocks a split gives each stage (contiguous, in stage order), the times a stage of n
blocks holds (n × the stated ones), read back from the trace files with json (not traceana's reader) and from the
workload's own perf_counter spans (RUN/workload/rank{R}.json), outside the trace."""

from __future__ import annotations

import gzip
import json
import re
import sys
import time
from collections import defaultdict

import pytest

from collect_refusal import assert_collect_refused
from collected_runs import RUNS
from traceana.core.errors import ConfigError
from traceana.core.manifest import Manifest, Workload
from traceana.core.pipeline_rules import plan_refusal

SLEEP = ["--work", "sleep", "--forward-ms", "2", "--backward-ms", "4"]


# ---- flags and refusals: no processes ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--layers-per-stage", "3,2,2"], "must be 4 counts (one a device) summing to the model's 8 layers"),
    (["--layers-per-stage", "3,3,2,1"], "summing to the model's 8 layers"),
    (["--layers-per-stage", "4,2,2,0"], "stage 3 would hold 0 layers"),
    (["--layers-per-stage", "3,2,x,1"], "is not a comma-separated list of layer counts"),
    (["--layers-per-stage", "3,-2,2,1"], "is not a comma-separated list of layer counts"),
    (["--layers-per-stage", ""], "is not a comma-separated list of layer counts"),
    # torch.distributed.pipelining's schedules take the rules' even split of their chunks: not theirs to move
    (["--layers-per-stage", "3,2,2,1", "--schedule", "interleaved-1f1b"], "--layers-per-stage is not available"),
    (["--layers-per-stage", "3,2,2,1", "--schedule", "zbv"], "--layers-per-stage is not available"),
    (["--layer-holds", "per-layer"], "--layer-holds describes the known workload"),
    ([*SLEEP, "--layer-holds", "per-layer", "--schedule", "looped-bfs"], "--layer-holds is not available"),
    ([*SLEEP, "--slow-layer", "1:2"], "--slow-layer slows one block's own hold: it needs --layer-holds per-layer"),
    ([*SLEEP, "--layer-holds", "per-layer", "--slow-layer", "8:2"], "--slow-layer 8 names no layer: this run has 8"),
    ([*SLEEP, "--layer-holds", "per-layer", "--slow-layer", "1"], "is not INDEX:FACTOR"),
    (["--slow-layer", "1:2"], "--slow-layer describes the known workload"),
])
def test_a_bad_split_or_layer_hold_is_one_line_and_exit_2_before_anything_is_written(argv, says, tmp_path, capsys):
    assert_collect_refused(argv, says, tmp_path, capsys)


@pytest.mark.parametrize("split", [(3, 2, 2, 1), (2, 2, 2, 2), (1, 1, 1, 5), (8, 0, 0, 0), (3, 2, 2), (2, 2, 2, 3),
                                   (4, 4, 0, 0)])
def test_collect_refuses_a_split_exactly_where_a_plan_whatif_does(split):
    """One rule (pipeline_rules.layers_refusal through plan_refusal, which whatif --layers-per-stage asks): the
    trainer's configuration is refused for a split exactly when the plan is, with the same words."""
    from collectors.trainer.config import CollectConfig

    why = plan_refusal("1f1b", pp=4, num_microbatches=8, layers_per_stage=split, layers=8)
    if why is None:
        assert CollectConfig(pp=4, layers_per_stage=split).layers_per_stage == split
    else:
        with pytest.raises(ConfigError) as e:
            CollectConfig(pp=4, layers_per_stage=split)
        assert e.value.what == why[0]


def test_the_split_gives_each_stage_its_blocks_by_hand():
    from collectors.trainer.config import CollectConfig

    assert [list(r) for r in CollectConfig(pp=4, layers_per_stage=(3, 2, 2, 1)).stage_layer_ranges()] == [
        [0, 1, 2], [3, 4], [5, 6], [7]]
    assert [list(r) for r in CollectConfig(pp=4).stage_layer_ranges()] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(r) for r in CollectConfig(pp=3).stage_layer_ranges()] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_per_layer_holds_are_recorded_and_a_stage_holds_its_blocks_times_the_stated_times():
    from traceana.core.errors import BadInputError

    w = Workload("sleep", 4, 6, 2, slow_stages=((1, 2.0),), layer_holds="per-layer")
    back = Manifest.from_dict(json.loads(Manifest(world_size=2, pp=2, schedule="1f1b", workload=w).to_json()))
    assert back.workload.layer_holds == "per-layer"
    # by hand: stage 0 of 5 blocks, stage 1 of 3 blocks slowed ×2
    assert w.held_ms("F", stage=0, rank=0, layers=range(5)) == 20 and w.held_ms("B", stage=0, rank=0,
                                                                                 layers=range(5)) == 40
    assert w.held_ms("I", stage=1, rank=1, layers=range(5, 8)) == 36
    assert w.held_ms("W", stage=1, rank=1, layers=range(5, 8)) == 12
    with pytest.raises(ValueError):  # a per-layer hold without the stage's blocks would be a silently wrong number
        w.held_ms("F", stage=0, rank=0)
    assert Workload("sleep", 4, 6).held_ms("F", stage=0, rank=0, layers=range(5)) == 4  # even: the pass's time
    # a slowed block (--slow-layer 1:3): 4 + 12 + 4 = 20 ms for blocks 0–2, wherever they are
    slow = Workload("sleep", 4, 6, slow_layers=((1, 3.0),), layer_holds="per-layer")
    assert slow.held_ms("F", stage=0, rank=0, layers=(0, 1, 2)) == 20 and slow.layer_weights((2, 1)) == (1.0, 3.0)
    assert Manifest.from_dict(json.loads(Manifest(world_size=2, pp=2, schedule="1f1b", workload=slow).to_json())
                              ).workload.slow_layers == ((1, 3.0),)
    for bad in ({"slow_layers": [[1, 2]]},  # (even holds: no block holds a time of its own)
                {"slow_layers": [[1, 0]], "layer_holds": "per-layer"}):
        with pytest.raises(BadInputError):
            Manifest.from_dict({**json.loads(Manifest(world_size=2, pp=2, schedule="1f1b", workload=w).to_json()),
                                "workload": {"kind": "sleep", "forward_ms": 1, "backward_ms": 1, **bad}})


# ---- collected runs -------------------------------------------------------------------------------------------------
def _layer_spans(run, rank: int) -> dict[tuple, list[tuple[float, float]]]:
    """(stage, action, micro-batch) → [(ts µs, dur µs, layer)] of one rank's ``PP:{s}{A}{mb}/L{layer}`` spans, and
    the passes' ``PP:{s}{A}{mb}`` spans, read with json and a regular expression."""
    with gzip.open(run / f"rank{rank}.pt.trace.json.gz", "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    layers, passes = defaultdict(list), defaultdict(list)
    for e in events:
        if m := re.fullmatch(r"PP:(\d+)([A-Z_]+)(\d+)/L(\d+)", e.get("name", "")):
            layers[(int(m[1]), m[2], int(m[3]))].append((e["ts"], e["dur"], int(m[4])))
        elif m := re.fullmatch(r"PP:(\d+)([FB])(\d+)", e.get("name", "")):
            passes[(int(m[1]), m[2], int(m[3]))].append((e["ts"], e["dur"]))
    return layers, passes


def test_a_real_collection_gives_the_stages_the_blocks_of_its_split(collected_run):
    """Real compute, tiny-gpt's 8 blocks as 5,3 over 2 stages: rank 0's trace times blocks 0–4 in every forward and
    backward of stage 0, rank 1's blocks 5–7 of stage 1, and nothing else; run.json records the counts, and
    traceana reads its per-layer work on that split (measurement.layer_work, no note)."""
    import traceana
    from traceana.validation.measurement import layer_work

    run = collected_run("layers_5_3")
    assert json.loads((run / "run.json").read_text())["layers_per_stage"] == [5, 3]
    m = RUNS["layers_5_3"]["num_microbatches"]
    want = {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}
    for rank in (0, 1):
        layers, passes = _layer_spans(run, rank)
        assert {k[0] for k in layers} == {rank} and {k[0] for k in passes} == {rank}
        assert {(k[1], k[2]) for k in layers} == {(a, mb) for a in "FB" for mb in range(m)}
        for key, spans in layers.items():
            assert sorted({layer for *_, layer in spans}) == want[rank], (rank, key)
            (ts, dur), = passes[key]  # each block's span lies inside its pass
            assert all(ts <= t and t + d <= ts + dur + 1 for t, d, _ in spans), (rank, key)
    work, notes = layer_work(traceana.load_and_analyze(run, cache=False))
    assert notes == []
    assert {s: sorted(set(work.filter(work["stage"] == s)["layer"])) for s in (0, 1)} == want


def _calibrated_slack_ms(n: int = 30, ms: float = 1.0) -> float:
    """This machine's wake-up slack now (tests/collectors/test_known_workload.py's measure): the most a hold of ``ms``
    overran, less the time the kernel kept this thread waiting for a CPU."""
    from collectors.trainer.workload import hold_until, run_delay_ns

    worst = 0.0
    for _ in range(n):
        d0, t0 = run_delay_ns(), time.perf_counter()
        hold_until(t0 + ms / 1e3)
        worst = max(worst, (time.perf_counter() - t0) * 1e3 - ms - (run_delay_ns() - d0) / 1e6)
    return worst


def test_per_layer_holds_make_each_stage_hold_its_blocks_times_the_stated_times(collected_run):
    """The known workload with per-layer holds, F 4, I 6, W 2 ms a block, block 1 ×2, blocks 5,3: by hand stage 0
    (blocks 0–4, weights 1 + 2 + 1 + 1 + 1 = 6) holds F 24, I 36, W 12 ms a micro-batch, stage 1 (3 blocks) F 12,
    I 18, W 6. The workload's own perf_counter spans (the truth, outside the trace) say so: each held pass lasts its
    stated time, never less, and more only by its own run-queue delay, this machine's wake-up slack (measured here)
    and Python's switch interval. In the trace each held pass's block spans are its stage's blocks and together
    take the hold less the pass's work before its first block (at most 1 ms plus the pass's run-queue delay); a
    forward's block 1 span holds its 8 ms (its start is block 0's end, late by at most that pass's delay, the
    slack and the switch interval), the others' 4 ms at most plus as much."""
    from collectors.trainer.workload import read_spans

    run = collected_run("sleep_layers_5_3")
    manifest = Manifest.read(run / "run.json")
    assert manifest.layers_per_stage == (5, 3) and manifest.workload.layer_holds == "per-layer"
    m = RUNS["sleep_layers_5_3"]["num_microbatches"]
    stated = {0: {"F": 24.0, "I": 36.0, "W": 12.0}, 1: {"F": 12.0, "I": 18.0, "W": 6.0}}
    blocks = {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}
    slack, gil = 10 * _calibrated_slack_ms(), sys.getswitchinterval() * 1e3
    for rank in (0, 1):
        held = read_spans(run, manifest.workload, rank)["spans"]
        profiled = max(s["step"] for s in held)
        mine = [s for s in held if s["step"] == profiled]
        assert sorted((s["action"], s["microbatch"]) for s in mine) == sorted(
            (a, mb) for a in "FIW" for mb in range(m)), rank
        for s in mine:
            assert s["stage"] == rank and s["stated_ms"] == stated[rank][s["action"]], s
            took = (s["end_ns"] - s["start_ns"]) / 1e6
            assert s["stated_ms"] <= took <= s["stated_ms"] + s["run_delay_ns"] / 1e6 + slack + gil, (s, slack)
        layers, _ = _layer_spans(run, rank)
        for s in mine:
            if s["action"] == "W":  # (a full backward's I and W are one PP:{s}B{mb} pass: judged with its I)
                continue
            key = (rank, "F" if s["action"] == "F" else "B", s["microbatch"])
            spans = layers[key]  # (one profiled step: the trace's spans are this step's)
            assert sorted({layer for *_, layer in spans}) == blocks[rank], (rank, key)
            # one span a block in a forward; two in a full backward (its I's share, then its W's)
            assert len(spans) == len(blocks[rank]) * (1 if s["action"] == "F" else 2), (rank, key)
            inside = sum(dur for _, dur, _ in spans) / 1e3
            same = [x for x in mine
                    if x["microbatch"] == s["microbatch"] and (x["action"] == "F") == (s["action"] == "F")]
            hold = sum((x["end_ns"] - x["start_ns"]) / 1e6 for x in same)
            delay = sum(x["run_delay_ns"] / 1e6 for x in same)
            assert -0.1 <= hold - inside <= 1.0 + delay, (rank, key, hold, inside, delay)
            if s["action"] == "F":
                late = delay + slack + gil
                for _, dur, layer in spans:
                    if layer == 1:
                        assert 8.0 - late <= dur / 1e3 <= 8.0 + late + 0.5, (key, dur, late)
                    else:
                        assert dur / 1e3 <= 4.0 + late + 0.5, (key, layer, dur, late)


def test_whatif_moves_the_measured_blocks_of_a_per_layer_run_and_refuses_what_collect_refuses(collected_run):
    """From the per-layer run (5,3), ``whatif --layers-per-stage`` moves blocks with their measured layer spans
    (not the layer-count scaling) and reads the run's own split from run.json; a split collect refuses is refused
    by the plan with collect's own words (one rule: pipeline_rules.layers_refusal)."""
    import traceana
    from collectors.trainer.config import CollectConfig
    from traceana.core.errors import AnalysisError
    from traceana.validation.plan import plan_whatif

    a = traceana.load_and_analyze(collected_run("sleep_layers_5_3"), cache=False)
    plan = plan_whatif(a, layers_per_stage=(4, 4))
    assert plan["as_run"]["layers_per_stage"] == [5, 3] and plan["plan"]["layers_per_stage"] == [4, 4]
    assert plan["layers_source"] == "measured per-layer work"
    for split in ((8, 0), (4, 3), (2, 2, 4)):
        with pytest.raises(ConfigError) as collect_says:
            CollectConfig(pp=2, layers_per_stage=split)
        with pytest.raises(AnalysisError) as whatif_says:
            plan_whatif(a, layers_per_stage=split)
        assert collect_says.value.what in whatif_says.value.what, (split, whatif_says.value.what)
