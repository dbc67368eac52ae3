"""The command line's vocabulary and its printing: the same flag for the same concept in every command, a default in
every option's help, a command's own usage on its errors, and tables that keep every figure whole at 80 columns and
when piped (split into several tables rather than cut with "…")."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tracebuilder import TraceBuilder, write_two_stage_run

from traceana.cli import build_parser, main
from traceana.core.tables import plural, split_columns, table_width

READ_RUN = ("analyze", "validate", "report", "merge")  # the commands that read a run


def _cli(*argv: str, columns: int = 80) -> subprocess.CompletedProcess:
    """``traceana ARGV`` in a child process with stdout a pipe (not a terminal), COLUMNS as given."""
    env = {**os.environ, "COLUMNS": str(columns)}
    env.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "traceana", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120)


def _whole(text: str, width: int = 80) -> None:
    assert "…" not in text, text
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, too_wide


@pytest.fixture
def two_stage(tmp_path) -> Path:
    (tmp_path / "two").mkdir()
    return write_two_stage_run(tmp_path / "two")


@pytest.fixture
def with_unknown_stage(tmp_path) -> Path:
    """Ranks 0 and 1: the annotated two-stage step of tracebuilder.write_two_stage_run (µs); rank 2 has neither
    annotations nor P2P, so its stage cannot be determined."""
    run = tmp_path / "three"
    run.mkdir()
    r0 = TraceBuilder(rank=0, world_size=3, pid=10, tid=10)
    r0.step(5, 0, 100)
    r0.annotation("PP:0F0", 0, 20)
    r0.cpu_op("aten::mm", 2, 16)
    r0.send(peer=1, ts=20, dur=5)
    r0.recv(peer=1, ts=30, dur=40)
    r0.annotation("PP:0B0", 70, 20)
    r0.cpu_op("autograd::engine::evaluate_function: MmBackward0", 72, 16)
    r1 = TraceBuilder(rank=1, world_size=3, pid=11, tid=11)
    r1.step(5, 0, 100)
    r1.recv(peer=0, ts=5, dur=21)
    r1.annotation("PP:1F0", 26, 14)
    r1.cpu_op("aten::mm", 27, 12)
    r1.annotation("PP:1B0", 40, 20)
    r1.cpu_op("autograd::engine::evaluate_function: MmBackward0", 41, 18)
    r1.send(peer=0, ts=60, dur=5)
    r2 = TraceBuilder(rank=2, world_size=3, pid=12, tid=12)
    r2.step(5, 0, 100)
    r2.cpu_op("aten::mm", 10, 50)
    for r, tb in enumerate((r0, r1, r2)):
        tb.write(run / f"rank{r}.pt.trace.json.gz")
    return run


@pytest.fixture
def four_stage(tmp_path, monkeypatch) -> Path:
    """A 1F1B pipeline of 8 stages × 8 micro-batches written as Kineto traces with a run.json (the simulator's own
    timeline, see tests/validation/test_validate_roundtrip.py): wide enough that no table fits 80 columns in one
    piece."""
    import test_validate_roundtrip as rt

    from traceana.core.manifest import Manifest
    from traceana.model.simulate import StageTimes

    pp, m = 8, 8
    times = StageTimes.uniform(pp, forward=1234.5 * rt.US, backward=2345.6 * rt.US, optimizer=345.6 * rt.US)
    writer = rt.KinetoWriter(pp)
    monkeypatch.setattr(rt, "EventsBuilder", lambda: writer)
    rt.pipeline_events("1f1b", pp=pp, m=m, times=times)
    run = tmp_path / "four"
    run.mkdir()
    for r, tb in writer.tb.items():
        tb.write(run / f"rank{r}.pt.trace.json.gz")
    manifest = Manifest(world_size=pp, pp=pp, stage_of_rank=tuple(range(pp)), schedule="1f1b", microbatch_size=1,
                        num_microbatches=m, model=dataclasses.replace(rt.TINY, layers=pp), dtype="float32", attention="sdpa", recompute="none",
                        extra={"nnodes": 1})
    (run / "run.json").write_text(manifest.to_json())
    return run


# --- tables at 80 columns, piped -----------------------------------------------------------------------------
def test_split_columns_fits_the_width_and_repeats_the_keys():
    widths = [14] + [13] * 8  # a label column and 8 stages of "12,345.67 (8%)"-like cells
    parts = split_columns(widths, keys=1, width=80)
    assert all(p[0] == 0 for p in parts)
    assert sorted(i for p in parts for i in p[1:]) == list(range(1, 9))
    assert all(table_width([widths[i] for i in p]) <= 80 for p in parts)
    # 16 + 4·15 + 6 = 82 > 80, so at most 3 stages beside the label: 8 stages need 3 parts, sized 3, 3, 2
    assert [len(p) - 1 for p in parts] == [3, 3, 2]
    assert split_columns([100, 5], keys=1, width=80) == [[0, 1]]  # too wide anyway: one part, folded, not cut


def test_analyze_tables_keep_every_figure_at_80_columns_piped(four_stage):
    data = json.loads(_cli("analyze", str(four_stage), "--json", "--per-step", "--no-cache").stdout)
    res = _cli("analyze", str(four_stage), "--per-step", "--no-cache")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    _whole(text)
    assert text.count("Where each stage's step time goes") >= 2  # 8 stages do not fit beside the labels at 80
    cells = set(re.findall(r"[\d,.]+(?: \(\d+%\))?", text))
    for s in data["stages"]:
        assert f"{s['step_ms']:,.2f}" in cells
        for k, v in s.items():
            if k.endswith("_ms") and k != "step_ms" and v:
                pct = 100 * s[k.removesuffix("_ms") + "_fraction"]
                assert f"{v:,.2f} ({pct:.0f}%)" in cells, k
    for r in data["per_step"]:
        assert f"{r['step_ms']:,.3f}" in cells
    assert "1 (stage" not in text


def test_two_stage_figures_by_hand_at_80_columns(two_stage):
    res = _cli("analyze", str(two_stage), "--per-step", "--no-cache")
    _whole(res.stdout)
    # rank 1 posts its recv at 5 µs (the post call lasts until 10: time in a P2P call) and stage 0 sends at 20:
    # 0.010 ms of warm-up in a 100 µs step
    assert "0.010" in res.stdout and "0.01 (10%)" in res.stdout and "0.10" in res.stdout


def test_validate_and_estimate_keep_every_figure_at_80_columns_piped(four_stage):
    res = _cli("validate", str(four_stage), "--no-cache")
    assert res.returncode == 0, res.stderr
    _whole(res.stdout)
    data = json.loads(_cli("validate", str(four_stage), "--json", "--no-cache").stdout)
    cells = set(re.findall(r"[+\-]?[\d,.]+%?", res.stdout))
    for r in data["per_stage"]:
        assert f"{r['measured_step_ms']:,.1f}" in cells and f"{r['measured_blocked_ms']:,.1f}" in cells
    assert "MiB" in res.stdout and " MB" not in res.stdout
    words = " ".join(res.stdout.split())  # sentences wrap where the path's length puts them
    assert "8 micro-batches" in words and "(2 steps measured)" in words

    argv = ("estimate", "--model", "llama-65b", "--tp", "8", "--pp", "8", "--microbatches", "16")
    res = _cli(*argv)
    assert res.returncode == 0, res.stderr
    _whole(res.stdout)
    data = json.loads(_cli(*argv, "--json").stdout)
    for s in data["stages"]:
        assert f"{s['total_bytes'] / 2**20:,.2f}" in res.stdout
    table = res.stdout[res.stdout.index("Memory per stage"):res.stdout.index("fits:")]
    assert "MiB" in table and "GiB" not in table


def test_per_step_columns_and_unknown_stage(with_unknown_stage):
    text = _cli("analyze", str(with_unknown_stage), "--per-step", "--no-cache").stdout
    _whole(text)
    per_step = text[text.index("Per step (ms)"):]
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in per_step.splitlines() if line.startswith("│")]
    # stage, rank, step: the rank under "rank", an unknown stage as "–" (never the rank number under "stage")
    assert ["0", "0", "5"] == rows[0][:3] and ["1", "1", "5"] == rows[1][:3] and ["–", "2", "5"] == rows[2][:3]
    stages = text[text.index("Where each stage's"):text.index("Per step")]
    assert "stage –" in stages and "stage 2" not in stages
    warmup = next(line for line in stages.splitlines() if "bubble: warm-up" in line)
    assert warmup.rstrip("│ ").endswith("–")  # rank 2 has no schedule: its bubble is unknown, not 0
    assert "no allocator samples ([memory] events)" in " ".join(text.split())  # not eaten as rich markup
    assert "stage of rank 2 could not be determined" in " ".join(text.split())


def test_notes_are_not_read_as_markup(capsys):
    from rich.console import Console

    from traceana.core.tables import print_line

    console = Console(width=200)
    print_line(console, "no allocator samples ([memory] events): profile", prefix="[yellow]note:[/] ")
    assert capsys.readouterr().out.strip() == "note: no allocator samples ([memory] events): profile"


def test_plurals():
    assert plural(1, "rank") == "1 rank" and plural(2, "rank") == "2 ranks" and plural(0, "file") == "0 files"
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert plural(1200, "event") == "1,200 events"


def test_merge_says_how_many_ranks(two_stage, tmp_path):
    res = _cli("merge", str(two_stage), "-o", str(tmp_path / "m.json.gz"), "--no-cache")
    assert res.returncode == 0 and "(2 ranks)" in res.stderr


# --- JSON: every share is a fraction and says so --------------------------------------------------------------
def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_json_shares_are_fractions(two_stage, four_stage, capsys):
    assert main(["analyze", str(two_stage), "--json", "--per-step", "--no-cache"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = _keys(out)
    assert not {k for k in keys if k.endswith("_pct")} and "mfu" not in keys and "mfu_fraction" in keys
    # rank 1: 10 µs of warm-up in a 100 µs step (see test_two_stage_figures_by_hand_at_80_columns)
    assert out["stages"][1]["bubble_warmup_fraction"] == pytest.approx(0.10)
    assert main(["validate", str(four_stage), "--json", "--no-cache"]) == 0
    keys = _keys(json.loads(capsys.readouterr().out))
    assert "step_error_fraction" in keys and not keys & {"step_error", "blocked_error", "memory_error"}
    assert main(["estimate", "--model", "tiny-gpt", "--pp", "2", "--json"]) == 0
    keys = _keys(json.loads(capsys.readouterr().out))
    assert {"mfu_fraction", "efficiency_fraction"} <= keys and not keys & {"mfu", "efficiency"}


# --- one vocabulary -------------------------------------------------------------------------------------------
def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", READ_RUN)
def test_every_command_that_reads_a_run_takes_workers_cache_quiet(command):
    runs = ["a", "b"] if command == "report" else ["a"]
    ns = _parse(command, *runs, "--workers", "2", "--no-cache", "--quiet")
    assert (ns.workers, ns.no_cache, ns.quiet) == (2, True, True)


@pytest.mark.parametrize("command", ["merge", "report", "collect", "demo", "attach"])
def test_every_command_that_writes_takes_o_output(command):
    before = ["a"] if command in ("merge", "report") else []
    assert str(_parse(command, *before, "-o", "x").output) == "x"
    assert str(_parse(command, *before, "--output", "y").output) == "y"


@pytest.mark.parametrize("command", ["analyze", "validate", "report", "estimate"])
def test_peak_flops_is_flop_per_second_everywhere(command):
    before = ["a"] if command != "estimate" else []
    assert _parse(command, *before, "--peak-flops", "312e12").peak_flops == 312e12
    assert _parse(command, *before, "--peak-tflops", "312").peak_flops == pytest.approx(312e12)  # old spelling


def test_old_spellings_are_accepted_and_hidden():
    ns = _parse("collect", "--preset", "tiny-llama", "--out", "r", "--microbatches", "3")
    assert (ns.model, str(ns.output), ns.microbatches) == ("tiny-llama", "r", 3)
    ns = _parse("estimate", "--model", "tiny-gpt", "--num-microbatches", "6")
    assert (ns.model, ns.microbatches) == ("tiny-gpt", 6)
    assert str(_parse("demo", "--out", "d").output) == "d"
    for name in ("collect", "estimate", "demo", "analyze", "report", "validate", "merge"):
        text = _command(name).format_help()
        for old in ("--preset", "--num-microbatches", "--peak-tflops", "--out "):
            assert old not in text, (name, old)


@pytest.mark.parametrize("name", ["demo", "collect", "analyze", "merge", "report", "estimate", "validate", "watch"])
def test_every_option_has_help_and_a_default(name):
    p = _command(name)
    formatter = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        assert text.strip() and ("(default" in text or "(required)" in text), (name, action.option_strings, text)


# --- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["analyze", "--bogus", "x"], "unrecognized arguments: --bogus"),
    (["analyze"], "the following arguments are required: RUN_DIR"),
    (["estimate", "--pp", "two"], "argument --pp: invalid int value"),
    (["validate", "x", "--workers"], "argument --workers: expected one argument"),
])
def test_errors_show_the_command_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: traceana {argv[0]} ") and f"traceana {argv[0]}: error: {says}" in err


def test_our_own_bad_input_stays_one_line(two_stage, capsys):
    assert main(["analyze", str(two_stage), "--peak-flops", "-1", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--peak-flops must be" in err and "usage" not in err
    assert main(["estimate", "--model", "tiny-gpt", "--peak-flops", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--peak-flops must be" in err


def test_exit_handlers_are_skipped_only_when_they_have_nothing_to_do():
    """The program skips the interpreter's teardown (docs/performance.md) only when no exit handler has work: a live
    child process (multiprocessing reaps it at exit) or an imported torch/Dask keeps the normal exit."""
    code = ("import multiprocessing as mp, sys, time\n"
            "from traceana.cli import _nothing_to_tear_down as quick\n"
            "before = quick()\n"
            "p = mp.get_context('fork').Process(target=time.sleep, args=(5,)); p.start()\n"
            "during = quick(); p.terminate(); p.join()\n"
            "sys.modules['torch'] = sys\n"
            "print(before, during, quick())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr


@pytest.mark.skipif(f"{sys.version_info[0]}.{sys.version_info[1]}" != "3.11",
                    reason="docs/commands.md is laid out by Python 3.11's argparse")
def test_command_reference_is_the_help_each_command_prints():
    """docs/commands.md is every command's --help; an option added, renamed or reworded without rewriting it fails
    here (rewrite: python -m traceana.reference > docs/commands.md)."""
    from traceana.commands.options import HIDDEN_ALIASES
    from traceana.reference import reference

    page = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text(encoding="utf-8")
    assert page == reference(), "docs/commands.md is out of date: python -m traceana.reference > docs/commands.md"
    # Every option of every command is in it, by the spelling its help shows.
    parser = build_parser(None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.help is argparse.SUPPRESS:  # an old spelling kept hidden (--peak-tflops)
                continue
            for option in set(action.option_strings) - HIDDEN_ALIASES:
                assert f" {option}" in page, f"traceana {name} {option} is not in docs/commands.md"
