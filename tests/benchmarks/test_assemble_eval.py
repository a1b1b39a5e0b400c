"""benchmarks/assemble.py: the `dcache eval` section quotes its command and the report's own table with links that
exist, results from an uncommitted tree are refused with the command that reproduces them, and the page it builds
from the committed results is one page whose links all exist."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "benchmarks" / "results" / "eval_tiny"


def _assemble():
    spec = importlib.util.spec_from_file_location("dcache_benchmarks_assemble", ROOT / "benchmarks" / "assemble.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eval_copy(tmp_path: Path, commit: str) -> Path:
    """The recorded eval folder (its report and results only) inside the repository layout, with `commit`."""
    folder = ROOT / "benchmarks" / "out" / f"assemble-test-{tmp_path.name}"
    folder.mkdir(parents=True)
    for name in ["report.md", "report.html", "pareto.png"]:
        shutil.copy(FOLDER / name, folder / name)
    results = json.loads((FOLDER / "results.json").read_text())
    results["environment"]["git_commit"] = commit
    (folder / "results.json").write_text(json.dumps(results))
    return folder


@pytest.fixture
def eval_folder(tmp_path):
    folders = []
    yield lambda commit: folders.append(_eval_copy(tmp_path, commit)) or folders[-1]
    for folder in folders:
        shutil.rmtree(folder)


@pytest.mark.skipif(not (FOLDER / "results.json").is_file(), reason="benchmarks/eval_tiny.sh has not been run")
def test_eval_section_quotes_the_command_and_the_report_table(eval_folder):
    folder = eval_folder("0123abc")
    section = _assemble().eval_section(folder)
    results = json.loads((folder / "results.json").read_text())
    assert results["command"].startswith("dcache eval ") and results["command"] in section
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| method | compute ratio |")
    assert [row.split(" | ")[0].lstrip("| ") for row in table[1:]] == results["order"]  # one row per method
    report_table = [line for line in (folder / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert table == report_table  # copied, not recomputed
    for link in re.findall(r"\]\(([^)]+)\)", section):
        assert (ROOT / link).is_file(), link


@pytest.mark.skipif(not (FOLDER / "results.json").is_file(), reason="benchmarks/eval_tiny.sh has not been run")
def test_results_from_an_uncommitted_tree_are_refused_with_the_rerun_command(eval_folder):
    assemble = _assemble()
    folder = eval_folder("0123abc+dirty")
    with pytest.raises(assemble.DirtyResultsError, match=r"uncommitted changes \(0123abc\+dirty\).*"
                                                         r"bash benchmarks/eval_tiny\.sh") as error:
        assemble.eval_section(folder)
    assert str(folder.relative_to(ROOT) / "results.json") in str(error.value)


def test_the_page_is_one_page_whose_links_exist_and_shows_no_dirty_results(tmp_path, monkeypatch):
    assemble = _assemble()
    monkeypatch.setattr(assemble, "RESULTS", tmp_path)  # plots go to tmp_path; inputs are copied there
    for name in ["methods.json", "search.json"]:
        shutil.copy(ROOT / "benchmarks" / "results" / name, tmp_path / name)
    page = assemble.build()
    assert len(page.encode()) < 21_000  # every section but two says "not recorded yet" here: ~20 kB of fallbacks
    assert "+dirty" not in page
    for link in re.findall(r"\]\(([^)#]+)", page):
        assert (ROOT / link).exists() or (tmp_path / Path(link).name).exists(), link
