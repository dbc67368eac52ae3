"""BPipe: balance activation memory across a 1F1B pipeline by evicting activations to a partner stage.

Kim et al., "BPipe: Memory-Balanced Pipeline Parallelism for Training Large Language Models", ICML 2023.
In 1F1B stage s holds p−s micro-batches' activations while stage p−1−s holds s+1: together p+1. The *evictor* s sends
the saved activations of some micro-batches to its *acceptor* p−1−s after their forward and gets them back before
their backward, so each keeps about ceil((p+1)/2).

How it works here (FIELD-NOTES.md, "Activation eviction"):
- A micro-batch chosen for eviction runs its forward under ``torch.autograd.graph.saved_tensors_hooks``; the pack
  hook wraps every saved tensor in a ``_Saved`` placeholder.
- After the forward, ``evict`` groups the placeholders by storage (several saved views can share one storage: each
  storage goes once, views are rebuilt with ``set_``/as_strided on return), leaves out what eviction cannot free
  (parameter and buffer views, the stage's input and output, which the pipeline itself holds) and sends the storages
  as bytes on BPipe's own process group (``names.BPIPE_GROUP_DESC``) without blocking.
- Saved-tensor hooks switch off autograd's in-place version check, so the version is recorded at pack time and
  checked before eviction and at unpack.
- The schedule of evictions and loads is a pure function of (schedule, p, m, stage, keep) that both partners
  compute (``eviction_plan``): nothing is negotiated at run time. The storage sizes of one micro-batch are measured
  once at start-up (``Evictor.measure_layout``) and sent to the acceptor, which can then post its receives early.
- The acceptor posts the receive for micro-batch e (evicted before the evictor's forward of k) before its own
  forward of k−(q−s) (which needs nothing from the evictor beyond forwards it already ran, so the evictor's blocking eviction always finds it posted), and returns e
  right after its own backward of e, which the evictor's backward of e waits for anyway (the gradient flows q → s):
  no cycle, so no deadlock. Data moves on gloo/NCCL's own threads while the acceptor computes.
Annotated: ``EVICT``/``LOAD`` on the evictor, ``ACCEPT``/``RETURN`` on the acceptor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collectors.annotations import annotate
from collectors.trainer.comm import Transport, Waiter
from collectors.trainer.schedules import B, F, Action, actions_for, peak_in_flight
from traceana import names

MIN_EVICT_BYTES = 256  # smaller storages are not worth a message
TAG_SHIFT = 12  # tag = (microbatch << TAG_SHIFT) | storage index


# ---- the plan -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    keep: int  # micro-batches the evictor keeps on device
    evict_before: dict[int, list[int]]  # evictor action index (a forward) -> micro-batches evicted just before it
    load_before: dict[int, int]  # evictor action index (a backward) -> the evicted micro-batch it brings back
    order: tuple[int, ...]  # evicted micro-batches in eviction order
    displaced_by: dict[int, int]  # evicted micro-batch -> the micro-batch whose forward it makes room for


def balanced_keep(schedule: str, evictor: int, acceptor: int, stages: int, microbatches: int) -> int:
    """The pair's balanced level: half of what evictor and acceptor hold together, rounded up (p+1 for 1F1B)."""
    own = peak_in_flight(actions_for(schedule, evictor, stages, microbatches))
    partner = peak_in_flight(actions_for(schedule, acceptor, stages, microbatches))
    return math.ceil((own + partner) / 2)


def eviction_plan(actions: list[Action], keep: int) -> Plan:
    """Which micro-batches leave, and when, so that at most ``keep`` micro-batches' activations are ever on device.

    Before a forward that would exceed ``keep`` (counting the load the next backward needs), evict the resident
    micro-batch whose backward is furthest away (the newest). An evicted micro-batch comes back at the start of
    its own backward (its receive is posted before the wait for the incoming gradient, so the two overlap).
    Evicting *before* the forward, not after it, is what lowers the peak: the new activations are never on device
    together with the ones they displace.
    """
    resident: set[int] = set()
    evicted: set[int] = set()
    evict_before: dict[int, list[int]] = {}
    load_before: dict[int, int] = {}
    order: list[int] = []
    displaced_by: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind == F:
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            needed_next = nxt.microbatch if nxt is not None and nxt.kind == B else None
            need = 1 + (needed_next in evicted)
            while len(resident) + need > keep:
                candidates = resident - {needed_next}
                if not candidates:
                    break
                victim = max(candidates)  # backwards run in micro-batch order: the newest is needed last
                resident.discard(victim)
                evicted.add(victim)
                evict_before.setdefault(i, []).append(victim)
                order.append(victim)
                displaced_by[victim] = a.microbatch
            resident.add(a.microbatch)
            continue
        if a.microbatch in evicted:
            evicted.discard(a.microbatch)
            resident.add(a.microbatch)
            load_before[i] = a.microbatch
        if a.microbatch not in resident:
            raise RuntimeError(f"BPipe plan: micro-batch {a.microbatch} has no activations at its backward")
        resident.discard(a.microbatch)
    return Plan(keep=keep, evict_before=evict_before, load_before=load_before, order=tuple(order),
                displaced_by=displaced_by)


def plan_for(schedule: str, evictor: int, acceptor: int, stages: int, microbatches: int,
             keep: int | None = None) -> Plan:
    keep = keep or balanced_keep(schedule, evictor, acceptor, stages, microbatches)
    return eviction_plan(actions_for(schedule, evictor, stages, microbatches), keep)


def pair_of(stage: int, stages: int) -> tuple[int, int] | None:
    """(evictor, acceptor) containing ``stage``, or None for the middle stage of an odd pipeline."""
    partner = stages - 1 - stage
    if partner == stage:
        return None
    return (min(stage, partner), max(stage, partner))


def new_groups(stages: int, rank_of_stage: list[int], *, backend: str | None = None
               ) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One process group per pair, created on every rank in the same order (``new_group`` is collective).

    The trainer asks for gloo: on CPU that is the default anyway; on GPUs it keeps BPipe's sends and receives, which
    cross in both directions at times the two partners choose independently, off NCCL's one-stream-per-pair
    ordering (where crossing sends can wait on each other), at the price of staging through host memory.
    """
    groups = {}
    for s in range(stages // 2):
        ranks = sorted((rank_of_stage[s], rank_of_stage[stages - 1 - s]))
        groups[(s, stages - 1 - s)] = dist.new_group(ranks, backend=backend, group_desc=names.BPIPE_GROUP_DESC)
    return groups


# ---- the evictor --------------------------------------------------------------------------------------------------
@dataclass
class _Saved:
    """What autograd holds instead of a saved tensor while BPipe may move it."""

    tensor: torch.Tensor | None
    version: int
    # set when evicted: where the tensor lives in its storage
    storage_index: int = -1
    dtype: torch.dtype | None = None
    offset: int = 0
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()


@dataclass
class _Bundle:
    """One micro-batch's captured saved tensors."""

    saved: list[_Saved] = field(default_factory=list)
    buffers: list[torch.Tensor] | None = None  # storages as bytes once loaded back
    loads: list[object] = field(default_factory=list)  # Transfers in flight


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``t`` as a flat uint8 tensor (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def _view(buffer: torch.Tensor, s: _Saved) -> torch.Tensor:
    return torch.empty(0, dtype=s.dtype, device=buffer.device).set_(buffer.untyped_storage(), s.offset, s.size, s.stride)


def _version_error(s: _Saved, t: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation "
        f"(saved at version {s.version}, now {t._version}); BPipe's saved-tensor hooks check what autograd would"
    )


class Evictor:
    """Stage s's side: capture, evict, load."""

    def __init__(self, *, stage: int, acceptor_rank: int, plan: Plan, module: torch.nn.Module,
                 transport: Transport) -> None:
        self.stage, self.peer, self.plan, self.transport = stage, acceptor_rank, plan, transport
        self.pinned_storages = {_storage_key(t) for t in [*module.parameters(), *module.buffers()]}
        self.bundles: dict[int, _Bundle] = {}
        self.layout: list[int] | None = None  # bytes of each evicted storage, identical for every micro-batch

    # -- capture during the forward
    def capture(self, microbatch: int) -> torch.autograd.graph.saved_tensors_hooks:
        bundle = self.bundles[microbatch] = _Bundle()

        def pack(t: torch.Tensor) -> _Saved:
            s = _Saved(tensor=t, version=t._version)
            bundle.saved.append(s)
            return s

        def unpack(s: _Saved) -> torch.Tensor:
            if s.tensor is not None:
                if s.tensor._version != s.version:
                    raise _version_error(s, s.tensor)
                return s.tensor
            if bundle.buffers is None:
                raise RuntimeError(f"BPipe: micro-batch {microbatch}'s activations were not loaded before backward")
            return _view(bundle.buffers[s.storage_index], s)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _evictable(self, bundle: _Bundle, held: Iterable[torch.Tensor]) -> list[list[_Saved]]:
        """Saved tensors grouped by storage, leaving out storages eviction cannot free."""
        pinned = self.pinned_storages | {_storage_key(t) for t in held}
        groups: dict[int, list[_Saved]] = {}
        for s in bundle.saved:
            t = s.tensor
            if t is None or t.untyped_storage().nbytes() < MIN_EVICT_BYTES:
                continue
            key = _storage_key(t)
            if key not in pinned:
                groups.setdefault(key, []).append(s)
        return list(groups.values())

    def measure_layout(self, microbatch: int, held: Iterable[torch.Tensor]) -> list[int]:
        """Storage sizes of a captured (dummy) forward; sent once to the acceptor at start-up."""
        groups = self._evictable(self.bundles.pop(microbatch), held)
        self.layout = [g[0].tensor.untyped_storage().nbytes() for g in groups]
        return self.layout

    # -- after the forward of an evicted micro-batch
    def evict(self, microbatch: int, held: Iterable[torch.Tensor]) -> None:
        bundle = self.bundles[microbatch]
        with annotate(self.stage, names.EVICT, microbatch):
            groups = self._evictable(bundle, held)
            sizes = [g[0].tensor.untyped_storage().nbytes() for g in groups]
            if sizes != self.layout:
                raise RuntimeError(f"BPipe: micro-batch {microbatch} saved {sizes} bytes per storage, "
                                   f"the acceptor was told {self.layout}; shapes must not change between micro-batches")
            sends = []
            for index, group in enumerate(groups):
                for s in group:
                    t = s.tensor
                    if t._version != s.version:
                        raise _version_error(s, t)
                    s.storage_index, s.dtype = index, t.dtype
                    s.offset, s.size, s.stride = t.storage_offset(), tuple(t.shape), tuple(t.stride())
                work, sent = self.transport.isend(_as_bytes(group[0].tensor), self.peer,
                                                  tag=(microbatch << TAG_SHIFT) | index)
                sends.append((work, sent))
                for s in group:
                    s.tensor = None  # our last reference: the storage is freed once the send completes
            # Wait here, before the next forward allocates: otherwise the evicted and the new activations would
            # coexist and the peak would not drop. The acceptor posted its receive long before (see Acceptor).
            for work, _ in sends:
                work.wait()
            del sends

    def prefetch(self, microbatch: int) -> None:
        """Post the receives that bring a micro-batch back (at the start of its backward)."""
        self.bundles[microbatch].loads = [
            self.transport.irecv((n,), torch.uint8, self.peer, tag=(microbatch << TAG_SHIFT) | index)
            for index, n in enumerate(self.layout or [])
        ]

    def load(self, microbatch: int) -> None:
        """Before the backward of an evicted micro-batch: wait for its activations (the exposed BPipe time)."""
        bundle = self.bundles[microbatch]
        with annotate(self.stage, names.LOAD, microbatch):
            bundle.buffers = [transfer.wait() for transfer in bundle.loads]
            bundle.loads = []

    def release(self, microbatch: int) -> None:
        """After the backward: forget the micro-batch."""
        self.bundles.pop(microbatch, None)

    def finish_step(self) -> None:
        if any(b.loads for b in self.bundles.values()):
            raise RuntimeError("BPipe evictor: a load was posted but never waited for")
        self.bundles.clear()


# ---- the acceptor -------------------------------------------------------------------------------------------------
class Acceptor:
    """Stage q = p−1−s's side: receive, hold, return."""

    def __init__(self, *, stage: int, evictor_stage: int, evictor_rank: int, plan: Plan, layout: list[int],
                 actions: list[Action], transport: Transport) -> None:
        self.stage, self.peer, self.plan, self.layout, self.transport = stage, evictor_rank, plan, layout, transport
        self.waiter = Waiter()
        # Post the receive for e (evicted to make room for the evictor's forward of k) before our own forward of
        # k − (q − s): about when the evictor evicts, and never later (that forward needs only forwards the evictor
        # has run before evicting). Earlier would hold the buffer longer than needed.
        lag = stage - evictor_stage
        forwards = {a.microbatch: i for i, a in enumerate(actions) if a.kind == F}
        self.post_before: dict[int, list[int]] = {}
        for e in plan.order:
            at = forwards.get(max(plan.displaced_by[e] - lag, 0), 0)
            self.post_before.setdefault(at, []).append(e)
        self.held: dict[int, list] = {}  # micro-batch -> Transfers (receives in flight or done)
        self.returning: list[tuple[object, list]] = []  # (done event, (work, tensor) pairs)

    def before(self, action_index: int) -> None:
        for e in self.post_before.get(action_index, []):
            with annotate(self.stage, names.ACCEPT, e):
                self.held[e] = [self.transport.irecv((n,), torch.uint8, self.peer, tag=(e << TAG_SHIFT) | index)
                                for index, n in enumerate(self.layout)]
        self.progress()

    def after_backward(self, microbatch: int) -> None:
        """Our backward of e is done, so the evictor's backward of e is next in line: send e back now."""
        transfers = self.held.pop(microbatch, None)
        if transfers is None:
            return
        with annotate(self.stage, names.RETURN, microbatch):
            sends = [self.transport.isend(t.wait(), self.peer, tag=(microbatch << TAG_SHIFT) | index)
                     for index, t in enumerate(transfers)]
            self.returning.append((self.waiter.watch([w for w, _ in sends]), sends))

    def progress(self) -> None:
        """Free the buffers of returns that completed."""
        self.returning = [(done, sends) for done, sends in self.returning if not done.is_set()]

    def finish_step(self) -> None:
        for done, _ in self.returning:
            done.wait()
        self.returning.clear()
        if self.held:
            raise RuntimeError(f"BPipe acceptor: micro-batches {sorted(self.held)} were never returned")
