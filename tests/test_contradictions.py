"""Readable traces that contradict themselves or run.json get a note naming the contradiction (issue 13, "must
not be silent"). Expected values by hand from the tiny traces built here."""

from __future__ import annotations

import json
import warnings

from tracebuilder import TraceBuilder, write_two_stage_run

from traceana.ingest.run_dir import load_run


def _load(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_run(d, cache=False)


def test_distributed_info_rank_against_the_file_name(tmp_path):
    tb = TraceBuilder(rank=1, world_size=2)
    tb.step(0, 0, 100)
    tb.write(tmp_path / "rank0.pt.trace.json.gz")
    run = _load(tmp_path / "rank0.pt.trace.json.gz")
    assert run.ranks == [1]
    assert any("distributedInfo says rank 1 but the file name says rank 0" in w for w in run.warnings)


def test_overlapping_steps_are_named_with_the_overlap(tmp_path):
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(1, 0, 150)  # 0–150 µs: extended 50 µs into step 2
    tb.step(2, 100, 200)
    tb.write(tmp_path / "rank0.json")
    (note,) = [w for w in _load(tmp_path).warnings if "overlap" in w]
    assert "1 ProfilerStep spans overlap" in note and "ProfilerStep#2 starts 0.050 ms before ProfilerStep#1" in note


def test_every_event_duplicated_is_named(tmp_path):
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(0, 0, 100)
    tb.annotation("PP:0F0", 10, 20)
    tb.events = tb.events + [dict(e) for e in tb.events]
    tb.write(tmp_path / "rank0.json")
    (note,) = [w for w in _load(tmp_path).warnings if "copies of another" in w]
    assert note.split(": ")[1].startswith("2 step spans or annotations")  # the step and the annotation, once each


def test_all_zero_durations_are_named(tmp_path):
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(0, 0, 0)
    tb.cpu_op("aten::mm", 1, 0)
    tb.write(tmp_path / "rank0.json")
    assert any("every one of its 2 events lasts 0 ns" in w for w in _load(tmp_path).warnings)


def test_run_json_stage_map_against_the_traces_own_stages(tmp_path):
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2, meta={"rank": r, "stage": r})
        tb.step(0, 0, 100)
        tb.write(tmp_path / f"rank{r}.json")
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, "stage_of_rank": [1, 0]}))
    notes = [w for w in _load(tmp_path).warnings if "stage_of_rank" in w]
    assert len(notes) == 2 and "gives rank 0 stage 1 but its trace says stage 0" in notes[0]


def test_a_clean_run_gets_none_of_these_notes(tmp_path):
    d = write_two_stage_run(tmp_path)
    assert not [w for w in _load(d).warnings if any(k in w for k in ("overlap", "copies of another", "0 ns", "says rank"))]
