"""Prediction: a run's step time from another run's measured durations only (none of the predicted run's), and
the noise floor it must be judged against (one configuration measured twice)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from traceana.validation.plan import LOCAL_COPY_BYTES_PER_NS  # (the one assumption, also verdict's: imported from here)
from traceana.core.errors import AnalysisError
from traceana.core.training_config import TrainingConfig
from traceana.measure.analysis import Analysis
from traceana.measure.noise import between_runs, twice
from traceana.model.memory import estimate_stage_memory
from traceana.model.simulate import Simulation, StageTimes, simulate
from traceana.validation.measurement import measure, shared_cpus
from traceana.validation.plan import plan_of, plan_whatif


def predict(baseline: Analysis, target: TrainingConfig, *, base_cfg: TrainingConfig | None = None,
            bpipe_ns: float | None = None) -> Simulation:
    """Predict a target configuration's step from a baseline run's measured durations.

    The same pipeline and micro-batch size are assumed (durations do not transfer across shapes); recompute is dropped
    or kept as the target says; BPipe transfers cost ``bpipe_ns`` each (by default one baseline P2P message's time
    plus the evictor's activation bytes per micro-batch at LOCAL_COPY_BYTES_PER_NS).
    """
    base_cfg = base_cfg or baseline.config.training_config(path=baseline.run.path)
    if (target.pp, target.microbatch_size, target.model) != (base_cfg.pp, base_cfg.microbatch_size, base_cfg.model):
        raise AnalysisError("the cross-run prediction needs the same model, pp and micro-batch size",
                            path=baseline.run.path, fix="compare runs that differ only in schedule, BPipe, recompute")
    meas = measure(baseline, base_cfg)
    t = meas.times
    if target.recompute == "none":
        t = StageTimes(t.forward_ns, t.backward_ns, (), t.optimizer_ns, t.host_ns)
    costs = meas.costs
    if target.bpipe:
        if bpipe_ns is None:
            # One eviction costs what one of the baseline's P2P messages cost (on a CPU host that is latency, not
            # bandwidth: every message here is small) plus its bytes at copy speed.
            evict = estimate_stage_memory(target)[0].activation_per_microbatch
            bpipe_ns = costs.p2p_ns + evict / LOCAL_COPY_BYTES_PER_NS
        costs = dataclasses.replace(costs, bpipe_ns=bpipe_ns)
    return simulate(target.schedule, pp=target.pp, num_microbatches=target.num_microbatches, times=t, costs=costs,
                    virtual_stages=target.virtual_stages, bpipe=bool(target.bpipe),
                    bpipe_inflight=target.bpipe_inflight)


def noise_floor(first: Analysis, second: Analysis) -> float:
    """The same configuration measured twice: |step₁ − step₂| / their mean. A prediction cannot be judged finer.

    Refused (AnalysisError) unless they are two runs (not one folder twice, which would read as no noise at all)
    of one configuration as their run.json describe it (the traces' schedule and micro-batches): the difference
    between two configurations is not noise."""
    if twice([(str(Path(a.run.path).resolve()), a.summary.step_times_ms) for a in (first, second)]):
        raise AnalysisError("--repeat names the same run twice (one folder, or a copy with the same measured steps): "
                            "its noise floor would be 0", path=second.run.path,
                            fix="give two separate collections of one configuration")
    cfgs = []
    for a in (first, second):
        if not a.config.has_run_json:
            raise AnalysisError("the noise floor needs run.json (to tell that both runs are one configuration)",
                                path=a.run.path, fix="collect both runs with `traceana collect`")
        cfgs.append(a.config.training_config(path=a.run.path))
    if cfgs[0] != cfgs[1]:
        diff = [f.name for f in dataclasses.fields(cfgs[0]) if getattr(cfgs[0], f.name) != getattr(cfgs[1], f.name)]
        raise AnalysisError(f"--repeat runs are not one configuration (they differ in {', '.join(diff)}), so their "
                            "difference is not noise", path=second.run.path,
                            fix="give two collections of the same configuration")
    x, y = first.summary.step_ms, second.summary.step_ms
    return abs(x - y) / ((x + y) / 2) if x + y else 0.0


def distinct(runs: list[Analysis]) -> tuple[list[Analysis], list[str]]:
    """``runs`` with each run once (traceana.measure.noise.twice: the same folder, or a copy with the same measured
    steps), and one sentence per run dropped: a run given twice adds no spread between runs, so it counts once."""
    kept: list[Analysis] = []
    said: list[str] = []
    for a in runs:
        hit = twice([(str(Path(r.run.path).resolve()), r.summary.step_times_ms) for r in (*kept, a)])
        if hit is None:
            kept.append(a)
        else:
            first = kept[hit[0]].run.path
            how = "the same folder" if Path(first).resolve() == Path(a.run.path).resolve() else \
                "the same measured steps: a copy"
            said.append(f"{a.run.path} is {first} again ({how}): counted once")
    return kept, said


def _measured(*runs: Analysis) -> None:
    """Refuse (one line) a run with no measured step time: it has nothing to compare."""
    for r in runs:
        if not r.summary.step_ms:
            raise AnalysisError("no measured step time in this run, so it cannot be compared", path=r.run.path,
                                fix="profile at least one complete step after the warm-up")


def _sides(baseline: Analysis, target: Analysis, base_cfg: TrainingConfig, tgt_cfg: TrainingConfig,
           repeat: tuple[Analysis, ...] | None) -> tuple[list[Analysis], list[Analysis], list[str]]:
    """Each side's runs in the order given (the baseline or the target first, then the ``repeat`` runs of its
    configuration), each run once; a repeat of neither configuration is refused (its difference is not noise)."""
    base, other = [baseline], [target]
    for r in repeat or ():
        cfg = r.config.training_config(path=r.run.path) if r.config.has_run_json else None
        if cfg == base_cfg:
            base.append(r)
        elif cfg == tgt_cfg:
            other.append(r)
        else:
            raise AnalysisError("--repeat: this run is a collection of neither the baseline's nor the target's "
                                "configuration (run.json), so its difference is not noise", path=r.run.path,
                                fix="give --repeat only more collections of the two configurations compared")
    _measured(*base, *other)
    base, said = distinct(base)
    other, said_o = distinct(other)
    return base, other, said + said_o


def cross_run(baseline: Analysis, target: Analysis, *,
              repeat: tuple[Analysis, ...] | None = None) -> dict[str, float | str | None]:
    """A PREDICTION: measure the baseline, predict the target from it (no duration of the target is used), compare
    with the target's measured step time; ``repeat``: more collections of either configuration (each side's runs
    then give the between-run noise, traceana.measure.noise).

    The model predicts the *change*: the target's step is the baseline's measured step times the ratio of the two
    simulations (target over baseline, both fed only with the baseline run's measurements), so a bias the simulator
    has on this machine cancels. Where the runs differ only in their plan (schedule, micro-batches, BPipe:
    plan.plan_of) that is the baseline's measured what-if (plan.plan_whatif; ``measured_whatif`` true), else the
    model with the target's whole configuration. One statistic throughout: each side's step time is the geometric
    mean of its runs' (traceana.measure.noise: ``baseline_step_ms``, ``measured_step_ms``; ``predicted_step_ms`` is the
    baseline side's times the predicted ratio), the measured change and its interval come from the runs, and the
    speed-ups are 1/(1 + change) of the same numbers. ``prediction_within_noise``: whether the predicted change lies
    inside the measured interval (None: one run on a side, the noise unknown)."""
    for a in (baseline, target):
        if not a.config.has_run_json:  # the run that lacks it is the one named
            raise AnalysisError("cross-run validation needs run.json in both runs: this one has none",
                                path=a.run.path, fix="collect both with `traceana collect`, or write its run.json")
    base_cfg = baseline.config.training_config(path=baseline.run.path)
    tgt_cfg = target.config.training_config(path=target.run.path)

    base_runs, tgt_runs, counted_once = _sides(baseline, target, base_cfg, tgt_cfg, repeat)
    meas_t = measure(target, tgt_cfg)
    meas_b = measure(baseline, base_cfg)
    plan = plan_of(base_cfg, tgt_cfg)
    if plan is not None:  # the runs differ only in their plan: the baseline's measured what-if (one rule)
        whatif = plan_whatif(baseline, **plan)
        ratio = whatif["simulated_plan_ms"] / whatif["simulated_as_run_ms"]
        method = ("measured what-if: the baseline's own durations under this run's schedule, micro-batches and "
                  "BPipe (traceana whatif --schedule), scaled by the baseline's measured step")
    else:
        ratio = (predict(baseline, tgt_cfg, base_cfg=base_cfg).step_ns
                 / predict(baseline, base_cfg, base_cfg=base_cfg).step_ns)
        method = "model: the simulator fed with the baseline's per-stage durations, scaled by its measured step"
    measured_change = between_runs([a.summary.step_ms for a in base_runs], [a.summary.step_ms for a in tgt_runs])
    base_ms, measured = measured_change.base_ms, measured_change.other_ms
    predicted = base_ms * ratio
    predicted_change = ratio - 1
    compute = ((sum(meas_t.times.forward_ns) + sum(meas_t.times.backward_ns))
               / (sum(meas_b.times.forward_ns) + sum(meas_b.times.backward_ns)))
    agree, prediction_words = judged(measured_change, predicted_change, compute)
    one_config = len(repeat or ()) == 2 and len({r.config.training_config(path=r.run.path) for r in repeat}) == 1
    return {
        "kind": "prediction",
        "method": method,
        "measured_whatif": plan is not None,
        "baseline": str(baseline.run.path),
        "target": str(target.run.path),
        "statistic": measured_change.as_dict()["statistic"],
        "baseline_step_ms": base_ms,
        "predicted_step_ms": predicted,
        "measured_step_ms": measured,
        "error": (predicted - measured) / measured if measured else None,
        # two --repeat runs of one configuration: |step₁ − step₂| / their mean, beside the error (JSON only)
        "noise_floor": noise_floor(*repeat) if one_config else None,
        "predicted_change": predicted_change,
        "predicted_speedup": 1 / ratio,
        "measured_speedup": measured_change.speedup,
        # the target's forward+backward time per micro-batch over the baseline's: the model assumes 1 unless the
        # change (e.g. recompute) alters the work; anything else is the machine running at another speed
        "compute_ratio": compute,
        "machine_note": shared_cpus(target) or shared_cpus(baseline),
        # the measured change with its between-run interval (traceana.measure.noise's names), and whether the predicted
        # change lies inside it (None: the noise unknown)
        **measured_change.as_dict(),
        "measured_change_words": measured_change.words(what="measured step time"),
        "prediction_within_noise": None if measured_change.within_noise is None else
        measured_change.low <= predicted_change <= measured_change.high,
        # the model against the measurement: agree only where the measured change is beyond the noise
        "agree": agree, "prediction_words": prediction_words,
        "counted_once": counted_once,
    }


# A measured and a modelled change agree when the measured one is beyond the noise and the model's lies inside its
# interval (traceana.measure.noise). When they do not, the runs' forward+backward time per micro-batch says whether the
# machine changed speed between them: outside 1 ± MACHINE_DRIFT it did (no configuration change of the kind compared
# alters a kernel's work), inside it the model missed something.
MACHINE_DRIFT = 0.10


def judged(measured, predicted: float, compute: float) -> tuple[bool | None, str]:
    """(agree, sentence) for a measured change (traceana.measure.noise.Change) against the model's predicted change:
    agree is None where the runs cannot judge the model (within noise, or one run on a side)."""
    said = f"the model predicts {predicted:+.1%} (speed-up {1 / (1 + predicted):.3f}×)"
    if measured.within_noise is None:
        return None, f"{said}; the runs cannot judge it until each side is repeated"
    inside = measured.low <= predicted <= measured.high
    if measured.within_noise:
        return None, (f"{said}, {'inside' if inside else 'outside'} that interval; runs within noise neither "
                      "confirm nor refute it")
    if inside:
        return True, f"{said}, inside that interval: measured and modelled agree"
    if abs(compute - 1) > MACHINE_DRIFT:
        return False, (f"{said}, outside that interval: they differ because the machine changed speed — "
                       f"forward+backward per micro-batch took {compute:.2f}× as long in the second configuration's "
                       "runs, which no change compared here makes (other work on the host)")
    return False, (f"{said}, outside that interval, with forward+backward per micro-batch unchanged "
                   f"({compute:.2f}×): the model misses what changed (see the report's A/B section)")


def repeated_comparison(baselines: list[Analysis], targets: list[Analysis]) -> dict:
    """Two configurations, each collected several times (interleaved, in the order collected: round k's runs are the
    k-th of each list): the measured change of step time over their runs with its between-run interval
    (traceana.measure.noise), the model's predicted change (``cross_run`` of each pair, the median), the median
    forward+backward ratio, and one ``headline`` that says the measured change with its interval first and then
    whether the model's agrees, or why it cannot be judged. Each side's step time (``base_step_ms``,
    ``other_step_ms``) is traceana.measure.noise's statistic; per side also its runs' step times, activation peaks and
    bubble fractions (with their medians: memory and bubbles, not the step-time comparison)."""
    import statistics

    if not baselines or not targets:
        raise AnalysisError("a repeated comparison needs runs on both sides", path=None,
                            fix="collect each configuration at least once")
    _measured(*baselines, *targets)
    (baselines, said_b), (targets, said_t) = distinct(baselines), distinct(targets)
    pairs = [cross_run(b, t) for b, t in zip(baselines, targets)]
    measured = between_runs([a.summary.step_ms for a in baselines], [a.summary.step_ms for a in targets])
    predicted = statistics.median(p["predicted_change"] for p in pairs)
    compute = statistics.median(p["compute_ratio"] for p in pairs)

    def side(runs: list[Analysis]) -> dict:
        steps = [a.summary.step_ms for a in runs]
        peaks = [a.summary.largest_activation_peak_mib for a in runs if a.summary.largest_activation_peak_mib]
        bubbles = [a.summary.bubble_fraction for a in runs if a.summary.bubble_fraction is not None]
        return {"runs": len(runs), "step_ms": steps, "activation_peak_mib": peaks,
                "median_activation_peak_mib": statistics.median(peaks) if peaks else None,
                "bubble_fraction": bubbles, "median_bubble": statistics.median(bubbles) if bubbles else None}

    agree, model = judged(measured, predicted, compute)
    words = measured.words(what="step time")
    return {"baseline": side(baselines), "target": side(targets), **measured.as_dict(),
            "base_step_ms": measured.base_ms, "other_step_ms": measured.other_ms,
            "measured_change_words": words, "predicted_change": predicted, "compute_ratio": compute,
            "agree": agree, "headline": f"{words}; {model}.", "counted_once": said_b + said_t}
