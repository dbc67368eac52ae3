"""Measurement: the ingested events → what happened, in figures. Classify each event, the steps and clocks, P2P
messages and their pairing, rank → stage placement, the schedule, run.json reconciled against the traces, the
attribution of every instant, memory per stage, GPU overlap, the noise rule, ``analysis.analyze`` (→ ``Analysis``)
and the measured summary (figures only; who holds a step back is the causal layer's). Imports core and ingest only."""
