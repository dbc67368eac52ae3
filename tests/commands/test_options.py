"""The training configuration collect and estimate share is one definition with one default per flag
(traceana/commands/options.py), and ``--steps``'s two meanings have two names, the old spelling still accepted."""

from __future__ import annotations

import argparse

import pytest

from traceana.cli import build_parser

SHARED = ("--pp", "--dp", "--microbatches", "--microbatch-size", "--schedule", "--attention", "--recompute", "--bpipe")


def _actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {o: a for a in sub._actions for o in a.option_strings}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_collect_and_estimate_share_each_training_flag_with_one_default_and_help():
    collect, estimate = _actions("collect"), _actions("estimate")
    for flag in SHARED:
        a, b = collect[flag], estimate[flag]
        assert (a.default, a.help, a.choices, a.type, a.dest) == (b.default, b.help, b.choices, b.type, b.dest), flag
    # the defaults picked where they differed (pp 4 / 1, micro-batch size 2 / 1, attention naive / sdpa)
    ns = _parse("estimate", "--model", "tiny-gpt")
    assert (ns.pp, ns.microbatch_size, ns.attention, ns.microbatches) == (4, 1, "sdpa", None)


def test_the_default_microbatch_count_is_twice_the_stages_in_both():
    from collectors.command import config_from_args
    from traceana.commands.estimate import build

    collect = config_from_args(_parse("collect", "--pp", "2", "-o", "x"))
    estimate = build(_parse("estimate", "--model", "tiny-gpt", "--pp", "2"))[0]
    assert collect.num_microbatches == estimate.num_microbatches == 4  # 2 × --pp
    at_default = config_from_args(_parse("collect", "-o", "x"))
    assert (at_default.pp, at_default.num_microbatches) == (4, 8)  # collect's run at its defaults is as before


@pytest.mark.parametrize("flag", ["--profile-steps", "--steps"])
def test_collect_counts_its_profiled_steps(flag):
    assert _parse("collect", flag, "3", "-o", "x").steps == 3


@pytest.mark.parametrize("flag", ["--window", "--steps"])
def test_attach_takes_a_window_of_step_numbers(flag):
    from collectors.attach.command import parse_windows

    ns = _parse("attach", "-o", "x", flag, "4:6", "--warmup-steps", "2", "--", "python", "train.py")
    assert parse_windows(ns.window) == ((4, 6),) and ns.warmup == 2
    assert _parse("attach", "-o", "x", "--warmup", "3", "--", "python", "t.py").warmup == 3  # the old spelling


def test_old_spellings_are_not_in_the_help():
    for command in ("collect", "attach"):
        sub = next(a for a in build_parser([command])._actions if isinstance(a, argparse._SubParsersAction))
        help_ = sub.choices[command].format_help()
        assert "--steps" not in help_.replace("--profile-steps", "").replace("--warmup-steps", "")
