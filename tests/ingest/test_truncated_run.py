"""A job killed while writing: the truncated rank is recovered and marked in the analysis, the CLI and the report."""

from __future__ import annotations

import warnings

from tracebuilder import TraceBuilder

from reports.build import write_report
from traceana.cli import main
from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze


def two_rank_run(tmp_path):
    tmp_path.mkdir()
    for rank in range(2):
        tb = TraceBuilder(rank=rank, world_size=2)
        for step in range(3):
            t0 = step * 100
            tb.step(step, t0, t0 + 100)
            tb.annotation(f"PP:{rank}F0", t0 + 10 + 40 * rank, 20)
            tb.cpu_op("aten::mm", t0 + 12 + 40 * rank, 15)
            if rank == 0:
                tb.send(peer=1, tag=0, ts=t0 + 31, dur=2)
            else:
                tb.recv(peer=0, tag=0, ts=t0 + 5, dur=30)
        tb.write(tmp_path / f"rank{rank}.pt.trace.json")
    whole = (tmp_path / "rank1.pt.trace.json").read_bytes()
    (tmp_path / "rank1.pt.trace.json").write_bytes(whole[: int(len(whole) * 0.6)])  # killed mid-write
    return tmp_path


def test_truncated_rank_is_marked_in_analysis_cli_and_report(tmp_path, capsys):
    run_dir = two_rank_run(tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(run_dir, cache=False)
    assert any("truncated" in str(w.message) and "rank1" in str(w.message) for w in caught)
    assert run.traces.sort("rank")["truncated"].to_list() == [False, True]
    a = analyze(run)
    assert any(n.startswith("rank 1: trace truncated") for n in a.notes)
    assert a.steps.filter(a.steps["rank"] == 1).height >= 1  # what was complete is still analysed

    assert main(["analyze", "--quiet", "--no-cache", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "truncated" in out.out and "rank 1: trace truncated" in " ".join(out.out.split())

    html = write_report(tmp_path / "r.html", [a], validation=None).read_text()
    assert "rank 1: trace truncated" in html
