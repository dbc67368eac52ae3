"""Every pipeline schedule's name, listed once, with the two things the rules tell schedules apart by: where its
stages sit (``single``: one stage a device; ``looped``: device d holds d, d+p, …; ``v``: d and 2p−1−d) and whether
its backward is split into an input-gradient and a weight-gradient pass (I and W). The names are run.json's words
for its ``schedule`` key (plus ``UNKNOWN``, run.json's word for one it does not know) and ``--schedule``'s choices.

The run.json schema (traceana.core.manifest), the pipeline rules (traceana.core.pipeline_rules), the model
(traceana.core.training_config), the analysis, the command line and the collectors import them from here. No imports:
reading run.json and building the help stay cheap.
"""

from __future__ import annotations

# name: (placement, backward) — the order is the order the help and the messages list them in
_SCHEDULE_KINDS = {
    "gpipe": ("single", "whole"),
    "1f1b": ("single", "whole"),
    "interleaved-1f1b": ("looped", "whole"),
    "looped-bfs": ("looped", "whole"),
    "zero-bubble": ("looped", "split"),
    "zbv": ("v", "split"),
    "dualpipev": ("v", "split"),
}
UNKNOWN = "unknown"  # run.json's schedule when it does not know it (no rules: nothing is simulated)

SCHEDULES = tuple(_SCHEDULE_KINDS)  #: every schedule the rules know (run.json names these, or UNKNOWN)
RUN_JSON_SCHEDULES = (*SCHEDULES, UNKNOWN)  #: what run.json's ``schedule`` may say
ONE_STAGE_SCHEDULES = tuple(s for s, (placement, _) in _SCHEDULE_KINDS.items() if placement == "single")
MULTI_STAGE_SCHEDULES = tuple(s for s in SCHEDULES if s not in ONE_STAGE_SCHEDULES)  #: several stages a device
V_SCHEDULES = tuple(s for s, (placement, _) in _SCHEDULE_KINDS.items() if placement == "v")
SPLIT_BACKWARD_SCHEDULES = tuple(s for s, (_, backward) in _SCHEDULE_KINDS.items() if backward == "split")
#: several stages a device, each backward whole (its phases are still in autograd's ops)
WHOLE_BACKWARD_MULTI_STAGE = tuple(s for s in MULTI_STAGE_SCHEDULES if s not in SPLIT_BACKWARD_SCHEDULES)
#: the reference trainer's own (collectors/trainer); collect runs the others with torch.distributed.pipelining
TRAINER_SCHEDULES = ONE_STAGE_SCHEDULES
