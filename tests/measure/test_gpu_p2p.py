"""Waiting vs transfer of P2P messages (issue 26, item 3): the transfer floor (bytes over the link's bandwidth) on
both sides of a pair, GPU and CPU, and the wait-return tolerance of the CPU "last activity" rule. Times in µs; every
expected figure is worked out by hand in the comments."""

from __future__ import annotations

import polars as pl
from attribution_builder import US, EventsBuilder

from traceana.core.schema import conform
from traceana.measure import attribution as attr
from traceana.measure.analysis import analyze
from traceana.measure.p2p import LINK_BYTES_PER_S, MESSAGE, pair


def _messages(rows):
    cols = ["rank", "dir", "channel", "peer", "tag", "nbytes", "step", "post_ns", "end_ns", "on_gpu", "launch_ns"]
    return conform(pl.DataFrame([dict(zip(cols, r)) for r in rows]), MESSAGE)


def _gpu_pair(nbytes: int):
    """Rank 1's receive kernel runs 0–100 µs; rank 0's send kernel starts at 90 and ends at 100."""
    return _messages([(0, "send", "p2p", 1, 0, nbytes, 1, 90 * US, 100 * US, True, 85 * US),
                      (1, "recv", "p2p", 0, 0, nbytes, 1, 0, 100 * US, True, 0)])


def test_a_receive_kernel_waits_until_the_send_kernel_starts_then_transfers():
    """The receive kernel spins 0–90 until its peer's send kernel starts: 90 µs waiting, 10 moving 32 bytes."""
    pairs, _, _, notes = pair(_gpu_pair(32))
    assert pairs.select("wait_ns", "transfer_ns", "min_transfer_ns").row(0) == (90 * US, 10 * US, 1)
    assert not any("link" in n for n in notes)


def test_no_transfer_is_shorter_than_its_bytes_over_the_link():
    """20,000 bytes at 1 GB/s take 20 µs: the measured 10 µs after the send kernel started (clocks apart) cannot be
    the whole transfer, so the split moves to 80 µs (wait 80, transfer 20) and a note names the bandwidth."""
    pairs, _, _, notes = pair(_gpu_pair(20_000), link_bytes_per_s=1e9)
    assert pairs.select("data_ready_ns", "wait_ns", "transfer_ns").row(0) == (80 * US, 80 * US, 20 * US)
    assert any("1 GB/s" in n and "link_bytes_per_s" in n and "0.010 ms" in n for n in notes)
    # At the default (NVLink 4, 450 GB/s) the same bytes take 44 ns: the measured split stands.
    pairs, _, _, notes = pair(_gpu_pair(20_000))
    assert pairs["transfer_ns"][0] == 10 * US and LINK_BYTES_PER_S == 450e9 and not notes


def test_the_sender_side_gets_the_same_floor():
    """The send kernel 90–100 µs against a receive posted at 0: by the measured times it moved bytes all along (its
    peer was ready); with a 15 µs floor it still does (the floor only moves a split earlier, never later)."""
    pairs, unmatched, _, _ = pair(_gpu_pair(15_000), link_bytes_per_s=1e9)
    transfer, wait = attr.p2p_intervals(pairs, unmatched)
    assert transfer.filter(pl.col("rank") == 0).select("start", "end").row(0) == (90 * US, 100 * US)
    assert wait.filter(pl.col("rank") == 0).filter(pl.col("end") > pl.col("start")).height == 0


def test_a_send_kernel_that_waited_for_its_receiver_keeps_the_floor():
    """Rank 0's send kernel 0–100, rank 1's receive kernel 95–100: the sender waited until 95, then 5 µs moved
    20,000 bytes — at 1 GB/s they take 20, so its transfer is 80–100 and its wait 0–80."""
    msgs = _messages([(0, "send", "p2p", 1, 0, 20_000, 1, 0, 100 * US, True, 0),
                      (1, "recv", "p2p", 0, 0, 20_000, 1, 95 * US, 100 * US, True, 90 * US)])
    pairs, unmatched, _, _ = pair(msgs, link_bytes_per_s=1e9)
    transfer, wait = attr.p2p_intervals(pairs, unmatched)
    assert transfer.filter(pl.col("rank") == 0).select("start", "end").row(0) == (80 * US, 100 * US)
    assert wait.filter(pl.col("rank") == 0).select("start", "end").row(0) == (0, 80 * US)


def _wait_returning_late(next_op_start: float) -> EventsBuilder:
    """Two CPU ranks, one step 0–100. Rank 1 posts a receive at 0 (gloo:recv 0→50), computes 10–20, then blocks in
    wait() until 50; its next op starts at ``next_op_start`` and runs to 60. Rank 0 sends at 45 (45→50)."""
    b = EventsBuilder()
    for r in (0, 1):
        b.step(r, 1, 0, 100)
    b.send(0, 1, 45, 50)
    b.recv(1, 0, 0, 50)
    b.op(1, "aten::mm", 10, 20)
    b.op(1, "aten::mm", next_op_start, 60)
    return b


def test_the_next_op_starting_a_few_us_before_the_wait_returns_does_not_make_the_wait_host():
    """Rank 1 blocked from its last activity (20) to the return (50): waiting 20–45 (its peer sent at 45), moving
    45–50. The next op starting at 47, 3 µs before the return (a converted timeline), used to be taken as the
    thread's last activity: the wait was 47–50 and 20–47 host. Host is now 1–10 (the post op ends at 1) and 60–100:
    49 µs, whichever of 47 or 50 the next op starts at."""
    for start in (50, 47):
        a = analyze(_wait_returning_late(start).run())
        got = dict(a.attribution.filter(pl.col("rank") == 1).select(pl.col("category").cast(pl.String), "ns").rows())
        assert got["host"] == 49 * US, start
        assert sum(v for c, v in got.items() if c.startswith("bubble")) == 25 * US, start


def test_a_batched_send_recv_kernel_that_names_no_send_or_receive_is_noted():
    """A rank posts a send and a receive (record_param_comms, their scopes closed) and the batch's one SendRecv
    kernel is launched afterwards by a coalescing op: it names no direction, counts as collective, and is noted."""
    b = EventsBuilder()
    b.step(0, 1, 0, 100)
    b._add(0, "cpu_op", "record_param_comms", 1, 2, coll="send", peer=1, nbytes=64)
    b._add(0, "cpu_op", "record_param_comms", 3, 4, coll="recv", peer=1, nbytes=64)
    b.op(0, "nccl:coalesced", 5, 6)
    b.kernel(0, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 10, 30, stream=20, launch=5.5)
    a = analyze(b.run())
    kernel = a.events.filter(pl.col("is_gpu"))
    assert kernel["kind"].cast(pl.String).to_list() == ["collective"]
    assert any(n.startswith("rank 0: 1 send/receive kernels (0.020 ms) name no launching send or receive")
               for n in a.notes)


def test_run_json_link_bandwidth_reaches_the_split_of_a_gpu_pair():
    """Rank 0's send kernel 25–35 µs, rank 1's receive kernel 10–36: by the kernels, rank 1 waited 10–25 and moved
    bytes 25–36. run.json says the link moves 256 bytes in 16 µs (16 MB/s): the transfer is 20–36, the wait 10–20."""
    from traceana.core.manifest import Manifest

    b = EventsBuilder()
    for r in (0, 1):
        b.step(r, 1, 0, 100)
    b.nccl(0, "send", 1, launch=12, start=25, end=35)
    b.nccl(1, "recv", 0, launch=1, start=10, end=36)
    plain = analyze(b.run(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1))))
    assert plain.p2p.select("wait_ns", "transfer_ns").row(0) == (15 * US, 11 * US)
    slow = analyze(b.run(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1), extra={"link_bytes_per_s": 16e6})))
    assert slow.p2p.select("wait_ns", "transfer_ns", "min_transfer_ns").row(0) == (10 * US, 16 * US, 16 * US)
    assert any("16 MB/s" in n or "0.016 GB/s" in n for n in slow.notes)
