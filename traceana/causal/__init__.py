"""Causes: the measured step as a dependency graph (``graph``), the one scheduling engine it is replayed on and the
model simulates on (``scheduler.run_schedule``), the critical path, what-if replays (``whatif``) and the diagnosis
that names a straggler or bottleneck. Imports core, ingest and measure only."""
