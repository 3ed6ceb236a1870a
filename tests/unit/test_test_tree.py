"""The test tree itself: pytest imports test files by basename (rootdir, no packages), so two test files of
one name in different tiers stop the whole run at collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py" and "data" not in p.parts)
    assert [name for name, n in names.items() if n > 1] == []
