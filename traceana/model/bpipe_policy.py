"""BPipe as a policy of the pipeline simulator (model.simulate): what an evictor and its acceptor do beyond 1F1B.

The plan is the pipeline rules' (``pipeline_rules.bpipe_plan``): before a forward that would take the evictor over its
keep it evicts what the plan says; an evicted micro-batch is loaded back for its backward; the acceptor posts its
receives and returns where the plan says. Overlapped (``Costs.bpipe_overlap``): transfers run in the background on
one link per pair, the load overlapping the wait for the incoming gradient, and only waiting for it is exposed
(``bpipe``). Not overlapped: the evictor is busy for each transfer. The evictor's and acceptor's own time per
eviction / per accept or return is ``Costs.evict_block_ns`` / ``accept_block_ns``.
"""

from __future__ import annotations

from traceana.causal.scheduler import Costs, Policy, Recorder
from traceana.core.pipeline_rules import FORWARD, Op, bpipe_plan


class BPipePolicy(Policy):
    def __init__(self, *, pairs: tuple[tuple[int, int], ...], pp: int, num_microbatches: int, costs: Costs,
                 keep: int | None = None, schedule: str = "1f1b") -> None:
        self.costs = costs
        self.acceptor_of = dict(pairs)
        self.plans = {e: bpipe_plan(schedule, pp=pp, num_microbatches=num_microbatches, evictor=e, keep=keep)
                      for e in self.acceptor_of}
        self.accept_after = {(plan.acceptor, j): len(v) for plan in self.plans.values()
                             for j, v in plan.accept_after.items()}
        self.returns = {(plan.acceptor, j) for plan in self.plans.values() for j in plan.return_after}
        self.resident: dict[int, list[int]] = {e: [] for e in self.acceptor_of}
        self.evicted_at: dict[tuple[int, int], float] = {}  # (evictor, mb) -> time the eviction completed
        self.loaded_at: dict[tuple[int, int], tuple[float, float]] = {}  # (evictor, mb) -> (load issued, done)
        self.link_free = {e: 0.0 for e in self.acceptor_of}  # one BPipe link per pair: transfers serialise on it
        self.n_evicted: dict[int, int] = {}

    def _issue_load(self, rec: Recorder, d: int, mb: int, after: float) -> None:
        issue = max(after, self.evicted_at.pop((d, mb)), self.link_free[d])
        loaded = issue + self.costs.bpipe_ns
        self.link_free[d] = loaded
        self.loaded_at[(d, mb)] = (issue, loaded)
        rec.note_held(loaded, self.acceptor_of[d], -1.0)
        rec.note_held(loaded, d, 1.0)
        self.resident[d].append(mb)

    def before_start(self, rec: Recorder, d: int, i: int, op: Op, *, free: float, start: float, ready: float,
                     windows: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, float, str]]]:
        key = (d, op.microbatch)
        if op.action != FORWARD and key in self.evicted_at:
            if self.costs.bpipe_overlap:
                self._issue_load(rec, d, op.microbatch, free)  # nothing prefetched it: load now
            else:  # a blocking load right before this backward
                issue = max(free, self.evicted_at[key], self.link_free[d])
                rec.wait(d, free, issue, windows)
                self._issue_load(rec, d, op.microbatch, issue)
                rec.busy(d, issue, self.loaded_at[key][1], "bpipe")
                free = self.loaded_at.pop(key)[1]
                start = max(free, ready)
        if op.action != FORWARD and key in self.loaded_at:
            issue, loaded = self.loaded_at.pop(key)
            windows = [(max(issue, free), loaded, "bpipe"), *windows]
            start = max(start, loaded)
        return free, start, windows

    def before_work(self, rec: Recorder, d: int, i: int, op: Op, t: float) -> float:
        c = self.costs
        if op.action == FORWARD and d in self.plans:
            for victim in self.plans[d].evict_before.get(i, ()):  # evict what the plan says before this forward
                self.resident[d].remove(victim)
                self.n_evicted[d] = self.n_evicted.get(d, 0) + 1
                if c.evict_block_ns:
                    rec.busy(d, t, t + c.evict_block_ns, "bpipe")
                    t += c.evict_block_ns
                ev_start = max(t, self.link_free[d])
                ev_end = ev_start + c.bpipe_ns
                self.link_free[d] = ev_end
                self.evicted_at[(d, victim)] = ev_end
                rec.note_held(ev_end, d, -1.0)
                rec.note_held(ev_end, self.acceptor_of[d], 1.0)
                if not c.bpipe_overlap:
                    rec.busy(d, ev_start, ev_end, "bpipe")
                    t = ev_end
        if i == 0 and (d, -1) in self.accept_after and c.accept_block_ns:
            n = self.accept_after[(d, -1)]  # the acceptor posts the receives the plan takes at the start
            rec.busy(d, t, t + n * c.accept_block_ns, "bpipe")
            t += n * c.accept_block_ns
        return t

    def after_work(self, rec: Recorder, d: int, i: int, op: Op, end: float) -> float:
        if op.action == FORWARD:
            if d in self.plans:
                self.resident[d].append(op.microbatch)
            return end
        n = ((d, i) in self.returns) + self.accept_after.get((d, i), 0)  # the acceptor returns, then accepts
        if n and self.costs.accept_block_ns:
            rec.busy(d, end, end + n * self.costs.accept_block_ns, "bpipe")
            end += n * self.costs.accept_block_ns
        if d in self.plans and op.microbatch in self.resident[d]:
            self.resident[d].remove(op.microbatch)
        return end

    def evicted(self, devices: int) -> tuple[int, ...]:
        return tuple(self.n_evicted.get(d, 0) for d in range(devices))
