"""Calibration: MagCache ratios and TeaCache coefficients from uncached runs, the calibration file, target search.

The recorded signals are checked against the same quantities computed by hand from forward hooks on the first
and last blocks of the tiny FLUX transformer (stack input / output), so the tables mean what the papers define.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from schedule_testkit import STEPS, denoise, denoise_two_branches, run_with, saved_tables, tiny_flux

import dcache
from dcache.schedules import calibration_file
from dcache.schedules.tuning import calibrate, targets
from dcache.schedules.tables import lookup_table, model_identity


@pytest.fixture(scope="module")
def model():
    return tiny_flux()


def stack_io(model, fn):
    """Run fn() and return per call (stack input, stack output) from hooks on the first / last block."""
    inputs, outputs = [], []
    first, last = model.transformer_blocks[0], model.single_transformer_blocks[-1]
    h1 = first.register_forward_pre_hook(lambda m, a, kw: inputs.append(kw["hidden_states"].clone()),
                                         with_kwargs=True)
    h2 = last.register_forward_hook(lambda m, a, kw, out: outputs.append(out[1].clone()), with_kwargs=True)
    try:
        fn()
    finally:
        h1.remove()
        h2.remove()
    return inputs, outputs


def test_magcache_ratios_are_mean_token_norm_ratios_of_the_stack_residual(model, tmp_path):
    with saved_tables():
        table = calibrate.calibrate_magcache(model, lambda: denoise(model), num_steps=STEPS,
                                             path=tmp_path / "cal.json")
        assert set(table) == {"cond"} and len(table["cond"]) == STEPS and table["cond"][0] == 1.0
        assert lookup_table("magcache", model) == table  # registered for the tiny model's identity
    xs, vs = stack_io(model, lambda: denoise(model))
    residuals = [v - x for x, v in zip(xs, vs)]
    expected = [1.0] + [float((r.norm(dim=-1) / p.norm(dim=-1)).mean()) for p, r in zip(residuals, residuals[1:])]
    assert table["cond"] == pytest.approx(expected, abs=2e-5)  # rounded to 5 decimals
    assert all(round(g, 5) == g for g in table["cond"])


def test_magcache_calibration_per_branch_and_averaged_over_runs(model):
    with saved_tables():
        table = calibrate.calibrate_magcache(model, lambda: denoise_two_branches(model), runs=2, num_steps=STEPS)
    assert set(table) == {"cond", "uncond"}  # call0 / call1 are named like split CFG
    assert len(table["cond"]) == len(table["uncond"]) == STEPS
    assert table["cond"] != table["uncond"]  # the two generations differ, so do their curves
    assert all(0.5 < g < 2.0 for g in table["cond"] + table["uncond"])


def test_magcache_uses_a_calibration_file_like_explicit_ratios(model, tmp_path):
    path = tmp_path / "cal.json"
    with saved_tables():
        table = calibrate.calibrate_magcache(model, lambda: denoise(model), num_steps=STEPS, path=path,
                                             register=False)
        assert lookup_table("magcache", model) is None
        from_file, h1 = run_with(model, "magcache", calibration=str(path), threshold=0.1)
        explicit, h2 = run_with(model, "magcache", ratios=table["cond"], threshold=0.1)
        assert torch.equal(from_file, explicit)
        assert h1.stats().per_step == h2.stats().per_step
        assert h1.stats().compute_ratio < 1.0
        # registering the file makes "magcache" work on this model with no arguments
        calibration_file.load_calibration(path, register=True)
        registered, h3 = run_with(model, "magcache", threshold=0.1)
        assert torch.equal(registered, explicit)


def test_teacache_points_are_modulated_and_output_rel_l1(model, tmp_path):
    path = tmp_path / "cal.json"
    with saved_tables():
        result = calibrate.calibrate_teacache(model, [lambda: denoise(model, seed=1), lambda: denoise(model, seed=2)],
                                              num_steps=STEPS, path=path, threshold=0.05)
        assert len(result["coefficients"]) == 5 and result["points"] == 2 * (STEPS - 1)
        assert result["fit_rel_error"] < 0.5  # a 4th-order fit of 38 points: measured 0.009
        schedule = dcache.config_for("teacache").build(model)  # registered: no coefficients needed
        assert schedule.coefficients == tuple(result["coefficients"]) and schedule.threshold == 0.05
    rec = calibrate.record_signals(model, lambda: denoise(model, seed=1), calibrate.TEACACHE_SIGNALS,
                                   num_steps=STEPS)
    x, y = calibrate.teacache_points(rec)
    _, vs = stack_io(model, lambda: denoise(model, seed=1))
    expected_y = [float((v - p).abs().mean() / p.abs().mean()) for p, v in zip(vs, vs[1:])]
    assert y == pytest.approx(expected_y, rel=1e-4)
    assert np.all(x > 0)
    # the file holds a TeaCache entry keyed by this model; a config can point at it
    cal = calibration_file.load_calibration(path)
    entry = cal.find("teacache", model=model)
    assert entry is not None and entry.num_steps == STEPS and entry.resolution == [16, 32]
    out, handle = run_with(model, "teacache", calibration=str(path))
    assert torch.isfinite(out).all() and handle.stats().compute_ratio < 1.0


def test_teacache_suggests_a_threshold_for_a_target_compute_ratio(model):
    with saved_tables():
        result = calibrate.calibrate_teacache(model, lambda: denoise(model), num_steps=STEPS,
                                              target_compute_ratio=0.5)
        assert result["threshold_for"] == {"compute_ratio": 0.5}
        out, handle = run_with(model, "teacache")  # the registered table's threshold
    # the simulation replays the recorded signals; the real run drifts a little from them
    assert handle.stats().compute_ratio == pytest.approx(0.5, abs=0.1)
    assert torch.isfinite(out).all()


def test_calibration_file_merges_entries_by_key_and_is_written_atomically(tmp_path, model):
    path = tmp_path / "cal.json"
    make = lambda steps, table: calibration_file.CalibrationEntry(
        method="magcache", model_identity=model_identity(model), model_class="FluxTransformer2DModel",
        table=table, num_steps=steps, scheduler="S", resolution=[16, 32])
    calibration_file.save_calibration(path, make(20, {"cond": [1.0] * 20}))
    calibration_file.save_calibration(path, make(28, {"cond": [1.0] * 28}))
    calibration_file.save_calibration(path, make(20, {"cond": [0.5] * 20}))  # same key: replaces
    cal = calibration_file.load_calibration(path)
    assert sorted(e.num_steps for e in cal.entries) == [20, 28]
    assert cal.find("magcache", model=model, num_steps=20).table == {"cond": [0.5] * 20}
    assert cal.find("magcache", model=model).num_steps == 28  # no step count asked: the longest table
    assert cal.find("teacache", model=model) is None
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]  # no temporary files left behind
    assert json.loads(path.read_text())["format"] == "dcache.calibration"


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"format": "dcache.plan"}', "not a dcache calibration file"),
    ('{"format": "dcache.calibration", "version": 99}', "version"),
    ('{"format": "dcache.calibration", "version": 1, "entries": [{"method": "magcache"}]}', "lacks"),
])
def test_bad_calibration_files_teach_the_fix(tmp_path, content, message):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        calibration_file.load_calibration(path)


def test_run_fn_must_run_one_generation(model):
    def two():
        denoise(model)
        denoise(model)

    with pytest.raises(ValueError, match="exactly one generation"):
        calibrate.calibrate_magcache(model, two, num_steps=STEPS, register=False)
    assert getattr(model, "_dcache_engine", None) is None  # the recording handle was removed


def test_resolve_target_speed_and_quality(model):
    run = lambda: denoise(model)
    fast = targets.resolve_target("fixed_interval", target=model, run_fn=run, speed="2x", num_steps=STEPS,
                                    grid=(2, 3, 4))
    assert fast.met and fast.knob == "interval"
    chosen = next(r for r in fast.sweep if r["value"] == fast.value)
    assert chosen["compute_ratio"] <= 0.5  # block FLOPs counted from shapes ("2x" ideal), not wall clock
    # the least lossy setting among those fast enough
    assert chosen["psnr"] == max(r["psnr"] for r in fast.sweep if r["compute_ratio"] <= 0.5)
    good = targets.resolve_target("fbcache", target=model, run_fn=run, quality="psnr>=40", num_steps=STEPS,
                                    grid=(0.02, 0.08, 0.3))
    assert good.met
    chosen = next(r for r in good.sweep if r["value"] == good.value)
    assert chosen["psnr"] >= 40.0
    cheapest = min(r["compute_ratio"] for r in good.sweep if r["psnr"] >= 40.0)
    assert chosen["compute_ratio"] == cheapest
    impossible = targets.resolve_target("fixed_interval", target=model, run_fn=run, speed="50x",
                                          num_steps=STEPS, grid=(2,))
    assert not impossible.met and impossible.config is None
    custom = targets.resolve_target("fbcache-fast", target=model, run_fn=run, speed="1.2x", num_steps=STEPS,
                                      knob="warmup_steps", grid=(2, 12))  # a preset and another knob
    assert custom.met and custom.config.threshold == 0.12 and custom.value in (2, 12)
    assert [r["value"] for r in custom.sweep] == [2, 12]
    with pytest.raises(ValueError, match="exactly one target"):
        targets.resolve_target("fbcache", target=model, run_fn=run)
    with pytest.raises(ValueError, match="psnr>="):
        targets.resolve_target("fbcache", target=model, run_fn=run, quality="ssim>0.9")
