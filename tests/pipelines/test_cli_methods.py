"""`dcache generate --cache NAME` for every method and preset `dcache methods` lists, on the bundled model.

Every name runs at 6 steps without CFG (--guidance 1: one call per step, half the time). Each method (one per family:
a preset runs its method's code with other knobs) runs at a second step count with the default split CFG: 12, or for
the profiled methods, whose bundled plans are calibrated at the pipeline's default 28 steps, 28 (exact replay; at 6
steps their plans are interpolated). Bounds against the uncached run of the same command: the calls per step (1, or
2 with CFG), compute ratio x ideal speed-up = 1 (FLOP arithmetic, not a timing), and the PSNR of the cached vs the
uncached images above a floor. Presets bound to a model's own TeaCache table (a `variant`)
must refuse the bundled model and name the variant.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import dcache
from dcache.pipelines.cli import app
from dcache.methods import calibrated_methods

runner = CliRunner()
PLAN_METHODS = calibrated_methods("plan")  # the profiled methods: their configs declare a plan calibrator

METHODS = sorted(dcache.methods())
PRESETS = dcache.presets()
MODEL_BOUND = sorted(name for name, preset in PRESETS.items() if "variant" in preset.overrides)
NAMES = METHODS + sorted(set(PRESETS) - set(MODEL_BOUND))
# The most aggressive setting at 6 steps (fora-7: one compute per 7 steps of every module) still keeps the digit.
PSNR_FLOOR_DB = 12.0


def generate(tmp_path, name: str, steps: int | None, *extra: str) -> dict:
    out = tmp_path / "out"
    args = ["generate", "--cache", name, "--prompt", "3", "--repeats", "0", "--out", str(out), *extra]
    result = runner.invoke(app, args + (["--steps", str(steps)] if steps is not None else []))
    assert result.exit_code == 0, f"dcache generate --cache {name}: {result.output}"
    return json.loads((out / "stats.json").read_text())


def check(stats: dict, steps: int, calls_per_step: int = 2) -> None:
    assert stats["steps"] == steps and stats["calls"] == calls_per_step * steps  # split CFG: cond + uncond
    assert stats["compute_ratio"] * stats["ideal_speedup"] == pytest.approx(1.0)
    assert float(stats["psnr_db"]) >= PSNR_FLOOR_DB, stats["psnr_db"]  # "inf" when nothing was reused


def test_the_parametrization_covers_what_dcache_methods_lists():
    listed = {line.split()[0] for line in runner.invoke(app, ["methods"]).output.splitlines() if line.strip()}
    assert listed == set(NAMES) | set(MODEL_BOUND)


@pytest.mark.parametrize("name", NAMES)
def test_every_method_and_preset_runs_at_6_steps(name, tmp_path):
    check(generate(tmp_path, name, 6, "--guidance", "1"), 6, calls_per_step=1)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_at_a_second_step_count(name, tmp_path):
    if name not in PLAN_METHODS:
        check(generate(tmp_path, name, 12), 12)
        return
    stats = generate(tmp_path, name, None)  # the pipeline default: 28 steps, the bundled plans' calibrated count
    check(stats, 28)
    assert stats["units_reused"] + stats["units_forecast"] > 0  # the plan's reuse really happened
    assert stats["stats"]["method"] == name  # the method's own schedule replayed the plan


@pytest.mark.parametrize("name", MODEL_BOUND)
def test_presets_bound_to_another_models_table_refuse_the_bundled_model(name, tmp_path):
    result = runner.invoke(app, ["generate", "--cache", name, "--prompt", "3", "--steps", "4", "--repeats", "0",
                                 "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "under variant" in result.output and "FluxTransformer2DModel" in result.output
