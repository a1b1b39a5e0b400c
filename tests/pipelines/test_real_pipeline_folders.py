"""`dcache generate --model <folder>` and `dcache eval --model <folder>` end to end on real diffusers pipelines saved
with save_pretrained (tests/real_pipelines.py: tiny configs, random weights, word-level tokenizers), loaded back by
the CLI through `DiffusionPipeline.from_pretrained` exactly as a user's folder: images / videos written, the printed
and saved stats show reuse (fixed_interval: step 1 of 4 reused), cached close to uncached."""

from __future__ import annotations

import json
import math

import pytest
from real_pipelines import PROMPT, REAL_PIPELINES, STEPS
from typer.testing import CliRunner

from dcache.pipelines.cli import app

runner = CliRunner()

FOLDERS = ["flux", "sd3", "qwen_image", "wan21", "wan22"]  # wan22: two experts (transformer_2)
# Call arguments the CLI passes through --call (prompt, steps, guidance, height and width have their own flags).
CLI_OWN = {"prompt", "num_inference_steps", "guidance_scale", "height", "width", "output_type"}


def _common(spec) -> list[str]:
    args = ["--steps", str(STEPS), "--device", "cpu", "--dtype", "float32",
            "--height", str(spec.kwargs["height"]), "--width", str(spec.kwargs["width"])]
    for key, value in spec.kwargs.items():
        if key not in CLI_OWN:
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
                                 "--repeats", "1", "--out", str(out), *_common(spec)])
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
                                 "psnr,max_abs", "--no-progress", "--out", str(out), *_common(spec)])
    assert result.exit_code == 0, result.output
    variants = json.loads((out / "results.json").read_text())["variants"]
    row = variants["fixed_interval"]
    assert 0.0 < row["compute_ratio"] < 1.0 and row["max_abs"] > 0.0 and 15.0 < row["psnr"] < math.inf
    assert variants["uncached"]["compute_ratio"] == 1.0
    assert (out / "report.md").stat().st_size > 0 and (out / "report.html").stat().st_size > 0
