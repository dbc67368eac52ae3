"""Run the reference pipeline trainer under the profiler and write a run directory.

Spawns one process per stage (gloo on CPU; NCCL when each rank has its own GPU; several stages on one GPU
communicate through host memory over gloo). Under torchrun (RANK/WORLD_SIZE set) this process is one rank.
Impossible configurations are refused before any process starts.

  traceana collect --model tiny-gpt --pp 4 --microbatches 8 --schedule 1f1b --bpipe -o runs/bpipe

The multi-stage schedules (interleaved-1f1b, looped-bfs, zero-bubble, zbv, dualpipev) run torch.distributed.pipelining's
own schedule classes instead (collectors.pipelining_example): --pp stages on --pp/2 ranks, two per rank; --bpipe,
--recompute, --dp, --layers-per-stage and --layer-holds are the reference trainer's only.

  traceana collect --pp 4 --layers-per-stage 3,2,2,1 --work sleep --layer-holds per-layer --forward-ms 10 \
      --backward-ms 20 -o runs/moved    # stage 0 holds blocks 0-2: 3 × 10 ms a forward

  traceana collect --schedule zero-bubble --pp 4 --microbatches 4 -o runs/zb
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traceana.core.flags import Flag

LOG = "collect.log"  # in the run directory: the spawned ranks' stderr


_TYPES = {"int": int, "float": float, "str": str}


def config_flags() -> list[tuple[dataclasses.Field, Flag]]:
    """``CollectConfig``'s fields that are flags, in their order, each with its ``Flag``."""
    from collectors.trainer.config import CollectConfig

    return [(f, f.metadata["flag"]) for f in dataclasses.fields(CollectConfig) if "flag" in f.metadata]


def workload_flags() -> list[tuple[dataclasses.Field, Flag]]:
    """The known workload's flags: ``traceana.core.manifest.Workload``'s fields that are flags, in their order."""
    from traceana.core.manifest import Workload

    return [(f, f.metadata["flag"]) for f in dataclasses.fields(Workload) if "flag" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from collectors.trainer.config import PRESETS  # cheap: no torch import
    from traceana.commands import options
    from traceana.core.flags import FIELD_DEFAULT

    # The training configuration, generated from CollectConfig's fields (a flag is its field's name); the flags
    # estimate shares keep their one definition and default in options.py.
    for f, flag in config_flags():
        if flag.shared == "model":
            options.model(parser, default=f.default, presets=PRESETS)
        elif flag.shared:
            getattr(options, flag.shared)(parser)
        else:  # (the field's type, from its annotation: "int | None" is an int)
            # (a tuple field, --layers-per-stage, is its text here: config_from_args parses it, one line if bad)
            kind = str(f.type).split("|")[0].strip()
            parser.add_argument(*flag.names(f.name), dest=f.name,
                                type=str if kind.startswith("tuple") else _TYPES[kind], default=f.default,
                                metavar=flag.metavar, help=flag.help)
    work = parser.add_argument_group(
        "known workload", "--work sleep: every pass holds for a stated time instead of computing, everything else "
        "stays real (docs/known-workload.md)")
    for f, flag in workload_flags():  # (generated from Workload's fields, as the training configuration's above)
        kw = {"action": flag.action} if flag.action else {"type": _TYPES[str(f.type).split("|")[0].strip()]}
        if flag.choices:
            kw = {"choices": flag.choices}
        default = f.default if flag.default is FIELD_DEFAULT else flag.default
        work.add_argument(*flag.names(f.name), dest=flag.dest or f.name, default=default, metavar=flag.metavar,
                          help=flag.help, **kw)
    options.output(parser, type=Path, required=True, metavar="DIR",
                   help="run directory to write (required)")



def workload_from_args(args: argparse.Namespace):
    """The known workload the flags describe (traceana.core.manifest.Workload), None for ``--work compute``; a flag that
    makes no sense is one ConfigError line (exit 2)."""
    from traceana.core.errors import ConfigError
    from traceana.core.manifest import Workload

    given = [flag for flag, v in (("--forward-ms", args.forward_ms), ("--backward-ms", args.backward_ms),
                                  ("--weight-ms", args.weight_ms), ("--slow-stage", args.slow_stage),
                                  ("--slow-rank", args.slow_rank), ("--slow-layer", args.slow_layer),
                                  ("--layer-holds", args.layer_holds)) if v is not None]
    if args.work != "sleep":
        if given:
            raise ConfigError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} the known workload",
                              fix="add --work sleep, or drop " + ", ".join(given))
        return None
    missing = [flag for flag, v in (("--forward-ms", args.forward_ms), ("--backward-ms", args.backward_ms))
               if v is None]
    if missing:
        raise ConfigError(f"--work sleep needs {' and '.join(missing)}",
                          fix="give each pass's time, e.g. --forward-ms 20 --backward-ms 40")
    for flag, v in (("--forward-ms", args.forward_ms), ("--backward-ms", args.backward_ms),
                    ("--weight-ms", args.weight_ms)):
        if v is not None and not (v >= 0 and v < float("inf")):
            raise ConfigError(f"{flag} must be a number of milliseconds, 0 or more, got {v:g}",
                              fix=f"give {flag} 0 or more")

    def pairs(flag: str, values: list[str] | None) -> tuple[tuple[int, float], ...]:
        out = []
        for text in values or ():
            index, sep, factor = text.partition(":")
            try:
                i, f = int(index), float(factor)
            except ValueError:
                i, f = None, None
            if not sep or i is None or i < 0:
                raise ConfigError(f"{flag} {text!r} is not INDEX:FACTOR",
                                  fix=f"write e.g. {flag} 1:2 (index 1, every pass twice as long)")
            if not (f > 0 and f < float("inf")):
                raise ConfigError(f"{flag} {text!r}: the factor must be more than 0, got {factor}",
                                  fix="give a factor above 0 (2 = twice as long, 0.5 = half)")
            if i in dict(out):
                raise ConfigError(f"{flag} names {i} twice", fix=f"give each {flag[7:]} once")
            out.append((i, f))
        return tuple(out)

    if args.slow_layer and args.layer_holds != "per-layer":  # (even holds: a pass's time is the stage's, not a block's)
        raise ConfigError("--slow-layer slows one block's own hold: it needs --layer-holds per-layer",
                          fix="add --layer-holds per-layer, or drop --slow-layer")
    return Workload(kind="sleep", forward_ms=args.forward_ms, backward_ms=args.backward_ms,
                    weight_ms=args.weight_ms or 0.0, slow_stages=pairs("--slow-stage", args.slow_stage),
                    slow_ranks=pairs("--slow-rank", args.slow_rank), slow_layers=pairs("--slow-layer", args.slow_layer),
                    layer_holds=args.layer_holds)


def config_from_args(args: argparse.Namespace):
    """The ``CollectConfig`` the flags describe: each flag's field (``config_flags``), the micro-batches' shared
    default (2 × --pp) and the known workload (``workload_from_args``)."""
    from collectors.trainer.config import CollectConfig
    from traceana.commands.options import microbatch_count

    from traceana.core.pipeline_rules import parse_layers

    given = {f.name: getattr(args, flag.dest or f.name) for f, flag in config_flags()}
    if given["layers_per_stage"] is not None:
        given["layers_per_stage"] = parse_layers(given["layers_per_stage"])
    return CollectConfig(**{**given, "num_microbatches": microbatch_count(args)}, workload=workload_from_args(args))


def run_pipelining(args: argparse.Namespace) -> int:
    """A multi-stage schedule: torch.distributed.pipelining's own class, two stages per rank."""
    from traceana.core.errors import ConfigError

    # torch.distributed.pipelining has no BPipe, and collectors.pipelining_example no recompute or data parallelism:
    # a flag it would ignore is refused, not dropped silently
    # nor a split of the layers of its own (its stages take the rules' even split of the chunks) or layer holds
    unsupported = [flag for flag, on in (("--bpipe", args.bpipe), ("--bpipe-inflight", args.bpipe_inflight is not None),
                                         ("--recompute", args.recompute != "none"), ("--dp", args.dp != 1),
                                         ("--layers-per-stage", args.layers_per_stage is not None),
                                         ("--layer-holds", args.layer_holds is not None)) if on]
    if unsupported:
        raise ConfigError(f"{', '.join(unsupported)} is not available with schedule {args.schedule!r}",
                          fix="use it with the reference trainer's gpipe or 1f1b schedules")
    if args.pp < 2 or args.pp % 2:
        raise ConfigError(f"schedule {args.schedule!r} puts two stages on each rank: --pp must be even, got {args.pp}",
                          fix="give an even --pp, e.g. 4")
    # the trainer's own checks of the flags both paths share (positive counts, a preset whose layers fill --pp
    # stages), then the schedule's rules (traceana.core.pipeline_rules: torch's constraints on the micro-batches), so an
    # impossible configuration is refused here and not as a traceback from inside the spawned ranks
    from traceana.core.pipeline_rules import device_order

    from traceana.commands.options import microbatch_count

    workload = workload_from_args(args)
    if workload is not None:
        from collectors.trainer.config import check_workload_layout

        check_workload_layout(workload, stages=args.pp, ranks=args.pp // 2)
    config_from_args(argparse.Namespace(**{**vars(args), "schedule": "gpipe"}))
    device_order(args.schedule, pp=args.pp // 2, num_microbatches=microbatch_count(args), device=0, virtual_stages=2)
    from collectors.pipelining_example import collect

    with ranks_output(args.output):
        out = collect(args.schedule, args.output, preset=args.model, num_microbatches=microbatch_count(args),
                      microbatch_size=args.microbatch_size, steps=args.steps, ranks=args.pp // 2,
                      attention=args.attention, seed=args.seed, warmup_steps=args.warmup_steps,
                      workload=workload)
    print(f"wrote {out}; next: traceana analyze {out}")
    return 0


@contextmanager
def ranks_output(out: Path) -> Iterator[None]:
    """The spawned ranks' stderr — torch's profiler writes several lines per rank and step there (``USDT …
    profiler_start``, allocator warnings) — goes to ``OUT/collect.log``, not over traceana's own lines; where it
    went is said at the end, and when the collection failed."""
    from collectors.launch import check_out_dir, workers_output_to

    check_out_dir(out)
    log = out / LOG
    try:
        with workers_output_to(log):
            yield
    except BaseException:
        print(f"the ranks' own output (torch's messages) is in {log}", file=sys.stderr)
        raise
    print(f"the ranks' own output (torch's messages): {log}")


def collect_run(out: Path, *, progress=None, log: Path | None = None, **config) -> Path:
    """Collect one run of the reference trainer into ``out`` (``CollectConfig``'s fields as keywords); returns the
    run directory. What the demo collects with, through the command registry (``registry.provided("collect",
    "collect_run")``): reports never imports the trainer or torch itself. ``progress``: called with one line of
    text per event of the trainer (e.g. a rank finished a step); ``log``: where the trainer's processes write their
    stderr (default: ours). Without torch: one BadInputError line saying how to get it."""
    from traceana.core.errors import BadInputError

    try:
        from collectors.launch import collect, workers_output_to
        from collectors.trainer.config import CollectConfig
    except ImportError as e:  # torch is missing: say how to get it
        raise BadInputError(
            f"traceana demo needs the collectors and torch ({e.name or e} is missing)",
            fix="pip install 'traceana[collect]' (with a torch build for your machine), or analyse saved traces with "
                "traceana report RUN_DIR",
        ) from None
    cfg = CollectConfig(**config)
    if log is None:
        return Path(collect(cfg, out, progress=progress))
    with workers_output_to(log):
        return Path(collect(cfg, out, progress=progress))


OWNER = ".traceana-collect"  # in a run directory being collected: which launch it belongs to (torchrun's ranks)


def refuse_used_output(out: Path) -> None:
    """A collection writes only into a new or empty directory (as ``traceana attach`` does): collecting into an
    existing run would replace some of its traces and leave the others — a mixed run. Under torchrun every rank
    runs this command on the same directory: the first rank marks it with the launch's id (``OWNER``) and the others
    accept a directory holding nothing but that mark (its own unfinished output)."""
    from traceana.core.errors import ConfigError

    launch_id = _launch_id()
    try:
        names = sorted(n for n in os.listdir(out) if not n.startswith(".traceana-write-test-"))
    except FileNotFoundError:
        names = []
    except OSError as e:  # (the words of launch.check_out_dir)
        raise ConfigError(f"cannot write to the output directory ({e.strerror or e})", path=out,
                          fix="choose a writable -o/--output directory") from None
    if names == [OWNER] and launch_id is not None:
        try:
            if (out / OWNER).read_text() == launch_id:
                return
        except OSError:
            pass
    if names:
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        raise ConfigError(f"the output directory is not empty ({shown}); collecting into it would mix two runs",
                          path=out, fix="choose a new -o/--output directory (traceana never writes into a run)")
    if launch_id is not None:  # the first rank here: mark the directory as this launch's (atomically, content and all)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".traceana-write-test-{os.getpid()}"
        tmp.write_text(launch_id)
        try:
            os.link(tmp, out / OWNER)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        refuse_used_output(out)  # another launch's rank may have marked it first


def _launch_id() -> str | None:
    """What all the ranks of one torchrun launch share (None outside torchrun)."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):  # launch.in_torchrun
        return None
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def run(args: argparse.Namespace) -> int:
    from collectors.trainer.config import SCHEDULES

    refuse_used_output(args.output)  # before anything is spawned or written
    if args.schedule not in SCHEDULES:
        return run_pipelining(args)
    config = config_from_args(args)  # ConfigError (exit 2) before torch is even imported
    from collectors import launch

    if launch.in_torchrun():
        launch.run_under_torchrun(config, args.output, progress=print)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        with ranks_output(args.output):
            launch.collect(config, args.output, progress=print)
    print(f"wrote {args.output}; next: traceana analyze {args.output}")
    return 0
