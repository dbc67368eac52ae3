from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIRD_PARTY = ROOT.parent / "shared" / "traces" / "third_party"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def third_party() -> Path:
    if not THIRD_PARTY.is_dir():
        pytest.skip("../shared/traces/third_party is absent")
    return THIRD_PARTY
