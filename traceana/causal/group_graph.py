"""The measured step's dependency graph built one pipeline group a task: no process ever holds the job's events.

``graph.build`` is ``graph.assemble`` of one ``graph.GraphPart`` of every rank. A part needs only its ranks' events
and the ranks they exchange P2P messages with — the pipeline group ``measure.partitioned`` analyses in one task —
save for what only the whole job tells, which ``assemble`` adds to the parts: a collective's members in other groups
(each stage's data-parallel all-reduce) and its work (what a member took after the *last* member joined, wherever it
is), the stage scope of a collective no process group names, the replicas, the notes (counts summed over the
groups). So the graph assembled from the groups' parts is the one ``build`` makes of the whole run in one process
(tests/causal/test_group_graph.py compares them frame for frame on every run of tests/data with replicas).

``analyze_with_graph`` runs ``partitioned.analyze_partitioned`` with ``graph_part`` as each group task's ``extra``:
the worker, holding the group's events, builds its part over the group's measured steps (a superset of the job's:
a step every rank of the job ran is one every rank of the group ran); the parent assembles the job's measured
steps. ``analyze --dask`` gets its diagnosis from it, ``whatif --per-group --dask`` its graph (its variants then
replayed one group a task too: causal.group_replay).

Where the groups are not the pipelines: a run profiled without record_shapes names no P2P peer; where its traces
name a pipeline process group (megatron-core's) ``measure.partitioned`` groups by it, else (DeepSpeed) each rank is
a group of its own, its messages cannot be paired inside one task (their peer is in another) and the graph is
refused in one line (GraphError: analyse in one process, where the peers are taken from the schedule — docs/whatif.md
"Edges without metadata" — or profile with shapes), never assembled with edges missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from traceana.causal.graph import GraphError, GraphPart, PairFacts, StepGraph, assemble, build_part
from traceana.measure import partitioned


@dataclass(frozen=True)
class PartRefused:
    """A group's part that could not be built (``GraphError``'s what and fix: plain strings, picklable)."""

    what: str
    fix: str | None


def graph_part(analysis) -> GraphPart | PartRefused:
    """In a worker: the group's part of the graph over its measured steps (``graph.build_part``)."""
    try:
        return build_part(analysis, list(analysis.summary.steps))
    except GraphError as e:
        return PartRefused(e.what, e.fix)


def assemble_parts(parts: list, steps: list[int], *, path) -> StepGraph:
    """The job's graph over ``steps`` from its groups' parts (``graph.assemble``); GraphError where a group's part
    was refused (the first one's reason)."""
    refused = [p for p in parts if isinstance(p, PartRefused)]
    if refused:
        raise GraphError(refused[0].what, path=path, fix=refused[0].fix)
    facts = PairFacts.combined([p.pairs for p in parts])
    if len(parts) > 1 and not facts.complete:  # (a message's peer is in another group: the groups are no pipelines)
        raise GraphError(f"{facts.counts.get('missing', 0)} P2P messages name no peer and the traces name no pipeline "
                         f"process group, so the {len(parts)} groups the run was split into are not its pipelines: "
                         "its graph cannot be built one group a task", path=path,
                         fix="analyse it in one process (drop --dask: the peers are then taken from the schedule), "
                             "or profile with record_shapes=True")
    return assemble(parts, steps, path=path)


def analyze_with_graph(run_dir: str | Path, out_dir: str | Path, *, map=map, peak_flops: float | None = None,
                       names=None):
    """``measure.partitioned.analyze_partitioned``, and the measured steps' graph built one pipeline group a task
    (module docstring): (analysis, graph), the graph a GraphError (not raised) where it cannot be built."""
    analysis, parts = partitioned.analyze_partitioned_with(run_dir, out_dir, extra=graph_part, map=map,
                                                           peak_flops=peak_flops, names=names)
    try:
        return analysis, assemble_parts(parts, list(analysis.summary.steps), path=Path(run_dir))
    except GraphError as e:
        return analysis, e
