"""`dcache generate` end to end on the bundled model, and its teaching errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dcache.pipelines.cli import app

runner = CliRunner()


def test_generate_writes_grid_stats_and_a_replayable_plan(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompt", "3,7", "--steps", "12", "--repeats", "1",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["calls"] == 24  # split CFG: 2 calls per step
    assert stats["units_reused"] + stats["units_forecast"] > 0  # the default (cadence-2x) forecasts
    ideal = stats["ideal_speedup"]  # arithmetic from FLOPs, not a timing
    assert stats["compute_ratio"] < 1.0 and stats["compute_ratio"] * ideal == 1.0
    assert stats["psnr_db"] > 25.0
    assert (out / "grid.png").stat().st_size > 0
    assert "measured" in result.output and "PSNR" in result.output
    replay = runner.invoke(app, ["generate", "--prompt", "3,7", "--steps", "12", "--repeats", "1",
                                 "--cache", str(out / "plan.json"), "--out", str(tmp_path / "replay")])
    assert replay.exit_code == 0, replay.output
    again = json.loads((tmp_path / "replay" / "stats.json").read_text())
    assert again["psnr_db"] == stats["psnr_db"]  # the plan replays the same decisions bit-exactly


def test_generate_resolves_a_speed_target_on_a_calibration_seed_and_scope_call(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompt", "3,7", "--steps", "12", "--repeats", "1", "--out", str(out),
                                 "--cache", "fixed_interval", "--speed", "2.5x", "--scope", "call"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    target = stats["target"]
    assert target["knob"] == "interval" and target["calibration_seed"] == 1 and stats["scope"] == "call"
    fast_enough = [r for r in target["sweep"] if r["ideal_speedup"] >= 2.5]
    chosen = next(r for r in target["sweep"] if r["value"] == target["value"])
    assert chosen in fast_enough and chosen["psnr"] == max(r["psnr"] for r in fast_enough)
    assert stats["compute_ratio"] <= 0.4 + 1e-12  # ideal 2.5x: the generation itself (seed 0) has the chosen compute
    assert "call scope" in result.output and "target       speed 2.5x: interval=" in result.output


@pytest.mark.parametrize("args, message", [
    (["--prompt", "12"], "class labels 0-9"),
    (["--cache", "fixed_interval", "--speed", "50x"], "no setting of 'fixed_interval' meets speed='50x'"),
    (["--cache", "fixed_interval", "--speed", "fast"], "must look like '2x'"),
    (["--cache", "fbcache", "--scope", "call"], "decides before the transformer runs"),
    (["--cache", "magcash"], "Did you mean 'magcache'"),
    (["--cache", "missing.json"], "does not exist"),
    (["--model", "not a model"], "neither an existing folder nor a hub id"),
    (["--set", "threshold=-1"], "threshold=-1 is invalid"),
])
def test_generate_rejects_bad_input_with_the_fix(tmp_path, args, message):
    result = runner.invoke(app, ["generate", "--steps", "4", "--repeats", "1", "--out", str(tmp_path), *args])
    assert result.exit_code != 0
    assert message in result.output
