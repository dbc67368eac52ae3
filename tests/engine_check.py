"""One check the replay tests share: a variant of a measured step replayed on the engine (``replay_steps_ns``) and on
the batched evaluator (``replay_variants``, forced on however small the graph), which must agree to the nanosecond."""

from __future__ import annotations

from traceana.causal import replay


def replayed_ns(g, ops, edges, variant) -> list[int]:
    """Each step of ``g`` replayed with ``variant`` (``whatif.changed``'s (work, gap, transfer) expressions over
    ``ops`` and ``edges``), in ns, after asserting that the engine and the batched evaluator give the same."""
    engine = replay.replay_steps_ns(g, ops=ops.with_columns(variant[0].alias("work_ns"), variant[1].alias("gap_ns")),
                                    edges=edges.with_columns(variant[2].alias("transfer_ns")))
    old, replay.BATCH_FROM_OPS = replay.BATCH_FROM_OPS, 0
    try:
        batched = replay.replay_variants(g, ops, edges, [variant])[0]
    finally:
        replay.BATCH_FROM_OPS = old
    assert batched == engine
    return engine
