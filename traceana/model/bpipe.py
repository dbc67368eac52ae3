"""Does BPipe help? The question of Huang et al. 2024, "Re-evaluating the Memory-balanced Pipeline Parallelism: BPipe"
(arXiv 2401.02088), answered by the model.

BPipe (Kim et al. 2023) does not make any kernel faster. It lowers the peak activation memory of the first stages, and
that freed memory can buy one of two things: turning recomputation off, or a larger micro-batch (which, at a fixed
global batch, means fewer micro-batches). So whether it helps is a trade between terms of the step time:

    step ≈ (m + p − 1) · t(b)            1F1B with uniform stages (Narayanan et al. 2021 §2.2.1)
    t(b) = FLOPs(b) / (E(b) · peak)      E(b): the compute efficiency (MFU of the busy time) at micro-batch b

- compute: m·t(b) shrinks only if E grows with b (bigger matrices use the device better);
- recompute: an extra forward (full) or attention core (selective) per micro-batch that BPipe may make unnecessary;
- bubble (warm-up + stall + cool-down, the word's one meaning): (p − 1)·t(b) grows with b because m = G/(b·dp) falls;
- host (time between operations no dependency explains) and communication (exposed P2P and collectives);
- transfer: evicting and reloading activations costs bandwidth, exposed when it cannot hide behind compute.

We compute every candidate with the memory model (does it fit?) and the simulator (how long?), and compare the best
BPipe configuration with both the user's configuration and the best configuration that fits without BPipe — the fair
baseline the re-evaluation asks for. With flash attention the s×s activations are gone (see model/memory.py), so
configurations that needed BPipe to fit usually fit without it, and the verdict turns on E(b) alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import polars as pl

from traceana.core import schema
from traceana.core import flops
from traceana.core.errors import ConfigError
from traceana.core.limits import schedule_slots_error
from traceana.core.pipeline_rules import bpipe_pairs, bpipe_plan, check_bpipe
from traceana.core.training_config import TrainingConfig
from traceana.core.units import GB, MS_PER_S, NS_PER_S, bytes_text, seconds_text
from traceana.model.memory import StageMemory, estimate_stage_memory, fit_uncertainty_bytes, layer_activation_bytes
from traceana.model.memory import reserve_bytes as default_reserve
from traceana.model.presets import Device
from traceana.model.simulate import Costs, StageTimes, engine_inputs, simulate

HELPS_ABOVE = 1.005  # a predicted speed-up above this (0.5 %, within the model's resolution) counts as helping


@dataclass(frozen=True)
class EfficiencyCurve:
    """Compute efficiency E(b) (model FLOP/s during compute over peak) by micro-batch size.

    Between measured points it is interpolated linearly in log2(b); outside them it is held at the nearest point.
    Without points it follows an assumed saturating curve E(b) = e_max · n/(n + n_half) in tokens n = b·s per
    tensor-parallel rank, which says only "bigger matrices are used better, with diminishing returns".
    """

    points: tuple[tuple[float, float], ...] = ()  # (micro-batch size, efficiency)
    e_max: float = 0.6
    tokens_half: float = 512.0
    source: str = "assumed"
    # Measured points of one attention kernel, where they differ (naive attention spends time on s×s matrices that
    # flash attention fuses away): (attention, points) pairs; an attention without its own points uses ``points``.
    by_attention: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        pts = [pt for pt in self.points] + [pt for _, ps in self.by_attention for pt in ps]
        if any(b <= 0 or not 0 < e <= 1 for b, e in pts):
            raise ConfigError("efficiency points need b > 0 and 0 < efficiency ≤ 1", fix="check --efficiency")

    @classmethod
    def measured(cls, points: list[tuple[float, str, float]], *, source: str) -> EfficiencyCurve:
        """A curve from measured (micro-batch size, attention, efficiency) points: one curve when every point has
        the same attention, else one per attention (naive and flash attention use the hardware differently)."""
        kinds = sorted({a for _, a, _ in points})
        if not points:
            raise ConfigError("no measured efficiency points", fix="give at least one run")
        if len(kinds) == 1:
            return cls(points=tuple(sorted((b, e) for b, _, e in points)), source=source)
        by = tuple((k, tuple(sorted((b, e) for b, a, e in points if a == k))) for k in kinds)
        return cls(points=tuple(sorted((b, e) for b, _, e in points)), by_attention=by, source=source)

    def at(self, microbatch_size: float, *, seq: int, attention: str | None = None) -> float:
        own = dict(self.by_attention).get(attention) if attention else None
        if own:
            return EfficiencyCurve(points=own, source=self.source).at(microbatch_size, seq=seq)
        if not self.points:
            n = microbatch_size * seq
            return self.e_max * n / (n + self.tokens_half)
        pts = sorted(self.points)
        if microbatch_size <= pts[0][0]:
            return pts[0][1]
        if microbatch_size >= pts[-1][0]:
            return pts[-1][1]
        for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
            if b0 <= microbatch_size <= b1:
                w = (math.log2(microbatch_size) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return e0 + w * (e1 - e0)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class Network:
    """Bandwidths (bytes/s) for pipeline messages and BPipe transfers; assumptions unless measured."""

    p2p_bytes_per_s: float = 25e9  # one 200 Gb/s InfiniBand HDR port per GPU (inter-node pipeline stages)
    bpipe_bytes_per_s: float = 25e9  # evictor → acceptor crosses the same fabric (pairs s, p−1−s are far apart)
    bpipe_overlap: bool = True

    def __post_init__(self) -> None:
        for what, flag, v in (("pipeline messages", "--p2p-gbps", self.p2p_bytes_per_s),
                              ("BPipe transfers", "--bpipe-gbps", self.bpipe_bytes_per_s)):
            if not (isinstance(v, (int, float)) and v > 0):  # (NaN compares false; inf: free transfers)
                raise ConfigError(f"the bandwidth for {what} must be a positive number of bytes/s, got {v!r}",
                                  fix=f"give {flag} a positive GB/s, e.g. 25")


@dataclass(frozen=True)
class StepEstimate:
    config: TrainingConfig
    step_s: float
    mfu: float  # model FLOPs utilisation (flops.MFU_COUNTS)
    fits: bool | None  # None when no device memory was given
    peak_bytes: float  # the largest stage's total
    terms: dict[str, float]  # seconds on stage 0 per TERM_CATEGORIES group (terms_of): they add up to the step
    efficiency: float
    largest: StageMemory | None = None  # the stage with the largest total (the one that decides the fit)
    hfu: float | None = None  # hardware FLOPs utilisation (flops.HFU_COUNTS); None without recompute (= mfu)
    twin_peak_bytes: float | None = None  # a BPipe configuration's largest stage without BPipe (does BPipe make it fit?)

    def describe(self) -> str:
        c = self.config
        rc = "" if c.recompute == "none" else f", {c.recompute} recompute"
        return f"b={c.microbatch_size}, m={c.num_microbatches}{rc}{', BPipe' if c.bpipe else ''}"


def stage_work(cfg: TrainingConfig, *, peak_flops: float, efficiency: float) -> dict:
    """Per device the modelled durations (ns) of one micro-batch, as model.simulate.engine_inputs takes work (every
    micro-batch alike: micro-batch None): from FLOPs at a given efficiency, the backward B 2× the forward F, its
    weight-gradient part W ``flops.stage_weight_gradient_flops`` (which schedules splitting the backward run apart),
    R the recompute's extra forward."""
    rate = peak_flops * efficiency * cfg.tp  # the stage's tensor-parallel group works together
    work = {}
    for s, n in enumerate(cfg.stage_layers()):
        last = s == cfg.last_device
        total = flops.stage_flops(cfg.model, layers=n, microbatch_size=cfg.microbatch_size, last=last)
        extra = flops.stage_flops(cfg.model, layers=n, microbatch_size=cfg.microbatch_size, last=last,
                                  recompute=cfg.recompute) - total
        work[("F", s, None)] = total / 3 / rate * NS_PER_S
        work[("B", s, None)] = 2 * total / 3 / rate * NS_PER_S
        work[("R", s, None)] = extra / rate * NS_PER_S
        work[("W", s, None)] = flops.stage_weight_gradient_flops(cfg.model, layers=n, microbatch_size=cfg.microbatch_size,
                                                               last=last) / rate * NS_PER_S
    return work


def stage_times(cfg: TrainingConfig, *, peak_flops: float, efficiency: float,
                costs: Costs = Costs()) -> tuple[StageTimes, Costs]:
    """The engine's inputs of the modelled step: ``stage_work`` per device through model.simulate.engine_inputs (the
    path ``whatif``'s plans feed the measured work through), one chunk's share of it a virtual stage."""
    return engine_inputs(stage_work(cfg, peak_flops=peak_flops, efficiency=efficiency),
                         device_of_work=tuple(range(cfg.pp)), stages=cfg.pp * cfg.virtual_stages,
                         p2p_ns=costs.p2p_ns, optimizer_ns=(0.0,) * cfg.pp, costs=costs)


def estimate_step(cfg: TrainingConfig, *, device: Device | None, curve: EfficiencyCurve,
                  network: Network = Network(), peak_flops: float | None = None, with_simulation: bool = False):
    """Step time, MFU, memory fit and the step's terms for one configuration (and the simulation, if asked)."""
    peak = peak_flops or (device.peak_flops if device else None)
    if not peak:
        raise ConfigError("a step-time estimate needs the device's peak FLOP/s", fix="pass --device or --peak-flops")
    eff = curve.at(cfg.microbatch_size, seq=cfg.model.seq, attention=cfg.attention)
    mem = estimate_stage_memory(cfg)
    act = cfg.precision.activation_bytes
    msg_bytes = cfg.microbatch_size * cfg.model.seq * cfg.model.hidden * act / (cfg.tp if cfg.sequence_parallel else 1)
    evict_bytes = max((m.activation_per_microbatch for m in mem[: max(1, cfg.pp // 2)]), default=0.0)
    costs = Costs(
        p2p_ns=msg_bytes / network.p2p_bytes_per_s * NS_PER_S,
        bpipe_ns=evict_bytes / network.bpipe_bytes_per_s * NS_PER_S if cfg.bpipe and math.isfinite(
            network.bpipe_bytes_per_s) else 0.0,
        bpipe_overlap=network.bpipe_overlap,
    )
    times, costs = stage_times(cfg, peak_flops=peak, efficiency=eff, costs=costs)
    sim = simulate(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, times=times, costs=costs,
                   virtual_stages=cfg.virtual_stages, bpipe=bpipe_pairs(cfg.pp) if cfg.bpipe else False,
                   bpipe_inflight=cfg.bpipe_inflight)
    step_s = sim.step_ns / NS_PER_S
    model_flops = flops.iteration_flops(cfg.model, global_batch=cfg.global_batch)
    devices = cfg.pp * cfg.tp * cfg.dp
    terms = terms_of(sim.attribution)
    largest = max(mem, key=lambda m: m.total_bytes)
    peak_bytes = largest.total_bytes
    out = StepEstimate(
        config=cfg,
        step_s=step_s,
        mfu=flops.mfu(model_flops, seconds=step_s, peak_flops=peak, devices=devices),
        fits=None if device is None else peak_bytes <= device.memory_bytes,
        peak_bytes=peak_bytes,
        terms=terms,
        efficiency=eff,
        largest=largest,
        twin_peak_bytes=max(m.total_bytes for m in estimate_stage_memory(cfg.replace(bpipe=False))) if cfg.bpipe
        else None,
        hfu=None if cfg.recompute == "none" else flops.mfu(
            flops.iteration_flops(cfg.model, global_batch=cfg.global_batch, recompute=cfg.recompute),
            seconds=step_s, peak_flops=peak, devices=devices),
    )
    return (out, sim) if with_simulation else out


# The step's terms on a stage, by attribution category: each category in one term, so they add up to the step.
# "bubble" is the bubble alone (warm-up + stall + cool-down), as everywhere; host and communication are their own.
TERM_CATEGORIES = {
    "compute": tuple(c for c in schema.COMPUTE_CATEGORIES if c != "recompute"),
    "recompute": ("recompute",),
    "bubble": schema.BUBBLE_CATEGORIES,
    "host": ("host",),
    "communication": ("p2p", "bpipe", "collective"),  # exposed: P2P, BPipe's evictions and loads, collectives
}


def terms_of(attribution: pl.DataFrame) -> dict[str, float]:
    """Seconds per term (TERM_CATEGORIES) on stage 0. It is BPipe's evictor, so waiting for its loads shows there as
    communication, and its window spans the whole step like every stage's, so its terms add up to the step time."""
    groups = TERM_CATEGORIES
    group_of = {c: g for g, cs in groups.items() for c in cs}
    first = attribution.filter(pl.col("stage") == pl.col("stage").min())
    got: dict[str, float] = {g: 0.0 for g in groups}
    for category, ns in zip(first["category"].cast(pl.String).to_list(), first["ns"].to_list()):
        got[group_of[category]] += ns / NS_PER_S
    return got


# --- the verdict -----------------------------------------------------------------------------------------------------
# What BPipe is compared with. Each policy names the configurations the comparison may choose from (micro-batch sizes
# at the same global batch, recompute modes); the same recompute modes are open to the BPipe side, so a gain is BPipe's.
BASELINES: dict[str, str] = {
    "as-configured": "the configuration as given (its micro-batch size and recompute), without BPipe",
    "best-without-bpipe": "the fastest configuration that fits without BPipe (any micro-batch size, any recompute)",
    "full-recompute": "Megatron-LM as the BPipe paper ran it: no recompute where that fits, else full recompute "
                      "(no selective recompute), at the fastest micro-batch size that fits",
}
DEFAULT_BASELINE = "best-without-bpipe"
_POLICY_RECOMPUTES = {"as-configured": ("none", "selective", "full"), "best-without-bpipe": ("none", "selective", "full"),
                      "full-recompute": ("none", "full")}
# The verdict's terms: TERM_CATEGORIES', and transfer: what BPipe's evictions and loads on a real link add to the step
TERMS = (*TERM_CATEGORIES, "transfer")


@dataclass(frozen=True)
class Verdict:
    helps: bool
    speedup: float  # reference step / best BPipe step (> 1: BPipe is faster)
    reference: StepEstimate  # what BPipe is compared with (chosen by the baseline policy)
    given: StepEstimate  # the user's configuration as given
    with_bpipe: StepEstimate | None  # the best fitting BPipe configuration
    deciding_term: str  # a TERM_CATEGORIES term, bandwidth (the transfers), memory or "no change"
    deltas: dict[str, float]  # seconds, BPipe − reference, per term; they sum to the step-time change
    sentence: str
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    baseline: str = DEFAULT_BASELINE
    why: str = ""  # the memory arithmetic in plain words: what BPipe frees and what that memory can buy
    # How robust the answer is (``margins``): the configuration whose fit decides, its distance to the fit line
    # (usable − its largest stage; negative: short by that much), the values at which the verdict flips
    # (``flips``: reserve_bytes, bpipe_bytes_per_s, efficiency at efficiency_microbatch_size; None: none within
    # reach, ``flip_notes`` says why) and warnings (a flip inside the memory model's measured error).
    deciding_config: str = ""
    margin_bytes: float | None = None
    flips: dict = field(default_factory=dict)
    flip_notes: dict = field(default_factory=dict)  # per key of ``flips`` left None: why none is within reach
    warnings: tuple[str, ...] = field(default_factory=tuple)
    fits_without: bool = True  # the reference fits without BPipe (else BPipe helps by making the run fit at all)

    def margin_line(self) -> str:
        """One line: the deciding configuration's distance to the fit line and where the verdict flips."""
        gb = lambda x: f"{x / 2**30:.1f} GiB"  # noqa: E731
        if self.margin_bytes is None:
            room = "has no device memory limit to meet"
        else:
            room = (f"fits with {gb(self.margin_bytes)} to spare" if self.margin_bytes >= 0
                    else f"is {gb(-self.margin_bytes)} short of fitting")
        f, why = self.flips, self.flip_notes
        values = {"reserve_bytes": lambda x: f"at a reserve of {gb(x)}",
                  "bpipe_bytes_per_s": lambda x: f"at a BPipe link of {x / GB:,.3g} GB/s",
                  "efficiency": lambda x: f"at E(b={f['efficiency_microbatch_size']}) = {x:.1%}"}
        said = [values[k](f[k]) if f.get(k) is not None else why[k] for k in values
                if f.get(k) is not None or k in why]
        if not said and self.margin_bytes is None:
            return ""
        flips = "the verdict flips " + "; ".join(said) if said else "nothing within reach flips the verdict"
        return f"Margin: the deciding configuration ({self.deciding_config}) {room}; {flips}."


def check_baseline(baseline: str) -> str:
    if baseline not in BASELINES:
        raise ConfigError(f"unknown BPipe baseline {baseline!r}", fix=f"use one of {', '.join(BASELINES)}")
    return baseline


def decompose(ref_sim, target_sim, free_sim) -> dict[str, float]:
    """Seconds each term (TERMS) adds (+) or saves (−) going from the reference to the BPipe configuration, summing
    exactly to the step-time change. The change of configuration (micro-batch size, recompute, BPipe's schedule) is
    read from stage 0's terms of ``free_sim`` — the best BPipe configuration with free transfers — against the
    reference's (stage 0's terms add up to its step); the transfers are what the real link adds on top: target step −
    free step. Waiting for a load is thus never booked as "transfer +x" against "bubble −x" when it only fills time
    the stage would have waited anyway."""
    a, b = terms_of(ref_sim.attribution), terms_of(free_sim.attribution)
    deltas = {term: b[term] - a[term] for term in TERM_CATEGORIES}
    deltas["transfer"] = (target_sim.step_ns - free_sim.step_ns) / NS_PER_S
    return deltas


def deciding_term(speedup: float, deltas: dict[str, float]) -> str:
    """The term that decides: "no change" inside the model's resolution; else the largest saving when BPipe wins and
    the largest cost when it loses ("bandwidth" when that is the transfers)."""
    if abs(speedup - 1) <= HELPS_ABOVE - 1 or not deltas:
        return "no change"
    pick = min(deltas, key=deltas.get) if speedup > 1 else max(deltas, key=deltas.get)
    return "bandwidth" if pick == "transfer" else pick


def describe_deltas(deltas: dict[str, float], *, unit: float = MS_PER_S, suffix: str = "ms", spec: str = ".0f") -> str:
    """"recompute −1200 ms, bubble +300 ms": the terms that moved, largest first ("transfer" as BPipe transfers)."""
    shown = [(k, d) for k, d in sorted(deltas.items(), key=lambda kv: -abs(kv[1]))
             if abs(d * unit) >= 0.5 * 10 ** -int(spec[1:-1] or 0)]
    name = {"transfer": "BPipe transfers"}
    return ", ".join(f"{name.get(k, k)} {'+' if d >= 0 else '−'}{format(abs(d) * unit, spec)} {suffix}"
                     for k, d in shown)


def evictions(cfg: TrainingConfig) -> int:
    """Micro-batches BPipe evicts per step over all pairs (0: it balances nothing for this configuration)."""
    return sum(bpipe_plan(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches, evictor=e,
                          keep=cfg.bpipe_inflight).evicted
               for e, _ in bpipe_pairs(cfg.pp))


def memory_why(cfg: TrainingConfig, *, device_bytes: float | None) -> str:
    """Plain words and numbers: how much of a layer's saved activations are the s×s attention terms, what stage 0
    holds at the configured micro-batch size without recompute, with and without BPipe, and against the device."""
    m = cfg.model
    kw = dict(microbatch_size=cfg.microbatch_size, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel,
              activation_bytes=cfg.precision.activation_bytes, dropout=cfg.has_dropout, eager=cfg.eager)
    naive = layer_activation_bytes(m, attention="naive", recompute="none", **kw)
    flash = layer_activation_bytes(m, attention="sdpa", recompute="none", **kw)
    share = (naive - flash) / naive if naive else 0.0
    plain = cfg.replace(bpipe=False, recompute="none")
    largest = lambda c: max(estimate_stage_memory(c), key=lambda st: st.total_bytes)  # noqa: E731
    words = (f"{m.name or m.family}: the s×s attention terms (scores, probabilities"
             + (", their dropout mask" if cfg.has_dropout else "") + f") are {share:.0%} of a layer's saved "
             f"activations with naive attention ({bytes_text(naive - flash)} of {bytes_text(naive)} per "
             f"layer at b={cfg.microbatch_size}, s={m.seq}); flash attention does not store them")
    if cfg.pp > 1:
        # Each term of the largest stage named: the state (weights, gradients, optimizer) is what BPipe cannot move
        # and often what decides (LLaMA-65B at pp 4 carries far less of it per stage than GPT-3 175B at pp 8).
        st = largest(plain)
        params = f"{st.params / 1e9:.2f}B" if st.params >= 1e8 else f"{st.params / 1e6:.2f}M"
        words += (f"; largest stage's weights, gradients and optimizer state {bytes_text(st.state_bytes)} "
                  f"({params} parameters a device)")
        for att in ("naive", "sdpa"):
            c = plain.replace(attention=att)
            before, after = largest(c), largest(c.replace(bpipe=True))
            fit = "" if device_bytes is None else (
                " — fits without BPipe" if before.total_bytes <= device_bytes else
                (" — fits only with BPipe" if after.total_bytes <= device_bytes else " — does not fit either way"))
            words += (f"; {att}, no recompute: largest stage {bytes_text(before.total_bytes)} "
                      f"(activations {bytes_text(before.activation_peak_bytes)}) without BPipe, "
                      f"{bytes_text(after.total_bytes)} (activations {bytes_text(after.activation_peak_bytes)}) "
                      f"with it{fit}")
    return words + "."


def candidates(cfg: TrainingConfig, *, bpipe: bool, max_microbatch: int = 64,
               recomputes: tuple[str, ...] = ("none", "selective", "full")) -> list[TrainingConfig]:
    """Configurations at the same global batch: micro-batch sizes b·2^k that divide it, each recompute mode (not
    those with more stage passes per step than the simulator steps through: limits.MAX_SCHEDULE_SLOTS)."""
    per_pipeline = cfg.microbatch_size * cfg.num_microbatches
    out = []
    b = 1
    while b <= min(per_pipeline, max_microbatch):
        if per_pipeline % b == 0 and not schedule_slots_error(cfg.pp, cfg.virtual_stages, per_pipeline // b):
            for rc in recomputes:
                if rc == "selective" and cfg.attention != "naive":
                    continue  # nothing s×s to drop: selective equals none with flash attention
                out.append(cfg.replace(microbatch_size=b, num_microbatches=per_pipeline // b, recompute=rc,
                                       bpipe=bpipe))
        b *= 2
    return out


def _best(estimates: list[StepEstimate], usable: float | None = None) -> StepEstimate | None:
    ok = [e for e in estimates if (e.fits is not False if usable is None else e.peak_bytes <= usable)]
    return min(ok, key=lambda e: e.step_s) if ok else None


def decide(plain: list[StepEstimate], balanced: list[StepEstimate], given: StepEstimate, *,
           usable: float) -> tuple[bool, StepEstimate, StepEstimate | None]:
    """(helps, reference, best BPipe) with ``usable`` bytes per device: the rule the verdict and its flips share.
    BPipe helps when its best fitting configuration beats the baseline's by more than HELPS_ABOVE, or when the
    baseline does not fit at all and BPipe is what makes the fastest fitting BPipe configuration fit (its twin
    without BPipe does not; then no speed-up is a fair figure). When that configuration fits without BPipe too (e.g.
    with recompute), its recompute or micro-batch size makes the run fit, not BPipe."""
    reference = _best(plain, usable) or given
    best = _best(balanced, usable)
    if best is None:
        return False, reference, None
    if reference.peak_bytes > usable:
        return best.twin_peak_bytes is None or best.twin_peak_bytes > usable, reference, best
    return reference.step_s / best.step_s > HELPS_ABOVE, reference, best


@dataclass(frozen=True)
class _Pinned:
    """An efficiency curve with E at one micro-batch size replaced (the efficiency flip's search)."""

    curve: EfficiencyCurve
    microbatch_size: int
    value: float

    def at(self, microbatch_size: float, *, seq: int, attention: str | None = None) -> float:
        if microbatch_size == self.microbatch_size:
            return self.value
        return self.curve.at(microbatch_size, seq=seq, attention=attention)


def _bisect(helps: Callable[[float], bool], now: bool, lo: float, hi: float, *, log: bool, steps: int = 4) -> float:
    """The value between ``lo`` (where the verdict is ``now``) and ``hi`` (where it is not) at which it flips, to
    within (hi/lo)^(1/2^steps) (log) or (hi−lo)/2^steps: a handful of evaluations, each a few simulations."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
        if helps(mid) == now:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def bpipe_verdict(cfg: TrainingConfig, *, device: Device, curve: EfficiencyCurve = EfficiencyCurve(),
                  network: Network = Network(), reserve_bytes: float | None = None,
                  baseline: str = DEFAULT_BASELINE,
                  on_progress: Callable[[int, int], None] | None = None) -> Verdict:
    """Compare the best BPipe configuration with the baseline policy's configuration (``BASELINES``), at the same
    global batch and parallelism, on ``device`` less ``reserve_bytes`` (default: memory.reserve_bytes's, the one
    default the CLI uses too). ``on_progress(done, total)`` after each simulated configuration (a thousand
    micro-batches take seconds each; ``total`` grows by the few the flip search adds)."""
    check_baseline(baseline)
    check_bpipe(cfg.schedule, virtual_stages=cfg.virtual_stages, fix="use --schedule 1f1b")
    total_bytes = device.memory_bytes
    reserve = default_reserve(total_bytes, reserve_bytes) if math.isfinite(total_bytes) else 0.0
    dev = Device(device.name, total_bytes - reserve, device.peak_flops, device.source)
    usable = dev.memory_bytes
    recomputes = _POLICY_RECOMPUTES[baseline]
    plain_cands = candidates(cfg, bpipe=False, recomputes=recomputes) if baseline != "as-configured" else []
    balanced_cands = candidates(cfg, bpipe=True, recomputes=recomputes) if cfg.pp > 1 else []
    # the given one, both candidate lists, the balanced ones again with free transfers, three simulated again
    total = 1 + len(plain_cands) + 2 * len(balanced_cands) + 3
    done = 0

    def simulated(c: TrainingConfig, net: Network = network, crv=curve):
        nonlocal done
        out = _estimate(c, device=dev, curve=crv, network=net)
        done += 1
        if on_progress is not None:
            on_progress(done, max(total, done))
        return out

    def est(c: TrainingConfig, net: Network = network, crv=curve) -> StepEstimate:
        return simulated(c, net, crv)[0]  # its simulation is dropped: memory stays one simulation's, whatever m

    given = est(cfg.replace(bpipe=False))
    plain = [est(c) for c in plain_cands] or [given]
    balanced = [est(c) for c in balanced_cands]
    helps, reference, best = decide(plain, balanced, given, usable=usable)
    why = memory_why(cfg, device_bytes=usable)
    assumptions = (
        f"baseline: {baseline} ({BASELINES[baseline]})",
        f"compute efficiency E(b) {curve.source}"
        + ("" if curve.points else f" (saturating, e_max={curve.e_max}, n_half={curve.tokens_half:g} tokens)"),
        f"P2P {network.p2p_bytes_per_s / GB:g} GB/s, BPipe transfers {network.bpipe_bytes_per_s / GB:g} GB/s "
        f"({'overlapped' if network.bpipe_overlap else 'blocking'})",
        f"device memory {bytes_text(usable, 0)} usable ({bytes_text(reserve, 0)} of {bytes_text(total_bytes, 0)} "
        "kept free)" if math.isfinite(total_bytes) else "no device memory limit",
    )
    def grow(n: int) -> None:  # the flip search's simulations, announced as they come
        nonlocal total
        total += n

    # What BPipe's freed memory could buy with free transfers; what the link costs is the rest (a BPipe configuration
    # chosen to keep transfers small, e.g. with recompute, is the link's cost too).
    free_net = Network(network.p2p_bytes_per_s, math.inf, network.bpipe_overlap)
    if best is None:
        total -= len(balanced) + 3  # nothing to decompose
        free = []
    else:
        free = [est(c.config, free_net) for c in balanced]
    margins = _margins(plain, balanced, given, free, reference=reference, best=best, helps=helps,
                       total_bytes=total_bytes, reserve=reserve, network=network, curve=curve, est=est, grow=grow)
    if best is None:
        sentence = ("BPipe does not help: no configuration fits even with balanced activations."
                    if reference.peak_bytes > usable else
                    f"BPipe does not help: no BPipe configuration fits in {bytes_text(usable, 1)} (against {baseline}, "
                    f"{reference.describe()}, {seconds_text(reference.step_s)} per step).")
        return Verdict(False, 1.0, reference, given, None, "memory", {}, sentence, assumptions, baseline, why,
                       fits_without=reference.peak_bytes <= usable, **margins)
    free_best = _best(free, usable) or best
    # The three simulations the terms come from, run again (deterministic) rather than all of them kept.
    deltas = decompose(simulated(reference.config)[1], simulated(best.config)[1],
                       simulated(free_best.config, free_net)[1])
    speedup = reference.step_s / best.step_s
    fits_without = reference.peak_bytes <= usable
    deciding = deciding_term(speedup, deltas) if fits_without else "memory"
    sentence = _sentence(helps, speedup, reference, best, deltas, deciding, fits_without=fits_without,
                         baseline=baseline, evicted=evictions(best.config))
    return Verdict(helps, speedup, reference, given, best, deciding, deltas, sentence, assumptions, baseline, why,
                   fits_without=fits_without, **margins)


def _margins(plain, balanced, given, free, *, reference, best, helps, total_bytes, reserve, network, curve, est,
             grow) -> dict:
    """The verdict's robustness (``Verdict.margin_bytes``, ``flips``, ``warnings``): where each assumption — the
    reserve, the BPipe link's bandwidth, the efficiency of the BPipe side's micro-batch size — would flip it.

    The reserve needs no simulation: every candidate's step time is known, only which ones fit changes, so the
    verdict is evaluated at each candidate's fit line (``decide``). The link and the efficiency are bisected on a
    few evaluations of the few configurations that could change the answer."""
    usable = total_bytes - reserve
    notes: dict[str, str] = {}
    flips: dict = {"reserve_bytes": None, "bpipe_bytes_per_s": None, "efficiency": None,
                   "efficiency_microbatch_size": None}
    # -- reserve: the nearest fit line across which the verdict changes
    nearest = None
    if math.isfinite(total_bytes):
        lines = [(e.peak_bytes, e) for e in {id(e): e for e in (*plain, *balanced, given)}.values()]
        lines += [(e.twin_peak_bytes, e) for e in balanced if e.twin_peak_bytes is not None]  # BPipe needed or not
        for p, e in sorted(lines, key=lambda pe: pe[0]):
            if p > total_bytes:
                continue  # no reserve lets it fit
            after = decide(plain, balanced, given, usable=p if p > usable else p * (1 - 1e-12))[0]
            if after != helps and (nearest is None or abs(p - usable) < abs(nearest[0] - usable)):
                nearest = (p, e)
    if nearest is not None:
        line, deciding = nearest
        flips["reserve_bytes"] = total_bytes - line
    else:
        deciding = best or reference
        line = deciding.peak_bytes
        if math.isfinite(total_bytes):
            notes["reserve_bytes"] = "at no reserve"
    margin = usable - line if math.isfinite(usable) else None
    # the line may be the BPipe configuration's twin without BPipe (whether BPipe is what makes it fit)
    twin = deciding.twin_peak_bytes is not None and line == deciding.twin_peak_bytes != deciding.peak_bytes
    named = deciding.config.replace(bpipe=False) if twin else deciding.config
    desc = StepEstimate.describe(dataclasses.replace(deciding, config=named)) + (" without BPipe" if twin else "")
    warnings = []
    if margin is not None and deciding.largest is not None:
        err = fit_uncertainty_bytes(deciding.largest, recompute=deciding.config.recompute)
        if abs(margin) <= err:
            warnings.append(
                f"the deciding configuration ({desc}) is {abs(margin) / 2**30:.1f} GiB from the fit "
                f"line, within the memory model's measured error (±{err / 2**30:.1f} GiB on its largest stage's "
                f"activations): the verdict may go either way")
    # -- the BPipe link and the efficiency change nothing while the baseline itself does not fit
    if reference.peak_bytes > usable or best is None:
        notes["bpipe_bytes_per_s"] = ("at no link or efficiency while it stands: the baseline does not fit without "
                                      "BPipe" if best is not None else
                                      "at no link or efficiency while it stands: no BPipe configuration fits")
        return dict(deciding_config=desc, margin_bytes=margin, flips=flips, flip_notes=notes,
                    warnings=tuple(warnings))
    # -- link: only fitting BPipe configurations that win with free transfers can make BPipe help
    by_step = sorted(((f, b) for f, b in zip(free, balanced) if b.peak_bytes <= usable), key=lambda fb: fb[0].step_s)
    hopeful = [b for f, b in by_step if reference.step_s / f.step_s > HELPS_ABOVE][:2]
    if helps:
        hopeful = [best, *[b for b in hopeful if b is not best]][:2]

    def helps_at_link(bw: float) -> bool:
        if not hopeful:
            return False
        grow(len(hopeful))
        net = Network(network.p2p_bytes_per_s, bw, network.bpipe_overlap)
        return reference.step_s / min(est(b.config, net).step_s for b in hopeful) > HELPS_ABOVE

    bw = network.bpipe_bytes_per_s
    if not hopeful:
        notes["bpipe_bytes_per_s"] = "at no BPipe link (not even free transfers make it help)"
    elif math.isfinite(bw):
        x = bw
        for _ in range(5):
            nxt = x / 4 if helps else x * 4
            if helps_at_link(nxt) != helps:
                flips["bpipe_bytes_per_s"] = _bisect(helps_at_link, helps, x, nxt, log=True)
                break
            x = nxt
        else:
            notes["bpipe_bytes_per_s"] = (f"at no BPipe link from {bw / GB:,.3g} to "
                                          f"{(bw / 4**5 if helps else bw * 4**5) / GB:,.3g} GB/s")
    # -- efficiency at the BPipe side's micro-batch size (the re-evaluation's question: is a larger b used better?)
    b_star = best.config.microbatch_size
    if b_star == reference.config.microbatch_size:
        notes["efficiency"] = f"at no E(b) that matters (both sides run b={b_star})"
    else:
        e_now = curve.at(b_star, seq=best.config.model.seq, attention=best.config.attention)

        # the fastest fitting configuration at b* on each side: the others at b* move with it (same E)
        def fastest_at_b(es: list[StepEstimate]) -> list[int]:
            fit = [i for i, e in enumerate(es) if e.config.microbatch_size == b_star and e.peak_bytes <= usable]
            return sorted(fit, key=lambda i: es[i].step_s)[:1]

        at_b, at_bb = fastest_at_b(plain), fastest_at_b(balanced)

        def helps_at_efficiency(x: float) -> bool:
            grow(len(at_b) + len(at_bb))
            pinned = _Pinned(curve, b_star, x)
            p2, b2 = list(plain), list(balanced)
            for i in at_b:
                p2[i] = est(plain[i].config, network, pinned)
            for i in at_bb:
                b2[i] = est(balanced[i].config, network, pinned)
            return decide(p2, b2, given, usable=usable)[0]

        for end in (max(0.01, e_now / 4), min(1.0, 2 * e_now)):
            if end != e_now and helps_at_efficiency(end) != helps:
                flips["efficiency"] = _bisect(helps_at_efficiency, helps, e_now, end, log=False)
                flips["efficiency_microbatch_size"] = b_star
                break
        else:
            notes["efficiency"] = f"at no E(b={b_star}) from {max(0.01, e_now / 4):.0%} to {min(1.0, 2 * e_now):.0%}"
    return dict(deciding_config=desc, margin_bytes=margin, flips=flips, flip_notes=notes,
                warnings=tuple(warnings))


def _estimate(cfg: TrainingConfig, *, device: Device | None, curve: EfficiencyCurve, network: Network):
    """``estimate_step`` and its simulation (the verdict decomposes the simulated terms)."""
    return estimate_step(cfg, device=device, curve=curve, network=network, with_simulation=True)


def _sentence(helps: bool, speedup: float, ref: StepEstimate, best: StepEstimate, deltas: dict[str, float],
              deciding: str, *, fits_without: bool, baseline: str, evicted: int) -> str:
    changed = describe_deltas(deltas) or "no term changes"
    against = f"against {baseline} ({ref.describe()}, {seconds_text(ref.step_s)} per step)"
    nothing = " BPipe evicts nothing in this configuration." if evicted == 0 else ""
    if not fits_without and not helps:
        return (f"BPipe does not help: the {baseline} configuration ({ref.describe()}) does not fit in memory (its "
                f"largest stage needs {bytes_text(ref.peak_bytes, 1)}), and the fastest configuration that fits with "
                f"BPipe, {best.describe()} ({seconds_text(best.step_s)} per step), fits without it too "
                f"({bytes_text(best.twin_peak_bytes or 0, 1)}): its "
                + ("recompute" if best.config.recompute != ref.config.recompute else "micro-batch size")
                + " makes the run fit, not BPipe.")
    if not fits_without:
        return (f"BPipe helps: without it the {baseline} configuration ({ref.describe()}) does not fit in memory "
                f"(its largest stage needs {bytes_text(ref.peak_bytes, 1)}); with it {best.describe()} fits and "
                f"runs at "
                f"{seconds_text(best.step_s)} per step (MFU {best.mfu:.1%}; {speedup:.3f}× the step the unfitting "
                "configuration would take).")
    if deciding == "no change":
        return (f"BPipe makes no difference ({speedup:.3f}×) {against}: best with it {best.describe()} "
                f"{seconds_text(best.step_s)}; {changed}.{nothing} Deciding term: no change.")
    if not helps:
        return (f"BPipe does not help ({speedup:.3f}×) {against}: best with it {best.describe()} "
                f"{seconds_text(best.step_s)}; {changed}.{nothing} Deciding term: {deciding}.")
    return (f"BPipe helps by {speedup:.3f}× {against}: with it {best.describe()} {seconds_text(best.step_s)} per step; "
            f"{changed}. Deciding term: {deciding}.")
