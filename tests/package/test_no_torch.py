"""Analysing saved traces must work without torch: block its import and run the analysis end to end."""

from __future__ import annotations

import subprocess
import sys

from tracebuilder import TraceBuilder

BLOCK_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` now raises ImportError, find_spec says it is absent
"""


def test_analyze_and_help_without_torch(tmp_path):
    for rank in range(2):
        tb = TraceBuilder(rank=rank, world_size=2)
        tb.step(0, 0, 100)
        tb.annotation(f"PP:{rank}F0", 10 + 40 * rank, 20)
        tb.cpu_op("aten::mm", 12 + 40 * rank, 15)
        if rank == 0:
            tb.send(peer=1, tag=0, ts=31, dur=2)
        else:
            tb.recv(peer=0, tag=0, ts=5, dur=30)
        tb.write(tmp_path / f"rank{rank}.pt.trace.json.gz")
    code = BLOCK_TORCH + """
from traceana.cli import main
main(["--help"])  # argparse exits 0 after printing the help
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    code = BLOCK_TORCH + f"""
import traceana
from traceana.cli import main
rc = main(["analyze", "--quiet", "--no-cache", {str(tmp_path)!r}])
assert rc == 0, rc
assert not any(m.startswith("torch.") for m in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "stage" in out.stdout
