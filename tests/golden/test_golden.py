"""The golden cases of tests/golden/golden_cases.py: each command's output on its checked-in trace against the expected
file (numbers to golden_cases.REL / ABS, everything else exactly). A failure lists every difference; if the change is
meant, regenerate (``python tests/golden/regenerate.py --case NAME``) and review the diff (tests/golden/README.md)."""

from __future__ import annotations

import pytest

from golden_cases import CASES, differences, output, read


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}/{c.name}" for c in CASES])
def test_golden(case):
    assert case.expected.is_file(), f"{case.expected} is missing: python tests/golden/regenerate.py --case {case.name}"
    diff = differences(read(case), output(case))
    assert not diff, (f"{case.area}/{case.name} ({' '.join(case.argv)}) differs from {case.expected.name} in "
                      f"{len(diff)} place(s):\n" + "\n".join(diff[:40]))


def test_every_expected_file_has_its_case():
    """No expected file is left behind by a removed or renamed case."""
    expected = {c.expected for c in CASES}
    on_disk = set(CASES[0].expected.parents[1].rglob("*.*"))
    assert on_disk <= expected, sorted(str(p) for p in on_disk - expected)


def test_the_comparison_tolerates_float_noise_and_nothing_else():
    assert differences({"a": 1.0, "b": [1, "x"]}, {"a": 1.0 + 1e-9, "b": [1, "x"]}) == []
    assert differences({"a": 1.0}, {"a": 1.001}) and differences({"a": "x"}, {"a": "y"})
    assert differences({"a": 1}, {"a": 1, "b": 2}) and differences([1, 2], [1])
    assert differences({"a": None}, {"a": 0}) and differences({"a": True}, {"a": 1})
