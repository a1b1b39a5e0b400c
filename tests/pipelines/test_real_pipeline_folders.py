"""`dcache generate --model <folder>` and `dcache eval --model <folder>` end to end on real diffusers pipelines saved
with save_pretrained (tests/real_pipelines.py: tiny configs, random weights, word-level tokenizers), loaded back by
the CLI through `DiffusionPipeline.from_pretrained` exactly as a user's folder: images / videos written, the printed
and saved stats show reuse (fixed_interval: step 1 of 4 reused), cached close to uncached; on the folder loaded as
the CLI loads it, all-compute and post-remove() outputs equal the uncached ones bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from real_pipelines import PROMPT, REAL_PIPELINES, STEPS
from typer.testing import CliRunner

import dcache
from dcache.pipelines.cli import app

runner = CliRunner()

# Every pipeline of tests/real_pipelines.py (wan22: two experts; Kontext, Qwen-Image-Edit and the ControlNets take an
# image, passed as --call image=@file / control_image=@file). Qwen-Image-Edit's processor is the registry's
# QwenVLProcessor (transformers' Qwen2VLProcessor needs torchvision), saved and loaded like any processor.
# Qwen-Image-Edit is slow-marked: ~5 s per test (it resizes and VAE-encodes its input image at every call).
FOLDERS = [pytest.param(name, marks=pytest.mark.slow) if name == "qwen_image_edit" else name
           for name in REAL_PIPELINES]
# Call arguments the CLI passes through --call (prompt, steps, guidance, height and width have their own flags).
CLI_OWN = {"prompt", "num_inference_steps", "guidance_scale", "height", "width", "output_type"}


def _common(spec, folder: Path) -> list[str]:
    """The CLI flags of the spec's call; image arguments (PIL) saved beside the pipeline, passed as --call k=@file."""
    args = ["--steps", str(STEPS), "--device", "cpu", "--dtype", "float32",
            "--height", str(spec.kwargs["height"]), "--width", str(spec.kwargs["width"])]
    for key, value in spec.kwargs.items():
        if key in CLI_OWN:
            continue
        if isinstance(value, Image.Image):
            path = folder.parent / f"{folder.name}-{key}.png"
            value.save(path)
            args += ["--call", f"{key}=@{path}"]
        else:
            args += ["--call", f"{key}={json.dumps(value)}"]
    return args


@pytest.fixture(scope="module", params=FOLDERS)
def folder(request, tmp_path_factory):
    spec = REAL_PIPELINES[request.param]
    path = tmp_path_factory.mktemp("folders") / request.param
    spec.build().save_pretrained(path)
    return spec, path


def test_generate_on_a_saved_pipeline_folder(folder, tmp_path):
    spec, path = folder
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--model", str(path), "--prompt", PROMPT, "--cache", "fixed_interval",
                                 "--repeats", "0", "--out", str(out), *_common(spec, path)])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["steps"] == STEPS and stats["units_reused"] > 0 and stats["compute_ratio"] < 1.0
    assert f"reused {stats['units_reused']}," in result.output  # the printed stats show the reuse
    assert 15.0 < stats["psnr_db"] < math.inf  # decoded images: cached close to, but not equal to, uncached
    written = ["uncached.gif", "cached.gif"] if spec.video else ["grid.png"]
    assert all((out / name).stat().st_size > 0 for name in written + ["plan.json"])
    experts = stats["stats"]["experts"]
    if spec.build().components.get("transformer_2") is not None:  # each expert's plan and stats, and their sum
        assert (out / "plan.transformer_2.json").stat().st_size > 0
        assert set(experts) == {"transformer", "transformer_2"}
        assert stats["calls"] == sum(e["calls"] for e in experts.values())
        assert "transformer_2:" in result.output
    else:
        assert experts == {} and not list(out.glob("plan.*.json"))


def test_eval_on_a_saved_pipeline_folder(folder, tmp_path):
    spec, path = folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    out = tmp_path / "report"
    result = runner.invoke(app, ["eval", "--model", str(path), "--methods", "fixed_interval", "--prompts",
                                 str(prompts), "--seeds", "1", "--repeats", "1", "--warmup", "0", "--metrics",
                                 "psnr,max_abs", "--no-progress", "--out", str(out), *_common(spec, path)])
    assert result.exit_code == 0, result.output
    variants = json.loads((out / "results.json").read_text())["variants"]
    row = variants["fixed_interval"]
    assert 0.0 < row["compute_ratio"] < 1.0 and row["max_abs"] > 0.0 and 15.0 < row["psnr"] < math.inf
    assert variants["uncached"]["compute_ratio"] == 1.0
    assert (out / "report.md").stat().st_size > 0 and (out / "report.html").stat().st_size > 0


def test_all_compute_and_removal_are_exact_on_a_saved_pipeline_folder(folder):
    """The folder loaded as the CLI loads it (runner.load_pipeline): all-compute under dcache and the pipeline after
    handle.remove() give the uncached latents bit for bit; a reusing setting skips blocks (counted)."""
    from dcache.pipelines.runner import load_pipeline

    spec, path = folder
    pipe, _ = load_pipeline(str(path), device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)

    def run() -> torch.Tensor:
        out = pipe(**spec.call(seed=0))
        return torch.as_tensor(np.asarray(out.frames if spec.video else out.images))

    reference = run()
    with dcache.apply(pipe, "fbcache", threshold=0.0) as handle:
        assert torch.equal(run(), reference) and handle.stats().units_reused == 0
    with dcache.apply(pipe, "fixed_interval") as handle:
        cached = run()
        assert handle.stats().units_reused > 0
    assert not torch.equal(cached, reference)
    assert torch.equal(run(), reference)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_image_argument_that_is_not_an_image_file_is_refused_by_name(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.png").write_text("not a PNG")
    for value, reason in (("@missing.png", "no file 'missing.png'"), ("@notes.png", "is not an image")):
        result = runner.invoke(app, [command, "--call", f"control_image={value}", "--out", "out"])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.replace("\u2502", " ").split())  # the error box's borders and wrapping
        assert f"--call control_image={value}" in text and reason in text
        assert not (tmp_path / "out").exists()  # refused before anything ran
