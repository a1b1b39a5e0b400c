"""`dcache generate --prompts FILE` (batch mode) on a random-weight tiny model: one image per prompt x seed, the
manifest, resume, refusal of a different run in the same folder, bad prompt files, and a 2-process `accelerate
launch` run that writes the same images as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
from typer.testing import CliRunner

from dcache.pipelines.cli import app

runner = CliRunner()
ARGS = ["--seeds", "2", "--cache", "fora", "--steps", "3", "--guidance", "1.0", "--batch-size", "2"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "labels.txt"
    path.write_text("# three digits\n3\n\n1\n4\n")
    return path


@pytest.fixture(scope="module")
def single(tiny_dir, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch") / "single"
    r = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--prompts", str(prompt_file), *ARGS,
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out, r.output


def _pixels(path) -> np.ndarray:
    return np.asarray(PIL.Image.open(path))


def test_one_image_per_prompt_and_seed_and_a_manifest(single):
    out, output = single
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "dcache.generate" and manifest["command"].startswith("dcache generate")
    images = manifest["images"]
    assert [(e["seed"], e["prompt"]) for e in images] == [(s, p) for s in (0, 1) for p in ("3", "1", "4")]
    for e in images:
        arr = _pixels(out / e["file"])
        assert arr.shape[:2] == (16, 16) and arr.dtype == np.uint8  # the tiny model's 16x16 digits
        assert 0 < e["compute_ratio"] < 1  # fora reused something
        # timing: the whole call's seconds (one item = up to --batch-size 2 prompts) and each image's share of it
        assert e["seconds_per_image"] == pytest.approx(e["batch_seconds"] / e["batch_size"])
    items = {e["item"] for e in images}
    for item in items:  # the images of one call share its time
        assert len({(e["batch_seconds"], e["batch_size"]) for e in images if e["item"] == item}) == 1
    assert sorted(e["batch_size"] for e in images) == [1, 1, 2, 2, 2, 2]  # 3 prompts in calls of 2 + 1
    s = manifest["summary"]
    assert s["images"] == 6 and s["cache"] == "fora" and s["processes"] == 1
    assert s["compute_ratio"] == pytest.approx(sum(e["block_flops"][0] for e in images)
                                               / sum(e["block_flops"][1] for e in images))
    assert "6 images (3 prompts x 2 seeds)" in output
    assert not list(out.rglob("*.tmp*"))  # nothing half-written left behind
    # the two seeds give different images of the same prompt
    assert not np.array_equal(_pixels(out / images[0]["file"]), _pixels(out / images[3]["file"]))


def test_rerun_resumes_and_a_different_run_is_refused(single, tiny_dir, prompt_file):
    out, _ = single
    first = json.loads((out / "manifest.json").read_text())["images"]
    mtimes = {e["file"]: (out / e["file"]).stat().st_mtime_ns for e in first}
    (out / first[-1]["file"]).unlink()  # a lost image is regenerated; the others are kept
    r = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--prompts", str(prompt_file), *ARGS,
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    again = json.loads((out / "manifest.json").read_text())["images"]
    assert [e["file"] for e in again] == [e["file"] for e in first]
    assert all((out / f).stat().st_mtime_ns == t for f, t in list(mtimes.items())[:4])  # other items untouched
    assert (out / first[-1]["file"]).is_file()
    r = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--prompts", str(prompt_file), *ARGS,
                            "--set", "interval=2", "--out", str(out)])
    assert r.exit_code == 2 and "different settings" in r.output and "--out" in r.output


@pytest.mark.parametrize("content, name, message", [
    (None, "missing.txt", "does not exist"),
    ("# only a comment\n\n", "empty.txt", "holds no prompts"),
    ('["a cat", ', "broken.json", "not valid JSON"),
    ('{"prompt": "a cat"}\n{"text": 3\n', "broken.jsonl", "line 2 is not valid JSON"),
    ('[{"caption": ""}]', "blank.json", "entry 1 is not a prompt"),
])
def test_bad_prompt_files_fail_before_the_model_loads(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    # the model does not exist: the prompt file is checked first, so its error is the one reported
    r = runner.invoke(app, ["generate", "--model", str(tmp_path / "no-model"), "--prompts", str(path),
                            "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_labels_the_model_cannot_take_and_conflicting_options(tiny_dir, tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("3\n12\n")
    r = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--prompts", str(labels), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "class labels 0-9" in r.output
    r = runner.invoke(app, ["generate", "--prompt", "3", "--prompts", str(labels), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "not both" in r.output


def test_batch_mode_takes_the_scope_and_refuses_a_target(tiny_dir, tmp_path):
    """--scope reaches dcache.apply in batch mode (fbcache decides inside the call, so call scope is refused, as it
    is for one generation); a --speed / --quality target is refused with the way to get one, not ignored."""
    labels = tmp_path / "labels.txt"
    labels.write_text("3\n")
    base = ["generate", "--model", str(tiny_dir), "--prompts", str(labels), "--steps", "4", "--no-progress"]
    r = runner.invoke(app, [*base, "--cache", "fbcache", "--scope", "call", "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "decides before the transformer runs" in r.output, r.output
    r = runner.invoke(app, [*base, "--speed", "2x", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--set <knob>=<value>" in r.output, r.output
    assert not (tmp_path / "b").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_write_the_same_images(single, tiny_dir, prompt_file, tmp_path):
    out, _ = single
    dist = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           "-m", "dcache.pipelines.cli", "generate", "--model", str(tiny_dir), "--prompts", str(prompt_file), *ARGS,
           "--out", str(dist)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single_m = json.loads((out / "manifest.json").read_text())
    dist_m = json.loads((dist / "manifest.json").read_text())
    assert dist_m["summary"]["processes"] == 2
    assert {e["process"] for e in dist_m["images"]} == {0, 1}  # the items were split over both processes
    assert [e["file"] for e in dist_m["images"]] == [e["file"] for e in single_m["images"]]
    for e in single_m["images"]:
        assert np.array_equal(_pixels(out / e["file"]), _pixels(dist / e["file"])), e["file"]
    assert dist_m["summary"]["compute_ratio"] == single_m["summary"]["compute_ratio"]
    assert proc.stdout.count("6 images") == 1  # one summary, printed by the main process
