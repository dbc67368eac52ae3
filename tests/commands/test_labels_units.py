"""Issue 36 item 5: one unit per kind in JSON (memory in bytes, as the README says), step labels that read as labels,
a rank's every stage in its label, and a sample of the ranks said as a note, not a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from traceana.cli import main
from traceana.core.tables import stage_label
from traceana.measure.summary import steps_label

DATA = Path(__file__).parents[1] / "data"


def test_step_labels_name_steps():
    assert steps_label([2]) == "step #2"  # (was "over steps 2": read as two steps)
    assert steps_label([2, 3]) == "steps #2, #3"
    assert steps_label([1, 2, 3, 4]) == "steps #1–#4"
    assert steps_label([1, 3, 7]) == "steps #1, #3, #7"
    assert steps_label([]) == "no step"


def test_a_ranks_every_stage_is_in_its_label():
    assert stage_label(0, "0,3") == "stages 0+3"  # a zbv rank (was "stage 0")
    assert stage_label(1, "1") == stage_label(1) == "stage 1"
    assert stage_label(None) == "stage –"


def test_summary_json_gives_memory_in_bytes_and_the_headline_names_its_step(capsys):
    run = DATA / "pipelining_memory" / "gpipe_m2"
    assert main(["analyze", str(run), "--no-cache", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)

    def keys(x):
        if isinstance(x, dict):
            for k, v in x.items():
                yield k
                yield from keys(v)
        elif isinstance(x, list):
            for v in x:
                yield from keys(v)
    assert not [k for k in keys(d) if k.endswith("_mib")]
    s = d["summary"]
    by_rank = {r["stage"]: r for r in d["stages"]}
    for row in s["per_stage"]:  # the per-stage bytes are the per-rank table's (one rank a stage here)
        assert row["activation_peak_bytes"] == by_rank[row["stage"]]["activation_peak_bytes"]
    assert max(r["activation_peak_bytes"] for r in s["per_stage"]) == s["largest_activation_peak_bytes"]
    assert main(["analyze", str(run), "--no-cache"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"over step #{s['measured_steps'][0]}" in out or "over steps #" in out


def test_a_sample_of_the_ranks_is_a_note(tmp_path, capsys):
    run = tmp_path / "tf"
    shutil.copytree(DATA / "third_party" / "hta" / "trace_filter", run)  # 2 of HTA's 128 ranks
    assert main(["analyze", str(run), "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert "traceana: note:" in err and "126 of 128 ranks have no trace" in err
    assert not [line for line in err.splitlines() if "warning:" in line and "126 of 128" in line], err
