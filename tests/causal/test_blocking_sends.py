"""Which sends hold their sender (graph._blocking, docs/whatif.md "The graph"): a send blocks where the trace shows
its sender waiting in it — the send's span (post to the return of its wait) still open when the message arrived, and
the sender running no operation between the arrival and the span's return. torch.distributed.pipelining posts its
sends with batch_isend_irecv and waits on them later (before the next send, or at the end of the step): a sender
that ran its next pass meanwhile did not wait, and a what-if on its receiver must not move it. Hand-built steps; the
counterfactuals are worked out by hand in the comments."""

from __future__ import annotations

import polars as pl

from traceana.causal import graph, replay

MS = 1_000_000


def _step(send_end_ms: float, rank0: list[tuple], rank1_x_ms: float = 20):
    """rank 0: the operations ``rank0`` ((action, start ms, end ms), work = the whole span); its seq 0 (A, 0-10 ms)
    sends to rank 1's seq 1 (C, 10 ms), whose receive is posted after its X (a backward of ``rank1_x_ms``, from 0);
    the message takes 1 ms once both are posted; the send's span runs from 10 ms to ``send_end_ms``."""
    rows = [(0, q, a, s, e) for q, (a, s, e) in enumerate(rank0)]
    rows += [(1, 0, "B", 0, rank1_x_ms), (1, 1, "F", rank1_x_ms + 1, rank1_x_ms + 11)]
    ops = pl.DataFrame(
        [(r, 0, q, a, graph.KIND_OF_ACTION[a], r, None, round(s * MS), round(e * MS), round((e - s) * MS), 0, None,
          None, "hand", False, 0) for r, q, a, s, e in rows],
        schema={**graph.OPS, **graph.WAIT}, orient="row")
    edges = pl.DataFrame([(0, "p2p", 0, 0, 1, 1, 0, 0, 0, MS)], schema=graph.EDGES, orient="row")
    sent = pl.DataFrame({"send_start_ns": [10 * MS], "send_end_ns": [round(send_end_ms * MS)],
                         "recv_post_ns": [round(rank1_x_ms * MS)], "recv_end_ns": [round((rank1_x_ms + 1) * MS)]})
    win = pl.DataFrame({"rank": [0, 1], "step": [0, 0], "start_ns": [0, 0], "end_ns": [60 * MS, 60 * MS]},
                       schema={"rank": pl.Int32, "step": pl.Int32, "start_ns": pl.Int64, "end_ns": pl.Int64})
    rk = pl.DataFrame([(r, 0, 0, 0, 0, r, 0) for r in (0, 1)], schema=graph.RANK_STEPS, orient="row")
    return ops, edges, sent, win, rk


def _ends(ops, edges, rk, blocking) -> dict[tuple[int, int], float]:
    g = graph.StepGraph(ops=ops, edges=edges, ranks=rk, steps=(0,), blocking=blocking)
    r = replay.replay(g, 0)
    return {(a, b): e / MS for a, b, e in r.ops.select("rank", "seq", "end_ns").iter_rows()}


def test_a_send_whose_sender_sat_in_it_until_the_message_arrived_blocks():
    # A 0-10 sends at 10; the receive is posted at 20 (after X), the message is through at 21; the sender sat in
    # the send until 21 (gloo's blocking send) and B ran after it, 21-31: B waits on the message.
    ops, edges, sent, win, rk = _step(21, [("F", 0, 10), ("F", 21, 31)])
    blocking = graph._blocking(edges, sent, ops, win)
    assert blocking.rows() == [(0, 0, 0, 1)]
    # X at twice its time (0-40): the message is through at 41, so B 41-51 (and C 41-51)
    slow = ops.with_columns(pl.when((pl.col("rank") == 1) & (pl.col("seq") == 0)).then(40 * MS)
                            .otherwise("work_ns").alias("work_ns"))
    assert _ends(slow, edges, rk, blocking)[(0, 1)] == 51


def test_an_isend_waited_on_after_the_next_pass_does_not_hold_the_sender():
    # pipelining's batch_isend_irecv: A 0-10 posts the send at 10 and rank 0 runs B 10-25 and D 25-30 before it
    # waits on the send's work (the span's return at 30.1). The message was through at 21, while B ran: rank 0 never
    # waited on it. (The old rule gated D, the first operation whose work began after the arrival.)
    ops, edges, sent, win, rk = _step(30.1, [("F", 0, 10), ("F", 10, 25), ("F", 25, 30)])
    blocking = graph._blocking(edges, sent, ops, win)
    assert blocking.height == 0
    # the receiver's X at twice its time (0-40, message through at 41): rank 0 stays as it ran, D ends at 30;
    # at half (0-10): D still 25-30, B 10-25
    for x in (40, 10):
        slow = ops.with_columns(pl.when((pl.col("rank") == 1) & (pl.col("seq") == 0)).then(x * MS)
                                .otherwise("work_ns").alias("work_ns"))
        got = _ends(slow, edges, rk, blocking)
        assert (got[(0, 1)], got[(0, 2)]) == (25, 30)
        assert got[(1, 1)] == x + 11


def test_an_isend_whose_wait_the_sender_reached_before_the_arrival_holds_it():
    # the same isend, but rank 0's next pass B is short (10-15) and it waits on the send from 15: the wait returns
    # when the message is through (21, the span's end) and D runs after it, 21-26: D waits on the message, B not.
    ops, edges, sent, win, rk = _step(21, [("F", 0, 10), ("F", 10, 15), ("F", 21, 26)])
    assert graph._blocking(edges, sent, ops, win).rows() == [(0, 0, 0, 2)]


def test_a_gain_beyond_the_time_removed_is_said():
    # megatron-core 1F1B (tests/data): stage 1's forwards at half remove half their work (summed here from the
    # graph's operations, per step); the replay gains more, because the waits no edge explains shrink with the step
    # (rho): a max-plus replay with those waits fixed gains at most the time removed, so the what-if says it.
    from traceana.causal.whatif import parse_set, whatif
    from traceana.measure.analysis_cache import load_and_analyze
    from pathlib import Path
    a = load_and_analyze(str(Path(__file__).parents[1] / "data/megatron_pipe/1f1b/run"), cache=False)
    w = whatif(a, [parse_set("stage=1:forward*0.5")])
    g = graph.build(a)
    fwd = g.ops.filter((pl.col("stage") == 1) & (pl.col("phase") == "forward"))
    removed_ms = fwd["work_ns"].sum() / 2 / g.ops["step"].n_unique() / MS
    gain = w.summary["replayed_step_ms"] - w.summary["changed_step_ms"]
    said = [n for n in w.notes if "more than the" in n and "stage=1:forward*0.5" in n]
    assert (gain > removed_ms + 0.01) == bool(said), (gain, removed_ms, said)
