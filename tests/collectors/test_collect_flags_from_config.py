"""``traceana collect``'s flags are generated from CollectConfig's fields, its known-workload group from run.json's
Workload's (issue 34, item 3): a flag is its field's name, its help the field's description; today's spellings keep
working. Expected values written by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from collectors.command import config_flags, config_from_args, workload_flags
from collectors.trainer.config import CollectConfig, flag_of
from traceana.cli import build_parser
from traceana.core.errors import ConfigError
from traceana.core.manifest import Workload


def _collect_parser() -> argparse.ArgumentParser:
    parser = build_parser(["collect"])
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["collect"]


def _config(*argv: str) -> CollectConfig:
    return config_from_args(build_parser(["collect"]).parse_args(["collect", *argv, "-o", "x"]))


def test_the_flags_in_the_help_are_the_fields_in_order():
    shown = [a.option_strings[0] if a.option_strings[0].startswith("--") else a.option_strings[1]
             for a in _collect_parser()._actions if a.option_strings and a.help != argparse.SUPPRESS]
    # the training configuration (the fields), then the known workload's group and the output
    assert shown[1:15] == ["--model", "--pp", "--layers-per-stage", "--dp", "--microbatches", "--microbatch-size", "--schedule", "--bpipe",
                           "--bpipe-inflight", "--attention", "--recompute", "--profile-steps", "--warmup-steps",
                           "--seed"]
    assert [f.name for f, _ in config_flags()] == ["preset", "pp", "layers_per_stage", "dp", "num_microbatches",
                                                   "microbatch_size",
                                                   "schedule", "bpipe", "bpipe_inflight", "attention", "recompute",
                                                   "steps", "warmup_steps", "seed"]


@pytest.mark.parametrize(("argv", "field", "value"), [
    (("--preset", "tiny-llama"), "preset", "tiny-llama"),  # the field's own name (an old spelling, hidden)
    (("--model", "tiny-llama"), "preset", "tiny-llama"),
    (("--steps", "3"), "steps", 3),  # the field's own name
    (("--profile-steps", "3"), "steps", 3),
    (("--warmup-steps", "0"), "warmup_steps", 0),
    (("--seed", "7"), "seed", 7),
    (("--pp", "2", "--microbatches", "3"), "num_microbatches", 3),
    (("--pp", "2", "--num-microbatches", "3"), "num_microbatches", 3),  # run.json's name, an old spelling
    (("--microbatch-size", "3"), "microbatch_size", 3),
    (("--schedule", "gpipe"), "schedule", "gpipe"),
    (("--attention", "naive"), "attention", "naive"),
    (("--recompute", "full"), "recompute", "full"),
    (("--dp", "2", "--pp", "2"), "dp", 2),
    (("--bpipe", "--bpipe-inflight", "2"), "bpipe_inflight", 2),
    (("--layers-per-stage", "3,2,2,1"), "layers_per_stage", (3, 2, 2, 1)),
])
def test_each_flag_sets_its_field(argv, field, value):
    assert getattr(_config(*argv), field) == value


def test_every_flag_field_has_a_flag_named_after_it_and_words():
    actions = {o: a for a in _collect_parser()._actions for o in a.option_strings}
    for f, flag in config_flags():
        own = "--" + f.name.replace("_", "-")
        assert own in actions, f"CollectConfig.{f.name} has no flag {own}"
        assert actions[own].help, f"{own} has no help"
        assert flag.shared or flag.help, f"CollectConfig.{f.name}'s flag has no words of its own or shared"


def test_at_the_command_lines_defaults():
    # the shared defaults (options.py: micro-batch size 1, sdpa, 2 × --pp micro-batches) and the fields' own
    c = _config()
    assert (c.preset, c.pp, c.dp, c.num_microbatches, c.microbatch_size, c.schedule, c.bpipe, c.bpipe_inflight,
            c.attention, c.recompute, c.steps, c.warmup_steps, c.seed, c.layers_per_stage) == (
        "tiny-gpt", 4, 1, 8, 1, "1f1b", False, None, "sdpa", "none", 2, 1, 1234, None)
    assert {f.name for f in dataclasses.fields(CollectConfig)} - {f.name for f, _ in config_flags()} == {
        "lr", "profile", "batch_p2p", "slow_rank", "workload"}  # (workload: the --work group builds it)


def test_a_refusal_names_the_flag_as_the_help_shows_it():
    assert flag_of("steps") == "--profile-steps" and flag_of("microbatch_size") == "--microbatch-size"
    with pytest.raises(ConfigError, match="--profile-steps must be at least 1"):
        CollectConfig(steps=0)


def test_the_known_workload_group_is_workloads_fields():
    # the group's flags, in the help's order, written by hand; each made from a field of run.json's Workload
    group = next(g for g in _collect_parser()._action_groups if g.title == "known workload")
    assert [a.option_strings for a in group._group_actions] == [
        ["--work"], ["--forward-ms"], ["--backward-ms"], ["--weight-ms"], ["--slow-stage"], ["--slow-rank"],
        ["--slow-layer"], ["--layer-holds"]]
    assert [f.name for f, _ in workload_flags()] == ["kind", "forward_ms", "backward_ms", "weight_ms", "slow_stages",
                                                     "slow_ranks", "slow_layers", "layer_holds"]
    c = _config("--pp", "2", "--work", "sleep", "--forward-ms", "2", "--backward-ms", "3", "--weight-ms", "1",
                "--slow-stage", "1:2", "--slow-stage", "0:1.5", "--slow-rank", "0:3")
    assert c.workload == Workload(kind="sleep", forward_ms=2.0, backward_ms=3.0, weight_ms=1.0,
                                  slow_stages=((1, 2.0), (0, 1.5)), slow_ranks=((0, 3.0),))
    assert _config().workload is None  # --work compute (the default): no workload
    per_layer = _config("--work", "sleep", "--forward-ms", "2", "--backward-ms", "3", "--layer-holds", "per-layer")
    assert per_layer.workload.layer_holds == "per-layer"
    with pytest.raises(ConfigError, match="--forward-ms describes the known workload"):
        _config("--forward-ms", "2")
    # (the fields' own names are no flags here)
    for own in ("--kind", "--slow-stages", "--slow-ranks", "--slow-layers"):
        with pytest.raises(SystemExit):
            build_parser(["collect"]).parse_args(["collect", own, "1:2", "-o", "x"])
