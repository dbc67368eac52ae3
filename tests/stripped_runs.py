"""A collected run as a foreign trace would come: the schedule's names and the collector's facts removed.

``strip_run(src, dst)`` writes a copy of the run directory ``src`` to ``dst`` with, in every trace, no ``PP:…``
span (the schedule's actions: F, B, I, W, overlapped F+B, SEND/RECV) and no PyTorch GPipe ``Forward {i}`` /
``Backward {i}`` span, and without the ``traceana`` metadata object the collector's profiler adds (rank, stage,
stages, schedule); and with no run.json. What is left is what any Kineto trace of the same job holds: the ops,
the P2P calls and the process groups. The names are matched here by their spelling in torch's schedules, not by
traceana's parser.

``as_defaults(src, dst)``: a copy as torch.profiler's defaults would have written it (``with_stack`` and
``record_shapes`` off): no Python frames, no input shapes or concrete inputs (the P2P calls lose their peer), no
collector metadata, no run.json.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

SCHEDULE_NAME = re.compile(r"^(PP:.*|Forward \d+|Backward \d+)$")


def strip_trace(doc: dict) -> dict:
    """The trace document without the schedule's spans and the collector's metadata."""
    events = [e for e in doc.get("traceEvents", [])
              if not (e.get("cat") == "user_annotation" and SCHEDULE_NAME.match(str(e.get("name", ""))))]
    return {**{k: v for k, v in doc.items() if k != "traceana"}, "traceEvents": events}


def strip_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for trace in sorted(Path(src).glob("rank*.pt.trace.json*")):
        opener = gzip.open if trace.suffix == ".gz" else open
        with opener(trace, "rt") as f:
            doc = json.load(f)
        with opener(dst / trace.name, "wt") as f:
            json.dump(strip_trace(doc), f)
    return dst


SHAPE_KEYS = {"Input Dims", "Input type", "Concrete Inputs", "Input Strides"}  # what record_shapes=True adds


def as_defaults(src: Path, dst: Path) -> Path:
    """The run ``src`` as torch.profiler's defaults would have written it, at ``dst`` (module docstring)."""
    dst.mkdir(parents=True)
    for trace in sorted(Path(src).glob("rank*.pt.trace.json.gz")):
        with gzip.open(trace, "rt") as f:
            doc = json.load(f)
        doc.pop("traceana", None)
        doc["traceEvents"] = [
            {**e, "args": {k: v for k, v in e["args"].items() if k not in SHAPE_KEYS}}
            if isinstance(e.get("args"), dict) else e
            for e in doc["traceEvents"] if e.get("cat") != "python_function"]
        with gzip.open(dst / trace.name, "wt") as f:
            json.dump(doc, f)
    return dst
