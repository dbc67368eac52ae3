"""The prepared GPU check (collectors/gpu_check.py, issue 26 item 6) without a GPU: it imports, refuses plainly
where there is no CUDA device, and its truth arithmetic gives the shares worked out by hand. (Its whole path runs on
the CPU with ``--cpu-smoke``, ~3 minutes here: docs/gpu.md shows that output; not a test, for time.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from collectors import gpu_check  # noqa: E402


def test_truth_shares_are_the_mean_share_of_each_phase_and_the_largest_allocator_growth():
    steps = [{"dur_ns": 100, "phases_ns": {"forward": 20, "backward": 50}, "base_bytes": 1000, "peak_bytes": 1600},
             {"dur_ns": 200, "phases_ns": {"forward": 60, "backward": 80}, "base_bytes": 1000, "peak_bytes": 1500}]
    got = gpu_check.truth_shares(steps)
    assert got["forward"] == pytest.approx((0.2 + 0.3) / 2) and got["backward"] == pytest.approx((0.5 + 0.4) / 2)
    assert got["activation_peak_bytes"] == 600 and got["peak_bytes"] == 1600


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path, capsys):
    assert gpu_check.main(["-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0] and "--cpu-smoke" in err[0]
