"""The torch.distributed.pipelining adapter: one call gives Schedule1F1B / ScheduleGPipe per-micro-batch spans."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from collectors.pipelining import annotate, annotate_stage, emits_pp_annotations  # noqa: E402
from traceana.core import names  # noqa: E402


class FakeStage:
    """The two methods schedules call, with PipelineStage's signatures."""

    stage_index = 3

    def __init__(self) -> None:
        self.calls = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(("F", fwd_chunk_id))
        return torch.ones(2) * fwd_chunk_id

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.calls.append(("B" if full_backward else "I", bwd_chunk_id))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.calls.append(("W", bwd_chunk_id))


class FakeSchedule:
    def __init__(self, stage) -> None:
        self._stage = stage


def test_annotate_wraps_each_chunk_in_a_pp_span_and_keeps_behaviour():
    stage = FakeStage()
    annotate(FakeSchedule(stage))
    annotate(FakeSchedule(stage))  # idempotent: no doubled spans
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(stage.forward_one_chunk(1, (), {}), torch.ones(2))
        stage.backward_one_chunk(1, None, True)
        stage.backward_one_chunk(2, full_backward=False)
        stage.backward_weight_one_chunk(2)
    assert stage.calls == [("F", 1), ("B", 1), ("I", 2), ("W", 2)]
    spans = Counter(e.name for e in prof.events() if e.name.startswith("PP:"))
    assert spans == Counter({"PP:3F1": 1, "PP:3B1": 1, "PP:3I2": 1, "PP:3W2": 1})
    assert [names.parse_pp_label(n) for n in sorted(spans)][0] == (3, names.BACKWARD, 1)


def test_runtime_schedules_are_left_alone_because_they_annotate_themselves():
    assert not emits_pp_annotations(FakeSchedule(FakeStage()))
    with pytest.raises(TypeError, match="not a torch.distributed.pipelining schedule"):
        annotate(object())
    assert annotate_stage(annotate_stage(FakeStage())).forward_one_chunk.__name__ == "forward_one_chunk"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_real_schedule_1f1b_run_gets_forward_and_backward_spans_per_microbatch(tmp_path):
    from collectors.pipelining_example import collect

    run_dir = collect("1f1b", tmp_path / "run", num_microbatches=2, microbatch_size=1, steps=1, ranks=2)
    for rank in (0, 1):
        with gzip.open(run_dir / f"rank{rank}.pt.trace.json.gz") as f:
            trace = json.load(f)
        got = Counter(e["name"] for e in trace["traceEvents"]
                      if e.get("ph") == "X" and e.get("name", "").startswith("PP:"))
        assert got == Counter({f"PP:{rank}{a}{mb}": 1 for a in "FB" for mb in (0, 1)})
        assert trace["traceana"]["schedule"] == "1f1b"
    assert json.loads((run_dir / "run.json").read_text())["ranks_written"] == [0, 1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_collect_command_runs_a_zero_bubble_schedule_through_torch_pipelining(tmp_path):
    from traceana.cli import main

    out = tmp_path / "zb"
    assert main(["collect", "--schedule", "zero-bubble", "--pp", "4", "--microbatches", "4",
                 "--microbatch-size", "1", "--steps", "1", "-o", str(out)]) == 0
    with gzip.open(out / "rank0.pt.trace.json.gz") as f:
        trace = json.load(f)
    got = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name", "").startswith("PP:")}
    assert {"PP:0I0", "PP:0W0", "PP:2I0", "PP:2W0"} <= got  # rank 0 holds stages 0 and 2; backward split I/W
    assert json.loads((out / "run.json").read_text())["schedule"] == "zero-bubble"
    assert main(["collect", "--schedule", "zbv", "--pp", "3", "-o", str(tmp_path / "bad")]) == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_collect_passes_attention_seed_and_warmup_to_a_pipelining_schedule(tmp_path):
    """--attention, --seed and --warmup-steps were refused for the torch.distributed.pipelining schedules; they now
    mean what they mean for the reference trainer. The trace itself shows the attention kernel that ran."""
    from traceana.cli import main

    out = tmp_path / "zbv"
    assert main(["collect", "--schedule", "zbv", "--pp", "4", "--microbatches", "4", "--microbatch-size", "1",
                 "--steps", "1", "--attention", "sdpa", "--seed", "7", "--warmup-steps", "2", "-o", str(out)]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["attention"] == "sdpa" and manifest["profiler"]["warmup"] == 1
    with gzip.open(out / "rank0.pt.trace.json.gz") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    assert any("scaled_dot_product" in e["name"] for e in events)  # torch's fused attention, not softmax(QKᵀ)V
    assert sum(e["name"].startswith("ProfilerStep#") for e in events) == 1  # the warm-up steps are not profiled
