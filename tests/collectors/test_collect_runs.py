"""Real tiny runs collected by the reference trainer: annotations, run.json, BPipe's memory effect, the CLI."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter

import pytest

pytest.importorskip("torch")

from collected_runs import RUNS  # noqa: E402
from traceana.core.pipeline_rules import bpipe_plan, stage_layer_ranges  # noqa: E402
from collectors.trainer.config import CollectConfig  # noqa: E402
from traceana.cli import main as cli  # noqa: E402
from traceana.core import names  # noqa: E402
from traceana.core.manifest import Manifest  # noqa: E402

pytestmark = pytest.mark.slow


def _trace(run_dir, rank):
    with gzip.open(run_dir / f"rank{rank}.pt.trace.json.gz") as f:
        return json.load(f)


def _spans(trace):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name", "").startswith("PP:")]


def _expected(config: CollectConfig, stage: int) -> Counter:
    """Every label a stage must emit in one step, with its count."""
    p, last = config.pp, config.pp - 1
    want: Counter = Counter({names.pp_label(stage, names.OPTIMIZER): 1})
    for mb in range(config.num_microbatches):
        actions = [names.FORWARD, names.BACKWARD]
        if stage > 0:
            actions += [names.RECV_F, names.WAIT_F, names.SEND_B]
        if stage < last:
            actions += [names.SEND_F, names.RECV_B, names.WAIT_B]
        for action in actions:
            want[names.pp_label(stage, action, mb)] += 1
    pair = next((pair for pair in config.bpipe_pairs if stage in pair), None)
    if pair is not None:
        plan = bpipe_plan(config.schedule, pp=p, num_microbatches=config.num_microbatches, evictor=pair[0],
                          keep=config.bpipe_inflight)
        out, back = (names.EVICT, names.LOAD) if stage == pair[0] else (names.ACCEPT, names.RETURN)
        for mb in plan.order:
            want[names.pp_label(stage, out, mb)] += 1
            want[names.pp_label(stage, back, mb)] += 1
    return want


@pytest.mark.parametrize("name", ["1f1b", "1f1b_bpipe", "gpipe", "gpipe_llama_recompute"])
def test_every_stage_microbatch_and_phase_is_annotated(collected_run, name):
    run_dir = collected_run(name)
    config = CollectConfig(**RUNS[name])
    for rank in range(config.pp):
        spans = _spans(_trace(run_dir, rank))
        _check_layer_spans(config, rank, spans)
        spans = [e for e in spans if not re.fullmatch(names.LAYER_PATTERN, e["name"])]
        got = Counter(e["name"] for e in spans if names.parse_pp_label(e["name"])[1] != names.RECOMPUTE)
        assert got == _expected(config, rank), f"rank {rank}"
        recomputes = [e for e in spans if names.parse_pp_label(e["name"])[1] == names.RECOMPUTE]
        if config.recompute == "none":
            assert not recomputes
            continue
        backward = {names.parse_pp_label(e["name"])[2]: e for e in spans
                    if names.parse_pp_label(e["name"])[1] == names.BACKWARD}
        assert {names.parse_pp_label(e["name"])[2] for e in recomputes} == set(range(config.num_microbatches))
        for r in recomputes:  # RECOMPUTE nests inside the B of the same micro-batch
            b = backward[names.parse_pp_label(r["name"])[2]]
            assert b["ts"] <= r["ts"] and r["ts"] + r["dur"] <= b["ts"] + b["dur"] + 1


def _check_layer_spans(config: CollectConfig, stage: int, spans: list[dict]) -> None:
    """Each of the stage's blocks (stage_layer_ranges: tiny models' 8 blocks, 2 a stage at pp 4) has one forward and
    one backward span per micro-batch, and one recompute span where the run recomputes, each inside its pass's span
    (``PP:{stage}F{mb}/L{layer}`` inside ``PP:{stage}F{mb}``)."""
    blocks = stage_layer_ranges(8, config.pp)[stage]
    layer = [e for e in spans if re.fullmatch(names.LAYER_PATTERN, e["name"])]
    kinds = [names.FORWARD, names.BACKWARD] + ([names.RECOMPUTE] if config.recompute != "none" else [])
    assert Counter(e["name"] for e in layer) == Counter(
        names.layer_label(stage, a, mb, k) for a in kinds for mb in range(config.num_microbatches) for k in blocks)
    passes: dict[str, list] = {}
    for e in spans:  # (a recompute of each block is a PP:{s}RECOMPUTE{mb} span of its own: several of one name)
        if names.parse_pp_label(e["name"]) is not None:
            passes.setdefault(e["name"], []).append(e)
    for e in layer:
        assert any(o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] + 1
                   for o in passes[e["name"].split("/")[0]]), e["name"]


@pytest.mark.parametrize("name", ["1f1b", "1f1b_bpipe"])
def test_run_json_and_each_trace_describe_the_run(collected_run, name):
    run_dir = collected_run(name)
    config = CollectConfig(**RUNS[name])
    manifest = Manifest.read(run_dir / "run.json")
    assert manifest.world_size == config.pp and manifest.pp == config.pp
    assert manifest.ranks_written == tuple(range(config.pp))
    assert manifest.stage_of_rank == tuple(range(config.pp))
    assert manifest.schedule == config.schedule and manifest.num_microbatches == config.num_microbatches
    assert manifest.model.name == config.preset
    # pair (1, 2) holds 3 + 2 micro-batches, already balanced: only (0, 3) moves anything
    assert manifest.bpipe == (((0, 3),) if config.bpipe else None)
    for rank in range(config.pp):
        trace = _trace(run_dir, rank)
        meta = trace["traceana"]
        assert meta["rank"] == trace["distributedInfo"]["rank"] == rank
        assert (meta["stage"], meta["pp"], meta["world_size"], meta["schedule"]) == (rank, 4, 4, config.schedule)
        if config.bpipe:  # BPipe traffic runs on its own, recognisable process group
            descs = [g["pg_desc"] for g in trace["distributedInfo"]["pg_config"]]
            assert names.BPIPE_GROUP_DESC in descs


def _activation_peak(trace) -> int:
    """The most bytes alive at once, in the profiled step, among the blocks it allocated and freed (walked here
    event by event, apart from traceana.measure.memory): gradients outlive the step, the previous step's existed before
    it."""
    step = next(e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    start, end = step["ts"], step["ts"] + step["dur"]
    mem = sorted(((e["ts"], i, e["args"]["Bytes"], e["args"]["Addr"]) for i, e in enumerate(trace["traceEvents"])
                  if e.get("name") == "[memory]" and start <= e["ts"] < end), key=lambda m: m[:2])
    transient, open_at = set(), {}
    for ts, i, nbytes, addr in mem:
        if nbytes > 0:
            open_at[addr] = (i, nbytes)
        elif addr in open_at and open_at[addr][1] == -nbytes:
            transient |= {open_at.pop(addr)[0], i}
    live = peak = 0
    for _, i, nbytes, _ in mem:
        if i in transient:
            live += nbytes
            peak = max(peak, live)
    return peak


def test_bpipe_moves_stage_0_peak_memory_toward_its_pairs_balanced_level(collected_run):
    base = [_activation_peak(_trace(collected_run("1f1b"), r)) for r in range(4)]
    bpipe = [_activation_peak(_trace(collected_run("1f1b_bpipe"), r)) for r in range(4)]
    per_microbatch = base[0] / 4  # 1F1B stage 0 holds all 4 micro-batches at its peak
    assert bpipe[0] < base[0] - 0.5 * per_microbatch, (base, bpipe)  # keeps 3 of 4
    assert bpipe[3] > base[3]  # the acceptor holds what stage 0 evicted
    assert abs(bpipe[0] - bpipe[3]) < abs(base[0] - base[3])  # the pair is closer to balanced
    assert bpipe[1:3] == pytest.approx(base[1:3], rel=0.1)  # (1, 2) is balanced already: untouched


@pytest.mark.parametrize("flags,message", [
    (["--pp", "9"], "8 layers cannot fill 9 pipeline chunks"),
    (["--pp", "1", "--bpipe"], "BPipe needs at least 2"),
    (["--pp", "4", "--microbatches", "3"], "never reaches its steady state"),
    (["--model", "gpt-9000"], "unknown preset"),
    (["--steps", "0"], "at least 1"),
    # GPipe keeps all m micro-batches on every stage (Huang et al. 2019): an acceptor has no room to lend, with
    # any --bpipe-inflight (validate and estimate --from-run refused what collect wrote)
    (["--schedule", "gpipe", "--bpipe"], "GPipe holds all its micro-batches on every stage"),
    (["--schedule", "gpipe", "--bpipe", "--bpipe-inflight", "2"], "use --schedule 1f1b, or drop --bpipe"),
    # 1F1B at pp 2 holds 2 and 1: the evictor's only other micro-batch is the one its next backward needs
    (["--pp", "2", "--bpipe"], "use --pp 4 or more"),
])
def test_collect_refuses_impossible_configs_before_starting_a_process(flags, message, tmp_path, monkeypatch,
                                                                      capsys):
    import collectors.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    assert cli(["collect", *flags, "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_collect_refuses_an_unwritable_output_directory(tmp_path, monkeypatch, capsys):
    import collectors.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli(["collect", "-o", str(blocker / "run")]) == 2
    assert "cannot write to the output directory" in capsys.readouterr().err


@pytest.mark.parametrize("pp", [2, 3])
def test_the_bpipe_inflight_suggestion_is_made_only_with_a_value_that_works(pp):
    """`collect --pp 2 --bpipe` suggested --bpipe-inflight, which gave the same refusal whatever its value: at pp 2
    the evictor's only other micro-batch is the one its next backward needs. Now the refusal offers a value only
    where one makes the plan evict, and that value is then accepted. At pp 3, m 8, the pair (0, 2) holds 3 and 1
    and its balanced keep is 3 (nothing evicted: the acceptor would briefly hold 3 too); keeping 2 evicts."""
    from collectors.trainer.config import CollectConfig
    from traceana.core.errors import ConfigError

    with pytest.raises(ConfigError, match="can balance nothing") as e:
        CollectConfig(pp=pp, num_microbatches=8, bpipe=True)
    fix = e.value.fix
    if pp == 2:
        assert "--bpipe-inflight" not in fix
        for keep in (1, 2, 3):
            with pytest.raises(ConfigError, match="can balance nothing"):
                CollectConfig(pp=2, num_microbatches=8, bpipe=True, bpipe_inflight=keep)
    else:
        keep = int(fix.rsplit("--bpipe-inflight ", 1)[1])
        assert keep == 2 and CollectConfig(pp=pp, num_microbatches=8, bpipe=True, bpipe_inflight=keep).bpipe_pairs
