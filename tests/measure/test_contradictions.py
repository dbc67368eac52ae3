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


# --- run.json's schedule and micro-batch count against the annotations; annotations one rank lacks --------------
def _pipeline_run(d, *, order: str, drop: tuple[int, str] | None = None, extra_name: str | None = None,
                  manifest: dict | None = None):
    """Two stages, two micro-batches in one step (µs). The last stage (rank 1) runs F0 B0 F1 B1 under ``order``
    1f1b (1F1B's last stage has no warm-up forward: each forward is followed by its backward) and F0 F1 B0 B1
    under gpipe; stage 0 runs F0 F1 B0 B1 in both (1F1B: one warm-up forward, F1 B0 steady, B1 cool-down)."""
    d.mkdir(exist_ok=True)
    spans = {
        0: [("F", 0, 0, 10), ("F", 1, 10, 20), ("B", 0, 40, 50), ("B", 1, 60, 70)],
        1: ([("F", 0, 20, 28), ("B", 0, 28, 36), ("F", 1, 36, 44), ("B", 1, 44, 52)] if order == "1f1b" else
            [("F", 0, 20, 28), ("F", 1, 28, 36), ("B", 0, 36, 44), ("B", 1, 44, 52)]),
    }
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2)
        tb.step(0, 0, 80)
        for act, mb, a, b in spans[r]:
            if drop != (r, f"{act}{mb}"):
                tb.annotation(f"PP:{r}{act}{mb}", a, b - a)
                tb.cpu_op("aten::mm", a + 1, b - a - 2)
        if extra_name and r == 0:
            tb.annotation(extra_name, 72, 4)
        tb.write(d / f"rank{r}.json")
    if manifest is not None:
        (d / "run.json").write_text(json.dumps({"world_size": 2, "pp": 2, **manifest}))
    return d


def _notes(d):
    from traceana.measure.analysis import analyze

    return analyze(_load(d)).notes


def test_run_json_gpipe_on_a_1f1b_trace_is_named(tmp_path):
    d = _pipeline_run(tmp_path / "r", order="1f1b", manifest={"schedule": "gpipe", "num_microbatches": 2})
    (note,) = [n for n in _notes(d) if "run.json says schedule" in n]
    assert "schedule gpipe" in note and "rank 1 starts the forward of micro-batch 1 after a backward" in note
    assert "1f1b is what the traces show" in note and "fix schedule in run.json" in note


def test_run_json_1f1b_on_a_gpipe_trace_is_named(tmp_path):
    d = _pipeline_run(tmp_path / "r", order="gpipe", manifest={"schedule": "1f1b", "num_microbatches": 2})
    (note,) = [n for n in _notes(d) if "run.json says schedule" in n]
    assert "every rank runs all its forwards before any backward" in note and "gpipe is what" in note


def test_run_json_micro_batches_against_the_annotations(tmp_path):
    d = _pipeline_run(tmp_path / "r", order="1f1b", manifest={"schedule": "1f1b", "num_microbatches": 4})
    (note,) = [n for n in _notes(d) if "num_microbatches" in n]
    assert "run.json says num_microbatches 4 but the traces' annotations show 2" in note


def test_a_consistent_run_json_gets_no_such_note(tmp_path):
    for order in ("1f1b", "gpipe"):
        d = _pipeline_run(tmp_path / order, order=order, manifest={"schedule": order, "num_microbatches": 2})
        assert not [n for n in _notes(d) if "run.json says" in n or "missing on" in n or "ignored" in n]


def test_a_micro_batch_annotation_missing_on_one_rank_is_named(tmp_path):
    d = _pipeline_run(tmp_path / "r", order="1f1b", drop=(0, "F1"))
    (note,) = [n for n in _notes(d) if "missing on" in n]
    assert note.startswith("1 forward/backward annotation missing") and "rank 0 step 0 forward of micro-batch 1" in note
    assert "other compute" in note


def test_a_pp_number_too_big_is_named_not_dropped_silently(tmp_path):
    d = _pipeline_run(tmp_path / "r", order="1f1b", extra_name="PP:0F99999999999999999999999")
    (note,) = [n for n in _notes(d) if "ignored" in n]
    assert note.startswith("1 PP: annotations ignored") and "PP:0F99999999999999999999999" in note and "rank 0" in note


def test_validate_names_what_to_fix_in_run_json_not_a_flag(tmp_path):
    """The model's checks name estimate's flags (--schedule, --bpipe); from run.json they name its keys."""
    import pytest

    from traceana.core.errors import ConfigError
    from traceana.core.manifest import Manifest
    from traceana.core.run_config import RunConfig

    m = Manifest.from_dict({"world_size": 2, "pp": 2, "schedule": "gpipe", "bpipe": [[0, 1]], "microbatch_size": 1,
                            "num_microbatches": 2, "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4,
                                                             "seq": 16, "vocab": 64}})
    with pytest.raises(ConfigError) as e:
        RunConfig.from_manifest(m).training_config(path=tmp_path)
    line = e.value.line()
    assert "--" not in line and line.startswith(f"{tmp_path / 'run.json'}: BPipe is defined on the 1F1B schedule")
    assert line.endswith("use schedule 1f1b with bpipe in run.json")


def test_duplicated_p2p_operations_are_named_instead_of_a_clock_cycle(tmp_path):
    import gzip

    from traceana.measure.analysis import analyze

    d = write_two_stage_run(tmp_path)
    f = next(d.glob("rank1*"))
    raw = f.read_bytes()
    doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    doc["traceEvents"] = doc["traceEvents"] * 2  # every event of rank 1 twice: its 2 P2P operations (recv, send) too
    f.write_bytes(gzip.compress(json.dumps(doc).encode()) if raw[:2] == b"\x1f\x8b" else json.dumps(doc).encode())
    notes = analyze(_load(d)).notes
    (note,) = [n for n in notes if "P2P operations are exact copies" in n]
    assert note.startswith("2 P2P operations are exact copies of another")
    assert not [n for n in notes if n.startswith("P2P timings contradict")]


def test_the_notes_are_the_same_read_by_any_path(tmp_path):
    # The step spans and annotations the notes compare are found in the thread that read each trace (one worker,
    # its finishing thread; two workers), or at the end for traces from the ingest cache: the same notes each way.
    tb = TraceBuilder(rank=0, world_size=3)
    tb.step(1, 0, 150)  # overlaps step 2 by 50 µs
    tb.step(2, 100, 200)
    tb.annotation("PP:0F0", 10, 20)
    tb.annotation("PP:0F0", 10, 20)  # a copy
    tb.write(tmp_path / "rank0.json")
    tb = TraceBuilder(rank=1, world_size=3)
    tb.step(0, 0, 0)
    tb.cpu_op("aten::mm", 1, 0)
    tb.write(tmp_path / "rank1.json")
    tb = TraceBuilder(rank=2, world_size=3)
    tb.step(0, 0, 100)
    tb.write(tmp_path / "rank2.json")
    expected = {"rank0.json": ["1 step spans or annotations are copies", "1 ProfilerStep spans overlap"],
                "rank1.json": ["every one of its 2 events lasts 0 ns"], "rank2.json": []}
    for workers, cache in ((1, False), (2, False), (1, True), (1, True)):  # the second cached load: all hits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            notes = load_run(tmp_path, workers=workers, cache=cache).warnings
        for name, wanted in expected.items():
            mine = [w for w in notes if f"{name}:" in w and ("copies" in w or "overlap" in w or "lasts 0 ns" in w)]
            assert len(mine) == len(wanted) and all(any(x in w for w in mine) for x in wanted), (workers, cache, notes)
