"""Batch generation (`dcache generate --prompts FILE`) keeps every path inside its output folder and trusts a marker
(`<out>/.work/<item>.json`, what a rerun skips) only when it names its item's own images:

  * a marker whose `file` climbs out of the folder is refused naming the marker, and nothing outside is listed;
  * malformed markers are one `error:` line naming the marker and the fix (exit code 2), never a traceback;
  * `images/` or `.work` linked out of the output folder is refused;
  * fuzzed markers: an error naming the marker, or a manifest of exactly the run's own images.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from state_fuzz import FUZZ, JSON_VALUES, dead_pid, mutate
from typer.testing import CliRunner

from dcache.pipelines.cli import app

runner = CliRunner()
ARGS = ["--seeds", "1", "--cache", "fora", "--steps", "2", "--guidance", "1.0", "--batch-size", "2"]
ITEM = "s0-p0-1"  # seed 0, prompts 0..1
FILES = ["images/s0-p00000.png", "images/s0-p00001.png", "images/s0-p00002.png"]


def generate(tiny_dir: Path, prompts: Path, out: Path):
    return runner.invoke(app, ["generate", "--model", str(tiny_dir), "--prompts", str(prompts), *ARGS,
                               "--out", str(out)])


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "labels.txt"
    path.write_text("3\n1\n4\n")
    return path


@pytest.fixture(scope="module")
def finished(tiny_dir, prompts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("batch") / "out"
    r = generate(tiny_dir, prompts, out)
    assert r.exit_code == 0, r.output
    return out


def _edit_marker(out: Path, edit) -> Path:
    marker = out / ".work" / f"{ITEM}.json"
    data = json.loads(marker.read_text())
    edit(data)
    marker.write_text(json.dumps(data))
    return marker


def _refused(result, path: Path, words: str = "delete") -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and str(path) in result.output and words in result.output, result.output


def test_a_marker_file_that_climbs_out_of_the_folder_is_refused(copy, tiny_dir, prompts, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not an image of this run")
    climb = "../" * len(copy.parts) + str(secret).lstrip("/")
    marker = _edit_marker(copy, lambda d: d["entries"][0].__setitem__("file", climb))
    (copy / "manifest.json").unlink()
    _refused(generate(tiny_dir, prompts, copy), marker)
    assert not (copy / "manifest.json").exists()


MARKERS = {
    "not JSON": '{"fingerprint": ',
    "a list": "[1, 2]",
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "no entries": None,
    "one entry of two": None,
    "seed as a string": None,
    "another item's image": None,
}


@pytest.mark.parametrize("case", sorted(MARKERS))
def test_a_malformed_marker_is_one_error_line_naming_it(copy, tiny_dir, prompts, case):
    marker = copy / ".work" / f"{ITEM}.json"
    if MARKERS[case] is not None:
        marker.write_text(MARKERS[case])
    else:
        _edit_marker(copy, {"no entries": lambda d: d.pop("entries"),
                            "one entry of two": lambda d: d["entries"].pop(),
                            "seed as a string": lambda d: d["entries"][1].__setitem__("seed", "0"),
                            "another item's image": lambda d: d["entries"][0].__setitem__("file", FILES[2])}[case])
    _refused(generate(tiny_dir, prompts, copy), marker)


@pytest.mark.parametrize("name", ["images", ".work"])
def test_a_folder_linked_out_of_the_output_folder_is_refused(copy, tiny_dir, prompts, tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(copy / name), str(elsewhere))
    (copy / name).symlink_to(elsewhere, target_is_directory=True)
    before = {p: p.stat().st_mtime_ns for p in elsewhere.rglob("*")}
    _refused(generate(tiny_dir, prompts, copy), copy / name, "leads out of")
    assert {p: p.stat().st_mtime_ns for p in elsewhere.rglob("*")} == before  # nothing written there


def test_a_marker_linked_out_of_the_output_folder_is_refused(copy, tiny_dir, prompts, tmp_path):
    marker = copy / ".work" / f"{ITEM}.json"
    outside = tmp_path / "outside.json"
    shutil.move(str(marker), str(outside))
    marker.symlink_to(outside)
    _refused(generate(tiny_dir, prompts, copy), marker, "leads out of")


@FUZZ
@given(data=st.data())
def test_fuzzed_markers(finished, tiny_dir, prompts, tmp_path_factory, data):
    out = tmp_path_factory.mktemp("fuzz") / "out"
    shutil.copytree(finished, out)
    marker = out / ".work" / f"{ITEM}.json"
    marker.write_text(json.dumps(mutate(data, json.loads(marker.read_text()), JSON_VALUES)))
    r = generate(tiny_dir, prompts, out)
    if r.exit_code == 2:
        assert "Traceback" not in r.output and str(marker) in r.output, r.output
        return
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["file"] for e in manifest["images"]] == FILES
    assert all((out / f).is_file() for f in FILES)


def test_a_killed_runs_temporary_files_are_removed_on_resume(copy, tiny_dir, prompts):
    """kill -9 while an image or a marker was being written leaves dcache.files.atomic's temporary file; the rerun
    removes the ones whose writer is gone and writes no manifest entry for them."""
    pid = dead_pid()
    stale = [copy / "images" / f".s0-p00000.{pid}.0123abcd.tmp.png",
             copy / ".work" / f".{ITEM}.{pid}.89abcdef.tmp.json"]
    for path in stale:
        path.write_bytes(b"half")
    r = generate(tiny_dir, prompts, copy)
    assert r.exit_code == 0, r.output
    assert not any(path.exists() for path in stale)
    assert [e["file"] for e in json.loads((copy / "manifest.json").read_text())["images"]] == FILES
