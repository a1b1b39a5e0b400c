"""pytest leaves right after its summary (tests/conftest.py): no closing gc passes, no interpreter teardown, no atexit
work; the session's exit status is kept. Shown with a plugin that registers an atexit marker: it never runs unless
DCACHE_TESTS_FULL_TEARDOWN=1 asks for the normal exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHEAP = "tests/meta/test_doc_links.py::test_the_reader_finds_links_and_repository_paths_and_skips_the_rest"
PLUGIN = """
import atexit, os

def pytest_configure(config):
    atexit.register(lambda: open(os.environ["EXIT_MARKER"], "w").close())
"""


def _run(tmp_path: Path, *args: str, full: bool = False) -> tuple[int, bool]:
    (tmp_path / "exit_marker_plugin.py").write_text(PLUGIN)
    marker = tmp_path / f"marker-{full}-{len(args)}"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "EXIT_MARKER": str(marker)}
    env.pop("DCACHE_TESTS_FULL_TEARDOWN", None)
    if full:
        env["DCACHE_TESTS_FULL_TEARDOWN"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "exit_marker_plugin", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, marker.exists()


@pytest.mark.slow  # three fresh interpreters importing torch
def test_the_session_exits_after_its_summary_with_its_status(tmp_path):
    assert _run(tmp_path, CHEAP) == (0, False)  # passed; atexit work skipped
    assert _run(tmp_path, CHEAP, "-k", "no_such_test") == (5, False)  # "no tests ran" status kept
    assert _run(tmp_path, CHEAP, full=True) == (0, True)  # the opt-out keeps the normal exit
