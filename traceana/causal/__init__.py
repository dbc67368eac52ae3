"""Causes: the measured step as a dependency graph (``graph``), its replay on the one scheduling engine, one step or
many duration variants at once (``replay``; the engine, ``scheduler.run_schedule``, is the one the model simulates
on), the replayed step's critical path and slack (``critical_path``), what-if replays (``whatif``) and the diagnosis
that names a straggler or bottleneck (``diagnosis``). Imports core, ingest and measure only."""
