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


def test_generate_decides_cfg_difference_on_the_calibration_seed(tmp_path):
    """--set cfg_difference=true: the calibration run (seed + 1) runs uncached, without and with the difference,
    and the closer one is generated (dcache.apply's cfg_difference=True with calibration_run=)."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompt", "3,7", "--steps", "12", "--repeats", "1", "--out", str(out),
                                 "--guidance", "3", "--cache", "keyframe-5x", "--scope", "call",
                                 "--set", "cfg_difference=true"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    target = stats["target"]
    assert target["knob"] == "cfg_difference" and target["calibration_seed"] == 1 and stats["scope"] == "call"
    assert [row["value"] for row in target["sweep"]] == [False, True]
    best = max(target["sweep"], key=lambda row: row["psnr"])
    assert target["value"] == best["value"] and target["sweep"][0]["psnr"] != target["sweep"][1]["psnr"]
    assert f"the closer to uncached: cfg_difference={best['value']}" in result.output


def test_a_speed_target_on_a_call_scope_preset_generates_in_call_scope(tmp_path):
    """The default method is a preset that runs in call scope (cadence-2x); its sweep ran there, and the chosen
    config (which no longer names the preset) must run there too, not in block scope."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompt", "3", "--steps", "12", "--repeats", "1", "--out", str(out),
                                 "--speed", "2x"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["scope"] == "call" and stats["target"]["knob"] == "max_consecutive"


def test_repeats_0_generates_once_each_untimed_with_the_same_images(tmp_path, monkeypatch):
    """--repeats 0: one uncached and one cached generation (no warm-ups), the same grid, PSNR and plan as a timed
    run, and stats.json's timing fields null (not NaN, not zero)."""
    from dcache.pipelines import runner as runner_module

    calls = []
    job_call = runner_module.GenerationJob.__call__
    monkeypatch.setattr(runner_module.GenerationJob, "__call__", lambda job: calls.append(1) or job_call(job))
    stats = {}
    for repeats in ("0", "1"):
        calls.clear()
        out = tmp_path / repeats
        result = runner.invoke(app, ["generate", "--prompt", "3", "--steps", "8", "--repeats", repeats,
                                     "--out", str(out)])
        assert result.exit_code == 0, result.output
        stats[repeats] = json.loads((out / "stats.json").read_text())
        assert len(calls) == (2 if repeats == "0" else 4), (repeats, len(calls))  # timed: a warm-up each too
    untimed, timed = stats["0"], stats["1"]
    assert untimed["psnr_db"] == timed["psnr_db"] and untimed["max_abs_error"] == timed["max_abs_error"]
    assert untimed["units_computed"] == timed["units_computed"] and untimed["repeats"] == 0
    plans = [json.loads((tmp_path / repeats / "plan.json").read_text()) for repeats in ("0", "1")]
    assert plans[0]["actions"] == plans[1]["actions"]  # the same decisions (the files differ in their timestamp)
    timing = ("measured_speedup", "cpu_speedup", "uncached_seconds", "cached_seconds", "measured_over_ideal")
    assert all(untimed[key] is None for key in timing) and all(timed[key] > 0 for key in timing)
    assert "not measured (--repeats 0" in result_output(tmp_path, "0")
    result = runner.invoke(app, ["generate", "--steps", "4", "--repeats", "-1", "--out", str(tmp_path / "bad")])
    assert result.exit_code != 0 and "--repeats -1 must be >= 0" in result.output


def result_output(tmp_path, repeats: str) -> str:
    """The summary `dcache generate` prints for the run in tmp_path / repeats (printed again from its stats.json)."""
    from dcache.pipelines.generate import format_summary

    return format_summary(json.loads((tmp_path / repeats / "stats.json").read_text()))


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
