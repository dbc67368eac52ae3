"""What would the step take if some work ran at its peers' speed: the measured step's dependency graph (operations,
P2P messages, collectives, host gaps) replayed on the simulator's engine with chosen operations made ideal or
changed (docs/whatif.md).

By default: the measured step, its replay and the replay's error per rank, the step with everything ideal (each
operation at the median of the same work on its stage), the slowdown (measured / ideal), the slowdown attributed
to each stage, rank, replica and kind of time (everything ideal but that group, over everything ideal), what the
step would be with each one made ideal, and one line saying who holds the step back. A rank, replica or stage is
named only when making it ideal shortens the step by more than the noise in every measured step.

  traceana whatif runs/1f1b
  traceana whatif runs/1f1b --set 'stage=1:forward*0.5' --set 'p2p=0'
  traceana whatif runs/pp2dp2 --set 'rank=3:ideal' --json
  traceana whatif runs/1f1b --schedule gpipe --microbatches 8 --bpipe off

--schedule, --microbatches and --bpipe predict the step under another plan from the run's own measured durations
(the simulator, the same scheduler the replay runs on, calibrated by the run's step): the measured counterpart of
`estimate`'s BPipe verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SET_HELP = ("change the replay: [stage=S:|rank=R:|replica=K:]WHAT where WHAT is ideal, KIND:ideal, KIND*FACTOR or "
            "KIND=MS and KIND one of forward, backward, optimizer, collective, p2p, host; repeat to combine (e.g. "
            "'stage=1:forward*0.5', 'p2p=0', 'rank=3:ideal') (default: none)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (or a single Kineto trace file)")
    p.add_argument("--set", action="append", default=[], metavar="CHANGE", dest="changes", help=SET_HELP)
    p.add_argument("--schedule", metavar="NAME",
                   help="also predict the step under another schedule (gpipe, 1f1b, …) from this run's own measured "
                        "durations (needs run.json's model and pipeline) (default: none)")
    p.add_argument("--microbatches", type=int, metavar="N",
                   help="… with another number of micro-batches per step (default: as the run)")
    p.add_argument("--bpipe", choices=("on", "off"), help="… with BPipe on or off (default: as the run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    options.names(p)
    options.reading(p)


def render(w, *, console) -> None:
    from traceana.tables import cell as _fmt
    from traceana.tables import print_line, print_table
    from traceana.whatif import ms

    s = w.summary
    from traceana.summary import steps_label

    print_line(console, f"{s['run']}: measured step {ms(s['measured_step_ms'])} ms over "
               f"{steps_label(s['measured_steps'])}; replayed {ms(s['replayed_step_ms'])} ms (largest "
               f"error of a rank's step {s['replay_error']:.2%}); everything ideal {ms(s['ideal_step_ms'])} ms, "
               f"slowdown {_fmt(s['slowdown'], '.2f')}×; noise {ms(s['noise_ms'])} ms")
    headers = ["group", "", "step if ideal\nms", "gain\nms", "gain in the\nworst step ms", "slowdown", "named"]
    def sig(x, sign=""):
        return "–" if x is None else (sign if x >= 0 else "") + ms(x)

    rows = [[r["group"], r["id"], sig(r["if_ideal_step_ms"]), sig(r["gain_ms"], "+"), sig(r["min_gain_ms"], "+"),
             _fmt(r["slowdown"], ".2f"), "yes" if r["named"] else ""]
            for r in w.groups.iter_rows(named=True)]  # one row per group: display only
    print_table(console, "What if each were ideal (the rest as measured); slowdown: everything ideal but it, over "
                         "everything ideal", headers, rows, keys=2, justify=["left", "left", *["right"] * 5])
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
    print_line(console, s["diagnosis"], prefix="diagnosis: ")
    for n in w.notes:
        print_line(console, n, prefix="note: ")


def run(args: argparse.Namespace) -> int:
    from traceana.commands.analyze import load_and_analyze
    from traceana.whatif import parse_set, whatif

    changes = [parse_set(c) for c in args.changes]  # a bad --set is refused before any trace is read
    progress = not args.quiet and not args.json and sys.stderr.isatty()
    analysis = load_and_analyze(str(args.run_dir), peak_flops=None, workers=args.workers, cache=not args.no_cache,
                                progress=progress, names=args.names)
    w = whatif(analysis, changes)
    plan = None
    if args.schedule is not None or args.microbatches is not None or args.bpipe is not None:
        from traceana.whatif import plan_whatif

        plan = plan_whatif(analysis, schedule=args.schedule, microbatches=args.microbatches,
                           bpipe=None if args.bpipe is None else args.bpipe == "on")
    if args.json:
        print(json.dumps({**w.as_dict(), "plan": plan}, indent=2, default=str))
    else:
        from traceana.tables import console as output_console
        from traceana.tables import print_line
        from traceana.whatif import ms

        console = output_console()
        render(w, console=console)
        if plan is not None:
            a, b = plan["as_run"], plan["plan"]
            on = {True: "on", False: "off"}
            print_line(console, f"plan: {b['schedule']}, {b['microbatches']} micro-batches, BPipe {on[b['bpipe']]} "
                                f"instead of {a['schedule']}, {a['microbatches']}, BPipe {on[a['bpipe']]}: the step "
                                f"would be about "
                                f"{ms(plan['predicted_step_ms'])} ms instead of {ms(plan['measured_step_ms'])} ms "
                                f"({plan['speedup']:.3f}× — simulated from this run's own durations: "
                                f"{ms(plan['simulated_as_run_ms'])} ms as it ran, {ms(plan['simulated_plan_ms'])} ms "
                                "so; a prediction, not a replay)")
    return 0
