"""1,000 ``--set`` flags through the command (parsed, checked against the run, composed, replayed) on a real run
(tests/data's megatron-core 1F1B, pp 2): by hand, stage 1's forwards ×2 then ×0.5 (exact in binary), P2P ×1 and
rank 0's host gaps ×1, 250 times each, leave every duration as measured, so the changed step is the replayed one;
and the cost is linear: the flags' CPU time beside the same command without them (the flags were once an
expression that doubled with each one: 16 aborted at 4 GB, 50 ran past 13 minutes). CPU time of this process, not
wall time (other jobs on a loaded machine stretch the wall clock, not the work)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

from traceana.cli import main

RUN = Path(__file__).resolve().parents[1] / "data" / "megatron_pipe" / "1f1b" / "run"
FLAGS = ["stage=1:forward*2", "stage=1:forward*0.5", "p2p*1", "rank=0:host*1"]


def _whatif(n: int) -> tuple[dict, float]:
    args = [a for i in range(n) for a in ("--set", FLAGS[i % 4])]
    out = io.StringIO()
    t0 = time.process_time()
    with contextlib.redirect_stdout(out):
        assert main(["whatif", str(RUN), "--no-cache", "--json", *args]) == 0
    return json.loads(out.getvalue()), time.process_time() - t0


def test_a_thousand_set_flags_compose_in_linear_time():
    plain, t_plain = _whatif(0)
    many, t_many = _whatif(1000)
    assert len(many["changes"]) == 1000
    assert many["changed_step_ms"] == plain["replayed_step_ms"] == many["replayed_step_ms"]
    assert t_many - t_plain < 10, (t_many, t_plain)
