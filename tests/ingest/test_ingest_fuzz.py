"""Fuzzing ingest with hypothesis: whatever the bytes, only TraceanaError escapes, and whatever is returned is a
schema-correct table with sane times. Bounded example counts keep this CI-sized."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ingest import gloo_pair
from tracebuilder import TraceBuilder

from traceana.core import schema
from traceana.core.errors import TraceanaError
from traceana.ingest.kineto import read_trace

THIRD_PARTY_SEED = Path(__file__).resolve().parents[1] / "data/third_party/hta/call_stack/backward_thread.json"
FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _seed_bytes() -> bytes:
    tb = TraceBuilder(rank=1, world_size=2)
    tb.step(0, 0.0, 100.0)
    tb.cpu_op("aten::mm", 1.0, 5.0)
    gloo_pair(tb, "send", peer=0, tag=1, ts=10.0, dur=20.0)
    tb.memory(2.0, 1024, 1024)
    tb.kernel("k", 3.0, 4.0, correlation=5)
    tb.nccl_p2p("recv", peer=0, ts=40.0, dur=2.0, kernel_ts=43.0, kernel_dur=9.0)
    return tb.to_bytes()


SEEDS = [_seed_bytes(), THIRD_PARTY_SEED.read_bytes()]


def _check(path: Path) -> None:
    try:
        events, memory, row = read_trace(path)
    except TraceanaError as e:
        line = e.line()
        assert "\n" not in line and line
        return
    schema.check(events, schema.EVENTS, "events")
    schema.check(memory, schema.MEMORY, "memory")
    assert events["ts_ns"].null_count() == 0 and events["dur_ns"].null_count() == 0
    assert (events["dur_ns"] >= 0).all() and (events["ts_ns"] >= 0).all()
    assert row["n_events"] == events.height
    assert events.select(pl.col("track").is_null().any()).item() is False


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 40)),
    st.tuples(st.just("replace_token"), st.sampled_from([b'"X"', b'"i"', b"1.0", b"{", b"}", b"[", b'"ts"',
                                                        b'"args"', b"null", b","]),
              st.sampled_from([b'"Q"', b"-1", b"1e999", b'"NaN"', b"[]", b"{}", b"null", b'"\xff"', b"", b"]]"])),
)


def _mutate(data: bytes, muts: list) -> bytes:
    buf = bytearray(data)
    for m in muts:
        if not buf:
            break
        kind = m[0]
        if kind == "truncate":
            del buf[int(m[1] * len(buf)):]
        elif kind == "flip":
            i = min(int(m[1] * len(buf)), len(buf) - 1)
            buf[i] ^= m[2]
        elif kind == "insert":
            i = int(m[1] * len(buf))
            buf[i:i] = m[2]
        elif kind == "delete":
            i = int(m[1] * len(buf))
            del buf[i:i + m[2]]
        else:
            buf = bytearray(bytes(buf).replace(m[1], m[2], 1))
    return bytes(buf)


@FUZZ
@given(seed=st.sampled_from(range(len(SEEDS))), muts=st.lists(mutation, min_size=1, max_size=4),
       gz=st.booleans())
def test_mutated_bytes_only_raise_traceana_errors(tmp_path, seed, muts, gz):
    data = _mutate(SEEDS[seed], muts)
    f = tmp_path / ("t.json.gz" if gz else "t.json")
    f.write_bytes(gzip.compress(data) if gz else data)
    _check(f)


@FUZZ
@given(cut=st.floats(0, 1))
def test_truncated_gzip_stream_only_raises_traceana_errors(tmp_path, cut):
    data = gzip.compress(SEEDS[0])
    f = tmp_path / "t.json.gz"
    f.write_bytes(data[: int(cut * len(data))])
    _check(f)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["ph", "name", "cat", "pid", "tid", "ts", "dur", "args", "s", "id"]
ARG_KEYS = ["correlation", "External id", "device", "stream", "Total Allocated", "Bytes", "Device Id",
            "Collective name", "In msg nelems", "dtype", "Src Rank", "Dst Rank", "Process Group Name",
            "Concrete Inputs", "Input Dims", "Input type"]


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 20), st.sampled_from(FIELDS + ARG_KEYS), json_value),
                      min_size=1, max_size=6),
       top=st.dictionaries(st.sampled_from(["distributedInfo", "deviceProperties", "baseTimeNanoseconds",
                                            "traceana"]), json_value, max_size=2))
def test_wrong_typed_fields_only_raise_traceana_errors(tmp_path, edits, top):
    trace = json.loads(SEEDS[0])
    events = trace["traceEvents"]
    for i, key, value in edits:
        ev = events[i % len(events)]
        if key in ARG_KEYS:
            if not isinstance(ev.get("args"), dict):
                ev["args"] = {}
            ev["args"][key] = value
        else:
            ev[key] = value
    trace.update(top)
    f = tmp_path / "rank1.json"
    f.write_text(json.dumps(trace))
    _check(f)


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_every_prefix_of_a_small_trace(tmp_path, seed):
    """Truncation of a small trace every 11 bytes: a killed writer can stop anywhere."""
    data = SEEDS[seed]
    f = tmp_path / "t.json"
    complete = read_trace(_write(f, data))[0].height
    for cut in range(0, len(data), 11):
        _write(f, data[:cut])
        try:
            events, _, row = read_trace(f)
        except TraceanaError:
            continue
        assert row["truncated"] or cut >= len(data.rstrip())
        assert events.height <= complete


def _write(f: Path, data: bytes) -> Path:
    f.write_bytes(data)
    return f


# --- semantic mutations: a readable run that contradicts itself ----------------------------------------------------
# Each kind of contradiction, and the words of the note that must name it (None: the run must still be analysed to
# steps that add up, or refused with one line). Counts of examples per kind are kept in SEMANTIC_COUNTS.
SEMANTIC = {
    "stage_of_rank_swapped": "stage_of_rank gives rank",
    "duplicate_all": "copies of another",
    "overlap_steps": "overlap the previous step",
    "zero_durations": "lasts 0 ns",
    "rank_vs_file_name": "the file name says rank",
    "manifest_pp_too_big": "pp 8 is larger than world_size 2",
    "manifest_bpipe_outside": "names a stage outside",
    "manifest_microbatch_zero": "microbatch_size must be a positive integer",
    # on a pipelined run (two stages, two micro-batches per step, annotated; see _pipelined)
    "manifest_gpipe_on_1f1b": "run.json says schedule gpipe",
    "manifest_1f1b_on_gpipe": "run.json says schedule 1f1b",
    "manifest_microbatches_wrong": "run.json says num_microbatches 4 but the traces' annotations show 2",
    "annotation_missing_one_rank": "missing on one rank",
    "pp_number_too_big": "PP: annotations ignored",
    "duplicate_with_p2p": "P2P operations are exact copies",
}
SEMANTIC_COUNTS: dict[str, int] = {k: 0 for k in SEMANTIC} | {"refused": 0, "analysed": 0, "silent": 0}
_PIPELINED = {"manifest_gpipe_on_1f1b", "manifest_1f1b_on_gpipe", "manifest_microbatches_wrong",
              "annotation_missing_one_rank", "pp_number_too_big", "duplicate_with_p2p"}


def _pipelined(kind: str, shift_us: float) -> tuple[list[dict], dict]:
    """Two stages, two micro-batches in each of two steps (µs, ``shift_us`` moves step 1 later), with the P2P of
    each micro-batch's activation and gradient. Rank 1, the last stage, runs F0 B0 F1 B1 (1F1B), or F0 F1 B0 B1
    for ``manifest_1f1b_on_gpipe`` (GPipe); rank 0 runs F0 F1 B0 B1 under both."""
    gpipe = kind == "manifest_1f1b_on_gpipe"
    manifest = {"world_size": 2, "pp": 2, "schedule": "gpipe" if kind == "manifest_gpipe_on_1f1b" else "1f1b",
                "num_microbatches": 4 if kind == "manifest_microbatches_wrong" else 2}
    if gpipe:
        manifest["schedule"] = "1f1b"
    spans = {0: [("F", 0, 0, 10), ("F", 1, 10, 20), ("B", 0, 40, 50), ("B", 1, 60, 70)],
             1: ([("F", 0, 20, 28), ("F", 1, 28, 36), ("B", 0, 36, 44), ("B", 1, 44, 52)] if gpipe else
                 [("F", 0, 20, 28), ("B", 0, 28, 36), ("F", 1, 36, 44), ("B", 1, 44, 52)])}
    traces = []
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2, meta={"rank": r, "stage": r})
        for step, t0 in ((0, 0.0), (1, 100.0 + shift_us)):
            tb.step(step, t0, t0 + 90)
            for act, mb, a, b in spans[r]:
                if kind == "annotation_missing_one_rank" and (r, step, act, mb) == (0, 1, "F", 1):
                    continue
                tb.annotation(f"PP:{r}{act}{mb}", t0 + a, b - a)
                tb.cpu_op("aten::mm", t0 + a + 1, b - a - 2)
            for mb in (0, 1):  # activation 0 -> 1 after each forward of stage 0, gradient 1 -> 0 after each backward
                f0_end = t0 + spans[0][mb][3]
                b1_end = t0 + [e for e in spans[1] if e[:2] == ("B", mb)][0][3]
                if r == 0:
                    tb.send(peer=1, tag=mb, ts=f0_end, dur=1)
                    tb.recv(peer=1, tag=mb, ts=b1_end - 2, dur=3)
                else:
                    tb.recv(peer=0, tag=mb, ts=f0_end - 1, dur=2)
                    tb.send(peer=0, tag=mb, ts=b1_end, dur=1)
            if kind == "pp_number_too_big" and r == 0:
                tb.annotation("PP:0F99999999999999999999999", t0 + 75, 4)
        if kind == "duplicate_with_p2p" and r == 1:
            tb.events = tb.events + [dict(e) for e in tb.events]
        traces.append(tb.to_dict())
    return traces, manifest


def _two_ranks(kind: str, shift_us: float) -> tuple[list[dict], dict | None]:
    traces, manifest = [], {"world_size": 2, "pp": 2, "schedule": "1f1b"}
    for r in (0, 1):
        tb = TraceBuilder(rank=r, world_size=2, meta={"rank": r, "stage": r})
        end = 100 + (shift_us if kind == "overlap_steps" else 0)
        tb.step(0, 0, end)
        tb.step(1, 100, 200)
        tb.annotation(f"PP:{r}F0", 10, 20)
        tb.cpu_op("aten::mm", 12, 10)
        if kind == "zero_durations":
            for e in tb.events:
                e["dur"] = 0
        if kind == "duplicate_all":
            tb.events = tb.events + [dict(e) for e in tb.events]
        traces.append(tb.to_dict())
    if kind == "rank_vs_file_name":
        traces[0]["distributedInfo"]["rank"], traces[1]["distributedInfo"]["rank"] = 1, 0
        traces[0]["traceana"]["rank"], traces[1]["traceana"]["rank"] = 1, 0
    if kind == "stage_of_rank_swapped":
        manifest["stage_of_rank"] = [1, 0]
    if kind == "manifest_pp_too_big":
        manifest["pp"] = 8
    if kind == "manifest_bpipe_outside":
        manifest["bpipe"] = [[0, 9]]
    if kind == "manifest_microbatch_zero":
        manifest["microbatch_size"] = 0
    return traces, manifest


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(SEMANTIC)), shift_us=st.floats(1, 90), gz=st.booleans())
@pytest.mark.slow
def test_semantic_mutations_are_named_or_refused_never_silent(tmp_path_factory, kind, shift_us, gz):
    import warnings

    from traceana.measure.analysis import analyze
    from traceana.ingest.run_dir import load_run

    d = tmp_path_factory.mktemp("semantic")
    traces, manifest = (_pipelined if kind in _PIPELINED else _two_ranks)(kind, shift_us)
    for r, trace in enumerate(traces):
        data = json.dumps(trace).encode()
        (d / f"rank{r}.json{'.gz' if gz else ''}").write_bytes(gzip.compress(data) if gz else data)
    (d / "run.json").write_text(json.dumps(manifest))
    SEMANTIC_COUNTS[kind] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = load_run(d, cache=False)
            result = analyze(run)
    except TraceanaError as e:
        SEMANTIC_COUNTS["refused"] += 1
        assert "\n" not in e.line() and SEMANTIC[kind] in e.line(), (kind, e.line())
        return
    said = " | ".join([*run.warnings, *result.notes])
    SEMANTIC_COUNTS["analysed" if SEMANTIC[kind] in said else "silent"] += 1
    assert SEMANTIC[kind] in said, (kind, said)
    # Whatever the contradiction, each (rank, step)'s categories still add up to the step.
    per_step = result.attribution.group_by("rank", "step").agg(pl.col("ns").sum())
    steps = result.steps.select("rank", "step", "dur_ns").join(per_step, on=["rank", "step"])
    assert (steps["ns"] == steps["dur_ns"]).all()


@pytest.mark.slow
def test_semantic_mutation_counts():
    """Runs after the fuzz test above (file order): every kind was tried, and the totals agree."""
    if not SEMANTIC_COUNTS["analysed"] + SEMANTIC_COUNTS["refused"]:
        pytest.skip("the semantic fuzz test did not run in this process")
    assert all(SEMANTIC_COUNTS[k] > 0 for k in SEMANTIC), SEMANTIC_COUNTS
    assert SEMANTIC_COUNTS["silent"] == 0, SEMANTIC_COUNTS
    print("semantic mutations:", SEMANTIC_COUNTS)
