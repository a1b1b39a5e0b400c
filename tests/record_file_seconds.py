"""Rewrite tests/file_seconds.json, the seconds each test file takes, from a pytest JUnit report.

    python -m pytest -p no:xdist --junitxml=/tmp/junit.xml    # one process: the figures are one core's
    python tests/record_file_seconds.py /tmp/junit.xml

tests/conftest.py runs the longest files first so that `make test`'s workers finish together; it reads this table.
A test's time in the report includes its setup and teardown, so a module fixture counts in its file's first test.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

from dcache.files.atomic import atomic_write_text

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def file_of(classname: str) -> str | None:
    """'tests.core.test_x' or 'tests.core.test_x.TestCase' -> 'tests/core/test_x.py' (None: no such file)."""
    parts = classname.split(".")
    while parts:
        path = Path(*parts).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
        parts.pop()
    return None


def file_seconds(report: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return {path: round(s, 1) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        raise SystemExit("usage: python tests/record_file_seconds.py JUNIT_XML (a report written by pytest "
                         "--junitxml=JUNIT_XML)")
    seconds = file_seconds(Path(argv[0]))
    if not seconds:
        raise SystemExit(f"{argv[0]} names no test file under {ROOT}: run pytest from the repository root.")
    atomic_write_text(TESTS / "file_seconds.json", json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()) / 60:.1f} min in all; longest: "
          + ", ".join(f"{p} {s:.0f} s" for p, s in list(seconds.items())[:5]))


if __name__ == "__main__":
    main(sys.argv[1:])
