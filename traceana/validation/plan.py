"""The plan what-ifs: a run's own measured durations under another plan (another schedule, micro-batch
count, BPipe, recompute): ``plan_whatif`` (``traceana whatif --schedule/--microbatches/--bpipe``) and
``plan_of`` (which plan turns one configuration into another: ``validate --baseline``'s prediction). The
measured graph's passes on the engine, and the model's simulator and memory: above both causal and model."""

from __future__ import annotations

import polars as pl
import re

from traceana.causal.graph import EDGE_ORDER, GraphError, StepGraph, build, pass_durations
from traceana.causal.whatif import PASS_ACTIONS, _mean
from traceana.core.errors import AnalysisError, TraceanaError
from traceana.core.keyed import keyed
from traceana.core.schedule_names import MULTI_STAGE_SCHEDULES
from traceana.core.pipeline_rules import bpipe_applies, check_virtual_stages, device_of_stage, plan_refusal
from traceana.core.pipeline_rules import layer_ranges as _layer_ranges
from traceana.core.units import NS_PER_MS
from traceana.measure.noise import noise_ms
from traceana.model.memory import estimate_stage_memory
from traceana.model.simulate import bubble_fraction, engine_inputs, simulate
from traceana.validation.measurement import layer_work


# What a plan what-if can change of the run's configuration (everything else is the run's own).
PLAN_FIELDS = ("schedule", "num_microbatches", "bpipe", "virtual_stages")
# Moving one micro-batch's activations between two processes on one host, where neither run.json's link nor a
# measured BPipe transfer gives it: an assumption (1 GB/s), said where it is used.
LOCAL_COPY_BYTES_PER_NS = 1.0


def plan_of(base, target) -> dict | None:
    """``plan_whatif``'s keywords that make the configuration ``base`` into ``target`` (TrainingConfig), or None
    where they differ in more than these (PLAN_FIELDS: recompute, which plan_whatif prices too, goes to
    validation's model with the whole configuration, as the model, pp do)."""
    if base.replace(**{f: getattr(target, f) for f in PLAN_FIELDS}) != target:
        return None
    return {"schedule": target.schedule, "microbatches": target.num_microbatches, "bpipe": bool(target.bpipe),
            "virtual_stages": target.virtual_stages}


def _plan_dict(cfg) -> dict:
    return {"schedule": cfg.schedule, "microbatches": cfg.num_microbatches, "bpipe": bool(cfg.bpipe),
            "virtual_stages": cfg.virtual_stages, "recompute": cfg.recompute,
            "layers_per_stage": list(cfg.stage_layers())}


def _measured_plan_inputs(analysis, g: StepGraph | None, base) -> dict:
    """The measured work the plan engine is fed, per measured step: passes per (action, virtual stage,
    micro-batch) (graph.pass_durations, the graph's work: the mean over the stage's replicas), optimizer and
    collectives per device; from the graph where it builds: each device's mean host time before an operation
    (host_before), each P2P message's time in flight (send lag + transfer) per (F / B, producing stage,
    micro-batch), the BPipe transfers' median."""
    p = base.pp
    steps = list(g.steps) if g is not None else list(analysis.summary.steps)
    step_f = pl.DataFrame({"step": steps}, schema={"step": pl.Int32})
    passes = (pass_durations(analysis, step_f).filter(pl.col("phase").is_in(list(_PHASE_ACTION))
                                                     & pl.col("stage").is_not_null())
              .with_columns(pl.col("phase").replace_strict(_PHASE_ACTION).alias("action"),
                            pl.col("d").clip(lower_bound=0).alias("work_ns")))
    if passes.height == 0:
        raise AnalysisError("the measured steps hold no numbered forward or backward: no work to re-sequence",
                            path=analysis.run.path, fix="profile with the PP: annotations (traceana collect)")
    dev_of_rank = {r: device_of_stage(base.schedule, int(s), pp=p) % p
                   for r, s in passes.group_by("rank").agg(pl.col("stage").min()).iter_rows()}
    rk = pl.DataFrame({"rank": list(dev_of_rank), "device": list(dev_of_rank.values())},
                      schema={"rank": pl.Int32, "device": pl.Int32})
    work = passes.group_by("step", "action", "stage", "microbatch").agg(pl.col("work_ns").mean())
    if g is not None:
        others = g.ops.filter(pl.col("action").is_in(["O", "C"])).select("rank", "step", "work_ns")
    else:
        others = (analysis.schedule.join(step_f, on="step").filter(pl.col("phase") == "optimizer")
                  .select("rank", "step", (pl.col("end_ns") - pl.col("start_ns")).alias("work_ns")))
    other = (others.join(rk, on="rank").group_by("step", "rank", "device").agg(pl.col("work_ns").sum())
             .group_by("step", "device").agg(pl.col("work_ns").mean()))
    host = p2p = bpipe = None
    if g is not None:
        host = (host_before(g).join(rk, on="rank").group_by("step", "rank", "device")
                .agg(pl.col("host_ns").mean()).group_by("step", "device").agg(pl.col("host_ns").mean()))
        made = g.ops.select(pl.col("rank").alias("src"), "step", pl.col("seq").alias("src_seq"), "action", "stage",
                            "microbatch")
        msgs = (g.edges.join(made, on=["src", "step", "src_seq"])
                .with_columns((pl.col("send_lag_ns") + pl.col("transfer_ns")).alias("t")))
        p2p = (msgs.filter((pl.col("channel") != "bpipe") & pl.col("action").is_in(PASS_ACTIONS)
                           & pl.col("microbatch").is_not_null())
               .with_columns(pl.when(pl.col("action") == "F").then(pl.lit("F")).otherwise(pl.lit("B")).alias("key"))
               .group_by("step", "key", "stage", "microbatch").agg(pl.col("t").mean()))
        bpipe = msgs.filter(pl.col("channel") == "bpipe")
    out = {}
    for step in steps:
        def at(frame):
            return frame.filter(pl.col("step") == step).drop("step")

        b = at(bpipe) if bpipe is not None else None
        out[step] = {
            "per_op": keyed(at(work), "work_ns"),
            "other": keyed(at(other), "work_ns"),
            "host": keyed(at(host), "host_ns") if host is not None else {},
            "messages": keyed(at(p2p), "t") if p2p is not None else {},
            "bpipe_ns": float(b["t"].median()) if b is not None and b.height else None,
        }
    return out


_PHASE_ACTION = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def host_before(g: StepGraph) -> pl.DataFrame:
    """rank, step, seq, ``host_ns``: each operation's host time before it (after the rank's first) — what its rank's
    CPU did between the previous operation's end and this one's start, other than waiting for an input: posting the
    previous operation's sends and the receives posted after it (the latest such post's lag from that end: the
    messages' send and post lags — their time inside the posting calls included, ``StepGraph.lag_wait``: the engine's
    planned sends do not block, so a post's own time is the rank's — less the part of a lag that waited for an
    earlier receive of the rank, ``StepGraph.after_receive``: that message is an input of its own in the plan), then
    its host gap after its inputs arrived (``gap_ns``). The plan engine's host time before each operation
    (``StageTimes.host_ns``) is its device's mean of these: an operation that receives posts a receive first and one
    that does not, does not, so the typical operation's (the median) would drop the posts of a device whose every
    other operation receives."""
    # (after_receive numbers a step's messages in the replay's order, as build sorts them)
    e = (g.edges.sort(["step", *EDGE_ORDER], nulls_last=True, maintain_order=True)
         .with_columns(pl.int_range(pl.len()).over("step").cast(pl.Int32).alias("edge")))
    sides = pl.concat([
        e.select("step", "edge", pl.lit("send").alias("side"), pl.col("src").alias("rank"),
                 pl.col("src_seq").alias("after"), pl.col("send_lag_ns").alias("lag")),
        e.filter(pl.col("anchor_seq").is_not_null()).select(
            "step", "edge", pl.lit("post").alias("side"), pl.col("dst").alias("rank"),
            pl.col("anchor_seq").alias("after"), pl.col("post_lag_ns").alias("lag")),
    ])
    if g.after_receive is not None and g.after_receive.height:
        w = g.after_receive.group_by("step", "edge", "side").agg(pl.col("blocked_ns").max().alias("_w"))
        sides = (sides.join(w, on=["step", "edge", "side"], how="left")
                 .with_columns((pl.col("lag") - pl.col("_w").fill_null(0)).alias("lag")).drop("_w"))
    lags = (sides.group_by("step", "rank", (pl.col("after") + 1).cast(pl.Int32).alias("seq"))
            .agg(pl.col("lag").max().clip(lower_bound=0).alias("_lag")))
    return (g.ops.filter(pl.col("seq") > 0).join(lags, on=["step", "rank", "seq"], how="left")
            .select("rank", "step", "seq", (pl.col("gap_ns") + pl.col("_lag").fill_null(0)).alias("host_ns")))


def _times(m: dict, base, target, pp: int, *, measured_layers: bool = False):
    """StageTimes and Costs of one measured step for the target plan (the run's measured work; see plan_whatif),
    through model.simulate.engine_inputs, the path ``estimate``'s modelled durations take too. ``measured_layers``:
    layers moved from the measured per-layer work (``_moved_layers``), else each device's work scaled by its layer
    count (``_layer_scale``)."""
    nv_base = pp * base.virtual_stages
    device_of_work = tuple(device_of_stage(base.schedule, s, pp=pp) % pp for s in range(nv_base))
    scale = _layer_scale(base, target)  # layers moved between stages: each device's work by its layer count
    if measured_layers and target.stage_layers() != base.stage_layers():
        per_op = _moved_layers(m["per_op"], m["layers"], base.stage_layers(), target.stage_layers())
    else:
        per_op = {k: x * scale[device_of_work[k[1]]] for k, x in m["per_op"].items()}
    work = dict(per_op)
    base_rc, target_rc = base.recompute != "none", target.recompute != "none"
    if target_rc and not base_rc:  # full recompute: each backward first runs its own measured forward again
        work.update({("R", s, mb): x for (a, s, mb), x in per_op.items() if a == "F"})
    elif base_rc and not target_rc:  # the run's backwards held their forward's recompute: taken out (the measured one)
        work = {k: (max(0.0, x - per_op.get(("F", k[1], k[2]), 0.0)) if k[0] in ("B", "I") else x)
                for k, x in work.items()}
    elif base_rc and target_rc:  # inside the measured backwards already
        work.update({("R", s, None): 0.0 for s in range(nv_base)})
    return engine_inputs(work, device_of_work=device_of_work, stages=pp * target.virtual_stages,
                         messages=m["messages"],
                         optimizer_ns=tuple(m["other"].get(d, 0.0) * scale[d] for d in range(pp)),
                         host_ns=tuple(m["host"].get(d, 0.0) for d in range(pp)))


def _layer_scale(base, target) -> tuple[float, ...]:
    """Per device: the plan's transformer blocks over the run's (1 where none moved): where per-layer work is not
    measured (no layer spans, ``_layer_inputs``) a device's measured work — its blocks', and its embedding's or
    head's with them — is scaled by its layer count, the assumption the plan's note states; the optimizer's and the
    collectives' work always (they are not timed a block)."""
    was, now = base.stage_layers(), target.stage_layers()
    return tuple(1.0 if a == b else b / a for a, b in zip(was, now))


def _moved_layers(per_op: dict, layers: dict, was, now) -> dict:
    """Per (action, stage, micro-batch) the work under the split ``now``: the pass's measured work less its blocks'
    as run (what is left: the embedding, the head and loss, the pass's own bookkeeping — it stays with its stage)
    plus the measured work of the blocks the stage holds under ``now`` (``layers``: (action, layer, micro-batch)
    → ns; a block moved keeps its measured time of that micro-batch). One stage a device (checked by
    ``_layer_inputs``)."""
    old, new = _layer_ranges(was), _layer_ranges(now)
    out = {}
    for (a, st, mb), x in per_op.items():
        rest = max(0.0, x - sum(layers[(a, k, mb)] for k in old[st]))
        out[(a, st, mb)] = rest + sum(layers[(a, k, mb)] for k in new[st])
    return out


def _layer_inputs(analysis, base, target, measured_in: dict) -> tuple[bool, str]:
    """Whether the plan's moved layers can come from the measured per-layer work (measurement.layer_work), and the
    note that says which source the plan used. Measured where every measured step has a layer span of every
    block for every pass of the stages' passes (action, micro-batch), each stage's spans name the blocks the run's
    split gives it, and plan and run hold one stage a device; otherwise each stage's work is scaled by its layer
    count (LAYERS_ASSUMPTION), with the reason. Fills each step's ``layers`` of ``measured_in``."""
    was, now = base.stage_layers(), target.stage_layers()
    moved = f"{','.join(map(str, was))} → {','.join(map(str, now))}"
    scaled = LAYERS_ASSUMPTION.format(was=",".join(map(str, was)), now=",".join(map(str, now)))
    if base.virtual_stages != 1 or target.virtual_stages != 1:
        return False, f"{scaled}; per-layer work is used with one stage a device only"
    work, why = layer_work(analysis)
    if work.height == 0:
        return False, f"{scaled}; {why[0] if why else 'no layer spans'}"
    named = keyed(work.group_by("stage").agg(pl.col("layer").unique().sort()), "layer", convert=None)
    ranges = _layer_ranges(was)
    wrong = [st for st, r in enumerate(ranges) if list(named.get(st, [])) != list(r)]
    if wrong:
        st = wrong[0]
        return False, (f"{scaled}; the layer spans of stage {st} name blocks {list(named.get(st, []))}, not the "
                       f"{list(ranges[st])} of the run's split")
    per_step = (work.filter(pl.col("action") != "RECOMPUTE")  # (inside its backward's span, and its work)
                .group_by("step", "action", "layer", "microbatch").agg(pl.col("work_ns").mean()))
    for step, m in measured_in.items():
        at = per_step.filter(pl.col("step") == step).select("action", "layer", "microbatch", "work_ns")
        m["layers"] = keyed(at.with_columns(pl.col("layer", "microbatch").cast(pl.Int64)), "work_ns")
        missing = [(a, k, mb) for (a, st, mb) in m["per_op"] for k in ranges[st] if (a, k, mb) not in m["layers"]]
        if missing:
            a, k, mb = missing[0]
            return False, (f"{scaled}; step {step} has no layer span of block {k} in pass {a} of micro-batch {mb} "
                           f"({len(missing)} missing)")
    n = int(work["spans"].sum())
    return True, (f"layers moved ({moved}) from the measured per-layer work ({n} layer spans of "
                  f"{work['layer'].n_unique()} blocks): each stage's passes are their non-layer work as measured "
                  "(the pass less its blocks' spans: embedding, head and loss stay with their stage) plus the "
                  "measured work of the blocks the stage holds under the plan (a block moved keeps its measured "
                  "time); optimizer and collectives scaled by the stage's layer count; messages as measured")


LAYERS_ASSUMPTION = ("layers moved: each stage's measured work (forwards, backwards, optimizer and collectives) "
                     "scaled by its layer count, {was} → {now} (an assumption: per-layer work is not measured here, "
                     "so the embedding's and the head's work scale with the blocks beside them); messages as "
                     "measured")


def plan_whatif(analysis, *, schedule: str | None = None, microbatches: int | None = None,
                bpipe: bool | None = None, virtual_stages: int | None = None, recompute: bool | None = None,
                layers_per_stage: tuple[int, ...] | None = None, graph: StepGraph | None = None) -> dict:
    """The run's measured work under another plan — another schedule, micro-batch count, BPipe on or off,
    recompute on or off — re-sequenced in the rules' planned order (pipeline_rules.device_order) on the one engine
    (causal.scheduler.run_schedule through model.simulate): each pass's measured work per (action, virtual stage,
    micro-batch) (a micro-batch the run did not have: its stage's mean), each P2P message's measured time in flight,
    each device's mean host time before an operation (host_before), its optimizer and collectives; recompute from
    the measured forwards; BPipe's evictions and loads priced at the run's own BPipe transfers, else the stage's
    measured activations per micro-batch over run.json's link (else LOCAL_COPY_BYTES_PER_NS, said);
    ``layers_per_stage`` (one block count a device) moves layers between stages: from the measured per-layer work
    where the traces have layer spans of every block (``_layer_inputs``, ``_moved_layers``: a block moved keeps its
    measured time, the embedding's, head's and loss's work stays with its stage), else each device's measured work
    scaled by its layer count (``_layer_scale``); a note and ``layers_source`` say which. Every measured step is simulated on its own:
    the step, its interval (the steps' spread, at least noise.NOISE_FLOOR), the bubble share and memory per stage
    (the memory model's in-flight counts on the measured activations). A **prediction** (the run as it ran goes
    through the same engine: ``simulated_as_run_ms`` against the measured step says how far the engine is from
    this run). Refused exactly where ``traceana collect`` refuses the plan (pipeline_rules.plan_refusal). Needs
    run.json's model and pipeline (AnalysisError, ConfigError otherwise)."""
    base = analysis.config.training_config(path=analysis.run.path)
    notes: list[str] = []
    changes: dict = {k: v for k, v in (("schedule", schedule), ("num_microbatches", microbatches)) if v is not None}
    if schedule is not None:  # a multi-stage schedule splits each device's layers into two chunks (and back)
        changes["virtual_stages"] = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    if virtual_stages is not None:
        changes["virtual_stages"] = virtual_stages
    if recompute is not None:
        if base.recompute == "selective" and not recompute:
            raise AnalysisError("the run's selective recompute is inside its measured backwards and cannot be told "
                                "apart from them: recompute off is not priced", path=analysis.run.path,
                                fix="collect the run without recompute to compare")
        changes["recompute"] = "full" if recompute else "none"
    want = base.bpipe if bpipe is None else bpipe
    sched, vs = changes.get("schedule", base.schedule), changes.get("virtual_stages", base.virtual_stages)
    if want and bpipe is None and not bpipe_applies(sched, pp=base.pp, virtual_stages=vs):
        notes.append(f"BPipe off: the run's BPipe does not apply to {sched} (pass --bpipe on to be told why)")
        want = False
    changes["bpipe"] = bool(want)
    try:
        check_virtual_stages(sched, vs)
    except TraceanaError as e:
        raise AnalysisError(e.what, path=analysis.run.path, fix=e.fix) from None
    if layers_per_stage is not None:
        layers_per_stage = tuple(int(x) for x in layers_per_stage)
        if layers_per_stage != base.stage_layers():
            changes["layers_per_stage"] = layers_per_stage
    refused = plan_refusal(sched, pp=base.pp, num_microbatches=changes.get("num_microbatches",
                                                                          base.num_microbatches),
                           bpipe=bool(want), bpipe_inflight=base.bpipe_inflight, layers_per_stage=layers_per_stage,
                           layers=base.model.layers, virtual_stages=vs)
    if refused is not None:  # (collect's --bpipe-inflight is no option of the what-if's)
        fix = re.sub(r", or force evictions with --bpipe-inflight \d+", "", refused[1])
        raise AnalysisError(f"the plan is one traceana collect refuses: {refused[0]}", path=analysis.run.path,
                            fix=fix)
    target = base.replace(**changes)
    g = graph
    if g is None:
        try:
            g = build(analysis)
        except GraphError as e:  # the passes alone: no host gaps, no message times (said)
            notes.append(f"no graph of the measured step ({e.what}): host gaps and message times are not in the plan")
    measured_in = _measured_plan_inputs(analysis, g, base)
    measured_layers, layers_source = False, None
    if target.stage_layers() != base.stage_layers():  # which work the moved layers take: said in a note
        measured_layers, layers_note = _layer_inputs(analysis, base, target, measured_in)
        notes.append(layers_note)
        layers_source = "measured per-layer work" if measured_layers else "scaled by layer count"
    p = base.pp
    # BPipe's transfers: the run's own, else priced from the stage's measured activations per micro-batch
    act = _activation_per_microbatch(analysis, base)
    link = analysis.config.link_bytes_per_s
    latency = analysis.config.p2p_latency_ns or 0.0

    def priced(m: dict) -> float:
        if m["bpipe_ns"] is not None:
            return m["bpipe_ns"]
        evict = act.get(0, 0.0) * _activation_scale(base, target).get(0, 1.0)
        return latency + evict / (link / 1e9 if link else LOCAL_COPY_BYTES_PER_NS)

    if target.bpipe:
        any_measured = any(m["bpipe_ns"] is not None for m in measured_in.values())
        notes.append("BPipe's evictions and loads: " + (
            "the run's own measured transfers (median)" if any_measured else
            f"stage 0's measured activations per micro-batch ({act.get(0, 0.0) / 1e6:.3g} MB) over "
            + (f"run.json's link ({link / 1e9:.3g} GB/s)" if link else
               f"an assumed {LOCAL_COPY_BYTES_PER_NS:g} GB/s (no link in run.json, no BPipe transfer measured)")))

    def run(cfg, m) -> object:
        import dataclasses

        times, costs = _times(m, base, cfg, p, measured_layers=measured_layers)
        if cfg.bpipe:
            costs = dataclasses.replace(costs, bpipe_ns=priced(m))
        return simulate(cfg.schedule, pp=p, num_microbatches=cfg.num_microbatches, times=times, costs=costs,
                        virtual_stages=cfg.virtual_stages, bpipe=bool(cfg.bpipe), bpipe_inflight=cfg.bpipe_inflight)

    as_run = [run(base, m) for m in measured_in.values()]
    plan = [run(target, m) for m in measured_in.values()]
    as_ms = [s.step_ns / NS_PER_MS for s in as_run]
    plan_ms = [s.step_ns / NS_PER_MS for s in plan]
    spread = noise_ms(plan_ms)
    measured = analysis.summary.step_ms
    a_mean, p_mean = _mean(as_ms), _mean(plan_ms)

    def bubbles(sims) -> dict[int, float]:
        fr = pl.concat([bubble_fraction(s) for s in sims]).group_by("stage").agg(pl.col("bubble_fraction").mean())
        return keyed(fr.sort("stage"), "bubble_fraction")

    memory = _plan_memory(analysis, base, target, act, estimate_stage_memory)
    m_as, m_plan = base.num_microbatches, target.num_microbatches
    return {
        "as_run": _plan_dict(base),
        "plan": _plan_dict(target),
        "measured_step_ms": measured,
        "simulated_as_run_ms": a_mean,
        "as_run_error": (a_mean - measured) / measured if measured else None,
        "simulated_plan_ms": p_mean,
        "predicted_step_ms": p_mean,
        "interval_ms": [p_mean - spread / 2, p_mean + spread / 2],
        "step_ratio": p_mean / a_mean if a_mean else None,
        # the same micro-batches: the step's speed-up; another count: the time per micro-batch's (samples per second)
        "speedup": a_mean / p_mean if p_mean and m_as == m_plan else None,
        "per_microbatch_speedup": (a_mean / m_as) / (p_mean / m_plan) if p_mean else None,
        "bubble_fraction": bubbles(plan),
        "as_run_bubble_fraction": bubbles(as_run),
        "memory_bytes": memory,
        "steps_simulated": len(plan_ms),
        # layers moved: "measured per-layer work" (the layer spans) or "scaled by layer count"; None: none moved
        "layers_source": layers_source,
        "kind": "prediction: this run's measured work per operation re-sequenced in the plan's order on the "
                "schedule engine (not a replay of the measured step)",
        "notes": notes,
    }


def _activation_per_microbatch(analysis, base) -> dict[int, float]:
    """Per device: the measured peak of saved activations (stage_memory's activation_peak_bytes, the median over
    ranks and measured steps) over the micro-batches the memory model holds at that peak."""
    sm = analysis.stage_memory
    if sm is None or sm.height == 0 or "activation_peak_bytes" not in sm.columns:
        return {}
    peak = keyed(sm.filter(pl.col("stage").is_not_null()).group_by("stage")
                 .agg(pl.col("activation_peak_bytes").median()), "activation_peak_bytes", convert=None)
    out = {}
    for m in estimate_stage_memory(base):
        held = m.in_flight + m.foreign_in_flight
        if m.stage in peak and held and peak[m.stage] is not None:
            out[m.stage] = float(peak[m.stage]) / held
    return out


def _activation_scale(base, target) -> dict[int, float]:
    """Per device: the memory model's activations per micro-batch under the plan over the run's (recompute, the
    layers a stage holds)."""
    was = {m.stage: m.activation_per_microbatch for m in estimate_stage_memory(base)}
    return {m.stage: m.activation_per_microbatch / was[m.stage] if was.get(m.stage) else 1.0
            for m in estimate_stage_memory(target)}


def _plan_memory(analysis, base, target, act: dict[int, float], estimate) -> dict[int, float] | None:
    """Per stage the plan's peak memory: the measured baseline (what is not activations) plus the measured
    activations per micro-batch × the micro-batches the memory model holds under the plan (recompute, the layers a
    stage holds: the model's ratio of activations per micro-batch under the plan and as run). With layers moved the
    baseline scales by the model's ratio of the stage's weights, gradients and optimizer state."""
    sm = analysis.stage_memory
    if not act or sm is None or "baseline_bytes" not in sm.columns:
        return None
    baseline = keyed(sm.filter(pl.col("stage").is_not_null()).group_by("stage")
                     .agg(pl.col("baseline_bytes").median()), "baseline_bytes", convert=None)
    was = {m.stage: m for m in estimate(base)}
    out = {}
    for m in estimate(target):
        if m.stage not in act or m.stage not in was:
            continue
        w = was[m.stage]
        scale = m.activation_per_microbatch / w.activation_per_microbatch if w.activation_per_microbatch else 1.0
        state, state_was = (x.weight_bytes + x.grad_bytes + x.optimizer_bytes for x in (m, w))
        kept = state / state_was if state_was and state != state_was else 1.0
        out[m.stage] = (float(baseline.get(m.stage) or 0) * kept
                        + act[m.stage] * scale * (m.in_flight + m.foreign_in_flight))
    return out
