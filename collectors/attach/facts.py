"""``run.json`` of an attached window, from what each rank wrote to ``.attach/rank{R}.json`` and the traces on disk.

No torch here: the launching process (``traceana attach``) writes run.json as soon as every rank's trace landed, and
once more when the job has ended (then with the ranks that never wrote one and the job's exit status).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collectors.attach import FACTS_DIR
from collectors.manifest import ranks_written, write_manifest
from traceana.core.manifest import Manifest

# Facts a process cannot see from the outside, with what needs them (listed in run.json under attach).
_NEVER_DETECTED = {
    "model shape (layers, hidden, heads, sequence length)": "FLOPs/MFU and the memory model need it; add "
                                                             "\"model\" to run.json",
    "attention kind and recompute policy": "the activation-memory estimate needs them; add \"attention\" and "
                                          "\"recompute\" to run.json",
    "tensor-parallel degree": "run.json says tp 1 (its default); set \"tp\" if the job uses tensor parallelism",
    "BPipe pairs": "only traceana's own trainer evicts activations",
    "peak FLOP/s of the device": "give --peak-flops to traceana analyze for MFU",
}


def read_facts(window_dir: Path) -> dict[int, dict[str, Any]]:
    """rank → facts, for every readable ``.attach/rank{R}.json`` (a half-written or foreign file is skipped)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        files = sorted((Path(window_dir) / FACTS_DIR).glob("rank*.json"))
    except OSError:
        return out
    for f in files:
        try:
            data = json.loads(f.read_text())
            out[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def window_manifest(facts: dict[int, dict[str, Any]], written: tuple[int, ...], *, job: dict[str, Any] | None = None
                    ) -> Manifest | None:
    """The manifest of one window (None when no rank recorded anything). ``job``: exit status etc., once it ended."""
    if not facts:
        return None
    ranks = sorted(facts)
    any_fact = facts[ranks[0]]

    def agreed(key: str) -> Any:
        """The value every rank that knows ``key`` agrees on; None if none knows or they disagree."""
        values = {json.dumps(f[key], sort_keys=True) for f in facts.values() if f.get(key) is not None}
        return json.loads(values.pop()) if len(values) == 1 else None

    detected: dict[str, Any] = {}
    missing: dict[str, str] = {}
    world = agreed("world_size") or max(int(f["world_size"]) for f in facts.values())
    detected["world_size"] = f"{world} ({any_fact.get('rank_from', '?')})"

    pp = agreed("num_stages")
    stages_of_rank = {r: f["stages"] for r, f in facts.items() if f.get("stages")}
    stage_of_rank = None
    if pp is not None and len(stages_of_rank) == world and all(r in stages_of_rank for r in range(world)):
        stage_of_rank = tuple(min(stages_of_rank[r]) for r in range(world))
        detected["stage_of_rank"] = (f"{agreed('stages_from')}, every rank" if agreed("stages_from") else
                                     "the schedule's PipelineStage objects (stage_index), every rank")
    elif stages_of_rank:
        missing["stage_of_rank"] = (f"only ranks {sorted(stages_of_rank)} of {world} reported their stages "
                                    "(attach.stages_of_rank has those)")
    else:
        missing["pipeline stages (pp, stage_of_rank)"] = ("no torch.distributed.pipelining schedule stepped: the "
                                                          "analysis infers stages from P2P traffic, if any")
    if pp is not None:
        detected["pp"] = agreed("stages_from") or "PipelineStage.num_stages"

    schedule_class = agreed("schedule_class")
    schedule = agreed("schedule") or "unknown"
    if schedule_class:
        detected["schedule"] = f"{schedule_class} → {schedule}"
    else:
        missing["schedule"] = "no torch.distributed.pipelining schedule seen"

    n_mb = agreed("num_microbatches")
    framework = agreed("framework")
    if n_mb is not None:
        detected["num_microbatches"] = (f"{framework}'s own setting (its schedule call or engine)" if framework else
                                        "the schedule's n_microbatches")
    elif schedule_class:
        missing["num_microbatches"] = "ranks disagree or the schedule does not say"
    else:
        missing["num_microbatches"] = "no pipelining schedule"
    mbs = agreed("microbatch_size")
    if mbs is not None:
        detected["microbatch_size"] = (f"{framework}'s own setting" if framework else
                                       "the first stage's input batch / n_microbatches")
    else:
        missing["microbatch_size"] = ("the first stage's rank did not record it (its step() input was not one tensor "
                                      "splitting evenly)" if schedule_class else "no pipelining schedule")

    dp = 1
    if agreed("dp") is not None and framework:  # the framework's own grid
        dp = int(agreed("dp"))
        detected["dp"] = f"{framework}'s data-parallel group"
    elif pp is not None and stages_of_rank:
        per_pipeline = pp // max(len(s) for s in stages_of_rank.values())
        if per_pipeline and world % per_pipeline == 0:
            dp = world // per_pipeline
            detected["dp"] = f"world size {world} / {per_pipeline} ranks per pipeline"
    if "dp" not in detected:
        missing["data-parallel degree"] = ("without pipeline stages it cannot be told from tensor or sequence "
                                           "parallelism; run.json says dp 1 (its default)")

    global_batch = mbs * n_mb * dp if mbs is not None and n_mb is not None and "dp" in detected else None

    # Parameters: ranks holding the same stages are replicas; a pipeline's total is the sum over distinct stage sets.
    per_rank = {r: f["parameters"] for r, f in facts.items() if f.get("parameters") is not None}
    total = None
    if per_rank:
        by_group: dict[tuple, int] = {}
        for r, n in per_rank.items():
            key = tuple(facts[r].get("stages") or ())
            by_group[key] = max(by_group.get(key, 0), n)
        covered = set().union(*map(set, stages_of_rank.values())) if stages_of_rank else set()
        if not stages_of_rank or (pp is not None and covered == set(range(pp))):
            total = sum(by_group.values())
            how = "summed over distinct stages" if stages_of_rank else "one replica's (every rank holds them all)"
            detected["parameters"] = f"{agreed('parameters_from') or 'per rank'}, {how}"
        else:
            missing["parameters (whole model)"] = "not every stage's rank reported; attach has those that did"
    else:
        missing["parameters"] = "neither a pipelining schedule nor an optimizer was seen before the window"

    for key in ("torch_version", "device", "dtype"):
        if agreed(key) is not None:
            detected[key] = "the job's process"
        else:
            missing[key] = "not seen"
    missing.update(_NEVER_DETECTED)
    tp = agreed("tp") if framework else None
    if tp is not None:
        detected["tp"] = f"{framework}'s tensor-parallel group"
        missing.pop("tensor-parallel degree", None)
    if framework:
        detected["trainer"] = f"{framework} (its own objects, read in the job)"

    expected = set(range(world))
    not_profiled = {r: f["problem"] for r, f in facts.items() if f.get("problem")}
    no_trace = sorted(expected - set(written))
    attach: dict[str, Any] = {
        "window": list(any_fact["window"]),
        "steps": _steps_label(*any_fact["window"]),
        "step_source": agreed("step_source") or sorted({f.get("step_source") for f in facts.values()}),
        "schedule_class": schedule_class,
        "parameters": total,
        "parameters_per_rank": {str(r): n for r, n in sorted(per_rank.items())},
        "stages_of_rank": {str(r): s for r, s in sorted(stages_of_rank.items())},
        "detected": detected,
        "not_detected": missing,
        "ranks_without_trace": no_trace,
        "ranks_without_facts": sorted(expected - set(facts)),
        "problems": {str(r): p for r, p in sorted(not_profiled.items())},
    }
    if job is not None:
        attach["job"] = job
        if no_trace:
            attach["ranks_without_trace_why"] = (
                "the job ended with status {} before these ranks wrote their trace (died, killed, or never reached "
                "the window's end)".format(job.get("exit_code")))
    return Manifest(
        world_size=world, pp=pp, dp=dp, tp=int(tp) if tp else 1, trainer=framework,
        stages_of_rank=(tuple(tuple(stages_of_rank[r]) for r in range(world))
                        if stage_of_rank is not None and any(len(v) > 1 for v in stages_of_rank.values()) else None),
        stage_of_rank=stage_of_rank, schedule=schedule, microbatch_size=mbs,
        num_microbatches=n_mb, global_batch=global_batch, dtype=agreed("dtype"), device=agreed("device"),
        profiler={"wait": 0, "warmup": int(any_fact.get("warmup", 1)),
                  "active": int(any_fact["window"][1] - any_fact["window"][0]), "repeat": 1},
        torch_version=agreed("torch_version"), ranks_written=tuple(written),
        collector="traceana attach", attach=attach,
    )


def _steps_label(start: int, end: int) -> str:
    return f"{start}" if end - start == 1 else f"{start}–{end - 1}"


def finalize_window(window_dir: Path, *, job: dict[str, Any] | None = None) -> tuple[Manifest | None, bool]:
    """Write the window's run.json; (manifest, complete) where complete = every rank's trace is on disk."""
    facts = read_facts(window_dir)
    written = ranks_written(window_dir)
    manifest = window_manifest(facts, written, job=job)
    if manifest is None:
        return None, False
    write_manifest(window_dir, manifest)
    return manifest, set(range(manifest.world_size)) <= set(written)
