"""`dcache calibrate --method ertacache|profilingdit|invardiff|bac`: the plan file, its replay, calibration files,
models without a calibration, and the bundled model's shipped plans.

The calibrations run on the bundled model at 6 steps for one label (about a second each); the uncalibrated model is
a tiny random `DigitFlowPipeline` saved to a folder (another size, so another model identity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from typer.testing import CliRunner

import dcache
from dcache import Plan
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.pipelines.cli import app
from dcache.pipelines.label_encoder import LabelEncoder
from dcache.pipelines.presets import BUNDLED_CALIBRATION
from dcache.pipelines.tiny_pipeline import DigitFlowPipeline
from dcache.schedules.calibration_file import load_calibration
from dcache.methods import calibrated_methods
from dcache.schedules.calibrated_plans import CalibrationMissing, model_source
from dcache.schedules.tables import model_identity

runner = CliRunner()
PLAN_METHODS = calibrated_methods("plan")  # the profiled methods: their configs declare a plan calibrator
STEPS = ["--prompt", "3", "--steps", "6"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def generate(out: Path, cache: str, *extra: str) -> dict:
    result = invoke("generate", "--cache", cache, *STEPS, "--repeats", "0", "--out", str(out), *extra)
    assert result.exit_code == 0, result.output
    return json.loads((out / "stats.json").read_text())


@pytest.mark.parametrize("method", sorted(PLAN_METHODS))
def test_calibrate_writes_a_plan_that_replays_by_file_and_by_name(method, tmp_path):
    path = tmp_path / f"{method}.plan.json"
    result = invoke("calibrate", "--method", method, *STEPS, "--out", str(path))
    assert result.exit_code == 0, result.output
    plan = Plan.load(path)
    assert plan.provenance["method"] == method and plan.num_steps == 6 and plan.interpolate_steps
    assert sorted(plan.actions) == ["cond", "uncond"]
    assert f"dcache generate --cache {path}" in result.output
    assert f"dcache generate --cache {method} --set calibration={path}" in result.output
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write: no temporary file left

    by_file = generate(tmp_path / "file", str(path))
    by_name = generate(tmp_path / "name", method, "--set", f"calibration={path}")
    for stats in (by_file, by_name):  # the generation replayed exactly the calibrated rows
        assert [row for row in stats["stats"]["per_step"]] == [
            {b: plan.actions[b][i] for b in stats["stats"]["per_step"][i]} for i in range(6)]
    assert by_name["psnr_db"] == by_file["psnr_db"]  # the same decisions give the same images
    assert by_name["stats"]["method"] == method


def test_a_plan_added_to_a_calibration_file_keeps_its_other_entries(tmp_path):
    path = tmp_path / "cal.json"
    assert invoke("calibrate", "--method", "magcache", *STEPS, "--out", str(path)).exit_code == 0
    result = invoke("calibrate", "--method", "bac", *STEPS, "--out", str(path), "--set", "compute_ratio=0.4")
    assert result.exit_code == 0, result.output
    assert "--cache bac --set calibration=" in result.output and f"--cache {path}" not in result.output
    entries = {e.method: e for e in load_calibration(path).entries}
    assert set(entries) == {"magcache", "bac"} and entries["bac"].num_steps == 6
    assert Plan.from_dict(entries["bac"].table).provenance["config"]["compute_ratio"] == 0.4
    stats = generate(tmp_path / "out", "bac", "--set", f"calibration={path}")
    assert [r["cond"] for r in stats["stats"]["per_step"]] == entries["bac"].table["actions"]["cond"]


@pytest.mark.parametrize("args, message", [
    (["--method", "bac", "--set", "compute_ratio=3"], "compute_ratio=3"),
    (["--method", "bac", "--set", "speed=2"], "speed"),
    (["--method", "magcache", "--set", "threshold=0.1"], "--set configures a profiled method"),
    (["--method", "flowcache"], "has no calibration; choose one of"),
])
def test_calibrate_rejects_bad_input_with_the_fix(args, message, tmp_path):
    result = invoke("calibrate", *STEPS, "--out", str(tmp_path / "x.json"), *args)
    assert result.exit_code != 0 and message in result.output


def test_calibrate_refuses_to_overwrite_another_kind_of_file(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"mine": true}')
    result = invoke("calibrate", "--method", "bac", *STEPS, "--out", str(path))
    assert result.exit_code != 0 and "neither a dcache plan nor a dcache calibration file" in result.output
    assert path.read_text() == '{"mine": true}'


# ------------------------------------------------------------------------------------------------ uncalibrated model
@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """A saved digit pipeline the bundled calibration does not cover (another width: another model identity)."""
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    encoder = LabelEncoder(num_classes=10, num_tokens=4, joint_attention_dim=32, pooled_projection_dim=32).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    folder = tmp_path_factory.mktemp("other") / "digits"
    DigitFlowPipeline(transformer, scheduler, encoder).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", sorted(PLAN_METHODS))
def test_an_uncalibrated_model_gets_the_calibrate_command_and_it_works(method, other_model, tmp_path):
    result = invoke("generate", "--model", str(other_model), "--cache", method, *STEPS, "--repeats", "0",
                    "--out", str(tmp_path / "out"))
    assert result.exit_code != 0
    command = f"dcache calibrate --model {other_model} --method {method}"
    assert command in result.output, result.output
    assert f"calibrate_{method}(" not in result.output  # the command line shows the command, not Python

    out = tmp_path / "plan.json"  # the printed command, run as printed (plus the steps and the file)
    calibrated = invoke(*command.split()[1:], *STEPS, "--out", str(out))
    assert calibrated.exit_code == 0, calibrated.output
    assert f"dcache generate --model {other_model} --cache {out}" in calibrated.output
    result = invoke("generate", "--model", str(other_model), "--cache", method, "--set", f"calibration={out}",
                    *STEPS, "--repeats", "0", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output


def test_python_names_the_command_and_the_calls(other_model):
    pipe = DigitFlowPipeline.from_pretrained(str(other_model))
    with pytest.raises(CalibrationMissing) as info:
        dcache.apply(pipe, "bac")
    text = str(info.value)
    assert f"dcache calibrate --model {other_model} --method bac" in text
    assert "dcache.schedules.tuning.plan_calibration.calibrate_plan('bac', pipe, run_fn)" in text
    assert "calibration='bac.plan.json'" in text
    assert model_identity(pipe.transformer) in text


def test_model_source_reads_where_diffusers_loaded_the_model_from(other_model):
    class Loaded(torch.nn.Module):
        def __init__(self, where: str):
            super().__init__()
            self.config = {"_name_or_path": where}

    hub = "/root/.cache/huggingface/hub/models--black-forest-labs--FLUX.1-dev/snapshots/0ef5f/transformer"
    assert model_source(Loaded(hub)) == ("black-forest-labs/FLUX.1-dev", False)
    assert model_source(Loaded(str(other_model / "transformer"))) == (str(other_model), True)
    assert model_source(Loaded("org/name")) == ("org/name", False)
    assert model_source(Loaded("")) == (None, False)


# ------------------------------------------------------------------------------------------------ the bundled model
def test_the_bundled_model_ships_a_plan_for_every_profiled_method():
    entries = {e.method: e for e in load_calibration(BUNDLED_CALIBRATION).entries}
    pipe = load_tiny_pipeline()
    for method in PLAN_METHODS:
        entry = entries[method]
        plan = Plan.from_dict(entry.table)
        assert entry.model_identity == model_identity(pipe.transformer) and plan.num_steps == entry.num_steps == 28
        assert plan.interpolate_steps and plan.provenance["method"] == method
        assert plan.compute_ratio() < 0.9  # the shipped plans reuse
        with dcache.apply(pipe, method) as handle:  # registered: found by name
            assert handle.engine.schedule.plan.actions == plan.actions


@pytest.mark.parametrize("method", ["magcache", "bac"])
def test_calibrate_shows_progress_per_run(method, tmp_path):
    """A bar over the calibration runs (stderr) by default; with --no-progress, one line per run."""
    out = tmp_path / ("cal.json" if method == "magcache" else "plan.json")
    quiet = CliRunner().invoke(app, ["calibrate", "--method", method, *STEPS, "--seeds", "2", "--no-progress",
                                     "--out", str(out)])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr.count("[dcache] calibration run done") >= 2
    assert "seed 0" in quiet.stderr and "seed 1" in quiet.stderr
    bars = CliRunner().invoke(app, ["calibrate", "--method", method, *STEPS, "--seeds", "2", "--out", str(out)])
    assert bars.exit_code == 0, bars.output
    assert f"calibrate {method}" in bars.stderr and "2/2" in bars.stderr
