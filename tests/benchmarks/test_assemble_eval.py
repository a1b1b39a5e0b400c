"""The BENCHMARKS.md section made from a `dcache eval` report folder: the command that produced it, the report's own
table, and links that point at files in the repository."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "benchmarks" / "results" / "eval_tiny"


def _assemble():
    spec = importlib.util.spec_from_file_location("dcache_benchmarks_assemble", ROOT / "benchmarks" / "assemble.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (FOLDER / "results.json").is_file(), reason="benchmarks/eval_tiny.sh has not been run")
def test_eval_section_quotes_the_command_and_the_report_table():
    section = _assemble().eval_section(FOLDER)
    results = json.loads((FOLDER / "results.json").read_text())
    assert results["command"].startswith("dcache eval ") and results["command"] in section
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| method | compute ratio |")
    assert [row.split(" | ")[0].lstrip("| ") for row in table[1:]] == results["order"]  # one row per method
    report_table = [line for line in (FOLDER / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert table == report_table  # copied, not recomputed
    for link in re.findall(r"\]\(([^)]+)\)", section):
        assert (ROOT / link).is_file(), link
