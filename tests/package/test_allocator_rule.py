"""The traceana program's allocator decay by the run's shape (traceana.cli.allocator_for, set by program_settings
before polars is imported): a second's decay for a run of many small ranks, where returning each freed page at once
cost a fifth of the CPU in page faults for the same peak, and the immediate return (ALLOCATOR) for everything else,
where the retained pages raised the peak (docs/performance.md "The allocator's decay, by the run's shape"). No
timing here: which setting a given shape gets, and that a value the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from traceana import cli
from traceana.ingest import reading

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


@pytest.mark.parametrize("sizes, expected", [
    ([300_000] * 4096, "many small"),  # pp 8 x dp 512, one step a rank (docs/whatif.md "Scale"): the most files
    ([300_000] * 4097, "ours"),  # one file more
    ([300_000] * 8192, "ours"),  # 8,192 ranks: the decay raised the peak by 7 %
    ([370_000] * 16384, "ours"),  # 16,384 ranks: by 6 %
    ([300_000] * 2048, "many small"),  # the fewest files that count as many
    ([300_000] * 2047, "ours"),  # one file fewer
    ([300_000] * 1024, "ours"),  # 1,024 ranks of 0.3 MB: the decay raised the peak by 5 %
    ([2 * MIB] * 4096, "many small"),  # the largest file at the limit
    ([300_000] * 4095 + [2 * MIB + 1], "ours"),  # one file over it: a big rank's columns set the peak
    ([540_000] * 512, "ours"),  # 512 ranks of 0.5 MB: the decay raised the peak
    ([200 * MIB] * 4, "ours"),  # the 4 x 200 MB run
    ([4_000] * 2, "ours"),  # the tiny two-rank run
])
def test_which_decay_a_run_of_these_files_gets(sizes, expected):
    assert cli.allocator_for(sizes) == {"many small": cli.ALLOCATOR_MANY_SMALL, "ours": cli.ALLOCATOR}[expected]
    assert cli.ALLOCATOR_MANY_SMALL == "dirty_decay_ms:1000,muzzy_decay_ms:0"  # what was measured
    assert cli.ALLOCATOR == "dirty_decay_ms:0,muzzy_decay_ms:0"


def _run_of(tmp_path: Path, n: int, size: int, suffix: str = ".json") -> Path:
    run = tmp_path / f"run{n}_{size}"
    run.mkdir()
    for i in range(n):
        (run / f"rank{i}.pt.trace{suffix}").write_bytes(b" " * size)
    return run


def test_raw_sizes_count_a_gzipped_file_at_the_readers_ratio(tmp_path):
    run = _run_of(tmp_path, 3, 1000, ".json.gz")
    assert reading.raw_sizes(run) == [1000 * reading.GZ_RATIO] * 3
    assert reading.raw_sizes(tmp_path / "nowhere") is None
    # gzipped files of 70,000 bytes stand for 2.24 MB of JSON each: over SMALL_FILE_BYTES
    assert 70_000 * reading.GZ_RATIO > cli.SMALL_FILE_BYTES


@pytest.mark.parametrize("case", ["many small", "many small, user's", "few big"])
def test_the_program_sets_the_decay_of_the_runs_shape(tmp_path, case):
    # program_settings as the program calls it (first without the run, then with it), in a fresh interpreter
    if case == "few big":
        run = _run_of(tmp_path, 4, 2 * MIB + 1)
    else:
        run = _run_of(tmp_path, cli.MANY_FILES[0], 1_000)  # 2 MB in all: more than a small run
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    if case == "many small, user's":
        env["_RJEM_MALLOC_CONF"] = "dirty_decay_ms:5"
    code = ("import os; from traceana.cli import program_settings; program_settings(); "
            f"program_settings({str(run)!r}); print(os.environ.get('_RJEM_MALLOC_CONF'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == {"many small": "dirty_decay_ms:1000,muzzy_decay_ms:0",
                                  "many small, user's": "dirty_decay_ms:5",
                                  "few big": "dirty_decay_ms:0,muzzy_decay_ms:0"}[case]


def test_a_small_run_of_many_files_gets_one_arena_and_the_decay(tmp_path):
    run = _run_of(tmp_path, cli.MANY_FILES[0], 10)  # 20 kB of JSON in all: a small run (reading.SMALL_RUN_BYTES)
    assert reading.is_small_run(run)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    code = ("import os; from traceana.cli import program_settings; program_settings(); "
            f"program_settings({str(run)!r}); print(os.environ.get('_RJEM_MALLOC_CONF'), "
            "os.environ.get('POLARS_MAX_THREADS'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0", "1"]
    assert not os.environ.get("_RJEM_MALLOC_CONF", "").startswith("narenas")  # (this process: untouched)
