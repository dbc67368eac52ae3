"""The golden cases: per area a small checked-in trace, a command, and the expected output in tests/golden/expected/.

A case is run as the user types it (``traceana.cli.main`` with the arguments below, from the repository root, the
run folder read-only to it: ``--no-cache``), its standard output captured and made comparable:

- ``json`` cases: the parsed JSON with the volatile fields taken out (``VOLATILE``: where the output says which
  version or how long traceana itself took; none of these cases has one today, the list keeps the rule in one place)
  and absolute paths under the repository written relative to it; numbers are compared to ``REL``/``ABS`` (float
  arithmetic: a summation order in polars or numpy may move the last digits), everything else exactly.
- ``text`` cases: the human table, compared line by line exactly (its numbers are already rounded for print).

``python tests/golden/regenerate.py`` writes every expected file again; a diff of them is a change to review
(tests/golden/README.md), not the truth.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).resolve().parent / "expected"
DATA = "tests/data"

REL = 1e-6  # relative tolerance on numbers (JSON cases)
ABS = 1e-9  # absolute tolerance on numbers, for figures at or near zero
COLUMNS = 80  # the tables' width (else it follows the terminal's)
VOLATILE = frozenset({"version", "traceana_version", "elapsed_s", "wall_s", "took_s", "timings"})

MEGATRON = f"{DATA}/megatron_pipe/1f1b/run"  # megatron-core's own 1F1B, 2 ranks, 4 micro-batches (tests/data/README.md)
DEEPSPEED = f"{DATA}/deepspeed_pipe/1f1b/run"  # DeepSpeed's PipelineEngine 1F1B, 2 ranks, 4 micro-batches
GPIPE_M2 = f"{DATA}/pipelining_memory/gpipe_m2"  # the reference collector's torch.distributed.pipelining GPipe, 3 ranks
HTA_LINEAR = f"{DATA}/third_party/param/linear"  # a third-party one-rank trace (PARAM's linear benchmark), no pipeline


@dataclass(frozen=True)
class Case:
    area: str  # the layer it pins: ingest, measure, causal, model, validation, commands
    name: str
    argv: tuple[str, ...]
    kind: str = "json"  # json or text

    @property
    def expected(self) -> Path:
        return EXPECTED / self.area / f"{self.name}.{'json' if self.kind == 'json' else 'txt'}"


CASES = (
    Case("ingest", "describe_megatron_1f1b", ("describe", MEGATRON, "--json", "--no-cache", "--quiet")),
    Case("ingest", "describe_gpipe_m2", ("describe", GPIPE_M2, "--json", "--no-cache", "--quiet")),
    Case("measure", "analyze_megatron_1f1b", ("analyze", MEGATRON, "--json", "--no-cache", "--quiet")),
    Case("measure", "analyze_deepspeed_1f1b", ("analyze", DEEPSPEED, "--json", "--no-cache", "--quiet")),
    Case("measure", "analyze_gpipe_m2", ("analyze", GPIPE_M2, "--json", "--no-cache", "--quiet")),
    Case("measure", "analyze_param_linear", ("analyze", HTA_LINEAR, "--json", "--no-cache", "--quiet")),
    Case("causal", "whatif_megatron_1f1b_stage1_forward_half",
         ("whatif", MEGATRON, "--set", "stage=1:forward*0.5", "--json", "--no-cache", "--quiet")),
    Case("causal", "whatif_deepspeed_1f1b_p2p_zero",
         ("whatif", DEEPSPEED, "--set", "p2p=0", "--json", "--no-cache", "--quiet")),
    Case("model", "estimate_tiny_gpt_pp4_m8_1f1b",
         ("estimate", "--model", "tiny-gpt", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--json")),
    Case("model", "estimate_llama_7b_pp4_bpipe",
         ("estimate", "--model", "llama-7b", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--bpipe",
          "--json")),
    Case("validation", "validate_gpipe_m2", ("validate", GPIPE_M2, "--json", "--no-cache", "--quiet")),
    Case("commands", "analyze_megatron_1f1b_table", ("analyze", MEGATRON, "--no-cache", "--quiet"), kind="text"),
    Case("commands", "whatif_megatron_1f1b_table", ("whatif", MEGATRON, "--no-cache", "--quiet"), kind="text"),
)


def run(case: Case) -> tuple[int, str]:
    """The command's exit code and standard output, run in this process from the repository root."""
    import os

    from traceana.cli import main

    out, here, columns = io.StringIO(), os.getcwd(), os.environ.get("COLUMNS")
    os.chdir(ROOT)
    os.environ["COLUMNS"] = str(COLUMNS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(list(case.argv))
    finally:
        os.chdir(here)
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return rc, out.getvalue()


def normalise(value):
    """The output with the volatile fields out and repository paths relative (JSON cases)."""
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        return value.replace(str(ROOT) + "/", "")
    return value


def output(case: Case):
    """What the case's expected file holds: the normalised JSON, or the table's lines."""
    rc, text = run(case)
    if rc != 0:
        raise AssertionError(f"{' '.join(case.argv)}: exit {rc}")
    if case.kind == "json":
        return normalise(json.loads(text))
    return [line.rstrip() for line in text.replace(str(ROOT) + "/", "").splitlines()]


def differences(expected, actual, where: str = "$") -> list[str]:
    """Every place ``actual`` differs from ``expected``: numbers beyond REL/ABS, anything else at all."""
    if isinstance(expected, bool) or isinstance(actual, bool) or expected is None or actual is None:
        return [] if expected is actual or expected == actual and type(expected) is type(actual) else \
            [f"{where}: expected {expected!r}, got {actual!r}"]
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if math.isclose(expected, actual, rel_tol=REL, abs_tol=ABS):
            return []
        return [f"{where}: expected {expected!r}, got {actual!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}: key {k!r} missing" for k in expected if k not in actual]
        out += [f"{where}: key {k!r} new" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                out += differences(expected[k], actual[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        out = [] if len(expected) == len(actual) else [f"{where}: {len(expected)} items expected, got {len(actual)}"]
        for i, (e, a) in enumerate(zip(expected, actual)):
            out += differences(e, a, f"{where}[{i}]")
        return out
    return [] if expected == actual else [f"{where}: expected {expected!r}, got {actual!r}"]


def write(case: Case) -> Path:
    value = output(case)
    case.expected.parent.mkdir(parents=True, exist_ok=True)
    if case.kind == "json":
        case.expected.write_text(json.dumps(value, indent=1, sort_keys=False) + "\n")
    else:
        case.expected.write_text("\n".join(value) + "\n")
    return case.expected


def read(case: Case):
    text = case.expected.read_text()
    return json.loads(text) if case.kind == "json" else text.splitlines()
