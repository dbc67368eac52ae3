"""BPipe: balance activation memory across a 1F1B pipeline by evicting activations to a partner stage.

Kim et al., "BPipe: Memory-Balanced Pipeline Parallelism for Training Large Language Models", ICML 2023.
In 1F1B stage s holds p−s micro-batches' activations while stage p−1−s holds s+1: together p+1. The *evictor* s sends
the saved activations of some micro-batches to its *acceptor* p−1−s after their forward and gets them back before
their backward, so each keeps about ceil((p+1)/2).

How it works here (docs/field-notes.md, "Activation eviction"):
- A micro-batch chosen for eviction runs its forward under ``torch.autograd.graph.saved_tensors_hooks``; the pack
  hook wraps every saved tensor in a ``_Saved`` placeholder.
- After the forward, ``evict`` groups the placeholders by storage (several saved views can share one storage: each
  storage goes once, views are rebuilt with ``set_``/as_strided on return), leaves out what eviction cannot free
  (parameter and buffer views, the stage's input and output, which the pipeline itself holds) and sends the storages
  as bytes on BPipe's own process group (``names.BPIPE_GROUP_DESC``) without blocking.
- Saved-tensor hooks switch off autograd's in-place version check, so the version is recorded at pack time and
  checked before eviction and at unpack.
- The schedule of evictions and loads is a pure function of (schedule, p, m, stage, keep) that both partners
  compute (``traceana.core.pipeline_rules.bpipe_plan``): nothing is negotiated at run time. The storage sizes of one
  micro-batch are measured once at start-up (``Evictor.measure_layout``) and sent to the acceptor, which can then post
  its receives early.
- When the acceptor posts its receives and returns is the plan's (``traceana.core.pipeline_rules.bpipe_plan``): right
  after its own backward of the last micro-batch the evictor ran backward before evicting (so the evictor's blocking
  eviction always finds the receive posted: that gradient passed through the acceptor first), and it returns e right
  after its own backward of e, which the evictor's backward of e waits for anyway (the gradient flows q → s): no
  cycle, so no deadlock, and the acceptor never holds more than the pair's balanced level. A returned micro-batch
  stays in the acceptor's memory until the evictor has received it, so the evictor posts that receive as early as
  the plan has room for it (before the forward preceding its backward) and the acceptor waits for its returns to
  complete before it allocates the next receive. Data moves on gloo/NCCL's own threads while the acceptor computes.
Annotated: ``EVICT``/``LOAD`` on the evictor, ``ACCEPT``/``RETURN`` on the acceptor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collectors.annotations import annotate
from collectors.trainer.comm import Transport, Waiter
from traceana.core import names
from traceana.core.pipeline_rules import BPipePlan

MIN_EVICT_BYTES = 256  # smaller storages are not worth a message
TAG_SHIFT = 12  # tag = (microbatch << TAG_SHIFT) | storage index


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

    def __init__(self, *, stage: int, acceptor_rank: int, plan: BPipePlan, module: torch.nn.Module,
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

    def __init__(self, *, stage: int, evictor_rank: int, plan: BPipePlan, layout: list[int],
                 transport: Transport) -> None:
        self.stage, self.peer, self.plan, self.layout, self.transport = stage, evictor_rank, plan, layout, transport
        self.waiter = Waiter()
        self.held: dict[int, list] = {}  # micro-batch -> Transfers (receives in flight or done)
        self.returning: list[tuple[int, object, list]] = []  # (micro-batch, done event, (work, tensor) pairs)

    def start_step(self) -> None:
        """Post the receives the plan takes at the start of the step (evictions before the evictor's first
        backward)."""
        self._accept(self.plan.accept_after.get(-1, ()))

    def _accept(self, victims: tuple[int, ...]) -> None:
        for e in victims:
            with annotate(self.stage, names.ACCEPT, e):
                self.held[e] = [self.transport.irecv((n,), torch.uint8, self.peer, tag=(e << TAG_SHIFT) | index)
                                for index, n in enumerate(self.layout)]

    def after_backward(self, action_index: int, microbatch: int) -> None:
        """After our backward (action ``action_index``): send back what the plan returns now (the evictor's
        backward of it is next in line), then post the receives it takes now (pipeline_rules.bpipe_plan: just in
        time for the evictor's next eviction, never earlier), so the buffer of a new micro-batch is allocated only
        once our own backward has freed one micro-batch's activations."""
        for e in self.plan.return_after.get(action_index, ()):
            transfers = self.held.pop(e)
            with annotate(self.stage, names.RETURN, e):
                sends = [self.transport.isend(t.wait(), self.peer, tag=(e << TAG_SHIFT) | index)
                         for index, t in enumerate(transfers)]
                self.returning.append((e, self.waiter.watch([w for w, _ in sends]), sends))
        victims = self.plan.accept_after.get(action_index, ())
        if victims:
            # A returned micro-batch's bytes stay ours until the evictor has received them. Wait for that before
            # allocating the next one's buffers, so we never hold more than the plan counts (bpipe_held). The
            # evictor posts that receive before its backward of it, which needs nothing we do after this point.
            for e, done, _ in self.returning:
                with annotate(self.stage, names.RETURN, e):
                    done.wait()
            self.returning.clear()
        self._accept(victims)
        self.progress()

    def progress(self) -> None:
        """Free the buffers of returns that completed."""
        self.returning = [entry for entry in self.returning if not entry[1].is_set()]

    def finish_step(self) -> None:
        for _, done, _ in self.returning:
            done.wait()
        self.returning.clear()
        if self.held:
            raise RuntimeError(f"BPipe acceptor: micro-batches {sorted(self.held)} were never returned")
