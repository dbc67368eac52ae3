"""The command line's vocabulary: one flag per concept, defined once and used by every command that needs it.

``-o/--output`` is where a command writes, ``--model`` a model preset, ``--microbatches`` micro-batches per step,
``--peak-flops`` the device's peak in FLOP/s, ``--workers/--no-cache/--quiet`` how a run is read, and the training
configuration collect and estimate share (``--pp``, ``--dp``, ``--microbatches``, ``--microbatch-size``,
``--schedule``, ``--attention``, ``--recompute``, ``--bpipe``) one definition and one default each. Older spellings
stay accepted but hidden from the help (``--num-microbatches``, ``--preset``, ``--out``, ``--peak-tflops``, and
``--steps``, which was a count in collect and windows in attach: now ``--profile-steps`` and ``--window``).
Imports nothing but argparse and math (manifest's name lists, where a choice needs them): building the help must
stay cheap.
"""

from __future__ import annotations

import argparse
import copy
import math
import textwrap

from traceana.core.units import TFLOPS


# Old spellings: accepted as aliases of the same option, not shown in the help.
HIDDEN_ALIASES = frozenset({"--out", "--preset", "--num-microbatches", "--steps", "--warmup"})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: ``(default: off)`` for a switch, ``(default: X)`` otherwise.
    An option whose default needs words (None meaning "from run.json", "automatic") says so in its own help.
    Old spellings (``HIDDEN_ALIASES``) are left out of the option lists."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "(default" in help_ or action.default is argparse.SUPPRESS or not action.option_strings:
            return help_
        if action.nargs == 0:  # a switch
            return f"{help_} (default: {'on' if action.default else 'off'})" if isinstance(action.default, bool) \
                else help_
        if action.default is None:
            return help_
        return f"{help_} (default: %(default)s)"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [o for o in action.option_strings if o not in HIDDEN_ALIASES]
        if len(shown) == len(action.option_strings):
            return super()._format_action_invocation(action)
        trimmed = copy.copy(action)
        trimmed.option_strings = shown
        return super()._format_action_invocation(trimmed)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # Descriptions are reflowed paragraph by paragraph; indented lines (examples) are kept as written.
        out = []
        for para in textwrap.dedent(text).split("\n\n"):
            lines = para.splitlines()
            if lines and all(line.startswith(" ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


def output(parser: argparse.ArgumentParser, *, default=None, required: bool = False, metavar: str = "FILE",
           help: str, type=str) -> None:
    """``-o/--output``; ``--out`` is an old spelling, kept hidden."""
    parser.add_argument("-o", "--output", "--out", dest="output", type=type, default=default, required=required,
                        metavar=metavar, help=help)


def model(parser, *, default: str | None, presets, help: str = "model preset") -> None:
    """``--model PRESET``; ``--preset`` is an old spelling, kept hidden. The one flag collect and estimate share
    with a default each: collect runs a model (tiny-gpt), while estimate's absent ``--model`` means an explicit
    shape (--family/--layers/...), which a default preset would fill in silently; their preset lists differ too
    (collect runs the trainer's tiny models only)."""
    parser.add_argument("--model", "--preset", dest="model", default=default, metavar="PRESET",
                        help=f"{help}: {', '.join(presets)}" + ("" if default else " (default: none)"))


class _TeraFlops(argparse.Action):
    """``--peak-tflops X`` (old spelling) stores X·10¹² in ``peak_flops``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values * TFLOPS)


def peak_flops(parser, *, help: str = "peak FLOP/s per device, for MFU (default: from run.json)") -> None:
    """``--peak-flops FLOP/S`` (e.g. 312e12); ``--peak-tflops`` is an old spelling in TFLOP/s, kept hidden."""
    parser.add_argument("--peak-flops", dest="peak_flops", type=float, default=None, metavar="FLOP/S", help=help)
    parser.add_argument("--peak-tflops", dest="peak_flops", type=float, action=_TeraFlops, help=argparse.SUPPRESS)


def names(parser) -> None:
    """``--names FILE``: the name rules (docs/naming.md) mapping other frameworks' annotation names to phases and
    their communication kernels to kinds."""
    parser.add_argument("--names", dest="names", default=None, metavar="FILE",
                        help="name rules file (TOML or JSON, docs/naming.md): your annotation names → phases, your "
                             "communication kernels → kinds; 'none' turns the built-in Megatron/DeepSpeed/DualPipe/"
                             "DeepEP rules off (default: run.json's \"names\", else the built-ins)")


def positive_int(text: str) -> int:
    """argparse type of a count that must be at least 1 (``--workers``, ``--count``): 0 or -1 is refused (exit 2)
    instead of quietly meaning something else."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value}")
    return value


def seconds(*, above_zero: bool):
    """argparse type of a duration in seconds: finite, and above 0 (``above_zero``) or at least 0; a negative, NaN
    or infinite value is refused (exit 2) instead of failing later or waiting forever."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
            raise argparse.ArgumentTypeError(f"expected seconds {'above' if above_zero else 'of at least'} 0, "
                                             f"got {text}")
        return value

    return parse


def reading(parser, *, quiet_help: str = "no progress display") -> None:
    """How a run is read: ``--workers N``, ``--no-cache``, ``--quiet``."""
    parser.add_argument("--workers", type=positive_int, default=None, metavar="N",
                        help="parallel trace parsers (default: automatic)")
    parser.add_argument("--no-cache", action="store_true",
                        help="do not read or write the run's .traceana/ cache")
    parser.add_argument("--quiet", action="store_true", help=quiet_help)


# --- the training configuration collect and estimate share: one definition and one default each ------------------
# Where the two commands' defaults differed (pp 4 / 1, micro-batches 8 / --pp, micro-batch size 2 / 1, attention
# naive / sdpa) one was picked, and its help says why. The Python API's dataclasses (collectors' CollectConfig,
# the model's TrainingConfig) keep their own field defaults.
PP = 4
MICROBATCHES_PER_STAGE = 2
MICROBATCH_SIZE = 1
ATTENTION = "sdpa"


def pp(parser) -> None:
    """``--pp N``, pipeline stages."""
    parser.add_argument("--pp", type=int, default=PP, metavar="N",
                        help="pipeline stages, one per rank with gpipe and 1f1b; with the multi-stage schedules "
                             "collect runs --pp stages two per rank, estimate --pp devices of --virtual-stages each "
                             f"(default: {PP}, the smallest pipeline with inner stages and two BPipe pairs)")


def dp(parser) -> None:
    """``--dp N``, data-parallel replicas of the pipeline."""
    parser.add_argument("--dp", type=int, default=1, metavar="N",
                        help="data-parallel replicas of the pipeline (pp × dp ranks; rank = stage · dp + replica)")


def microbatches(parser, *, default: int | None = None, help: str | None = None) -> None:
    """``--microbatches N``; ``--num-microbatches`` is an old spelling, kept hidden. Unset, ``microbatch_count``
    gives the shared default."""
    parser.add_argument("--microbatches", "--num-microbatches", dest="microbatches", type=int, default=default,
                        metavar="N", help=help or (
                            f"micro-batches per pipeline per step (default: {MICROBATCHES_PER_STAGE} × --pp: more "
                            "micro-batches than stages, so that 1F1B has a steady state between warm-up and "
                            "cool-down)"))


def microbatch_count(args: argparse.Namespace) -> int:
    """``--microbatches`` as given, else its default: MICROBATCHES_PER_STAGE × ``--pp``."""
    return args.microbatches if args.microbatches is not None else MICROBATCHES_PER_STAGE * args.pp


def microbatch_size(parser) -> None:
    """``--microbatch-size N``, sequences per micro-batch."""
    parser.add_argument("--microbatch-size", type=int, default=MICROBATCH_SIZE, metavar="N",
                        help="sequences per micro-batch (default: 1, the smallest; a larger one is what BPipe's "
                             "memory balance is for)")


def schedule(parser) -> None:
    """``--schedule NAME``: every schedule run.json names (docs/schedules.md)."""
    from traceana.core.schedule_names import SCHEDULES  # (not run.json's "unknown")

    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                        help="pipeline schedule (docs/schedules.md); collect runs the multi-stage ones with "
                             "torch.distributed.pipelining")


def attention(parser) -> None:
    """``--attention``: naive or sdpa."""
    from traceana.core.manifest import ATTENTIONS  # (cost: run.json's schema only for the parsers that offer it)

    parser.add_argument("--attention", default=ATTENTION, choices=ATTENTIONS,
                        help="naive keeps the s×s attention scores for the backward, sdpa (flash-style) does not "
                             f"(default: {ATTENTION}, what training runs today)")


def recompute(parser) -> None:
    """``--recompute``: activation recomputation."""
    from traceana.core.manifest import RECOMPUTES  # (cost: run.json's schema only for the parsers that offer it)

    parser.add_argument("--recompute", default="none", choices=RECOMPUTES, help="activation recomputation")


def bpipe(parser) -> None:
    """``--bpipe``: BPipe's activation balancing."""
    parser.add_argument("--bpipe", action="store_true",
                        help="BPipe (Kim et al. 2023): pair stage s with stage p−1−s; the evictor sends saved "
                             "activations to its partner and loads them back before the backward")
