"""Prediction: a run's step time from another run's measured durations only (none of the predicted run's), and
the noise floor it must be judged against (one configuration measured twice)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from traceana.analysis import Analysis
from traceana.errors import AnalysisError
from traceana.model.config import TrainingConfig
from traceana.model.memory import estimate_stage_memory
from traceana.model.simulate import Simulation, StageTimes, simulate
from traceana.validation.measurement import measure, shared_cpus
from traceana.whatif import LOCAL_COPY_BYTES_PER_NS  # (the one assumption, also verdict's: imported from here)


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
                    virtual_stages=target.virtual_stages, bpipe=bool(target.bpipe), bpipe_keep=target.bpipe_keep)


def noise_floor(first: Analysis, second: Analysis) -> float:
    """The same configuration measured twice: |step₁ − step₂| / their mean. A prediction cannot be judged finer.

    Refused (AnalysisError) unless they are two runs (not one folder twice, which would read as no noise at all)
    of one configuration as their run.json describe it (the traces' schedule and micro-batches): the difference
    between two configurations is not noise."""
    if Path(first.run.path).resolve() == Path(second.run.path).resolve():
        raise AnalysisError("--repeat names the same run twice: its noise floor would be 0", path=first.run.path,
                            fix="give two separate collections of one configuration")
    cfgs = []
    for a in (first, second):
        if a.run.manifest is None:
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


def cross_run(baseline: Analysis, target: Analysis, *,
              repeat: tuple[Analysis, Analysis] | None = None) -> dict[str, float | str | None]:
    """A PREDICTION: measure the baseline, predict the target from it (no duration of the target is used), compare
    with the target's measured step time; with ``repeat`` (one configuration collected twice), the noise floor.

    The model predicts the *change*: the target's step is the baseline's measured step times the ratio of the two
    simulations (target over baseline, both fed only with the baseline's measurements), so a bias the simulator has
    on this machine cancels. Where the runs differ only in their plan (schedule, micro-batches, BPipe:
    whatif.plan_of) that is the baseline's measured what-if (whatif.plan_whatif; ``measured_whatif`` true), else the
    model with the target's whole configuration. The measured change carries its noise interval (traceana.noise),
    and ``prediction_within_noise`` says whether the predicted change lies inside it."""
    for a in (baseline, target):
        if a.run.manifest is None:  # the run that lacks it is the one named
            raise AnalysisError("cross-run validation needs run.json in both runs: this one has none",
                                path=a.run.path, fix="collect both with `traceana collect`, or write its run.json")
    base_cfg = baseline.config.training_config(path=baseline.run.path)
    tgt_cfg = target.config.training_config(path=target.run.path)
    from traceana.whatif import plan_of, plan_whatif

    meas_t = measure(target, tgt_cfg)
    measured = target.summary.step_ms
    meas_b = measure(baseline, base_cfg)
    base_ms = baseline.summary.step_ms
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
    predicted = base_ms * ratio
    measured_change = _measured_change(baseline, target, base_cfg, tgt_cfg, repeat)
    predicted_change = ratio - 1
    return {
        "kind": "prediction",
        "method": method,
        "measured_whatif": plan is not None,
        "baseline": str(baseline.run.path),
        "target": str(target.run.path),
        "baseline_step_ms": base_ms,
        "predicted_step_ms": predicted,
        "measured_step_ms": measured,
        "error": (predicted - measured) / measured if measured else None,
        "noise_floor": noise_floor(*repeat) if repeat else None,
        "predicted_speedup": 1 / ratio,
        "measured_speedup": base_ms / measured if measured else None,
        # the target's forward+backward time per micro-batch over the baseline's: the model assumes 1 unless the
        # change (e.g. recompute) alters the work; anything else is the machine running at another speed
        "compute_ratio": (sum(meas_t.times.forward_ns) + sum(meas_t.times.backward_ns))
        / (sum(meas_b.times.forward_ns) + sum(meas_b.times.backward_ns)),
        "machine_note": shared_cpus(target) or shared_cpus(baseline),
        # the measured change with its noise interval (traceana.noise's names), and whether the predicted change
        # lies inside that interval (None: no spread to judge)
        **measured_change.as_dict(),
        "measured_change_words": measured_change.words(),
        "prediction_within_noise": None if measured_change.within_noise is None else
        measured_change.low <= predicted_change <= measured_change.high,
    }


def _measured_change(baseline: Analysis, target: Analysis, base_cfg: TrainingConfig, tgt_cfg: TrainingConfig,
                     repeat: tuple[Analysis, Analysis] | None):
    """The measured change from baseline to target with its noise (traceana.noise): over their steps, and over the
    repeated runs too when ``repeat`` is of the baseline's or the target's configuration."""
    from traceana.noise import compare

    base, other = [baseline.summary.step_times_ms], [target.summary.step_times_ms]
    if repeat:
        cfg = repeat[0].config.training_config(path=repeat[0].run.path)
        extra = [r.summary.step_times_ms for r in repeat
                 if Path(r.run.path).resolve() not in {Path(baseline.run.path).resolve(),
                                                         Path(target.run.path).resolve()}]
        if cfg == base_cfg:
            base += extra
        elif cfg == tgt_cfg:
            other += extra
    if not any(base) or not any(other):
        return compare([[baseline.summary.step_ms or 0.0]], [[target.summary.step_ms or 0.0]])
    return compare(base, other)


# A measured and a modelled change agree when the model's lies inside the measured interval (traceana.noise). When
# they do not, the runs' forward+backward time per micro-batch says whether the machine changed speed between them:
# outside 1 ± MACHINE_DRIFT it did (no configuration change of the kind compared alters a kernel's work), inside it the
# model missed something.
MACHINE_DRIFT = 0.10


def repeated_comparison(baselines: list[Analysis], targets: list[Analysis]) -> dict:
    """Two configurations, each collected several times (interleaved: A B A B …): the measured change of step time
    over all their runs with its noise interval (traceana.noise), the model's predicted change (``cross_run`` of each
    pair, the median), the median forward+backward ratio, and one ``headline`` whose measured and modelled parts
    agree, or that says why they differ. Also each side's runs' step times and activation peaks (median and range)."""
    import statistics

    from traceana.noise import compare

    if not baselines or not targets:
        raise AnalysisError("a repeated comparison needs runs on both sides", path=None,
                            fix="collect each configuration at least once")
    pairs = [cross_run(b, t) for b, t in zip(baselines, targets)]
    measured = compare([a.summary.step_times_ms or (a.summary.step_ms,) for a in baselines],
                       [a.summary.step_times_ms or (a.summary.step_ms,) for a in targets])
    predicted = statistics.median(1 / p["predicted_speedup"] - 1 for p in pairs)
    compute = statistics.median(p["compute_ratio"] for p in pairs)

    def side(runs: list[Analysis]) -> dict:
        steps = [a.summary.step_ms for a in runs]
        peaks = [a.summary.largest_activation_peak_mib for a in runs if a.summary.largest_activation_peak_mib]
        return {"runs": len(runs), "step_ms": steps, "median_step_ms": statistics.median(steps),
                "activation_peak_mib": peaks, "median_activation_peak_mib": statistics.median(peaks) if peaks else None}

    agree = None if measured.within_noise is None else measured.low <= predicted <= measured.high
    said = f"step time {measured.words(what='measured')}; modelled {predicted:+.1%}"
    if agree is None:
        headline = f"{said} — too few measured steps to tell whether they agree."
    elif agree:
        headline = f"{said}, inside the measured interval: measured and modelled agree."
    elif abs(compute - 1) > MACHINE_DRIFT:
        headline = (f"{said}, outside the measured interval: they differ because the machine changed speed — "
                    f"forward+backward per micro-batch took {compute:.2f}× as long in the second configuration's "
                    "runs, which no change compared here makes (other work on the host).")
    else:
        headline = (f"{said}, outside the measured interval, with forward+backward per micro-batch unchanged "
                    f"({compute:.2f}×): the model misses what changed (see the report's A/B section).")
    return {"baseline": side(baselines), "target": side(targets), **measured.as_dict(),
            "measured_change_words": measured.words(what="measured"), "predicted_change": predicted,
            "compute_ratio": compute,
            "agree": agree, "headline": headline}
