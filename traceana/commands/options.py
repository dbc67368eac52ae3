"""The command line's vocabulary: one flag per concept, defined once and used by every command that needs it.

``-o/--output`` is where a command writes, ``--model`` a model preset, ``--microbatches`` micro-batches per step,
``--peak-flops`` the device's peak in FLOP/s, and ``--workers/--no-cache/--quiet`` how a run is read. Older spellings
stay accepted but hidden from the help (``--num-microbatches``, ``--preset``, ``--out``, ``--peak-tflops``).
Imports nothing but argparse (and math): building the help must stay cheap.
"""

from __future__ import annotations

import argparse
import copy
import math
import textwrap


# Old spellings: accepted as aliases of the same option, not shown in the help.
HIDDEN_ALIASES = frozenset({"--out", "--preset", "--num-microbatches"})


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
    """``--model PRESET``; ``--preset`` is an old spelling, kept hidden."""
    parser.add_argument("--model", "--preset", dest="model", default=default, metavar="PRESET",
                        help=f"{help}: {', '.join(presets)}" + ("" if default else " (default: none)"))


def microbatches(parser, *, default: int | None, help: str = "micro-batches per pipeline per step") -> None:
    """``--microbatches N``; ``--num-microbatches`` is an old spelling, kept hidden."""
    parser.add_argument("--microbatches", "--num-microbatches", dest="microbatches", type=int, default=default,
                        metavar="N", help=help)


class _TeraFlops(argparse.Action):
    """``--peak-tflops X`` (old spelling) stores X·10¹² in ``peak_flops``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values * 1e12)


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
