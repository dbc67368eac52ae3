"""graph.build's memory: ``p2p.messages``, which the graph calls with the analysis' classified events (27 columns),
keeps only the columns it reads of the communication rows (at 4,096 ranks 90 MiB above its input instead of 236 MiB:
docs/whatif.md "Scale"). The messages are the same, to the row, whether the events carry every column, only
those it reads (listed here by hand from its docstring and body: the communication ops and kernels, their spans,
the LOAD/ACCEPT spans), or an extra wide column beside them — on a gloo CPU run (posts extended by their gloo
spans), a generated NCCL GPU job (kernels) and a DeepSpeed run (blocking sends)."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from traceana.measure import p2p
from traceana.measure.analysis_cache import load_and_analyze

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gen_big_trace import write_run  # noqa: E402

# What messages reads of the events (its docstring and body): who, when, which op or kernel, its P2P fields, the
# span that extends a CPU post, the launch of a kernel, and the BPipe LOAD/ACCEPT spans.
READS = ["rank", "comm_dir", "step", "is_gpu", "cat", "name", "track", "ts_ns", "dur_ns", "channel", "peer", "tag",
         "nbytes", "launch_ns", "pp_action"]


def _same_messages(a) -> None:
    ev = a.events
    groups = p2p.bpipe_groups(a.run.traces)
    full = p2p.messages(ev, groups)
    assert full.height > 0
    assert p2p.messages(ev.select(READS), groups).equals(full)
    wide = ev.with_columns(pl.concat_list("ts_ns", "dur_ns", "ts_ns").alias("_extra"))
    assert p2p.messages(wide, groups).equals(full)


@pytest.mark.parametrize("run", ["megatron_pipe/1f1b/run", "deepspeed_pipe/1f1b/run"])
def test_messages_are_the_same_from_the_columns_they_read(run):
    _same_messages(load_and_analyze(str(DATA / run), cache=False))


def test_messages_of_gpu_kernels_are_the_same_from_the_columns_they_read(tmp_path):
    out = tmp_path / "run"
    write_run(out, ranks=2, dp=2, mb=0.05, gz=False, microbatches=4, kernels=1)
    a = load_and_analyze(str(out), cache=False)
    assert a.events.filter(pl.col("is_gpu") & pl.col("comm_dir").is_not_null()).height > 0
    _same_messages(a)
