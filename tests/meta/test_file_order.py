"""The suite hands out its longest files first (tests/conftest.py), so that `make test`'s workers finish together."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "tests" / "file_seconds.json"


def test_the_table_names_test_files_that_exist():
    listed_files = list(json.loads(TABLE.read_text()))
    missing = [path for path in listed_files if not (ROOT / path).is_file()]
    assert len(listed_files) > 100 and not missing, (
        f"tests/file_seconds.json names files that are gone: {missing[:5]}; rewrite it with "
        f"`python tests/record_file_seconds.py junit.xml` (tests/record_file_seconds.py says how)")


def test_collection_puts_the_longest_file_first(request):
    """Files given shortest first come out longest first, each file's tests together and in their order (the
    suite's own hook, called on stand-in items)."""
    conftest = next(p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "_FILE_SECONDS"))
    seconds = json.loads(TABLE.read_text())
    ranked = sorted(seconds, key=seconds.get)
    files = [ranked[0], ranked[len(ranked) // 2], ranked[-1]]
    items = [SimpleNamespace(nodeid=f"{path}::test_{i}") for path in [*files, "tests/not_in_the_table.py"]
             for i in range(3)]
    conftest.pytest_collection_modifyitems(request.config, items)
    order = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items))
    assert order == [files[2], files[1], "tests/not_in_the_table.py", files[0]]  # unknown: a median file
    for path in files:
        own = [item.nodeid for item in items if item.nodeid.startswith(path)]
        assert own == [f"{path}::test_{i}" for i in range(3)]
