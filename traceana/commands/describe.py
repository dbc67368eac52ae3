"""Say what a run's traces show and what they do not, and write a run.json template for it.

For a job profiled outside traceana (Megatron-core, DeepSpeed, torch.distributed.pipelining, any torch.profiler
trace): the ranks and steps traced, the profiler's options as the traces show them, the framework, the stages of
each rank, the schedule and the micro-batches, each with how it was told, and every fact the traces cannot show
named by its run.json key and what it means. ``-o PATH`` writes a run.json with the facts told filled in and the
rest listed under ``"_describe"`` (``"to_fill"``: key and meaning); move the keys you fill to the top level and put
the file in the run folder (as run.json) for analyze, validate and whatif to read. traceana never writes into the
run folder itself: the file is written only where -o says, and never over an input.
"""

# Function-local imports here: order and cost. This module is imported to build the parser, before polars;
# polars, and what imports it, must come after the program's settings for a small run (traceana.cli), so
# they are imported in ``run`` and the functions it calls (docs/architecture.md "Function-local imports").

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from traceana.commands import options
from traceana.core.files import STDOUT, refuse_inputs, write_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    options.output(parser, help="write a run.json template there (- for standard output); never over an input "
                                "(the run's own run.json included) (default: none, only the description)")
    parser.add_argument("--json", action="store_true", help="print the description as JSON instead of text")
    options.names(parser)
    options.reading(parser)


# Facts no trace shows, asked for whenever run.json does not give them (their meanings: manifest.KEY_MEANINGS).
NEVER_IN_TRACES = ("model", "microbatch_size", "dtype", "device", "peak_flops")


def describe(analysis) -> dict[str, Any]:
    """What ``analysis``'s traces show: ``facts`` (run.json key → value told), ``how`` (key → how it was told),
    ``missing`` (key → meaning), ``seen`` (the traces' ranks, steps, profiler options and framework, in words) and
    ``notes`` (what could not be told and why)."""
    import polars as pl

    from traceana.core import names
    from traceana.core.manifest import KEY_MEANINGS
    from traceana.ingest.process_groups import process_groups
    from traceana.measure.schedule import PIPELINE_GROUP_DESCS

    run, manifest = analysis.run, analysis.run.manifest
    traces = run.traces
    facts: dict[str, Any] = {}
    how: dict[str, str] = {}
    notes: list[str] = []
    seen: dict[str, str] = {}

    ranks = sorted(set(traces["rank"].drop_nulls().to_list()))
    worlds = sorted(set(traces["world_size"].drop_nulls().to_list())) if "world_size" in traces.columns else []
    world = worlds[0] if len(worlds) == 1 else None
    if world is not None:
        facts["world_size"], how["world_size"] = world, "the traces' distributedInfo"
    elif ranks:
        facts["world_size"], how["world_size"] = max(ranks) + 1, "the highest rank traced (no distributedInfo)"
    seen["ranks"] = (f"{len(ranks)} traced" + (f" of {world}" if world is not None else "")
                     + (f" (a sample: ranks {', '.join(map(str, ranks[:8]))}{', …' if len(ranks) > 8 else ''})"
                        if world is not None and len(ranks) < world else ""))
    steps = sorted(set(analysis.steps["step"].to_list()))
    measured = list(analysis.summary.steps)
    seen["steps"] = (f"{len(steps)} ({', '.join(map(str, steps[:10]))}{', …' if len(steps) > 10 else ''}); "
                     f"measured: {', '.join(map(str, measured)) or 'none'}")

    # The profiler's options, as the events show them.
    ev = run.events
    cats = set(ev["cat"].drop_nulls().unique().cast(pl.String).to_list()) if ev is not None and "cat" in ev.columns \
        else set()
    p2p_calls = int(analysis.rank_summary["p2p_ops"].sum()) if analysis.rank_summary is not None else None
    if p2p_calls is None:
        from traceana.measure.classify import rank_summary
        p2p_calls = int(rank_summary(run)["p2p_ops"].sum())
    paired = analysis.p2p.filter(pl.col("channel") == "p2p").height
    seen["profiler"] = ", ".join([
        "with_stack on (Python frames)" if "python_function" in cats else "with_stack off (no Python frames)",
        ("record_shapes on (P2P calls name their peer)" if paired else
         "record_shapes off (P2P calls do not name their peer)") if p2p_calls else "no P2P calls",
        "profile_memory on" if run.memory.height else "profile_memory off (no allocator samples)",
    ])

    # The framework: its process groups' names, its built-in name rules, our own metadata.
    # (the first rank of each distinct pg_config: its other ranks hold the same groups)
    named = process_groups(traces.unique(subset="pg_config", keep="first", maintain_order=True),
                           pl.col("desc").is_not_null() & (pl.col("desc") != ""))
    groups: dict[str, list[int]] = {}
    for desc, members in zip(named["desc"].to_list(), named["ranks"].to_list()):
        groups.setdefault(desc, members)
    rule_hits = " ".join(n for n in analysis.notes if n.startswith("name rules ("))
    if any(d in groups for d in PIPELINE_GROUP_DESCS) or "built-in megatron" in rule_hits:
        framework, told = "megatron-core", ("its process groups' names (parallel_state)" if groups.get(
            PIPELINE_GROUP_DESCS[0]) else "its Python frames (name rules)")
    elif "built-in deepspeed" in rule_hits:
        framework, told = "deepspeed", "its Python frames (name rules)"
    elif ev is not None and ev.select(names.name_test(pl.col("name"),
                                                      lambda t: t.str.starts_with(names.PP_PREFIX)).any()).item():
        framework, told = "torch.distributed.pipelining (or traceana's trainer)", "its PP: annotations"
    else:
        framework, told = None, None
    if manifest is not None and manifest.trainer:
        framework, told = manifest.trainer, "run.json"
    seen["framework"] = f"{framework} (from {told})" if framework else \
        "not recognised (no process group, annotation or Python frame names one)"
    if framework and framework != "traceana":
        facts["trainer"], how["trainer"] = framework.split(" (")[0], told

    # The parallel layout megatron-core's groups give.
    for key, desc in (("pp", "PIPELINE_MODEL_PARALLEL_GROUP"), ("tp", "TENSOR_MODEL_PARALLEL_GROUP"),
                      ("dp", "DATA_PARALLEL_GROUP")):
        if desc in groups:
            facts[key], how[key] = len(groups[desc]), f"megatron-core's {desc} ({len(groups[desc])} ranks)"

    # Stages: the analysis' (run.json, metadata, annotations, P2P chain, megatron's group, P2P call order).
    st = analysis.stages.select("rank", "stage", "stages", "stage_source").sort("rank")
    known = st.filter(pl.col("stage").is_not_null())
    held = {r: [int(x) for x in (s or "").split(",") if x != ""] for r, s in st.select("rank", "stages").rows()}
    if known.height and world is not None and known.height == world:
        facts["stage_of_rank"] = [s for _, s in known.select("rank", "stage").rows()]
        how["stage_of_rank"] = "; ".join(sorted(set(known["stage_source"].drop_nulls().to_list())))
        if any(len(h) > 1 for h in held.values()):
            facts["stages_of_rank"] = [held[r] for r in sorted(held)]
            how["stages_of_rank"] = how["stage_of_rank"]
    elif known.height:
        listed = ", ".join(f"{r}: {s}" for r, s in known.select("rank", "stage").rows())
        notes.append(f"stages of the traced ranks ({listed}) are known, but not every rank is traced: stage_of_rank "
                     "lists every rank, so it is left to fill")
    unstaged = st.filter(pl.col("stage").is_null())["rank"].to_list()
    if unstaged:
        notes.append(f"stage of ranks {', '.join(map(str, unstaged))} not told by the traces: stage_of_rank")

    # Schedule and micro-batches, from the passes of the measured steps.
    fb = analysis.schedule.filter(pl.col("phase").is_in(["forward", "backward"]) & pl.col("step").is_in(measured))
    several = any(len(h) > 1 for h in held.values()) or (fb.height > 0 and fb["microbatch"].is_null().all())
    if several and how.get("pp", "").startswith("megatron-core"):  # (its group counts devices; pp counts stages)
        notes.append(f"megatron-core's pipeline group holds {facts.pop('pp')} ranks, each with several stages: pp "
                     "(every stage) is that × virtual_stages")
        how.pop("pp")
    chunks = {len(h) for h in held.values() if h}
    if "pp" not in facts and "stage_of_rank" in facts:
        every = {s for h in held.values() for s in h} | set(facts["stage_of_rank"])
        facts["pp"], how["pp"] = len(every), "the stages the ranks hold"
    if fb.height:
        per = fb.group_by("rank", "step", "phase").len()
        counts = sorted(set(per["len"].to_list()))
        if several and len(counts) == 1 and len(chunks) == 1 and min(chunks) > 1 and "stages_of_rank" in facts:
            v = min(chunks)
            facts["virtual_stages"], how["virtual_stages"] = v, "the stages each rank holds"
            if counts[0] % v == 0:
                facts["num_microbatches"] = counts[0] // v
                how["num_microbatches"] = f"forward passes a rank and step ({counts[0]}) over its {v} stages"
        if several:
            if framework == "megatron-core":
                facts["schedule"], how["schedule"] = "interleaved-1f1b", \
                    "several stages a rank under megatron-core (its only multi-chunk schedule)"
            if "num_microbatches" not in facts:
                notes.append(f"several stages a rank: {counts[0] if len(counts) == 1 else counts} forwards a rank "
                             "and step are num_microbatches × virtual_stages; which is which the traces do not tell: "
                             "num_microbatches, virtual_stages (or stages_of_rank)")
        elif len(counts) == 1:
            facts["num_microbatches"] = counts[0]
            how["num_microbatches"] = "forward passes a rank and step (one stage a rank)"
            first = fb.filter(pl.col("stage") == 0)
            if first.height:
                # GPipe runs every forward of a step before any backward; 1F1B a backward before the last forward.
                early = (first.group_by("rank", "step").agg(
                    (pl.col("start_ns").filter(pl.col("phase") == "backward").min()
                     < pl.col("start_ns").filter(pl.col("phase") == "forward").max()).alias("b_before_f")))
                facts["schedule"] = "1f1b" if early["b_before_f"].any() else "gpipe"
                how["schedule"] = ("a backward before the last forward on stage 0" if facts["schedule"] == "1f1b"
                                   else "every forward before any backward on stage 0")
        else:
            notes.append(f"ranks run different numbers of forward passes a step ({counts}): num_microbatches")
        sources = sorted(set(fb["source"].to_list()))
        seen["passes"] = (f"{fb.height} forward/backward passes in the measured steps, from "
                          + ", ".join({"annotated": "annotations or Python frames", "inferred": "P2P order",
                                       "autograd": "autograd's ops and the calls' order (torch.profiler's defaults)"}
                                      .get(s, s) for s in sources))
    else:
        seen["passes"] = "none found (no annotations, Python frames or autograd ops on a pipeline rank)"

    # run.json's own facts win over what the traces show; the rest is asked for by key.
    if manifest is not None:
        for k in ("world_size", "pp", "dp", "tp", "schedule", "num_microbatches", "microbatch_size", "dtype",
                  "device", "peak_flops", "stage_of_rank", "stages_of_rank", "trainer"):
            v = getattr(manifest, k, None)
            if v is not None and not (k == "schedule" and v == "unknown") and not (k in ("dp", "tp") and v == 1
                                                                                   and k in facts):
                facts[k] = list(v) if isinstance(v, tuple) else v
                how[k] = "run.json"
        if manifest.model is not None:
            import dataclasses

            facts["model"], how["model"] = dataclasses.asdict(manifest.model), "run.json"
    pipeline = bool(analysis.summary.pipeline_found)
    if not pipeline:  # (a data-parallel or single-rank job: no pipeline fact to ask for)
        seen["pipeline"] = "none found: no rank has a stage, no pass and no P2P message chains ranks"
    wanted = [*(["pp", "stage_of_rank", "schedule", "num_microbatches"] if pipeline else []), *NEVER_IN_TRACES]
    if several:
        wanted.append("stages_of_rank")
    missing = {k: KEY_MEANINGS[k] for k in wanted if k not in facts}
    return {"facts": facts, "how": how, "missing": missing, "seen": seen, "notes": notes}


def template(d: dict[str, Any]) -> dict[str, Any]:
    """A run.json: the facts told at the top level, the rest under ``_describe`` (run.json keeps unknown keys as
    ``extra``, so the file is read as it is)."""
    return {**d["facts"], "_describe": {
        "written_by": "traceana describe",
        "told": d["how"],
        "to_fill": d["missing"],
        "how_to_use": "move each key of to_fill you know to the top level with its value, then put this file in "
                      "the run folder as run.json",
    }}


def text(d: dict[str, Any]) -> str:
    lines = [f"{k}: {v}" for k, v in d["seen"].items()]
    if d["facts"]:
        lines.append("told (run.json key = value, from):")
        lines += [f"  {k} = {json.dumps(v)}  ({d['how'].get(k, '')})" for k, v in d["facts"].items()]
    if d["missing"]:
        lines.append("not in the traces (run.json key: meaning):")
        lines += [f"  {k}: {meaning}" for k, meaning in d["missing"].items()]
    lines += [f"note: {n}" for n in d["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze_run import load_and_analyze
    from traceana.ingest.run_dir import input_files

    if args.output is not None and args.output != STDOUT:  # before any work: never over a trace or run.json
        refuse_inputs(args.output, input_files(args.run_dir))
    progress = not args.quiet and sys.stderr.isatty()
    analysis = load_and_analyze(args.run_dir, peak_flops=None, workers=args.workers, cache=not args.no_cache,
                                progress=progress, names=args.names, diagnose=False)  # (it shows no straggler)
    d = describe(analysis)
    body = json.dumps(template(d), indent=1) + "\n"
    if args.output == STDOUT:
        sys.stdout.write(body)
        return 0
    print(json.dumps(d, indent=1) if args.json else text(d))
    if args.output is not None:
        path = write_text(args.output, body)
        if not args.quiet:
            print(f"wrote {path}: {len(d['facts'])} facts told, {len(d['missing'])} to fill (listed under "
                  "_describe.to_fill)", file=sys.stderr)
    return 0
