"""Would BPipe help this measured run? Both sides predicted from the run's own durations, under a named baseline
policy (traceana.model.bpipe.BASELINES)."""

from __future__ import annotations

from traceana.core.errors import AnalysisError
from traceana.core.pipeline_rules import why_no_bpipe
from traceana.core.training_config import TrainingConfig
from traceana.core.units import NS_PER_MS, NS_PER_S, bytes_text
from traceana.measure.analysis import Analysis
from traceana.model.bpipe import (BASELINES, HELPS_ABOVE, StepEstimate, Verdict, _bisect, check_baseline, deciding_term,
                                  decompose, describe_deltas, evictions, terms_of)
from traceana.model.memory import estimate_stage_memory
from traceana.model.simulate import Simulation
from traceana.validation.measurement import measure
from traceana.validation.prediction import LOCAL_COPY_BYTES_PER_NS, predict

RUN_RECOMPUTE = {"as-configured": None, "best-without-bpipe": "none", "full-recompute": "full"}


def bpipe_verdict_from_run(baseline: Analysis, *, cfg: TrainingConfig | None = None, bpipe_ns: float | None = None,
                           policy: str = "as-configured") -> Verdict:
    """Would BPipe help this measured (plain 1F1B) run? Both sides are predicted from the run's own measured
    durations. ``policy`` (model.bpipe.BASELINES) says what BPipe is compared with: ``as-configured`` the run as it
    ran, BPipe added and recompute kept (no device memory limit is known, so dropping recompute is not BPipe's to
    claim); ``best-without-bpipe`` both without recompute; ``full-recompute`` (the BPipe paper's comparison) the run
    with full recompute against BPipe without any. A BPipe transfer costs ``bpipe_ns`` (default: one P2P message's
    time plus stage 0's activation bytes per micro-batch at LOCAL_COPY_BYTES_PER_NS, overlapped)."""
    check_baseline(policy)
    cfg = cfg or baseline.config.training_config(path=baseline.run.path)
    why = "it already runs BPipe" if cfg.bpipe else why_no_bpipe(cfg.schedule, pp=cfg.pp,
                                                                    virtual_stages=cfg.virtual_stages)
    if why is not None:
        raise AnalysisError(f"no BPipe verdict for this run: {why}", path=baseline.run.path,
                            fix="collect a 1F1B run without BPipe")
    rc = RUN_RECOMPUTE[policy]
    ref_cfg = cfg if rc is None else cfg.replace(recompute=rc)
    target = cfg.replace(bpipe=True, recompute=cfg.recompute if rc is None else "none")
    ref = predict(baseline, ref_cfg, base_cfg=cfg)
    sim = predict(baseline, target, base_cfg=cfg, bpipe_ns=bpipe_ns)
    free = predict(baseline, target, base_cfg=cfg, bpipe_ns=0.0)
    deltas = decompose(ref, sim, free)
    speedup = ref.step_ns / sim.step_ns
    deciding = deciding_term(speedup, deltas)
    helps = speedup > HELPS_ABOVE
    before, after = estimate_stage_memory(ref_cfg), estimate_stage_memory(target)
    n_ev = evictions(target)
    flips, notes = _transfer_flip(baseline, target, cfg, ref.step_ns, helps, sim_bpipe_ns=bpipe_ns)
    flip = flips["bpipe_transfer_ns"]
    flip_words = (f" It would flip at a BPipe transfer of {flip / NS_PER_MS:.3g} ms per eviction (assumed "
                  f"{flips['assumed_bpipe_transfer_ns'] / NS_PER_MS:.3g} ms)." if flip is not None else
                  f" It flips {notes['bpipe_transfer_ns']}.")
    verb = {"no change": "would make no difference to"}.get(deciding, "would help" if helps else "would not help")
    sentence = (
        f"BPipe {verb} this run against {policy} ({speedup:.3f}×: {ref.step_ns / NS_PER_MS:.1f} → "
        f"{sim.step_ns / NS_PER_MS:.1f} ms per step predicted from its own durations"
        + (", dropping recompute" if target.recompute != ref_cfg.recompute else "")
        + f"); {describe_deltas(deltas, spec='.1f') or 'no term changes'}"
        + (f"; BPipe evicts nothing at pp={cfg.pp}, m={cfg.num_microbatches}" if n_ev == 0 else
           f"; {n_ev} evictions per step")
        + f". Deciding term: {deciding}. Model: largest stage's activation peak "
        f"{bytes_text(max(s.activation_peak_bytes for s in before), 2)} → "
        f"{bytes_text(max(s.activation_peak_bytes for s in after), 2)}."
        + flip_words
    )
    def est(c: TrainingConfig, s: Simulation, mem) -> StepEstimate:
        return StepEstimate(config=c, step_s=s.step_ns / NS_PER_S, mfu=float("nan"), fits=None,
                            peak_bytes=max(m.total_bytes for m in mem), terms=terms_of(s.attribution),
                            efficiency=float("nan"))

    r = est(ref_cfg, ref, before)
    return Verdict(
        helps=helps, speedup=speedup, reference=r, given=est(cfg, predict(baseline, cfg, base_cfg=cfg), before),
        with_bpipe=est(target, sim, after), deciding_term=deciding, deltas=deltas, sentence=sentence,
        assumptions=("durations measured on this run (both sides predicted from them); BPipe transfer "
                     + ("as given" if bpipe_ns is not None else "= one P2P message's time + stage 0's activation "
                        "bytes per micro-batch at 1 GB/s, overlapped (a run without BPipe has no BPipe transfer "
                        "to measure; a BPipe run's own are in validate's notes)"),
                     f"baseline: {policy} ({BASELINES[policy]})"),
        baseline=policy, flips=flips, flip_notes=notes)


def _transfer_flip(run: Analysis, target: TrainingConfig, cfg: TrainingConfig, ref_ns: float, helps: bool, *,
                   sim_bpipe_ns: float | None) -> tuple[dict, dict]:
    """The BPipe transfer time per eviction at which this run's verdict flips (a bisection on a few replays of the
    run's own durations), against the one assumed; no memory limit is known for a measured run, so no reserve
    flips it."""
    assumed = sim_bpipe_ns
    if assumed is None:  # predict's default, computed the same way: one P2P message + the bytes at copy speed
        assumed = (measure(run, cfg).costs.p2p_ns
                   + estimate_stage_memory(target)[0].activation_per_microbatch / LOCAL_COPY_BYTES_PER_NS)

    def helps_at(ns: float) -> bool:
        return ref_ns / predict(run, target, base_cfg=cfg, bpipe_ns=ns).step_ns > HELPS_ABOVE

    flips = {"bpipe_transfer_ns": None, "assumed_bpipe_transfer_ns": assumed}
    if not helps and (assumed <= 0 or not helps_at(0.0)):
        return flips, {"bpipe_transfer_ns": "at no transfer time (not even free transfers make it help)"}
    # free transfers assumed: search up from a ten-thousandth of the step (a transfer nothing could notice)
    x = assumed if assumed > 0 else ref_ns * 1e-4
    for _ in range(5 if assumed > 0 else 8):
        nxt = x * 4 if helps else x / 4
        if helps_at(nxt) != helps:
            flips["bpipe_transfer_ns"] = _bisect(helps_at, helps, x, nxt, log=True)
            return flips, {}
        x = nxt
    return flips, {"bpipe_transfer_ns": f"at no transfer time from {assumed / NS_PER_MS:.3g} to {x / NS_PER_MS:.3g} ms"}
