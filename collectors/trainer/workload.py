"""The known workload (``traceana collect --work sleep``): each pass holds for a stated time instead of computing.

A stage module's ``forward`` is replaced, on the instance, by two autograd functions (docs/known-workload.md):

    stage input ──▶ _Pass ──a──┐
                               + ──▶ output (the real stage's shape)
    parameters ──▶ _Weights ─w─┘

- ``_Pass.forward`` (F) allocates the real stage's saved activations (their storage sizes measured once from one
  real forward: what BPipe evicts and loads are the model's bytes) and an output of the real shape, then holds until
  ``start + F``; its backward (I: the input gradient) holds ``backward_ms``.
- ``_Weights``'s backward (W: the weights' gradients, zeros of each parameter's shape, so the optimizer step and the
  data-parallel all-reduce stay real) holds ``weight_ms``. A full backward (B) runs both: ``backward_ms +
  weight_ms``; the zero-bubble schedules of torch.distributed.pipelining run them as their I and W (their input
  pass stops at the sum, their weight pass goes from it to the parameters only: neither runs the other's hold). On
  the first stage, whose input is token ids, ``_Pass`` hangs from a scalar leaf of its own (``_Held.anchor``) so
  that its backward still runs (measured: one F, one I and one W hold a micro-batch on every stage of every
  schedule). There torch's split schedules compute no input gradient: their I pass of stage 0 holds nothing and
  their W pass holds both (B + W), as a real first stage's backward is all weight gradients.
- Inside the reference trainer's passes a hold is split evenly over the stage's blocks, held one after another
  (backwards from the last block), each block's share a span ``PP:{stage}F{mb}/L{layer}`` (``…B…`` for both parts
  of a full backward) ending at its cumulative deadline: the trace's measured per-layer work (run.json's
  ``workload.layer_holds`` is "even"; torch.distributed.pipelining's stages hold one piece, no layer spans).
  With ``layer_holds`` "per-layer" (collect --layer-holds per-layer) the stated times are each block's: a pass of
  a stage of n blocks holds n × them (``Workload.held_ms(..., layers=its blocks)``), each block its stated time
  (a block of ``slow_layers``, collect --slow-layer, its factor × it: ``Workload.layer_weights``), so moving blocks
  between stages (collect --layers-per-stage) moves their work.
- Each hold sleeps to a ``perf_counter`` deadline taken at the pass's start (never a sum of ``sleep(dt)``) and is
  recorded, outside the profiler, as a ``perf_counter_ns`` span with the time the thread was runnable but waiting
  for a CPU inside it (schedstat): ``RUN/workload/rank{R}.json`` (``write_spans``), the test's independent truth.

Everything else stays real: processes, P2P of activation-sized tensors, BPipe's transfers, the optimizer, the
profiler and the annotations. The durations and factors are ``traceana.core.manifest.Workload`` (run.json's
``workload``); a pass outside a labelled step (start-up measurements, torch's shape inference) does not hold.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from collectors import annotations as ann
from traceana.core.manifest import Workload

MIN_SAVED_BYTES = 256  # (collectors.bpipe.MIN_EVICT_BYTES: smaller storages are not activations worth sending)


def run_delay_ns() -> int:
    """How long this thread has been runnable but waiting for a CPU, in all (Linux: /proc/thread-self/schedstat's
    second field); 0 where the kernel does not tell."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def other_threads_run_delay_ns() -> int:
    """How long this process's other threads (gloo's socket loops and workers, torch's pools) have been runnable but
    waiting for a CPU, in all: the sum of /proc/self/task/*/schedstat's second field less this thread's; 0 where the
    kernel does not tell. A message between two ranks moves on those threads, so their waiting can delay a receive
    that the training thread's own run delay does not show."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return max(0, total - run_delay_ns())


def hold_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (re-sleeping what an early wake-up left)."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


@dataclass
class Clock:
    """One rank's record of its held passes: (action, stage, micro-batch, step, start ns, end ns, stated ms,
    run-queue delay ns) and of its steps (step, start ns, end ns, the training thread's run-queue delay in the
    step, ns: its waiting for a CPU outside the holds too). ``step`` and ``microbatch`` are set by the
    trainer before each step and forward; while ``step`` is None nothing holds."""

    rank: int
    step: int | None = None
    microbatch: int | None = None
    spans: list[tuple] = field(default_factory=list)
    steps: list[tuple[int, int, int, int]] = field(default_factory=list)

    def hold(self, action: str, stage: int, at: tuple[int | None, int | None], ms: float, *,
             start: float | None = None, delay: int | None = None, layers: tuple[int, ...] = (),
             weights: tuple[float, ...] | None = None) -> None:
        """Hold until ``start`` (perf_counter seconds; default now) + ``ms`` and record the span; ``at``: the pass's
        (micro-batch, step), nothing held when its step is None. ``delay``: the run-queue delay read at ``start``.
        ``layers`` (the stage's blocks in the order the pass runs them): inside a runner's pass the hold is split
        evenly over them, one after another, each block's share a span of its own (``PP:1F0/L5``) ending at its
        deadline (``start`` + its cumulative share: run.json's ``workload.layer_holds`` "even"), while a profiler
        records (``annotations.recording``; the total held is the same either way). ``weights`` (one a block, in
        ``layers``' order): the blocks' relative shares instead of equal ones (``Workload.layer_weights``: a slowed
        block of a per-layer workload)."""
        if at[1] is None or ms <= 0:
            return
        if start is None:
            delay, start = run_delay_ns(), time.perf_counter()
        if layers and ann.recording():
            w = weights if weights is not None else (1.0,) * len(layers)
            total, done = sum(w), 0.0
            for layer, share in zip(layers, w):
                done += share
                with ann.layer(layer):
                    hold_until(start + ms * done / total / 1e3)
        else:
            hold_until(start + ms / 1e3)
        self.spans.append((action, stage, *at, int(start * 1e9), time.perf_counter_ns(), ms,
                           run_delay_ns() - (delay or 0)))

    def write(self, run_dir: Path, workload: Workload) -> Path:
        path = spans_path(run_dir, workload, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps({
            "rank": self.rank, "clock": "time.perf_counter_ns",
            "span_fields": ["action", "stage", "microbatch", "step", "start_ns", "end_ns", "stated_ms",
                            "run_delay_ns"],
            "spans": self.spans, "step_fields": ["step", "start_ns", "end_ns", "run_delay_ns"], "steps": self.steps}))
        os.replace(tmp, path)
        return path


def spans_path(run_dir: Path, workload: Workload, rank: int) -> Path:
    """Where a rank's held-pass spans are: ``RUN/<workload.spans>/rank{R}.json`` (a subfolder: not a trace)."""
    return Path(run_dir) / workload.spans / f"rank{rank}.json"


def read_spans(run_dir: Path, workload: Workload, rank: int) -> dict:
    """A rank's spans file as written (``Clock.write``), each span a dict of its ``span_fields``."""
    data = json.loads(spans_path(run_dir, workload, rank).read_text())
    data["spans"] = [dict(zip(data["span_fields"], s)) for s in data["spans"]]
    data["steps"] = [dict(zip(data["step_fields"], s)) for s in data["steps"]]
    return data


@dataclass(frozen=True)
class _Held:
    """What one sleeping stage holds and allocates (fixed at build)."""

    clock: Clock
    stage: int
    forward_ms: float
    backward_ms: float  # the input-gradient part (I)
    weight_ms: float  # the weights' part (W)
    saved_bytes: tuple[int, ...]  # the real stage's saved activation storages, per micro-batch
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    params: tuple[torch.nn.Parameter, ...]
    anchor: torch.Tensor  # a scalar leaf requiring grad: _Pass's edge when the stage input needs no gradient
    layers: tuple[int, ...] = ()  # the stage's blocks (global indices), in forward order: each holds its share
    weights: tuple[float, ...] | None = None  # their relative shares (Workload.layer_weights), None: even

    @property
    def reversed_weights(self) -> tuple[float, ...] | None:
        """``weights`` in the backward's order (from the last block)."""
        return None if self.weights is None else self.weights[::-1]


class _Weights(torch.autograd.Function):
    """parameters → a zero scalar ``w`` whose backward is the weights' gradient pass (W)."""

    @staticmethod
    def forward(ctx, held: _Held, *params: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 (params: the graph's edges)
        ctx.held, ctx.at = held, (held.clock.microbatch, held.clock.step)
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        held = ctx.held
        held.clock.hold("W", held.stage, ctx.at, held.weight_ms, layers=held.layers[::-1],
                        weights=held.reversed_weights)
        return (None, *(torch.zeros_like(p) for p in held.params))


class _Pass(torch.autograd.Function):
    """stage input (or the anchor) → an output of the real stage's shape: holds F; its backward (I) holds
    ``backward_ms``."""

    @staticmethod
    def forward(ctx, held: _Held, x: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
        d0, t0 = run_delay_ns(), time.perf_counter()
        ctx.held, ctx.at = held, (held.clock.microbatch, held.clock.step)
        ctx.x_like = (x.shape, x.dtype)
        # the activations a real forward saves for its backward, as many bytes (BPipe moves them; memory shows them)
        ctx.save_for_backward(*(torch.empty(n, dtype=torch.uint8, device=x.device) for n in held.saved_bytes))
        out = torch.zeros(held.out_shape, dtype=held.out_dtype, device=x.device)
        held.clock.hold("F", held.stage, ctx.at, held.forward_ms, start=t0, delay=d0, layers=held.layers,
                        weights=held.weights)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        held = ctx.held
        d0, t0 = run_delay_ns(), time.perf_counter()
        ctx.saved_tensors  # noqa: B018 - unpacked as a real backward would (BPipe's loaded bytes)
        grad_x = torch.zeros(ctx.x_like[0], dtype=ctx.x_like[1], device=grad.device) if ctx.needs_input_grad[1] \
            else None
        grad_anchor = torch.zeros((), device=grad.device) if ctx.needs_input_grad[2] else None
        held.clock.hold("I", held.stage, ctx.at, held.backward_ms, start=t0, delay=d0, layers=held.layers[::-1],
                        weights=held.reversed_weights)
        return None, grad_x, grad_anchor


def saved_storage_bytes(module: torch.nn.Module, *example: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """One real forward of ``module`` on ``example``: the byte sizes of the distinct storages it saves for its
    backward (not its parameters' or buffers', not its input's or output's; as BPipe's evictor groups them), and
    its output."""
    pinned = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in pinned and st.nbytes() >= MIN_SAVED_BYTES:
            sizes[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*example)
    for t in (*example, out):
        sizes.pop(t.untyped_storage().data_ptr(), None)
    return tuple(sizes.values()), out


def make_sleeping(module: torch.nn.Module, workload: Workload, *, stage: int, rank: int, clock: Clock,
                  example: tuple[torch.Tensor, ...]) -> torch.nn.Module:
    """Replace ``module.forward`` (on the instance) by the held passes of ``workload`` for ``stage`` on ``rank``;
    ``example``: one micro-batch's real inputs (the real forward run once on them gives the saved sizes and the
    output's shape). The module keeps its parameters, names and buffers. Returns the module."""
    sizes, out = saved_storage_bytes(module, *example)
    layers = tuple(getattr(module, "layer_ids", ()))
    if workload.layer_holds == "per-layer" and not layers:
        raise RuntimeError(f"per-layer holds need the stage's blocks: stage {stage}'s module names none")
    # what each pass holds (Workload.held_ms: its factors; per-layer: × the stage's blocks' weights) and how it
    # splits over the blocks (per-layer: each block its weight × the stated times; even: equal shares)
    ms = {a: workload.held_ms(a, stage=stage, rank=rank, layers=layers) for a in "FIW"}
    weights = workload.layer_weights(layers) if workload.layer_holds == "per-layer" else None
    params = tuple(p for p in module.parameters() if p.requires_grad)
    held = _Held(clock=clock, stage=stage, forward_ms=ms["F"], backward_ms=ms["I"], weight_ms=ms["W"],
                 saved_bytes=sizes, out_shape=tuple(out.shape), out_dtype=out.dtype, params=params,
                 anchor=torch.zeros((), device=out.device, requires_grad=True), layers=layers, weights=weights)
    in_shape = tuple(example[0].shape)

    def forward(x: torch.Tensor, *_ignored) -> torch.Tensor:
        if tuple(x.shape) != in_shape and x.device.type != "meta":
            raise RuntimeError(f"the sleeping stage {stage} was built for inputs {in_shape}, got {tuple(x.shape)}")
        a = _Pass.apply(held, x, None if x.requires_grad else held.anchor)
        return a + _Weights.apply(held, *params)

    module.forward = forward
    return module
