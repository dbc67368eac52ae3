"""Name rules (traceana/core/names.py, docs/naming.md): other frameworks' annotation names → phases, their communication
kernels → kinds; the built-ins and a user's rules file; a bad file is one line and exit code 2.

The DualPipe-shaped trace: rank 0 of 64 on a GPU, one step of DualPipe's overlapped forward and backward chunks (4
MoE layers each, as in deepseek-ai/profile-data's train.json), annotated ``attn(F)``, ``mlp(B)``, ``mlp(W)``,
``dispatch(F)``, ``combine(B)``, … with DeepEP's all-to-all kernels (``void deep_ep::intranode::dispatch<…>``) on
their own stream. Every figure expected below is summed by hand from the kernel durations the builder writes."""

from __future__ import annotations

import json
import subprocess
import sys

import polars as pl
import pytest
from tracebuilder import TraceBuilder

import traceana
from traceana.cli import main
from traceana.core import names
from traceana.core.errors import BadInputError
from traceana.measure import classify as cls
from traceana.measure.analysis import analyze
from traceana.measure.analysis_cache import load_and_analyze

STEP_US = 3000.0
LAYER_US = 740.0
DISPATCH = "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*)"
COMBINE = "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(__nv_bfloat16*, float*, int*)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
# One layer of the overlapped chunk pair, GPU µs from the layer's start: (annotation, kernel, start, duration, stream).
# Compute on stream 7, one kernel at a time; DeepEP on stream 20: three of its kernels run under compute, the
# backward dispatch (680–740) under none, so it is exposed.
LAYER = [
    ("attn(F)", GEMM, 0, 100, 7),
    ("dispatch(F)", DISPATCH, 100, 90, 20),
    ("mlp(B)", GEMM, 100, 150, 7),
    ("combine(B)", COMBINE, 250, 90, 20),
    ("mlp(W)", GEMM, 250, 100, 7),
    ("mlp(F)", GEMM, 350, 120, 7),
    ("combine(F)", COMBINE, 470, 90, 20),
    ("attn(B)", GEMM, 470, 130, 7),
    ("attn(W)", GEMM, 600, 80, 7),
    ("dispatch(B)", DISPATCH, 680, 60, 20),
]
# By hand, per layer: forward 100 + 120, backward for inputs 150 + 130, for weights 100 + 80 (µs of compute
# kernels launched inside those annotations); exposed expert-parallel communication 60. Four layers, a 3,000 µs step.
TRUTH_FRACTION = {"forward": 4 * 220 / STEP_US, "backward_input": 4 * 280 / STEP_US,
                  "backward_weight": 4 * 180 / STEP_US, "collective": 4 * 60 / STEP_US}
NO_PHASE_COMPUTE = 4 * 680 / STEP_US  # without phases, every compute kernel (DeepEP's are communication by family)


def dualpipe_rank0(path, *, names_of=lambda n: n):
    """Write the DualPipe-shaped trace of rank 0 of 64; ``names_of`` renames the annotations."""
    tb = TraceBuilder(rank=0, world_size=64, backend="nccl", pid=7, tid=7)
    tb.step(0, 0, STEP_US)
    corr = 0
    for layer in range(4):
        base = layer * LAYER_US
        for k, (ann, kernel, start, dur, stream) in enumerate(LAYER):
            corr += 1
            cpu = base + 10 * k + 1  # the CPU runs ahead of the GPU: each annotation launches its kernel
            tb.annotation(names_of(ann), cpu, 8)
            tb.launch(cpu + 2, 4, correlation=corr)
            tb.kernel(kernel, base + start + 0.0, dur, stream=stream, correlation=corr)
    return tb.write(path)


@pytest.fixture
def dualpipe(tmp_path):
    run = tmp_path / "dualpipe"
    run.mkdir()
    dualpipe_rank0(run / "rank0.pt.trace.json.gz")
    return run


def _fractions(a) -> dict[str, float]:
    att = a.attribution.filter(pl.col("rank") == 0)
    total = att["ns"].sum()
    return {c: att.filter(pl.col("category") == c)["ns"].sum() / total for c in att["category"].cast(str).unique()}


def test_dualpipe_trace_without_rules_has_no_phase_but_its_all_to_all_kernels_are_communication(dualpipe):
    """With the PP: contract alone no phase is known (all compute is other compute), but DeepEP's kernels are
    communication by their family (names.EP_KERNEL_PATTERN), not by a rule: by hand, compute kernels 680 µs a layer
    (the 740 µs of kernels less DeepEP's exposed 60), the backward dispatch 60 µs exposed."""
    a = analyze(traceana.load_run(dualpipe, cache=False), names=names.NO_RULES)
    got = _fractions(a)
    assert got["other_compute"] == pytest.approx(NO_PHASE_COMPUTE, abs=1e-6)
    assert a.schedule.filter(pl.col("phase").is_in(list(names.PASS_PHASES))).height == 0
    assert got["collective"] == pytest.approx(TRUTH_FRACTION["collective"], abs=1e-6)


def test_dualpipe_builtins_give_phases_and_expert_parallel_communication(dualpipe):
    a = analyze(traceana.load_run(dualpipe, cache=False))
    got = _fractions(a)
    for category, want in TRUTH_FRACTION.items():
        assert got[category] == pytest.approx(want, abs=1e-6), category
    assert got.get("other_compute", 0) == 0
    # Each annotation is one schedule row: 4 layers × (attn, mlp, dispatch, combine) forward, (…) backward, W.
    rows = a.schedule.group_by("phase").len()
    assert dict(rows.rows()) == {"forward": 16, "backward_input": 16, "backward_weight": 8}
    ep = a.events.filter(pl.col("name").cast(pl.String).str.contains("deep_ep::"))
    assert ep["kind"].cast(str).unique().to_list() == ["collective"] and ep["channel"].unique().to_list() == ["ep"]
    assert any("built-in dualpipe" in n for n in a.notes) and any("built-in deepep" in n for n in a.notes)


RULES_TOML = r"""
# the DualPipe names, spelled by a user
builtins = []

[[rules]]
match = '^(attn|mlp|dispatch|combine)\(F\)$'
phase = "forward"

[[rules]]
match = '^(attn|mlp|dispatch|combine)\(B\)$'
phase = "backward_input"

[[rules]]
match = '^(attn|mlp)\(W\)$'
phase = "backward_weight"

[[rules]]
match = 'deep_ep::(intranode|internode|internode_ll)::'
kind = "collective"
channel = "ep"
"""


def test_a_rules_file_gives_the_same_as_the_builtins(dualpipe, tmp_path):
    rules = tmp_path / "names.toml"
    rules.write_text(RULES_TOML)
    a = load_and_analyze(dualpipe, cache=False, names=rules)
    got = _fractions(a)
    for category, want in TRUTH_FRACTION.items():
        assert got[category] == pytest.approx(want, abs=1e-6), category
    assert any(f"{rules} rule 1" in n for n in a.notes)
    # The same rules as JSON.
    as_json = tmp_path / "names.json"
    import tomllib

    as_json.write_text(json.dumps(tomllib.loads(RULES_TOML)))
    b = load_and_analyze(dualpipe, cache=False, names=as_json)
    assert _fractions(b) == got


def test_stage_and_microbatch_groups_and_order(tmp_path):
    """``(?P<stage>…)`` and ``(?P<microbatch>…)`` groups, and ``microbatch = "order"``."""
    run = tmp_path / "run"
    run.mkdir()
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(3, 0, 100)
    for mb in range(2):
        tb.annotation(f"stage1/fwd/mb{mb}", 10 * mb, 5)
        tb.cpu_op("aten::mm", 10 * mb + 1, 3)
    for k in range(2):
        tb.annotation("stage1/bwd", 50 + 10 * k, 5)
        tb.cpu_op("aten::mm", 50 + 10 * k + 1, 3)
    tb.write(run / "rank0.pt.trace.json.gz")
    rules = names.parse_rules({"rules": [
        {"match": r"^stage(?P<stage>\d+)/fwd/mb(?P<microbatch>\d+)$", "phase": "forward"},
        {"match": r"^stage(?P<stage>\d+)/bwd$", "phase": "backward", "microbatch": "order"},
    ]}, origin="test")
    a = analyze(traceana.load_run(run, cache=False), names=rules)
    rows = a.schedule.filter(pl.col("phase") != "optimizer").sort("start_ns").select("stage", "microbatch", "phase")
    assert rows.rows() == [(1, 0, "forward"), (1, 1, "forward"), (1, 0, "backward"), (1, 1, "backward")]


def test_rules_are_tried_once_per_distinct_name(dualpipe, monkeypatch):
    seen = []
    real = cls._name_rules

    def counting(distinct, rules):
        seen.append(len(distinct))
        return real(distinct, rules)
    monkeypatch.setattr(cls, "_name_rules", counting)
    run = traceana.load_run(dualpipe, cache=False)
    cls.classify(run.events)
    assert seen == [run.events["name"].n_unique()]
    assert seen[0] < run.events.height / 4  # 14 names, 81 events


def test_run_json_names_and_the_option_overriding_it(dualpipe, tmp_path):
    (dualpipe / "names.toml").write_text(RULES_TOML)
    (dualpipe / "run.json").write_text(json.dumps({"schema_version": 1, "world_size": 64, "names": "names.toml"}))
    a = load_and_analyze(dualpipe, cache=False)
    assert any("names.toml rule 1" in n for n in a.notes)
    off = load_and_analyze(dualpipe, cache=False, names="none")
    assert _fractions(off)["other_compute"] == pytest.approx(NO_PHASE_COMPUTE, abs=1e-6)
    # The cache tells rules apart: the same run with other rules is analysed again, not served stale.
    cached_on = load_and_analyze(dualpipe)
    cached_off = load_and_analyze(dualpipe, names="none")
    assert _fractions(cached_on)["forward"] == pytest.approx(TRUTH_FRACTION["forward"], abs=1e-6)
    assert _fractions(cached_off).get("forward", 0) == 0


def test_cli_names_option(dualpipe, tmp_path, capsys):
    assert main(["analyze", str(dualpipe), "--json", "--no-cache", "--names", "none"]) == 0
    off = json.loads(capsys.readouterr().out)
    rules = tmp_path / "names.toml"
    rules.write_text(RULES_TOML)
    assert main(["analyze", str(dualpipe), "--json", "--no-cache", "--names", str(rules)]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on != off
    assert main(["merge", str(dualpipe), "-o", str(tmp_path / "m.json.gz"), "--no-cache", "--names", str(rules),
                 "--quiet"]) == 0


BAD = {
    "bad.toml": ("[[rules]]\nmatch = '(unclosed'\nphase = 'forward'\n", "bad regular expression"),
    "phase.toml": ("[[rules]]\nmatch = 'x'\nphase = 'forwards'\n", "unknown phase 'forwards'"),
    "key.toml": ("[[rules]]\nmatch = 'x'\nphase = 'forward'\nstage = 1\n", "unknown key 'stage'"),
    "kind.toml": ("[[rules]]\nmatch = 'x'\nkind = 'p2p_send'\n", "cannot be given by a name"),
    "neither.toml": ("[[rules]]\nmatch = 'x'\n", "neither a phase nor a kind"),
    "syntax.toml": ("[[rules]\nmatch = \n", "not valid TOML"),
    "builtins.json": ('{"builtins": ["megatrom"]}', "builtins must be a list"),
    "top.json": ('[1, 2]', "holds a table"),
    "lookaround.toml": ("[[rules]]\nmatch = '(?<=a)b'\nphase = 'forward'\n", "bad regular expression"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_rules_file_is_one_line_and_exit_2(dualpipe, tmp_path, name):
    text, what = BAD[name]
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(BadInputError) as e:
        names.load_rules(f)
    assert what in str(e.value) and "docs/naming.md" in str(e.value) and "\n" not in str(e.value)
    p = subprocess.run([sys.executable, "-m", "traceana", "analyze", str(dualpipe), "--no-cache", "--names", str(f)],
                       capture_output=True, text=True, timeout=120) if name == "bad.toml" else None
    if p is not None:
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and what in p.stderr


def test_a_missing_rules_file(dualpipe, tmp_path):
    assert main(["analyze", str(dualpipe), "--no-cache", "--names", str(tmp_path / "nope.toml")]) == 2


def test_python_frames_are_spans_not_work(tmp_path):
    """A ``with_stack=True`` frame spans everything its call does, waits included: it is not compute."""
    run = tmp_path / "run"
    run.mkdir()
    tb = TraceBuilder(rank=0, world_size=1)
    tb.step(0, 0, 100)
    tb._x("python_function", "train.py(10): train_step", 0, 100)
    tb.cpu_op("aten::mm", 10, 20)
    tb.write(run / "rank0.pt.trace.json.gz")
    a = analyze(traceana.load_run(run, cache=False))
    got = _fractions(a)
    assert got["other_compute"] == pytest.approx(0.2) and got["host"] == pytest.approx(0.8)


@pytest.mark.parametrize("command", ["analyze", "validate", "report", "watch", "merge"])
def test_every_command_that_reads_a_run_refuses_a_bad_rules_file(dualpipe, tmp_path, command, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"match": "x", "phase": "fwd"}]}')
    extra = {"watch": ["--once"], "merge": ["-o", str(tmp_path / "m.json.gz")],
             "report": ["-o", str(tmp_path / "r.html")]}.get(command, [])
    assert main([command, str(dualpipe), "--names", str(bad), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown phase 'fwd'" in err[0] and str(bad) in err[0]
