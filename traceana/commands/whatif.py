"""What would the step take if some work ran at its ideal: the measured step's dependency graph (operations,
P2P messages, collectives, host gaps) replayed on the simulator's engine with chosen operations made ideal or
changed (docs/whatif.md).

By default: the measured step and its replay (the graph on the measured durations: how far its edges agree with
the timeline, in sample — not a prediction); the study's ideal (Lin et al., OSDI 2025: each compute kind at its mean
across stages, replicas and steps, communication at its median), the slowdown S = measured / ideal, its M_S (share
due to the last stage) and M_W (due to single workers); per stage, rank, replica and kind of time the slowdown
(everything ideal but it, over everything ideal) and the step with it made ideal; beside them ours (each operation at
its stage's median; a rank at its peers' speed), which names the straggler: a rank, replica or stage is named only
when at its peers' speed the step is shorter by more than the noise in every measured step.

  traceana whatif runs/1f1b
  traceana whatif runs/1f1b --set 'stage=1:forward*0.5' --set 'p2p=0'
  traceana whatif runs/pp2dp2 --set 'rank=3:peers' --json
  traceana whatif runs/1f1b --schedule gpipe --microbatches 8 --bpipe off --recompute on
  traceana whatif runs/gpipe --layers-per-stage 2,3,3

--schedule, --microbatches, --bpipe, --recompute and --layers-per-stage predict the step under another plan: the run's measured work
per operation re-sequenced in that plan's order on the same engine, with its interval, bubble share and memory per
stage (a prediction, not a replay); a plan `traceana collect` refuses is refused.
"""

# Function-local imports here: order and cost. This module is imported to build the parser, before polars;
# polars, and what imports it, must come after the program's settings for a small run (traceana.cli), so
# they are imported in ``run`` and the functions it calls (docs/architecture.md "Function-local imports").

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traceana.commands import options

SET_HELP = ("change the replay: [stage=S:|rank=R:|replica=K:]WHAT where WHAT is ideal (the study's: the mean of "
            "each kind across stages), peers (ours: its peers' speed), KIND:ideal, KIND:peers, KIND*FACTOR (≤ "
            "1,000,000) or KIND=MS (≤ 1,000,000,000) and KIND one of forward, backward, optimizer, collective, p2p, "
            "host; repeat to combine, applied in order (e.g. 'stage=1:forward*0.5', 'p2p=0', 'rank=3:ideal') "
            "(default: none)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    p.add_argument("--set", action="append", default=[], metavar="CHANGE", dest="changes", help=SET_HELP)
    p.add_argument("--schedule", metavar="NAME",
                   help="also predict the step under another schedule (gpipe, 1f1b, …): this run's measured work "
                        "re-sequenced in its order (needs run.json's model and pipeline) (default: as the run)")
    p.add_argument("--microbatches", type=int, metavar="N",
                   help="… with another number of micro-batches per step (default: as the run)")
    p.add_argument("--bpipe", choices=("on", "off"),
                   help="… with BPipe on or off, its evictions priced from the run's activations (default: as the "
                        "run; off where the run's BPipe does not apply to --schedule)")
    p.add_argument("--recompute", choices=("on", "off"),
                   help="… with full activation recomputation on or off, priced from the measured forwards "
                        "(default: as the run)")
    p.add_argument("--layers-per-stage", metavar="N,N,...",
                   help="… with the transformer layers split so over the stages (one count a stage, all its chunks "
                        "together when interleaved, summing to the model's layers): a block moved keeps its "
                        "measured work where the traces time each block (the reference trainer's layer spans), "
                        "else each stage's measured work is scaled by its layer count; a note says which "
                        "(default: as the run)")
    p.add_argument("--per-group", action="store_true",
                   help="replay the what-if's variants one pipeline group (a data-parallel replica's ranks) a task "
                        "(causal.group_replay: the same figures; docs/whatif.md \"Per pipeline group\"); a run whose "
                        "replicas are not known is refused (default: in one process)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="with --per-group: run the groups' tasks on a dask.distributed cluster (e.g. "
                        "tcp://host:8786): the analysis and the measured step's graph one pipeline group a task "
                        "too, so this process never holds a trace's events (causal.group_graph; docs/whatif.md "
                        "\"Per pipeline group\") (default: one after another in this process)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    options.names(p)
    options.reading(p)


def render(w, *, console) -> None:
    from traceana.core.tables import cell as _fmt
    from traceana.core.tables import print_line, print_table
    from traceana.measure.summary import steps_label
    from traceana.causal.whatif import ms

    s = w.summary

    def f2(x):
        return "–" if x is None else f"{x:.2f}"

    print_line(console, f"{s['run']}: measured step {ms(s['measured_step_ms'])} ms over "
               f"{steps_label(s['measured_steps'])}; noise {ms(s['noise_ms'])} ms")
    print_line(console, f"replay of the measured step (a consistency check of the graph's edges, in sample, not a "
               f"prediction): {ms(s['replayed_step_ms'])} ms; edges consistent with the timeline: "
               f"{s['consistent_operations']:,} of {s['operations']:,} operations (largest difference of a rank's "
               f"step {s['replay_error']:.2%})")
    print_line(console, f"the study's ideal (OSDI 2025: compute at the mean of its kind across stages, replicas and "
               f"steps; communication at its median): {ms(s['ideal_step_ms'])} ms, slowdown S "
               f"{f2(s['slowdown'])}× (host gaps 0 on both sides: {f2(s['slowdown_without_host'])}×); M_S "
               f"{_share(s['m_s'])}, M_W {_share(s['m_w'])}"
               + (f" (ranks {', '.join(map(str, s['m_w_ranks']))})" if s["m_w"] is not None else ""))
    ws = s["within_stage"]
    print_line(console, f"ours beside it (each operation at its stage's median): {ms(ws['ideal_step_ms'])} ms, "
               f"slowdown {f2(ws['slowdown'])}×")
    headers = ["group", "", "study: step if\nideal ms", "gain\nms", "gain in the\nworst step ms", "slowdown",
               "ours: at its\npeers' speed ms", "gain\nms", "named"]

    def sig(x, sign=""):
        return "–" if x is None else (sign if x >= 0 else "") + ms(x)

    rows = [[r["group"], r["id"], sig(r["if_ideal_step_ms"]), sig(r["gain_ms"], "+"), sig(r["min_gain_ms"], "+"),
             _fmt(r["slowdown"], ".2f"), sig(r["if_peers_step_ms"]), sig(r["peers_gain_ms"], "+"),
             "yes" if r["named"] else ""]
            for r in w.groups.iter_rows(named=True)]  # one row per group: display only
    print_table(console, "What if each were ideal (the rest as measured); slowdown: everything ideal but it, over "
                         "everything ideal (the study's); named: at its peers' speed the step is shorter by more than "
                         "the noise in every step", headers, rows, keys=2, justify=["left", "left", *["right"] * 7])
    pt = w.path_time
    if pt.height:
        rows = [[f"{r['group']} {r['id']}", ms(r["ms"]), f"{100 * (r['fraction'] or 0):.0f}%"]
                for r in pt.iter_rows(named=True)]  # kinds, stages and ranks: display only
        print_table(console, "Critical path: time on it per step (mean over the steps) and its share of the path",
                    ["on the path", "ms", "share"], rows, keys=1)
    if s["changes"]:
        change = s["changed_step_ms"] - s["replayed_step_ms"]
        print_line(console, f"with {', '.join(s['changes'])}: the step would be {ms(s['changed_step_ms'])} ms "
                            f"({'+' if change >= 0 else ''}{ms(change)} ms against the replay)")
    print_line(console, s["diagnosis"], prefix="diagnosis (ours: at its peers' speed): ")
    for n in w.notes:
        print_line(console, n, prefix="note: ")


def _share(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def render_plan(plan: dict, *, console) -> None:
    """The plan what-if's lines: what it predicts and what it is."""
    from traceana.core.tables import print_line
    from traceana.causal.whatif import ms

    a, b = plan["as_run"], plan["plan"]
    on = {True: "on", False: "off"}

    def desc(x: dict) -> str:
        layers = (f", layers {','.join(map(str, x['layers_per_stage']))}"
                  if a["layers_per_stage"] != b["layers_per_stage"] else "")
        return (f"{x['schedule']}, {x['microbatches']} micro-batches, BPipe {on[x['bpipe']]}, recompute "
                f"{x['recompute']}{layers}")

    lo, hi = plan["interval_ms"]
    if plan["speedup"] is not None:
        change = f"{plan['speedup']:.3f}× the step's speed"
    else:  # another micro-batch count: a step does other work; its time per micro-batch is what compares
        change = (f"{plan['step_ratio']:.3f}× the step (it holds {b['microbatches']} micro-batches instead of "
                  f"{a['microbatches']}); per micro-batch {plan['per_microbatch_speedup']:.3f}× as fast")
    print_line(console, f"plan (a prediction, not a replay: this run's measured work per operation re-sequenced in "
                        f"the plan's order): {desc(b)} instead of {desc(a)}: the step would be about "
                        f"{ms(plan['predicted_step_ms'])} ms ({ms(lo)}–{ms(hi)}: the measured steps' spread) — "
                        f"{change}; "
                        f"the run as it ran on the same engine: {ms(plan['simulated_as_run_ms'])} ms against "
                        f"{ms(plan['measured_step_ms'])} ms measured ({plan['as_run_error']:+.1%})")
    bub = ", ".join(f"stage {k} {100 * v:.0f}%" for k, v in plan["bubble_fraction"].items())
    print_line(console, f"plan's bubble share: {bub}")
    if plan["memory_bytes"]:
        mem = ", ".join(f"stage {k} {v / 2**20:.1f} MiB" for k, v in plan["memory_bytes"].items())
        print_line(console, f"plan's peak memory (the memory model's in-flight micro-batches on the measured "
                            f"activations): {mem}")
    for n in plan["notes"]:
        print_line(console, n, prefix="note: ")


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze_run import load_and_analyze
    from traceana.causal.whatif import parse_set, whatif
    from traceana.core.pipeline_rules import parse_layers

    changes = [parse_set(c) for c in args.changes]  # a bad --set is refused before any trace is read
    if args.dask is not None and not args.per_group:
        from traceana.core.errors import BadInputError

        raise BadInputError("--dask here runs the what-if's per-group tasks: it needs --per-group",
                            fix="add --per-group, or drop --dask")
    layers = None if args.layers_per_stage is None else parse_layers(args.layers_per_stage)  # (before reading, too)
    progress = not args.quiet and not args.json and sys.stderr.isatty()
    graph = None
    if args.dask is None:
        analysis = load_and_analyze(str(args.run_dir), peak_flops=None, workers=args.workers,
                                    cache=not args.no_cache, progress=progress, names=args.names,
                                    diagnose=False)  # (it runs the what-ifs itself)
        w = whatif(analysis, changes, per_group=map if args.per_group else None)
    else:  # on the cluster: the analysis and the graph one pipeline group a task, then the variants too
        from traceana.commands.analyze_run import analyze_on_cluster, check_run_directory
        from traceana.core.errors import TraceanaError
        from traceana.measure import partitioned

        check_run_directory(str(args.run_dir))
        with partitioned.connect(args.dask) as client:  # (one connection: the analysis, the graph, the variants)
            analysis, graph = analyze_on_cluster(str(args.run_dir), client, peak_flops=None, names=args.names)
            if isinstance(graph, TraceanaError):
                raise graph
            w = whatif(analysis, changes, graph=graph, per_group=partitioned.dask_map(client))
    plan = None
    if any(x is not None for x in (args.schedule, args.microbatches, args.bpipe, args.recompute, layers)):
        from traceana.validation.plan import plan_whatif

        plan = plan_whatif(analysis, schedule=args.schedule, microbatches=args.microbatches,
                           bpipe=None if args.bpipe is None else args.bpipe == "on",
                           recompute=None if args.recompute is None else args.recompute == "on",
                           layers_per_stage=layers, graph=graph)
    if args.json:
        print(json.dumps({**w.as_dict(), "plan": plan}, indent=2, default=str))
    else:
        from traceana.core.tables import console as output_console

        console = output_console()
        render(w, console=console)
        if plan is not None:
            render_plan(plan, console=console)
    return 0
