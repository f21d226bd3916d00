"""Test files are imported by their basename (the test folders are not packages), so one name
in tests/unit and tests/gpu stops the whole run's collection ("import file mismatch")."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique_across_the_test_folders():
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(TESTS)))
    twice = {name: paths for name, paths in seen.items()
             if len(paths) > 1 and name not in ("conftest.py", "__init__.py")}
    assert not twice, f"rename one of each: {twice}"
