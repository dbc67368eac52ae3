"""The pipeline rules' per-device orders (traceana/core/pipeline_rules.py, written without torch) against torch 2.13's
own schedule generators, the independent truth: each torch schedule class's ``_calculate_single_rank_operations``
(GPipe: ``_get_pipeline_order``), called on a stand-in object carrying only the attributes it reads, so no process
group or stage is built. torch's idle slots (None) are dropped; an overlapped F+B is its two sub-actions in order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from traceana.core.pipeline_rules import Op, device_of_stage, device_order  # noqa: E402

CLASSES = {
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[Op]:
    cls = getattr(torch_schedules, CLASSES[schedule])
    rounds = max(1, m // p)
    fake = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m, microbatches_per_round=m // rounds,
                           num_stages=p * v, _num_stages=p * v, _stages=[None] * v)
    out: list[Op] = []
    for a in cls._calculate_single_rank_operations(fake, rank):
        if a is None:
            continue
        subs = a.sub_actions if a.computation_type.value == "OVERLAP_F_B" else (a,)
        out += [Op(s.computation_type.value, s.stage_index, s.microbatch_index) for s in subs]
    return out


CASES = [
    ("looped-bfs", 2, 4, 2), ("looped-bfs", 3, 3, 3),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 10, 2),
    ("interleaved-1f1b", 4, 3, 3),
    ("zero-bubble", 2, 4, 2), ("zero-bubble", 4, 8, 2), ("zero-bubble", 3, 6, 1), ("zero-bubble", 4, 4, 1),
    ("zbv", 2, 4, 2), ("zbv", 4, 8, 2), ("zbv", 3, 4, 2), ("zbv", 4, 12, 2),
    ("dualpipev", 2, 4, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 3, 9, 2), ("dualpipev", 4, 13, 2),
]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_orders_equal_torch_schedules(schedule, p, m, v):
    for rank in range(p):
        assert device_order(schedule, pp=p, num_microbatches=m, device=rank, virtual_stages=v) == \
            torch_order(schedule, p, m, v, rank), (schedule, p, m, v, rank)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_gpipe_order_equals_torch(p):
    fake = SimpleNamespace(_num_stages=p, _n_microbatches=5)
    order = torch_schedules.ScheduleGPipe._get_pipeline_order(fake)
    for rank in range(p):
        truth = [Op(a.computation_type.value, a.stage_index, a.microbatch_index) for a in order[rank]
                 if a is not None and a.computation_type.value in ("F", "B")]
        assert device_order("gpipe", pp=p, num_microbatches=5, device=rank) == truth


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_placement_equals_torch(schedule, p):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = "v" if schedule == "zbv" else "loop"
    truth = generate_stage_to_rank_mapping(p, 2 * p, style=style)
    assert {s: device_of_stage(schedule, s, pp=p) for s in range(2 * p)} == truth
