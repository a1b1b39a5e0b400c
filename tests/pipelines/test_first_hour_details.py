"""Details a new user meets in the first hour: digit words in prompt files, the fix for a missing calibration file
and for a plan of another model variant, no empty --out left by a failed run, a difference heat map on a fixed scale
with a colour bar, the files generate wrote, --help without literal metavars on flags, readable calibrate output,
a progress bar that does not overflow, and what a search's quality column is."""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
import torch
from typer.testing import CliRunner

from dcache.eval.prompts import load_prompts
from dcache.pipelines import generate as generate_module
from dcache.pipelines.cli import app
from dcache.pipelines.images import DIFF_VMAX, heat, save_grid
from dcache.pipelines.progress import Progress

runner = CliRunner()
FAST = ["--steps", "4", "--repeats", "0", "--no-progress"]


def test_prompt_files_take_digit_words_as_generate_prompt_does(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("three\n7\nSeven\n")
    assert load_prompts(str(prompts), is_tiny=True) == ["3", "7", "7"]
    assert load_prompts("three,1", is_tiny=True) == ["3", "1"]
    result = runner.invoke(app, ["generate", "--prompts", str(prompts), "--seeds", "1", "--steps", "4",
                                 "--no-progress", "--out", str(tmp_path / "batch")])
    assert result.exit_code == 0, result.output
    assert "3 images (3 prompts x 1 seeds)" in result.output


def test_a_missing_calibration_file_gets_the_calibrate_command_before_loading(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(generate_module, "load_pipeline", refuse)
    result = runner.invoke(app, ["generate", "--cache", "magcache", "--set", "calibration=missing.json",
                                 "--out", str(tmp_path / "o"), *FAST])
    assert result.exit_code != 0
    assert "dcache calibrate --method magcache --out missing.json" in result.output
    assert "calibrate_magcache(" not in result.output


def test_a_plan_for_another_variant_says_how_to_make_one(tmp_path):
    out = tmp_path / "first"
    assert runner.invoke(app, ["generate", "--out", str(out), *FAST]).exit_code == 0
    plan = json.loads((out / "plan.json").read_text())
    plan["block_layout"] = [2, 4]  # as recorded on a variant with 4 single-stream blocks
    (tmp_path / "other.plan.json").write_text(json.dumps(plan))
    result = runner.invoke(app, ["generate", "--cache", str(tmp_path / "other.plan.json"),
                                 "--out", str(tmp_path / "second"), *FAST])
    assert result.exit_code != 0 and "another variant" in result.output
    assert "dcache generate --model <model> --cache magcache" in result.output
    assert "handle.plan().save" in result.output and "dcache search" in result.output
    assert not (tmp_path / "second").exists()  # the failed run left no empty --out behind


def test_a_failed_run_removes_the_out_folder_it_created_but_keeps_others(tmp_path):
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    for out in (fresh, existing):
        result = runner.invoke(app, ["generate", "--prompt", "12", "--out", str(out), *FAST])  # fails after loading
        assert result.exit_code != 0 and "class labels 0-9" in result.output
    assert not fresh.exists() and existing.is_dir()


def test_the_heat_map_has_a_fixed_scale_and_a_colour_bar(tmp_path):
    small = torch.full((1, 1, 8, 8), 0.003)  # ~50 dB: near black, however small its own maximum is
    assert float(heat(small).max()) < 0.03
    assert float(heat(torch.full((1, 1, 8, 8), DIFF_VMAX)).min(dim=1).values.max()) == 0.0  # blue channel
    assert heat(torch.full((1, 1, 8, 8), 2 * DIFF_VMAX))[:, :2].min() == 1.0  # saturates at yellow
    images = torch.rand(2, 1, 8, 8)
    plain = PIL.Image.open(save_grid([images], tmp_path / "a.png"))
    barred = PIL.Image.open(save_grid([images], tmp_path / "b.png", colorbar=DIFF_VMAX))
    assert barred.height > plain.height
    strip = np.asarray(barred.convert("RGB"))[plain.height:]
    assert (strip[..., 0] > 250).any() and ((strip[..., 1] > 250) & (strip[..., 2] < 10)).any()  # red, yellow


def test_generate_names_the_files_it_wrote(tmp_path):
    result = runner.invoke(app, ["generate", "--out", str(tmp_path / "o"), *FAST])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith(f"wrote        {tmp_path / 'o'}/: grid.png, stats.json, plan.json")


@pytest.mark.parametrize("command", ["generate", "eval", "search", "calibrate", "estimate"])
def test_help_shows_no_literal_metavar_on_flags(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "--help" in result.output
    assert "<bool>" not in result.output


def test_calibrate_prints_readable_lines(tmp_path):
    result = runner.invoke(app, ["calibrate", "--steps", "8", "--prompt", "1", "--out", str(tmp_path / "c.json"),
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "calibrated magcache:\n  cond: 8 values, first 1, last " in result.output
    assert "{" not in result.output and "[8 values]" not in result.output


def test_a_bar_that_runs_past_its_total_grows_instead_of_overflowing(capsys):
    with Progress(enabled=True).bar(total=1, desc="calibrate", unit="run") as bar:
        bar.step("seed 0")
        bar.step("seed 0 again")
        assert bar._bar.total == 2 and bar._bar.n == 2
    assert "2/2" in capsys.readouterr().err


def test_a_search_summary_names_its_quality(tmp_path):
    result = runner.invoke(app, ["search", "--method", "dp", "--steps", "6", "--prompts", "1", "--no-progress",
                                 "--out", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "s" / "summary.md").read_text()
    assert "Quality: PSNR (dB, capped at 100) of the cached images against the uncached ones" in summary
    assert "the caller's quality_fn" not in summary
