"""A receive posted ahead of the receiver's own work (issue 37: interleaved-1F1B → looped-BFS predicted +5 %), and the
host time between operations the plan what-if carries. Hand-built traces and graphs whose counterfactuals are worked
out by hand in each docstring.

The run (``posted_ahead``, times in µs): 1F1B, pp 2, m 2, every forward 20,000 µs and backward 40,000 µs (the
annotated spans), every send call 10 µs, a receive returns 200 µs after both sides posted (the wake-up).

- rank 0: F0 0-20,000, send act0 at 20,000; F1 20,010-40,010, send act1 at 40,010; receive of grad0 posted at
  40,020, returns at 80,410; B0 80,410-120,410; receive of grad1 posted at 120,410, returns at 140,610; B1
  140,610-180,610. Its step: 180,610 µs (the run's).
- rank 1: receive of act0 posted at 0, returns at 20,200; F0 20,200-40,200; the receive of act1 posted at 40,200
  (ahead: an irecv), then B0 40,210-80,210, send grad0 at 80,210; only then it waits on act1, which returns at
  80,410 (the bytes had been there since 40,200: the wait returns 200 µs after its rank began to wait); F1
  80,410-100,410, B1 100,410-140,410, send grad1 at 140,410.

act1's receive returned 40,210 µs after both sides posted, but for 40,000 of them rank 1 ran its own B0: that is not
the message's time. Its transfer is from the end of the receiver's last operation before the return (B0, 80,210) to
the return: 200 µs, raised to p2p.pair's ceiling for a CPU pair, 300 µs (its bytes at 125 MB/s — the trace gives
no byte count — plus a message's 300 µs: a receive that returns later than that after both sides were ready is taken
to have waited on its peer, the bytes moving last).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import graph, replay
from traceana.causal.whatif import parse_set
from traceana.measure.analysis_cache import load_and_analyze

MS = 1_000_000
US = 1_000


def posted_ahead(directory: Path) -> Path:
    import test_validate_roundtrip as rt
    from tracebuilder import TraceBuilder

    from traceana.core.manifest import Manifest

    directory.mkdir(parents=True, exist_ok=True)
    r0 = TraceBuilder(rank=0, world_size=2, pid=10, tid=10)
    r0.step(1, 0, 180_610)
    r0.annotation("PP:0F0", 0, 20_000)
    r0.send(peer=1, ts=20_000, dur=10)
    r0.annotation("PP:0F1", 20_010, 20_000)
    r0.send(peer=1, ts=40_010, dur=10)
    r0.recv(peer=1, ts=40_020, dur=80_410 - 40_020)
    r0.annotation("PP:0B0", 80_410, 40_000)
    r0.recv(peer=1, ts=120_410, dur=140_610 - 120_410)
    r0.annotation("PP:0B1", 140_610, 40_000)
    r1 = TraceBuilder(rank=1, world_size=2, pid=11, tid=11)
    r1.step(1, 0, 140_420)
    r1.recv(peer=0, ts=0, dur=20_200)
    r1.annotation("PP:1F0", 20_200, 20_000)
    r1.recv(peer=0, ts=40_200, dur=80_410 - 40_200)  # the irecv, waited on after B0 and the send of grad0
    r1.annotation("PP:1B0", 40_210, 40_000)
    r1.send(peer=0, ts=80_210, dur=10)
    r1.annotation("PP:1F1", 80_410, 20_000)
    r1.annotation("PP:1B1", 100_410, 40_000)
    r1.send(peer=0, ts=140_410, dur=10)
    r0.write(directory / "rank0.pt.trace.json.gz")
    r1.write(directory / "rank1.pt.trace.json.gz")
    (directory / "run.json").write_text(Manifest(
        world_size=2, pp=2, stage_of_rank=(0, 1), schedule="1f1b", microbatch_size=1, num_microbatches=2,
        model=dataclasses.replace(rt.TINY, layers=2), dtype="float32", attention="sdpa", recompute="none").to_json())
    return directory


def test_a_receive_posted_ahead_does_not_hold_the_receivers_own_work(tmp_path):
    """The graph of ``posted_ahead``: act0 200 µs, act1 300 µs (not 40,210: rank 1's own B0 is not in it), grad0 and
    grad1 200 µs; the replay is the run (180,610 µs). Rank 1's backwards at half (20,000 µs): B0 ends 10 µs × ρ after
    F0 (its 10 µs before B0, in the receive's post, is a wait no edge explains, scaled by the step's ratio ρ = work +
    transfers in the variant over the measured: (200,000 + 900) / (240,000 + 900)), act1 is long there, so F1 starts
    after B0 and the 200 µs wait (× ρ): 60,200 + 210 ρ, and B1 ends at 100,200 + 210 ρ. Rank 0's B0 starts when grad0
    arrives, 200 µs after rank 1's B0 (60,400 + 10 ρ), and ends 40,000 later; it then posts the receive of grad1,
    which rank 1 had sent already: through 200 µs later, B1 100,600 + 10 ρ to 140,600 + 10 ρ, the step. Before,
    act1 held rank 1's B0 (40 ms) as its flight: F1 could not start before 80,410, B1 ended at 120,410, and rank 0's
    B1 at 160,610."""
    a = load_and_analyze(str(posted_ahead(tmp_path / "run")), cache=False)
    g = graph.build(a)
    e = g.edges.sort("src", "src_seq")
    got = {(s, q): t / US for s, q, t in e.select("src", "src_seq", "transfer_ns").iter_rows()}
    assert got == {(0, 0): 200, (0, 1): 300, (1, 1): 200, (1, 3): 200}
    assert replay.replay_steps_ns(g) == [180_610 * US]
    rho = (200_000 + 900) / (240_000 + 900)
    ops = g.ops.with_columns(pl.when((pl.col("rank") == 1) & (pl.col("action") == "B")).then(20 * MS)
                             .otherwise(pl.col("work_ns")).alias("work_ns"))
    assert replay.replay_steps_ns(g, ops=ops)[0] == pytest.approx((140_600 + 10 * rho) * US, abs=2)
    # the what-if's own --set path gives the same
    from traceana.causal.whatif import whatif

    w = whatif(a, [parse_set("stage=1:backward=20")])
    assert w.summary["changed_step_ms"] == pytest.approx((140_600 + 10 * rho) / 1_000, abs=1e-5)


def test_the_plan_of_a_receive_posted_ahead_keeps_the_messages_own_time(tmp_path):
    """``posted_ahead`` under GPipe (``whatif --schedule gpipe``). The plan's inputs: every F 20,000 and B 40,000
    µs;     messages in flight (send lag 0 + transfer): act0 200, act1 300, grad0 200, grad1 200 µs; host time
    before an     operation (``plan.host_before``): rank 0's B0 10 µs (its receive of grad0 posted 10 µs after F1's
    end; the 10 µs     send calls are waits, not host work), its F1 and B1 0 — a mean of 10/3 µs before each
    operation of device 0;     device 1: 0. GPipe on the engine (each operation at max(previous end + host, inputs'
    arrival)): device 0's F0     10/3-20,003.33, F1 20,006.67-40,006.67; device 1's F0 at 20,203.33 (act0), F1 at
    40,306.67 (act1: 40,006.67 +     300) to 60,306.67, B0 to 100,306.67, B1 to 140,306.67; device 0's B0 at
    100,506.67 (grad0) to 140,506.67, B1 at     max(140,506.67 + 3.33, 140,306.67 + 200) = 140,510 to 180,510 µs:
    the step. Before, act1's flight held rank 1's     own B0 (40,210 µs) and the host time was each device's median
    gap (0): device 1's F1 at 80,210 and the step     220,410 µs, 22 % longer than the 1F1B it came from — not the
    ~(m + p − 1)(F + B) = 180 ms both take here. The run as it ran on the engine (1F1B): device 1's     F1 after its
    B0 (80,203.33), its B1 to 140,203.33, device 0's B1 140,403.33 to 180,403.33 µs."""
    from traceana.validation.plan import plan_whatif

    a = load_and_analyze(str(posted_ahead(tmp_path / "run")), cache=False)
    p = plan_whatif(a, schedule="gpipe")
    assert p["predicted_step_ms"] == pytest.approx(180.510, abs=1e-5)
    assert p["simulated_as_run_ms"] == pytest.approx(180.40333, abs=1e-5)
    assert p["measured_step_ms"] == pytest.approx(180.61)


def test_host_before_an_operation_is_its_ranks_posts_and_host_gap():
    """``plan.host_before`` on a hand-built graph (no trace): rank 0 runs A (seq 0), B (seq 1), C (seq 2); A's
    activation is sent 0.3 ms after A ends, and a receive for C's input is posted 0.5 ms after B ends (anchor B),
    C starting 0.2 ms of host work after that message arrived; B had 1 ms of host work before it and a 4 ms wait no
    edge explains. Rank 1 runs D (seq 0), E (seq 1), E's input posted 0.4 ms after D, of which 0.25 ms waited on an
    earlier receive (``after_receive``: DeepSpeed's posts after a blocking receive). By hand: B 1 (its gap) + 0.3
    (A's send, the post after A) = 1.3 ms; C 0.2 + 0.5 = 0.7 ms; E 0.4 − 0.25 = 0.15 ms; the first operations none.
    The plan engine's host time before each operation is the device's mean: rank 0 1.0 ms, rank 1 0.15 ms (the
    median of rank 0's would be 1.3 … or 0.7 by its two operations: the mean keeps the device's host time)."""
    from test_graph_replay import hand

    from traceana.validation.plan import host_before

    g = hand([(0, 0, "F", 10, 0, 0), (0, 1, "F", 10, 1, 4), (0, 2, "F", 10, 0.2, 0),
              (1, 0, "F", 10, 0, 0), (1, 1, "F", 10, 0, 0)],
             [(0, 0, 1, 1, 0, 0.3, 0.1, 1),    # A's activation to E (rank 1's post anchored at D, 0.1 ms after it)
              (1, 0, 0, 2, 1, 0.0, 0.5, 1)])   # D's output to C: rank 0 posts 0.5 ms after B
    # rank 1's post of A's activation came 0.4 ms after D: 0.25 of it waited on another receive (edge 1 of the step
    # in the replay's order: dst 1 sorts after dst 0)
    e = g.edges.with_columns(pl.when(pl.col("dst") == 1).then(round(0.4 * MS)).otherwise(pl.col("post_lag_ns"))
                             .alias("post_lag_ns"))
    after = pl.DataFrame([(0, 1, "post", 0, round(0.15 * MS), round(0.25 * MS))], schema=graph.AFTER_RECEIVE,
                         orient="row")
    g = graph.StepGraph(ops=g.ops, edges=e, ranks=g.ranks, steps=g.steps, after_receive=after)
    got = {(r, q): h / MS for r, _, q, h in host_before(g).sort("rank", "seq").iter_rows()}
    assert got == pytest.approx({(0, 1): 1.3, (0, 2): 0.7, (1, 1): 0.15})
