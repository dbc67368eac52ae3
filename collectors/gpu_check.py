"""A prepared check of traceana on a real GPU (issue 26, item 6): collect with traceana's own collectors on the GPU,
record an independent truth beside the traces, analyse the runs and print the comparison.

NOT YET RUN ON A GPU: no device was lent to the session that wrote it (docs/gpu.md says what it checks and how to
read its output). ``--cpu-smoke`` runs the same path on the CPU with a wall clock in place of CUDA events.

    python -m collectors.gpu_check -o /tmp/gpu_check                # on a machine with a CUDA GPU (~2 min)
    python -m collectors.gpu_check -o /tmp/gpu_check --cpu-smoke    # the same collection and comparison on the CPU

What it runs (tiny models, a few steps):
1. the reference trainer (collectors.trainer) with its stages as processes sharing the one GPU (gloo with host
   staging, as ``collectors.trainer.train.choose_device`` picks when ranks outnumber GPUs), 1F1B, without and with
   BPipe;
2. torch.distributed.pipelining (the reference trainer's GPT cut into ``PipelineStage``s, as
   collectors/pipelining_example.py does): with two GPUs, two NCCL ranks; with one, one process holding both stages
   of an interleaved schedule (torch's P2P between two stages on one rank is tried; a failure is printed, not hidden).

The truth, recorded in each worker outside the profiler and outside traceana:
- CUDA events recorded on the stage's stream around every forward and backward call (the collectors' own F and B
  annotations are wrapped, so the events bracket exactly the work they name) and around every training step:
  ``elapsed_time`` after a synchronize gives each phase's GPU time per step;
- ``torch.cuda.max_memory_allocated`` per step (peak statistics reset at each step's start), and the allocation when
  the step's first forward starts (after ``zero_grad(set_to_none=True)``): the allocator's own peak and transient
  growth per stage.

What it prints and checks (issue 26's targets): traceana's forward and backward shares of each stage's step within
0.05 of the CUDA-event shares; its activation peak within 10 % of the allocator's (peak − allocation at the first
forward); BPipe lowering the largest stage's activation peak, by traceana and by the allocator alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SHARE_TOLERANCE = 0.05  # |traceana − CUDA events| for the forward and backward shares of a step
MEMORY_TOLERANCE = 0.10  # |traceana − allocator| / allocator for the activation peak


# --- the truth: timed outside the profiler -----------------------------------------------------------------------
@dataclass
class PhaseTimer:
    """Per training step, each phase's time and the allocator's counters. ``cuda``: CUDA events on the current
    stream (GPU time); else ``time.perf_counter_ns`` (the CPU smoke run)."""

    cuda: bool
    steps: list[dict] = field(default_factory=list)
    _open: dict | None = None

    def _mark(self):
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter_ns()

    def _ns(self, a, b) -> int:
        return int(a.elapsed_time(b) * 1e6) if self.cuda else b - a

    def begin_step(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._open = {"start": self._mark(), "spans": [], "base_bytes": None}

    def end_step(self) -> None:
        import torch

        step = self._open
        step["end"] = self._mark()
        step["peak_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None
        self.steps.append(step)
        self._open = None

    @contextlib.contextmanager
    def around(self, phase: str, inner):
        """``inner`` (a collector's annotation) with this phase timed inside it."""
        import torch

        with inner:
            step = self._open
            if step is not None and step["base_bytes"] is None and phase == "forward" and self.cuda:
                step["base_bytes"] = torch.cuda.memory_allocated()
            start = self._mark()
            try:
                yield
            finally:
                if step is not None:
                    step["spans"].append((phase, start, self._mark()))

    def write(self, path: Path) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for s in self.steps:
            phases: dict[str, int] = {}
            for phase, a, b in s["spans"]:
                phases[phase] = phases.get(phase, 0) + self._ns(a, b)
            out.append({"dur_ns": self._ns(s["start"], s["end"]), "phases_ns": phases,
                        "base_bytes": s["base_bytes"], "peak_bytes": s["peak_bytes"]})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"clock": "cuda events" if self.cuda else "perf_counter", "steps": out}))


def _spawn(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """``nprocs`` processes of ``fn(rank, *args)``, killed past ``timeout_s`` (a stuck run must not hold a lent GPU
    for nothing: torch's P2P between two stages of one rank may hang rather than fail)."""
    import torch.multiprocessing as mp

    pc = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not pc.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in pc.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s:.0f} s; its processes were killed")


# --- 1. the reference trainer, stages as processes sharing the GPU -----------------------------------------------
def _trainer_worker(rank: int, config, world: int, init_method: str, out_dir: Path, truth_dir: Path,
                    cuda: bool) -> None:
    import torch.distributed as dist

    from collectors import annotations as ann
    from collectors.trainer import train as trainer

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timer = PhaseTimer(cuda=cuda)
    forward, backward, one_step = ann.forward, ann.backward, trainer._train_step
    ann.forward = lambda s, mb: timer.around("forward", forward(s, mb))
    ann.backward = lambda s, mb: timer.around("backward", backward(s, mb))

    def timed_step(*args, **kwargs):
        timer.begin_step()
        try:
            return one_step(*args, **kwargs)
        finally:
            timer.end_step()

    trainer._train_step = timed_step
    setup = trainer.choose_device(rank, world)
    if cuda and setup.device.type != "cuda":
        raise RuntimeError(f"rank {rank}: no CUDA device was chosen ({setup})")
    trainer.init_process_group(setup, init_method)
    try:
        trainer.train(config, setup, out_dir)
    finally:
        dist.destroy_process_group()
    timer.write(truth_dir / f"rank{rank}.json")


def collect_trainer(out_dir: Path, *, bpipe: bool, cuda: bool, steps: int,
                    timeout_s: float = 300.0) -> tuple[Path, Path]:
    from collectors.launch import free_port
    from collectors.manifest import finalize_manifest
    from collectors.trainer.config import CollectConfig
    from collectors.trainer.train import choose_device, manifest_for

    config = CollectConfig(preset="tiny-gpt", pp=4, num_microbatches=8, microbatch_size=2, schedule="1f1b", bpipe=bpipe,
                           steps=steps, warmup_steps=1)
    truth_dir = out_dir.with_name(out_dir.name + ".truth")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _spawn(_trainer_worker, (config, config.world_size, f"tcp://127.0.0.1:{free_port()}", out_dir, truth_dir, cuda),
           config.world_size, timeout_s)
    finalize_manifest(out_dir, manifest_for(config, choose_device(0, config.world_size)), since=started)
    return out_dir, truth_dir


# --- 2. torch.distributed.pipelining -----------------------------------------------------------------------------
def _pipelining_worker(rank: int, world: int, init_method: str, out_dir: Path, truth_dir: Path, cuda: bool,
                       steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from collectors import pipelining as collector_pipelining
    from collectors import pipelining_example as example
    from collectors.profiler import PipelineProfiler
    from collectors.trainer import data
    from collectors.trainer.config import PRESETS
    from collectors.trainer.model import GPT
    from traceana.core import names

    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    schedule_name = "1f1b" if world > 1 else "interleaved-1f1b"
    cls_name, virtual = example.SCHEDULE_CLASSES[schedule_name]
    stages = max(world * virtual, 2)
    mine = list(range(stages)) if world == 1 else example.stages_of_ranks(schedule_name, world)[rank]
    timer = PhaseTimer(cuda=cuda)
    span = collector_pipelining.pp_span

    def timed_span(stage, action, mb):
        phase = names.PHASE_OF_ACTION.get(action)
        return timer.around(phase, span(stage, action, mb)) if phase else span(stage, action, mb)

    collector_pipelining.pp_span = timed_span

    class Part(example.Part):  # the example's slice, with its positions on the stage's device
        def forward(self, x):
            if self.first:
                h = self.embed(x)
                x = h + self.pos(torch.arange(x.shape[1], device=x.device)) if self.pos is not None else h
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x)) if self.last else x

    shape = PRESETS["tiny-gpt"]
    torch.manual_seed(1234)
    model = GPT(shape).to(device)
    pipe = [pipelining.PipelineStage(Part(model, stage=s, stages=stages), s, stages, device) for s in mine]
    optimizer = torch.optim.AdamW([p for st in pipe for p in st.submod.parameters()], lr=1e-3)
    cls = getattr(pipelining.schedules, cls_name)
    num_microbatches = 4
    schedule = cls(pipe if len(pipe) > 1 or virtual > 1 else pipe[0], n_microbatches=num_microbatches,
                   loss_fn=example.loss_fn)
    collector_pipelining.annotate(schedule)
    batches = [data.batch(seed=1234, step=i, num_microbatches=1, microbatch_size=2 * num_microbatches, seq=shape.seq,
                          vocab=shape.vocab) for i in range(1 + steps)]
    with PipelineProfiler(out_dir, rank=rank, stage=mine[0], world_size=world, pp=stages, schedule=schedule_name,
                          warmup=1, active=steps,
                          manifest=example.manifest(schedule_name, world, stages, num_microbatches, 2, "tiny-gpt", steps)
                          if rank == 0 else None,
                          metadata={"stages": mine, "collector": "torch.distributed.pipelining"}) as prof:
        for inputs, targets in batches:
            timer.begin_step()
            optimizer.zero_grad(set_to_none=True)
            args = (inputs[0].to(device),) if 0 in mine else ()
            kwargs = {"target": targets[0].to(device), "losses": []} if stages - 1 in mine else {}
            schedule.step(*args, **kwargs)
            optimizer.step()
            timer.end_step()
            prof.step()
    dist.destroy_process_group()
    timer.write(truth_dir / f"rank{rank}.json")


def collect_pipelining(out_dir: Path, *, cuda: bool, steps: int, timeout_s: float = 120.0) -> tuple[Path, Path]:
    import torch

    from collectors.launch import free_port

    world = 2 if (not cuda or torch.cuda.device_count() >= 2) else 1
    truth_dir = out_dir.with_name(out_dir.name + ".truth")
    out_dir.mkdir(parents=True, exist_ok=True)
    _spawn(_pipelining_worker, (world, f"tcp://127.0.0.1:{free_port()}", out_dir, truth_dir, cuda, steps), world,
           timeout_s)
    return out_dir, truth_dir


# --- analysis and comparison: no torch, no GPU ------------------------------------------------------------------
def truth_of(truth_dir: Path) -> dict[int, list[dict]]:
    """Per rank, its steps as recorded (every training step, unprofiled warm-up ones first)."""
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text())["steps"]
            for p in sorted(Path(truth_dir).glob("rank*.json"))}


def truth_shares(steps: list[dict]) -> dict[str, float | None]:
    """Mean over ``steps`` of each phase's share of its step, and the largest transient growth of the allocator
    (``peak_bytes − base_bytes``; None without allocator counters)."""
    out: dict[str, float | None] = {}
    for phase in ("forward", "backward"):
        shares = [s["phases_ns"].get(phase, 0) / s["dur_ns"] for s in steps if s["dur_ns"] > 0]
        out[phase] = sum(shares) / len(shares) if shares else None
    growth = [s["peak_bytes"] - s["base_bytes"] for s in steps
              if s.get("peak_bytes") is not None and s.get("base_bytes") is not None]
    out["activation_peak_bytes"] = max(growth) if growth else None
    out["peak_bytes"] = max((s["peak_bytes"] for s in steps if s.get("peak_bytes") is not None), default=None)
    return out


def compare(run_dir: Path, truth_dir: Path, *, profiled: int) -> tuple[list[dict], object]:
    """One row per rank: traceana's figures over its measured steps beside the truth's over the same steps (the
    truth's last ``profiled`` steps are the trace's, in order), and whether each is within its tolerance."""
    import polars as pl

    import traceana
    from traceana.measure.analysis import analyze

    a = analyze(traceana.load_run(run_dir, cache=False))
    measured = list(a.summary.steps)
    traced = sorted(a.steps.filter(pl.col("step") >= 0)["step"].unique().to_list())
    rows = []
    for rank, recorded in truth_of(truth_dir).items():
        by_step = dict(zip(traced, recorded[-profiled:]))
        truth = truth_shares([by_step[s] for s in measured if s in by_step])
        st = a.stages.filter(pl.col("rank") == rank).row(0, named=True)
        got = {"forward": st["forward_pct"] / 100, "backward": (st["backward_pct"] + st["backward_input_pct"]
                                                                + st["backward_weight_pct"]) / 100,
               "activation_peak_bytes": st["activation_peak_bytes"], "peak_bytes": st["peak_memory_bytes"]}
        row = {"rank": rank, "stage": st["stage"]}
        for k in ("forward", "backward"):
            row[k] = (truth[k], got[k], truth[k] is not None and abs(got[k] - truth[k]) <= SHARE_TOLERANCE)
        for k in ("activation_peak_bytes", "peak_bytes"):
            t, g = truth[k], got[k]
            row[k] = (t, g, None if not t or g is None else abs(g - t) / t <= MEMORY_TOLERANCE)
        rows.append(row)
    return rows, a


def print_comparison(title: str, rows: list[dict]) -> bool:
    print(f"\n{title}")
    print(f"{'rank':>4} {'stage':>5} | {'forward share: events / traceana':>34} | {'backward share':>22} | "
          f"{'activation peak MiB: allocator / traceana':>42}")
    ok = True
    for r in rows:
        def share(k):
            t, g, good = r[k]
            return f"{'–' if t is None else f'{t:.3f}'} / {g:.3f} {'ok' if good else 'OFF'}"

        t, g, good = r["activation_peak_bytes"]
        mem = f"{'–' if t is None else f'{t / 2**20:.2f}'} / {'–' if g is None else f'{g / 2**20:.2f}'} " + \
              ("(no allocator counters)" if good is None else "ok" if good else "OFF")
        print(f"{r['rank']:>4} {str(r['stage']):>5} | {share('forward'):>34} | {share('backward'):>22} | {mem:>42}")
        ok &= bool(r["forward"][2] and r["backward"][2] and good is not False)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True, help="folder for the runs and their truth")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per run (default 3)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on the CPU with a wall clock for the truth (checks the script, not the GPU)")
    parser.add_argument("--skip-pipelining", action="store_true", help="only the reference trainer's runs")
    args = parser.parse_args(argv)
    import torch

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); use --cpu-smoke to check the "
              "script on the CPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda else "cpu (smoke run: wall clock, no allocator counters)"
    print(f"gpu_check on {device}, torch {torch.__version__}")
    ok = True
    peaks = {}
    for bpipe in (False, True):
        name = "trainer_bpipe" if bpipe else "trainer"
        run, truth = collect_trainer(args.out / name, bpipe=bpipe, cuda=cuda, steps=args.steps)
        rows, a = compare(run, truth, profiled=args.steps)
        ok &= print_comparison(f"reference trainer, 4 stages sharing the device, 1F1B{' + BPipe' if bpipe else ''} "
                               f"({run})", rows)
        peaks[bpipe] = (max((r["activation_peak_bytes"][0] or 0) for r in rows), a.summary.largest_activation_peak_mib)
    lowered_truth = peaks[True][0] < peaks[False][0] if peaks[False][0] else None
    lowered = (peaks[True][1] or 0) < (peaks[False][1] or 0)
    mib = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    allocator = (f"allocator {mib(peaks[False][0] / 2**20)} → {mib(peaks[True][0] / 2**20)} MiB "
                 f"({'lower' if lowered_truth else 'NOT lower'})" if peaks[False][0] else
                 "no allocator counters in a smoke run")
    print(f"\nBPipe, largest stage's activation peak: traceana {mib(peaks[False][1])} → {mib(peaks[True][1])} MiB "
          f"({'lower' if lowered else 'NOT lower'}); {allocator}")
    ok &= lowered and lowered_truth is not False
    if not args.skip_pipelining:
        try:
            run, truth = collect_pipelining(args.out / "pipelining", cuda=cuda, steps=args.steps)
            rows, _ = compare(run, truth, profiled=args.steps)
            ok &= print_comparison(f"torch.distributed.pipelining ({run})", rows)
        except Exception as e:  # one GPU and two stages: torch may refuse; say so, do not hide it
            print(f"\ntorch.distributed.pipelining could not run here: {type(e).__name__}: {str(e)[:300]}")
            ok = False
    print(f"\n{'all checks within tolerance' if ok else 'some checks OFF (see above)'}: shares within "
          f"{SHARE_TOLERANCE}, activation peaks within {MEMORY_TOLERANCE:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
