"""The test tree has no ``__init__.py`` files: pytest imports each test module by its basename, so
two test files with one basename in different tiers break collection of the whole suite."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_test_module_basenames_are_unique_across_tiers():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert names, "no test modules found"
    assert [n for n, k in names.items() if k > 1] == []
