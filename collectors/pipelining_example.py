"""Profile torch.distributed.pipelining's own schedules with traceana: a runnable example.

    python -m collectors.pipelining_example --schedule 1f1b -o runs/pipelining_1f1b
    python -m collectors.pipelining_example --schedule gpipe -o runs/pipelining_gpipe
    python -m collectors.pipelining_example --schedule interleaved-1f1b -o runs/pipelining_interleaved
    python -m collectors.pipelining_example --schedule zero-bubble -o runs/pipelining_zb --truth

Every schedule torch 2.13 ships (``SCHEDULES``): Schedule1F1B, ScheduleGPipe (one stage per rank, 4 ranks) and the
multi-stage ones on 2 ranks × 2 virtual stages — ScheduleInterleaved1F1B, ScheduleLoopedBFS and
ScheduleInterleavedZeroBubble on the looped placement (rank r holds r, r+2), ScheduleZBVZeroBubble and
ScheduleDualPipeV on the V placement (rank r holds r and 3−r). The model is the reference trainer's GPT cut into
``PipelineStage``s; the only traceana lines in ``run_rank`` are ``annotate(schedule)`` and the ``PipelineProfiler``
block.

``--truth`` also records, outside the profiler, ``time.perf_counter_ns()`` spans of every compute action the
schedule runs (its own ``record_function`` spans of F, B, I, W and overlapped F+B, timed by a wrapper) and compute
call (the stage's
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``, gradient scaling, handing a tensor to the next stage on the same rank (V schedules),
the loss, merging the outputs, the optimizer step) and of
every P2P call (torch's ``_batch_p2p`` / ``_sorted_batch_p2p`` posts and ``_wait_batch_p2p`` waits; time in one
is blocked, not compute, even inside an action), per step, into ``<out>.truth/rank{R}.json``: an independent
measurement to check traceana's compute and blocked shares against. Each span and step also carries how long the
thread was runnable but waiting for a CPU inside it (Linux's schedstat run delay): on a machine with fewer cores than
ranks a descheduled thread records nothing in the trace, and that is where a trace and a timer can disagree. Each
step also carries the run delay of the process's other threads in it: gloo moves a message's bytes on its own socket
threads, so a receive can return late because the peer's (or its own) socket thread waited for a CPU, which neither
the trace nor the training thread's own delay shows.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from collectors.launch import _start_method, free_port
from collectors.manifest import finalize_manifest, host_facts
from collectors.pipelining import annotate
from collectors.profiler import PipelineProfiler
from collectors.trainer import data
from collectors.trainer.config import PRESETS
from collectors.trainer.model import GPT
from collectors.trainer.workload import Clock, make_sleeping, other_threads_run_delay_ns, run_delay_ns
from traceana.core.manifest import Manifest, Workload
from traceana.core.pipeline_rules import placement_of, stage_layer_ranges
from traceana.core.pipeline_rules import stages_of_ranks as rules_stages_of_ranks

# name (as in run.json) -> (torch class, virtual stages per rank this example runs); which rank holds which stage is
# traceana.core.pipeline_rules' placement rule
SCHEDULE_CLASSES = {
    "1f1b": ("Schedule1F1B", 1),
    "gpipe": ("ScheduleGPipe", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "looped-bfs": ("ScheduleLoopedBFS", 2),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}
SCHEDULES = tuple(SCHEDULE_CLASSES)


def stages_of_ranks(schedule: str, world: int) -> list[list[int]]:
    """The stages each rank holds (traceana.core.pipeline_rules.stages_of_ranks: looped or V)."""
    return rules_stages_of_ranks(placement_of(schedule), world, SCHEDULE_CLASSES[schedule][1])


# Runtime schedules' compute actions. (GPipe's ``Forward {i}`` / ``Backward {i}`` group a micro-batch's P2P posts
# with its compute and are not timed as actions: the stage calls inside them are.)
COMPUTE_ACTION = re.compile(r"^(PP:\d+[FBIW]\d+|PP:\(.*\)OVERLAP_F_B)$")


class Truth:
    """``time.perf_counter_ns()`` spans of compute calls and blocking P2P waits, kept outside the profiler, each with
    the time the thread spent descheduled (runnable, waiting for a CPU) inside it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, int, int, int]] = []  # kind, start, end, run-queue delay inside
        # start, end, run-queue delay inside, and that of the process's other threads (gloo's) in the step
        self.steps: list[tuple[int, int, int, int]] = []

    def wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            d0, t0 = run_delay_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter_ns()
                self.spans.append((kind, t0, t1, run_delay_ns() - d0))
        return timed

    def install(self, pipe: list, optimizer) -> None:
        from torch.distributed.pipelining import schedules

        for st in pipe:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                           "perform_reduce_grad", "set_local_fwd_input", "set_local_bwd_input"):
                setattr(st, method, self.wrap("compute", getattr(st, method)))
        optimizer.step = self.wrap("compute", optimizer.step)
        # Tensor work the schedule does after the micro-batches: concatenating their outputs. (Splitting the batch
        # before them only makes views: host bookkeeping, like the rest of the schedule's Python.)
        schedules.merge_chunks = self.wrap("compute", schedules.merge_chunks)
        # The runtime schedules' own spans of compute actions (F, B, I, W, an overlapped F+B), timed around the
        # profiler's record_function: the action, including any P2P wait inside it, which is
        # counted as blocked instead.
        real = schedules.record_function
        spans = self.spans

        class timed_record_function:
            def __init__(self, name: str, *args, **kwargs) -> None:
                self.name, self.inner = name, real(name, *args, **kwargs)

            def __enter__(self):
                self.d0, self.t0 = run_delay_ns(), time.perf_counter_ns()
                return self.inner.__enter__()

            def __exit__(self, *exc):
                out = self.inner.__exit__(*exc)
                if COMPUTE_ACTION.match(self.name):
                    t1 = time.perf_counter_ns()
                    spans.append(("compute", self.t0, t1, run_delay_ns() - self.d0))
                return out

        schedules.record_function = timed_record_function
        # Every P2P call the schedules make goes through these three: posting (gloo's post can itself block) and
        # waiting.
        for fn in ("_batch_p2p", "_sorted_batch_p2p", "_wait_batch_p2p"):
            setattr(schedules, fn, self.wrap("blocked", getattr(schedules, fn)))

    def write(self, path: Path) -> None:
        import json

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"spans": self.spans, "steps": self.steps}))


class Part(nn.Module):
    """A contiguous slice of the GPT as a plain module (PipelineStage wants ``forward(x) -> y``)."""

    def __init__(self, model: GPT, *, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        self.layers = nn.ModuleList(model.blocks[i] for i in stage_layer_ranges(model.shape.layers, stages)[stage])
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        if self.last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.embed(x)
            x = h + self.pos(torch.arange(x.shape[1])) if self.pos is not None else h
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def manifest(schedule: str, world: int, stages: int, num_microbatches: int, microbatch_size: int, preset: str,
             steps: int, *, attention: str = "naive", warmup_steps: int = 1,
             workload: Workload | None = None) -> Manifest:
    per_rank = stages_of_ranks(schedule, world)
    return Manifest(
        world_size=world, pp=stages, stage_of_rank=tuple(p[0] for p in per_rank), schedule=schedule,
        microbatch_size=microbatch_size, num_microbatches=num_microbatches, global_batch=microbatch_size * num_microbatches,
        model=PRESETS[preset], dtype="float32", attention=attention, recompute="none", device="cpu",
        profiler={"wait": 0, "warmup": min(warmup_steps, 1), "active": steps, "repeat": 1},
        torch_version=torch.__version__,
        **host_facts(world),
        collector="torch.distributed.pipelining", stages_of_rank=tuple(tuple(p) for p in per_rank),
        workload=workload,
    )


def run_rank(rank: int, world: int, init_method: str, schedule_name: str, out_dir: Path, preset: str,
             num_microbatches: int, microbatch_size: int, steps: int, truth_dir: Path | None = None,
             attention: str = "naive", seed: int = 1234, warmup_steps: int = 1,
             workload: Workload | None = None) -> None:
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    shape = PRESETS[preset]
    cls_name, virtual = SCHEDULE_CLASSES[schedule_name]
    stages = world * virtual
    torch.manual_seed(seed)
    model = GPT(shape, attention=attention)
    my_stages = stages_of_ranks(schedule_name, world)[rank]
    parts = [Part(model, stage=s, stages=stages) for s in my_stages]
    clock = Clock(rank=rank) if workload is not None else None
    if clock is not None:  # the known workload (collect --work sleep): each stage's passes hold instead of computing
        for s, part in zip(my_stages, parts):
            x = (torch.zeros(microbatch_size, shape.seq, dtype=torch.int64) if s == 0 else
                 torch.zeros(microbatch_size, shape.seq, shape.hidden, requires_grad=True))
            make_sleeping(part, workload, stage=s, rank=rank, clock=clock, example=(x,))
    pipe = [pipelining.PipelineStage(part, s, stages, torch.device("cpu")) for s, part in zip(my_stages, parts)]
    if clock is not None:
        for st in pipe:
            _label_microbatches(st, clock)
    params = [p for st in pipe for p in st.submod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    truth = Truth() if truth_dir is not None else None
    cls = getattr(pipelining.schedules, cls_name)
    timed_loss = truth.wrap("compute", loss_fn) if truth else loss_fn
    schedule = cls(pipe[0] if placement_of(schedule_name) == "single" else pipe, n_microbatches=num_microbatches, loss_fn=timed_loss)
    annotate(schedule)  # <- traceana: per-micro-batch PP:{stage}F{mb} / B spans
    # The batches are made before the loop: a step is the schedule and the optimizer, no data loading.
    batches = [data.batch(seed=seed, step=step, num_microbatches=1, microbatch_size=microbatch_size * num_microbatches,
                          seq=shape.seq, vocab=shape.vocab) for step in range(warmup_steps + steps)]
    # the whole batch of each step (the schedule splits it), as the first and last stage take it
    batches = [((inputs[0],) if 0 in my_stages else (),
                {"target": targets[0], "losses": []} if stages - 1 in my_stages else {})
               for inputs, targets in batches]
    # As the reference trainer: the profiler's warm-up is the last unprofiled step; earlier ones run before it.
    unprofiled = max(warmup_steps - 1, 0)
    for step, (args, kwargs) in enumerate(batches[:unprofiled]):
        _train_step(schedule, optimizer, args, kwargs, clock, step)
    if truth:  # the wall-clock spans cover the profiled window's steps only
        truth.install(pipe, optimizer)
    with PipelineProfiler(out_dir, rank=rank, stage=my_stages[0], world_size=world, pp=stages,
                          schedule=schedule_name, warmup=min(warmup_steps, 1), active=steps,
                          manifest=manifest(schedule_name, world, stages, num_microbatches, microbatch_size, preset, steps,
                                            attention=attention, warmup_steps=warmup_steps, workload=workload)
                          if rank == 0 else None,
                          metadata={"stages": my_stages, "collector": "torch.distributed.pipelining"}) as prof:
        delay, others, begun = run_delay_ns(), other_threads_run_delay_ns(), time.perf_counter_ns()
        for step, (args, kwargs) in enumerate(batches[unprofiled:], start=unprofiled):
            _train_step(schedule, optimizer, args, kwargs, clock, step)
            if truth:
                now = time.perf_counter_ns()
                truth.steps.append((begun, now, run_delay_ns() - delay, other_threads_run_delay_ns() - others))
            prof.step()
            delay, others, begun = run_delay_ns(), other_threads_run_delay_ns(), time.perf_counter_ns()
    dist.destroy_process_group()
    if truth:
        truth.write(truth_dir / f"rank{rank}.json")
    if clock is not None:
        clock.write(out_dir, workload)


def _train_step(schedule, optimizer, args, kwargs, clock: Clock | None, step: int) -> None:
    begun, delay = time.perf_counter_ns(), run_delay_ns()
    if clock is not None:
        clock.step = step
    optimizer.zero_grad(set_to_none=True)
    schedule.step(*args, **kwargs)
    optimizer.step()
    if clock is not None:
        clock.steps.append((step, begun, time.perf_counter_ns(), run_delay_ns() - delay))


def _label_microbatches(stage, clock: Clock) -> None:
    """Tell the known workload's clock which micro-batch each forward of ``stage`` is (its backward keeps it)."""
    forward = stage.forward_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args, **kwargs):
        clock.microbatch = fwd_chunk_id
        return forward(fwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk


def collect(schedule: str, out_dir: str | Path, *, preset: str = "tiny-gpt", num_microbatches: int = 8,
            microbatch_size: int = 2, steps: int = 2, ranks: int | None = None, truth: bool = False,
            attention: str = "naive", seed: int = 1234, warmup_steps: int = 1,
            workload: Workload | None = None) -> Path:
    """Collect one run of a pipelining schedule: 4 ranks × 1 stage (multi-stage schedules: 2 ranks × 2 stages).
    With ``truth``, the independent wall-clock spans go to ``<out_dir>.truth/`` (see the module doc). ``attention``,
    ``seed`` and ``warmup_steps`` mean what they mean for the reference trainer (collectors.trainer.config)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    virtual = SCHEDULE_CLASSES[schedule][1]
    world = ranks or (4 if virtual == 1 else 2)
    truth_dir = truth_path(out_dir) if truth else None
    started = time.time()
    method = _start_method()
    mp.start_processes(run_rank, args=(world, f"tcp://127.0.0.1:{free_port()}", schedule, out_dir, preset,
                                       num_microbatches, microbatch_size, steps, truth_dir, attention, seed,
                                       warmup_steps, workload),
                       nprocs=world, join=True, start_method=method)
    finalize_manifest(out_dir, manifest(schedule, world, world * virtual, num_microbatches, microbatch_size, preset, steps,
                                        attention=attention, warmup_steps=warmup_steps, workload=workload),
                      since=started)
    return out_dir


def truth_path(out_dir: Path) -> Path:
    """Where ``collect(..., truth=True)`` writes its wall-clock spans: beside the run folder, not in it."""
    return out_dir.with_name(out_dir.name + ".truth")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--preset", default="tiny-gpt", choices=sorted(PRESETS))
    parser.add_argument("--microbatches", "--num-microbatches", dest="num_microbatches", type=int, default=8,
                        metavar="MICROBATCHES")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--truth", action="store_true",
                        help="also record perf_counter spans of compute and P2P waits beside the run folder")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(collect(args.schedule, args.out, preset=args.preset, num_microbatches=args.num_microbatches,
                  microbatch_size=args.microbatch_size, steps=args.steps, truth=args.truth))


if __name__ == "__main__":
    main()
