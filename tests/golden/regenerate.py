"""Write every golden case's expected output again: ``python tests/golden/regenerate.py`` (from anywhere: the
repository's traceana is put on the path). ``--case NAME`` (repeatable) writes only
those. Review the diff (``git diff tests/golden/expected``) before committing it: tests/golden/README.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

from golden_cases import CASES, ROOT  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append", default=[], help="only this case (its name; repeatable)")
    args = parser.parse_args(argv)
    unknown = set(args.case) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in CASES)}")
    from golden_cases import write

    for case in CASES:
        if not args.case or case.name in args.case:
            print(write(case).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
