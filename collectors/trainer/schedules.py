"""Which micro-batch each stage runs forward (F) or backward (B), in order: pure functions, no torch.

GPipe (Huang et al. 2019): all forwards, then all backwards. 1F1B (PipeDream-Flush, Narayanan et al. 2021, §3):
stage s runs p−s−1 warm-up forwards, then alternates one forward and one backward, then drains the backwards,
so it holds at most p−s micro-batches' activations instead of m.
"""

from __future__ import annotations

from typing import NamedTuple

F, B = "F", "B"


class Action(NamedTuple):
    kind: str  # "F" or "B"
    microbatch: int


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    return [Action(F, i) for i in range(microbatches)] + [Action(B, i) for i in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action(F, i) for i in range(warmup)]
    for i in range(microbatches - warmup):  # steady state: F(warmup+i), B(i)
        actions += [Action(F, warmup + i), Action(B, i)]
    actions += [Action(B, i) for i in range(microbatches - warmup, microbatches)]
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def actions_for(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    return SCHEDULES[schedule](stage, stages, microbatches)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not: the activations a stage holds at once."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == F else -1
        peak = max(peak, live)
    return peak
