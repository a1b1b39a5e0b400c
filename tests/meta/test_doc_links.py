"""Every path a document names exists in the repository: markdown links and images, and code spans that name a
repository file (`tests/compat/test_soak.py::test_x`, `benchmarks/results/methods.json`, `docs/eval.md`).

A code span counts as a repository path when its first component is a top-level entry of the repository, or when it
has a `/` and a file extension; spans with placeholders (`<out>/plans/*.plan.json`), absolute or home paths, URLs and
hub ids (`org/name`, no extension) are not paths of this repository. Relative paths resolve against the document's
folder, then the repository root, and must stay inside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "BENCHMARKS.md", "COMPATIBILITY.md", "SUPPORT.md",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
EXTENSION = re.compile(r"\.(py|md|json|png|sh|toml|txt|html|safetensors|jsonl|yaml|yml|gif|csv)$")
PLACEHOLDER = re.compile(r"[<>*{}$\s…]|\.\.\.")


def _top_level() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {f.split("/")[0] for f in files}


TOP = _top_level()


def _exists(target: str, doc: Path) -> bool:
    for base in (doc.parent, ROOT):
        path = (base / target).resolve()
        if path.is_relative_to(ROOT) and path.exists():
            return True
    return False


def named_paths(text: str) -> list[str]:
    """The repository paths a markdown text names (links first, then code spans outside fenced blocks)."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:, data:) or an anchor in the same page
        out.append(target.split("#")[0])
    for span in CODE_SPAN.findall(FENCE.sub("", text)):
        token = span.split("::")[0].strip().rstrip(",.;:")
        if not token or PLACEHOLDER.search(token) or token.startswith(("/", "~", "-")) or "://" in token:
            continue
        first = token.split("/")[0]
        if (first in TOP and first not in (".", "..")) or ("/" in token and EXTENSION.search(token)):
            out.append(token)
    return out


def test_the_reader_finds_links_and_repository_paths_and_skips_the_rest():
    text = ("see [the report](benchmarks/results/eval_tiny/report.md#x) and ![plot](pareto.png), "
            "[site](https://example.org), `tests/compat/test_soak.py::test_soak_200_generations`, "
            "`<out>/plans/*.plan.json`, `org/name`, `/tmp/x/y.json`, `stats.json`, `runs/a.plan.json`\n"
            "```\nnot/checked.py\n```\n")
    assert named_paths(text) == ["benchmarks/results/eval_tiny/report.md", "pareto.png",
                                 "tests/compat/test_soak.py", "runs/a.plan.json"]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_path_a_document_names_exists(document):
    doc = ROOT / document
    missing = sorted({p for p in named_paths(doc.read_text()) if not _exists(p, doc)})
    assert not missing, f"{document} names {len(missing)} path(s) that are not in the repository: {missing}"
