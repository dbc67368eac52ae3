"""One memory model: `estimate --from-run` and `validate` give the same per-stage activation peak for a collected run,
both within 10 % of the measured one, and BPipe lowers the largest stage's measured peak (tiny runs, pp=4, m=8)."""

from __future__ import annotations

import json

import pytest

from traceana.cli import main

RUNS = ("1f1b_m8", "1f1b_m8_bpipe")


def _estimate(run_dir, capsys) -> list[float]:
    assert main(["estimate", "--from-run", str(run_dir), "--json"]) == 0
    return [s["activation_peak_bytes"] for s in json.loads(capsys.readouterr().out)["stages"]]


def _validate(run_dir, capsys) -> tuple[list[float], list[float]]:
    assert main(["validate", str(run_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["per_stage"]
    return [r["estimated_activation_bytes"] for r in rows], [r["measured_activation_bytes"] for r in rows]


@pytest.mark.parametrize("name", RUNS)
def test_estimate_from_run_equals_validate_and_both_are_within_10_percent_of_measured(name, collected_run, capsys):
    run_dir = collected_run(name)
    est = _estimate(run_dir, capsys)
    val, measured = _validate(run_dir, capsys)
    assert est == pytest.approx(val, rel=1e-9)
    for stage, (e, m) in enumerate(zip(est, measured)):
        assert abs(e - m) <= 0.10 * m, f"stage {stage}: estimated {e / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB"


def test_bpipe_lowers_the_largest_stages_measured_peak(collected_run, capsys):
    # 1F1B, p = 4, m = 8: stage 0 holds 4 micro-batches, BPipe keeps 3 (the pair's ceil((4 + 1) / 2)); its acceptor
    # holds at most 3 (1 own + 2 accepted) and stage 1 holds 3 of the same size: the largest stage's activations fall
    # from 4 micro-batches' to 3 (plus the same working memory): about 20 %, at least 15 %.
    _, plain = _validate(collected_run("1f1b_m8"), capsys)
    _, bpipe = _validate(collected_run("1f1b_m8_bpipe"), capsys)
    assert max(bpipe) <= 0.85 * max(plain), (plain, bpipe)


def test_the_demo_headline_gives_both_peaks_and_the_change():
    from reports.demo_command import bpipe_headline

    # measured at pp=4, m=8 (docs/model.md): 5.40 MiB without BPipe, 4.26 with; 4.26 / 5.40 − 1 = −0.211
    assert bpipe_headline(5.40, 4.26) == ("BPipe: largest stage's activation peak 5.40 MiB without, 4.26 MiB with "
                                          "(-21%)")
    assert bpipe_headline(None, 4.26) is None
