"""Which cores the collector pins its ranks to (collectors.launch.cores_to_pin): one each when the ranks fit in the
launcher's cores and nothing else keeps those cores busy; none otherwise (measured: pinning under other jobs' load
made ranks slower and no steadier, docs/field-notes.md "Noise floor")."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

from collectors import launch  # noqa: E402


@pytest.mark.parametrize("cores, load, ranks, expected", [
    ({0, 1, 2, 3}, 0.0, 2, [0, 1]),  # an idle 4-core host: a core each
    ({4, 6}, 0.1, 2, [4, 6]),  # the launcher's own mask, in order
    ({0, 1, 2, 3}, 3.0, 2, None),  # other jobs hold 3 of 4 cores: the kernel may move ranks to the free one
    ({0, 1}, 0.0, 4, None),  # more ranks than cores: pinning two to one core would serialise them
])
def test_cores_to_pin(monkeypatch, cores, load, ranks, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert launch.cores_to_pin(ranks) == expected
