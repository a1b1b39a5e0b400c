"""speed= / quality= on a model dcache ships no MagCache ratios for: MagCache calibrates itself once, on the
calibration run, and the threshold sweep runs with the measured curve (it used to spend every setting's run on the
self-calibrating first generation, so every setting measured compute ratio 1.000 and no target was met)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxTransformer2DModel
from typer.testing import CliRunner

import dcache
from dcache.pipelines.bundled import TINY_MODEL_DIR, load_tiny_pipeline
from dcache.pipelines.cli import app
from dcache.pipelines.tiny_pipeline import DigitFlowPipeline
from dcache.schedules.magcache import MagCacheSelfCalibration
from dcache.schedules.tables import lookup_table

STEPS = 16


def uncalibrated_pipeline() -> DigitFlowPipeline:
    """The bundled digit pipeline with a transformer of another size (4 single-stream blocks instead of 6, random
    weights, seeded): a model identity no shipped MagCache table matches."""
    config = {k: v for k, v in json.loads((TINY_MODEL_DIR / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**{**config, "num_single_layers": 4}).eval()
    base = load_tiny_pipeline()
    pipe = DigitFlowPipeline(transformer=transformer, scheduler=base.scheduler, label_encoder=base.label_encoder)
    pipe.set_progress_bar_config(disable=True)
    assert lookup_table("magcache", transformer) is None
    return pipe


def calibration_run(pipe):
    return lambda: pipe(["3", "7"], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1),
                        output_type="pt")


@pytest.mark.parametrize("target, check", [
    ({"speed": "2x"}, lambda row: row["ideal_speedup"] >= 2.0),
    ({"quality": "psnr>=45"}, lambda row: row["psnr"] >= 45.0),
])
def test_targets_sweep_with_one_calibration_on_a_model_without_ratios(target, check, capsys):
    pipe = uncalibrated_pipeline()
    with pytest.warns(MagCacheSelfCalibration):  # said once, by the calibration
        handle = dcache.apply(pipe, "magcache", calibration_run=calibration_run(pipe), **target)
    sweep = handle.target.sweep
    assert handle.target.met and len(sweep) == 8
    assert all(row["compute_ratio"] < 1.0 for row in sweep), sweep  # every setting cached: none measured instead
    chosen = next(row for row in sweep if row["value"] == handle.target.value)
    assert check(chosen) and chosen["ideal_speedup"] > 1.5
    # the chosen config carries the measured curve: the handle caches from its first generation
    pipe(["3", "7"], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert handle.stats().compute_ratio == pytest.approx(chosen["compute_ratio"], abs=0.15)
    assert handle.stats().compute_ratio < 0.8
    handle.remove()
    err = capsys.readouterr().err
    assert "0/9" in err and "9/9" in err  # a bar over the 9 runs (calibration + 8 settings), shown from the start


def test_generate_speed_on_a_folder_without_ratios(tmp_path):
    folder = tmp_path / "digits-4"
    uncalibrated_pipeline().save_pretrained(folder)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt", "3,7", "--steps", str(STEPS),
                                      "--cache", "magcache", "--speed", "2x", "--repeats", "0", "--out", str(out),
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["target"]["value"] is not None and stats["ideal_speedup"] >= 2.0
    assert all(row["compute_ratio"] < 1.0 for row in stats["target"]["sweep"])
    # --no-progress: one line per sweep run, the first before any setting ran
    assert "magcache sweep: run 1/9: calibrating magcache" in result.output
    assert "magcache sweep: run 9/9" in result.output
