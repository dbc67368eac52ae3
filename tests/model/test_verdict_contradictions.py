"""`traceana estimate` says one thing in every place (issue 27): the as-configured verdict's sentence and its JSON
agree, a configuration that does not fit is flagged on the line giving its time, every schedule gets a verdict or a
line saying why not, and MFU/HFU are the published formulas (computed by hand here)."""

from __future__ import annotations

import json

import pytest

from traceana.cli import main

GPT3_NAIVE = ["estimate", "--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--microbatches", "64",
              "--attention", "naive"]


def run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_as_configured_sentence_and_json_agree_when_bpipe_makes_it_fit(capsys):
    # as given (b = 1, no recompute) stage 0 needs 93.8 GiB. With 46 GiB usable only full recompute comes near, and
    # it fits only with BPipe (45.4 GiB, 47.1 without): BPipe helps, and both the sentence and the JSON say so.
    argv = [*GPT3_NAIVE, "--bpipe-baseline", "as-configured", "--reserve-gib", "34", "--bpipe-gbps", "300"]
    b = json.loads(run([*argv, "--json"], capsys))["bpipe"]
    assert b["helps"] is True and b["fits_without_bpipe"] is False and b["verdict"] == "helps"
    assert b["with_bpipe"] == "b=1, m=64, full recompute, BPipe"
    assert b["sentence"].startswith("BPipe helps: without it") and "does not fit" in b["sentence"]
    assert "BPipe helps: without it" in " ".join(run(argv, capsys).split())
    # with 75 GiB usable the fastest BPipe configuration (selective recompute) fits without BPipe too: BPipe is not
    # what makes the run fit, and neither the sentence nor the JSON says it helps
    argv = [*GPT3_NAIVE, "--bpipe-baseline", "as-configured", "--reserve-gib", "5", "--bpipe-gbps", "300"]
    b = json.loads(run([*argv, "--json"], capsys))["bpipe"]
    assert b["helps"] is False and b["verdict"] == "does not help" and b["fits_without_bpipe"] is False
    assert b["sentence"].startswith("BPipe does not help") and "fits without it too" in b["sentence"]


def test_margin_and_flips_are_in_the_json(capsys):
    b = json.loads(run([*GPT3_NAIVE, "--bpipe-baseline", "full-recompute", "--bpipe-gbps", "300", "--json"],
                       capsys))["bpipe"]
    assert b["margin_bytes"] < 0 and b["deciding_configuration"] == "b=1, m=64, BPipe"
    assert set(b["flips"]) == {"reserve_bytes", "bpipe_bytes_per_s", "efficiency_fraction",
                               "efficiency_microbatch_size"}
    assert 5 * 2**30 < b["flips"]["reserve_bytes"] < 6 * 2**30
    assert b["margin"].startswith("Margin: the deciding configuration")


def test_a_configuration_that_does_not_fit_is_flagged_on_its_time_line(capsys):
    out = run([*GPT3_NAIVE, "--no-verdict"], capsys)
    line = next(x for x in out.splitlines() if "step time" in x)
    assert line.startswith("does NOT fit in memory")
    fits = run(["estimate", "--model", "llama-65b", "--tp", "8", "--pp", "4", "--microbatches", "32", "--no-verdict"],
               capsys)
    assert "does NOT fit" not in fits


@pytest.mark.parametrize("schedule", ["zbv", "gpipe", "interleaved-1f1b"])
def test_every_schedule_gets_a_verdict_or_a_line_saying_why_not(schedule, capsys):
    argv = ["estimate", "--model", "llama-65b", "--tp", "8", "--pp", "4", "--microbatches", "32",
            "--schedule", schedule]
    b = json.loads(run([*argv, "--json"], capsys))["bpipe"]
    assert b["verdict"] is None and schedule in b["why_none"].lower() and "--schedule 1f1b" in b["why_none"]
    assert "BPipe verdict: none — " in run(argv, capsys)


def test_mfu_and_hfu_are_megatrons_published_formulas(capsys):
    # Narayanan et al. 2021 eq. (3): 72·B·s·l·h²·(1 + s/6h + V/12lh) model FLOPs per iteration, and with full
    # recompute 96·B·s·l·h²·(1 + s/6h + V/16lh) hardware FLOPs; MFU/HFU = FLOPs / (step · peak · devices).
    B, s, l, h, V = 64, 2048, 96, 12288, 50257
    out = json.loads(run([*GPT3_NAIVE, "--recompute", "full", "--no-verdict", "--json"], capsys))
    st = out["step"]
    devices, peak = 8 * 8, 312e12
    model = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    hardware = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert st["mfu_fraction"] == pytest.approx(model / (st["seconds"] * peak * devices), rel=1e-9)
    assert st["hfu_fraction"] == pytest.approx(hardware / (st["seconds"] * peak * devices), rel=1e-9)
    assert "recompute not counted" in st["mfu_counts"] and "recompute counted" in st["hfu_counts"]
    text = run([*GPT3_NAIVE, "--recompute", "full", "--no-verdict"], capsys)
    assert "HFU" in text and "recompute not counted" in text
    plain = json.loads(run([*GPT3_NAIVE, "--no-verdict", "--json"], capsys))["step"]
    assert plain["hfu_fraction"] is None  # without recompute HFU is MFU: not shown twice
