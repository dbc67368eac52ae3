"""Tiny real runs collected once per test session (shared by pytest-xdist workers through a file lock).

Use the ``collected_run`` fixture from tests/conftest.py: ``run_dir = collected_run("1f1b_bpipe")``.
Every run: tiny model, 4 stages (pp=2 where noted), 4 micro-batches of 1 sequence, 1 warm-up + 1 profiled step
(2 where noted).

``pipelining-<schedule>``: torch.distributed.pipelining's own schedule classes (collectors.pipelining_example, what
``traceana collect --schedule NAME`` runs): 4 ranks for 1f1b and gpipe, 2 ranks × 2 stages for the multi-stage ones,
4 micro-batches of 1 sequence, two profiled steps, with the independent wall-clock truth beside the run
(``collectors.pipelining_example.truth_path(run_dir)``). ``@3``: on 3 ranks × 2 stages, 3 micro-batches, one profiled step, no truth.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from collectors.trainer.config import SCHEDULES  # no torch import
from traceana.core.manifest import MULTI_STAGE_SCHEDULES, Workload

RUNS = {
    # name: CollectConfig keyword arguments
    "1f1b": dict(preset="tiny-gpt", pp=4, num_microbatches=4, microbatch_size=1, schedule="1f1b"),
    "1f1b_bpipe": dict(preset="tiny-gpt", pp=4, num_microbatches=4, microbatch_size=1, schedule="1f1b", bpipe=True),
    "gpipe": dict(preset="tiny-gpt", pp=4, num_microbatches=4, microbatch_size=1, schedule="gpipe"),
    # m = p: 1F1B never reaches a steady state, so each stage's peak comes at its first backward, before any of this
    # step's gradients exist; two profiled steps: the second starts holding the first's gradients
    # (tests/measure/test_memory_truth_runs.py)
    "1f1b_pp3_m3": dict(preset="tiny-gpt", pp=3, num_microbatches=3, microbatch_size=1, schedule="1f1b", steps=2),
    "gpipe_llama_recompute": dict(preset="tiny-llama", pp=2, num_microbatches=2, microbatch_size=1, schedule="gpipe",
                                  recompute="selective", attention="sdpa"),
    # two profiled steps: validate measures memory on the steps after the first (the first profiled step's
    # activation peak reads ~0.4 MB higher on stages 1-3, see docs/model.md "Memory: model against measurement")
    # (and the check: pp=4, m=8, 2 sequences per micro-batch)
    "1f1b_m8": dict(preset="tiny-gpt", pp=4, num_microbatches=8, microbatch_size=2, schedule="1f1b", steps=2),
    "1f1b_m8_bpipe": dict(preset="tiny-gpt", pp=4, num_microbatches=8, microbatch_size=2, schedule="1f1b", bpipe=True,
                          steps=2),
    # data-parallel pipelines: pp=2 × dp=2 (rank = stage · dp + replica), six profiled steps (a straggler is slow
    # in every one of the 5 measured), on the known workload (F 20, B 40 ms); "_slow" holds every pass of rank 1
    # (stage 0 of replica 1) three times as long: tests/measure/test_replicas.py
    "1f1b_pp2dp2": dict(preset="tiny-gpt", pp=2, dp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b", steps=6,
                        workload=Workload("sleep", 20.0, 40.0)),
    "1f1b_pp2dp2_slow": dict(preset="tiny-gpt", pp=2, dp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b",
                             steps=6, workload=Workload("sleep", 20.0, 40.0, slow_ranks=((1, 3.0),))),
    # the plain configuration again, collected after the other two (A B A: the run-to-run change beside the noise)
    "1f1b_pp2dp2_again": dict(preset="tiny-gpt", pp=2, dp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b",
                              steps=6, workload=Workload("sleep", 20.0, 40.0)),
    # The known workload (collect --work sleep, docs/known-workload.md): passes hold stated times instead of
    # computing. GPipe pp=2 with stage 1 slowed ×2 and a weight pass, and twice the same configuration holding 0 ms
    # (its step is the configuration's overhead: P2P, optimizer, host, profiler), before and after
    # (tests/collectors/test_known_workload.py); 1F1B pp=2 plain, stage 1 slowed ×3, plain again (A B A,
    # tests/causal/test_whatif_runs.py)
    # 1F1B pp=4, 4 micro-batches, F = 20 ms, B = 40 ms: the stages' bubbles (tests/measure/test_schedule_real.py)
    "sleep_1f1b": dict(preset="tiny-gpt", pp=4, num_microbatches=4, microbatch_size=1, schedule="1f1b",
                       workload=Workload("sleep", 20.0, 40.0)),
    "sleep_gpipe_pp2": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="gpipe", steps=2,
                            workload=Workload("sleep", 15.0, 25.0, 5.0, slow_stages=((1, 2.0),))),
    "sleep0_gpipe_pp2": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="gpipe", steps=2,
                             workload=Workload("sleep", 0.0, 0.0)),
    "sleep0_gpipe_pp2_again": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="gpipe",
                                   steps=2, workload=Workload("sleep", 0.0, 0.0)),
    "sleep_1f1b_pp2": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b", steps=3,
                           workload=Workload("sleep", 20.0, 40.0)),
    "sleep_1f1b_pp2_slow": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b", steps=3,
                                workload=Workload("sleep", 20.0, 40.0, slow_stages=((1, 3.0),))),
    "sleep_1f1b_pp2_again": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="1f1b",
                                 steps=3, workload=Workload("sleep", 20.0, 40.0)),
    # GPipe pp=2, F 10, B 20 ms, stage 1 slowed ×3: each pass's hold split over its stage's 4 blocks (layer spans
    # PP:{s}F{mb}/L{layer}), layers moved by hand (tests/validation/test_whatif_layers.py)
    "sleep_gpipe_pp2_layers": dict(preset="tiny-gpt", pp=2, num_microbatches=4, microbatch_size=1, schedule="gpipe",
                                   steps=3, workload=Workload("sleep", 10.0, 20.0, slow_stages=((1, 3.0),))),
    # tiny-gpt's 8 blocks split 5,3 (collect --layers-per-stage 5,3): real compute, and the known workload with
    # per-layer holds (--layer-holds per-layer: F 4, I 6, W 2 ms a block, block 1 ×2: --slow-layer 1:2)
    # (tests/collectors/test_collect_layers.py)
    "layers_5_3": dict(preset="tiny-gpt", pp=2, num_microbatches=2, microbatch_size=1, schedule="1f1b",
                       layers_per_stage=(5, 3)),
    "sleep_layers_5_3": dict(preset="tiny-gpt", pp=2, num_microbatches=2, microbatch_size=1, schedule="1f1b",
                             layers_per_stage=(5, 3), workload=Workload("sleep", 4.0, 6.0, 2.0, slow_layers=((1, 2.0),),
                                                                         layer_holds="per-layer")),
}
PIPELINING_SCHEDULES = (*SCHEDULES, *MULTI_STAGE_SCHEDULES)  # what ``traceana collect --schedule`` offers
PIPELINING_RUNS = {
    # name: collectors.pipelining_example.collect keyword arguments
    **{f"pipelining-{s}": dict(schedule=s, num_microbatches=4, microbatch_size=1, steps=2, truth=True)
       for s in PIPELINING_SCHEDULES},
    **{f"pipelining-{s}@3": dict(schedule=s, num_microbatches=3, microbatch_size=1, steps=1, ranks=3)
       for s in ("interleaved-1f1b", "zbv")},
    # the known workload on a split-backward schedule: F 10, I 20, W 10 ms (tests/collectors/test_known_workload.py), with the
    # wall-clock truth beside it (the time each rank neither computed nor waited: tests/validation/test_schedules_truth.py)
    "pipelining-zbv-sleep": dict(schedule="zbv", num_microbatches=4, microbatch_size=1, steps=1, truth=True,
                                 workload=Workload("sleep", 10.0, 20.0, 10.0)),
}


def build(name: str, root: Path) -> Path:
    """Collect ``name`` into ``root/name`` unless another worker already did (atomic rename marks it done)."""
    from filelock import FileLock

    from collectors.launch import collect
    from collectors.pipelining_example import truth_path
    from collectors.trainer.config import CollectConfig

    if name not in RUNS and name not in PIPELINING_RUNS:
        raise KeyError(f"unknown collected run {name!r}; known: {', '.join([*RUNS, *PIPELINING_RUNS])}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (final / "run.json").is_file():
            tmp = root / f".{name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(truth_path(tmp), ignore_errors=True)
            if name in PIPELINING_RUNS:
                from collectors.pipelining_example import collect as collect_pipelining

                collect_pipelining(out_dir=tmp, **PIPELINING_RUNS[name])
            else:
                collect(CollectConfig(**{"steps": 1, "warmup_steps": 1, **RUNS[name]}), tmp)
            shutil.rmtree(final, ignore_errors=True)
            shutil.rmtree(truth_path(final), ignore_errors=True)
            if truth_path(tmp).exists():  # the truth first: a run folder in place means everything is there
                truth_path(tmp).rename(truth_path(final))
            tmp.rename(final)
    return final
