"""Waiting or transfer (docs/schedules.md): between CPU ranks a message moves its bytes in at most its bytes over the
slowest plausible link plus one message's latency (the ceiling: 1 Gb/s, 300 µs unless run.json says otherwise); a
receive that returns later than that after both sides were ready waited on its peer's process — a bubble by the
pipeline rules' windows, not P2P. Expected values by hand from the stated rule (tiny trace), and from the wall-clock
truth the Megatron run recorded outside its trace (tests/measure/test_foreign_pipelines.py)."""

from __future__ import annotations

import polars as pl
import pytest
from attribution_builder import US, EventsBuilder

from traceana.core.manifest import Manifest
from traceana.measure.analysis import analyze

# 128 bytes over 125e6 bytes/s is 1,024 ns; plus 300 µs of latency.
CEILING_NS = 1_024 + 300_000


def _late_sender() -> EventsBuilder:
    """Two CPU ranks, one step 0–6000 µs. Rank 1 posts a 128-byte receive at 100 (the post op 100→101) and then
    only blocks until it returns at 5000; it computes 5000→5500. Rank 0 computes 0→1000 and posts the send at 1000
    (1000→1001); its process makes the progress the transfer needs only at 5000 (its gloo:send span ends there)."""
    b = EventsBuilder()
    for r in (0, 1):
        b.step(r, 1, 0, 6000)
    b.op(0, "aten::mm", 0, 1000)
    b.send(0, 1, 1000, 5000)
    b.recv(1, 0, 100, 5000)
    b.op(1, "aten::mm", 5000, 5500)
    return b


def _shares(a, rank: int) -> dict[str, int]:
    got = dict(a.attribution.filter(pl.col("rank") == rank).select(pl.col("category").cast(pl.String), "ns").rows())
    got["bubble"] = sum(v for c, v in got.items() if c.startswith("bubble"))
    return got


def test_a_receiver_waiting_for_a_late_sender_is_a_bubble_not_transfer():
    a = analyze(_late_sender().run())
    msg = a.p2p.row(0, named=True)
    # The send started at 1000, after the receive was posted (100): the old split called 1000→5000 transfer.
    assert (msg["transfer_ns"], msg["wait_ns"]) == (CEILING_NS, 4_900 * US - CEILING_NS)
    assert msg["max_transfer_ns"] == CEILING_NS
    r1 = _shares(a, 1)
    # Rank 1: the last ceiling before the return is the message's cost (its transfer, which leaves nothing of the
    # ceiling to the post call's own 1 µs); the post call and the blocked time after it, 100 → 5000 − ceiling,
    # waited.
    assert r1["p2p"] == CEILING_NS
    assert r1["bubble"] == (5_000 - 100) * US - CEILING_NS
    assert r1["host"] == 600 * US  # 0→100 and 5500→6000
    # Rank 0 was blocked in its send from 1000 to 5000: the same ceiling holds on its side.
    r0 = _shares(a, 0)
    assert r0["p2p"] == CEILING_NS
    assert r0["bubble"] == (5_000 - 1_000) * US - CEILING_NS
    assert any("waiting on the peer's process" in n for n in a.notes)


def test_run_json_sets_the_ceilings_link_and_latency():
    """128 bytes at 128e6 bytes/s and no latency: 1 µs of transfer (the floor is the same link: 1 µs too)."""
    a = analyze(_late_sender().run(Manifest(world_size=2, pp=2, stage_of_rank=(0, 1),
                                            link_bytes_per_s=128e6, p2p_latency_ns=0)))
    assert a.p2p.select("transfer_ns", "max_transfer_ns", "min_transfer_ns").row(0) == (1 * US, 1 * US, 1 * US)
    assert _shares(a, 1)["p2p"] == 1 * US  # the transfer's 1 µs: the ceiling leaves nothing to the post call


def test_a_receive_returning_within_the_ceiling_keeps_its_transfer():
    """Both sides ready at 1000 and the receive back at 1100: 100 µs, under the ceiling, all transfer; the receive's
    post call (100→101) keeps its own 1 µs as P2P (the ceiling leaves room for it)."""
    b = EventsBuilder()
    for r in (0, 1):
        b.step(r, 1, 0, 2000)
    b.send(0, 1, 1000, 1100)
    b.recv(1, 0, 100, 1100)
    a = analyze(b.run())
    assert a.p2p.select("wait_ns", "transfer_ns").row(0) == (900 * US, 100 * US)
    assert not any("waiting on the peer's process" in n for n in a.notes)
    assert _shares(a, 1)["p2p"] == 101 * US


def test_a_bad_latency_in_run_json_is_refused():
    from traceana.core.errors import BadInputError
    for bad in (-1, "300us", True):
        with pytest.raises(BadInputError, match="p2p_latency_ns"):
            Manifest(world_size=2, pp=2, extra={"p2p_latency_ns": bad})


def test_the_waiting_note_counts_messages_waiting_at_once_once_per_rank_and_step():
    """Two 128-byte receives on rank 1, posted at 100 and 110 µs, both sent at 1000 and back at 5000 (tags 0 and
    1): each waited from its ready time (1000, the send's start) to 5000 − ceiling. Summed over messages that is
    twice 3,698.976 µs; rank 1 waited once, 3,698.976 µs, in its 6 ms step (issue 33: a note summed 56 s of
    waiting on a run whose ranks ran 10 s)."""
    import re

    b = EventsBuilder()
    for r in (0, 1):
        b.step(r, 1, 0, 6000)
    b.op(0, "aten::mm", 0, 1000)
    for tag, post in ((0, 100), (1, 110)):
        b.send(0, 1, 1000, 5000, tag=tag)
        b.recv(1, 0, post, 5000, tag=tag)
    a = analyze(b.run())
    note = next(n for n in a.notes if "waiting on the peer's process" in n)
    once = (5_000 - 1_000) * US - CEILING_NS  # ns
    assert f"{once / 1e6:,.3f} ms on the receiving ranks over 1 rank-step " in note, note
    assert f"at most {once / 1e6:,.3f} ms on rank 1 in step 1" in note, note
    total = float(re.search(r"— ([\d,.]+) ms on the receiving ranks", note).group(1).replace(",", ""))
    assert total <= 6.0  # never more than the rank ran (its 6 ms step)
