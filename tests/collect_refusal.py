"""The one check of a refused ``traceana collect`` (tests/collectors): exit 2, the reason on one line of stderr, no
traceback, and nothing written where the run was to go."""

from __future__ import annotations

from pathlib import Path

from traceana.cli import main


def assert_collect_refused(argv: list[str], says: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["collect", "--pp", "4", *argv, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err, err
    assert not out.exists()
