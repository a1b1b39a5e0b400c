"""`dcache.apply(pipe, method, speed="2x" | quality="psnr>=30", calibration_run=...)`: the setting is chosen by a sweep
of the method's main knob on the calibration run (schedules.tuning.targets.resolve_target), checked here against the
sweep itself; bad use is refused with the fix."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 10


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def run(pipe, seed):
    return pipe(labels=[2, 5], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images


def test_speed_target_picks_the_least_lossy_fast_enough_setting(pipe):
    with dcache.apply(pipe, "fixed_interval", speed="2x", calibration_run=lambda: run(pipe, 1)) as handle:
        run(pipe, 0)
        stats = handle.stats()
    target = handle.target
    assert target.met and target.knob == "interval"
    fast = [r for r in target.sweep if r["ideal_speedup"] >= 2.0]
    chosen = next(r for r in target.sweep if r["value"] == target.value)
    assert chosen in fast and chosen["psnr"] == max(r["psnr"] for r in fast)
    assert handle.config["interval"] == target.value and stats.compute_ratio <= 0.5  # ideal 2x from FLOPs


def test_quality_target_picks_the_fastest_setting_that_keeps_it_in_call_scope(pipe):
    with dcache.apply(pipe, "magcache", quality="psnr>=35", calibration_run=lambda: run(pipe, 1),
                      scope="call", max_skip_steps=2) as handle:
        assert handle.engine.scope == "call" and handle.config["max_skip_steps"] == 2
    target = handle.target
    ok = [r for r in target.sweep if r["psnr"] >= 35.0]
    chosen = next(r for r in target.sweep if r["value"] == target.value)
    assert chosen in ok and chosen["compute_ratio"] == min(r["compute_ratio"] for r in ok)  # the fastest in FLOPs


@pytest.mark.parametrize("kwargs, message", [
    (dict(speed="2x"), "pass calibration_run=lambda: pipe"),
    (dict(speed="90x", calibration_run=True), "no setting of 'fixed_interval' meets speed='90x'"),
    (dict(speed="2x", quality="psnr>=30", calibration_run=True), "exactly one target"),
])
def test_bad_targets_are_refused_with_the_fix(pipe, kwargs, message):
    if kwargs.get("calibration_run") is True:
        kwargs["calibration_run"] = lambda: run(pipe, 1)
    with pytest.raises(ValueError, match=message):
        dcache.apply(pipe, "fixed_interval", **kwargs)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None


def test_a_plan_has_no_knob_to_sweep(pipe, tmp_path):
    with dcache.apply(pipe, "fixed_interval") as handle:
        run(pipe, 0)
        path = handle.plan().save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="must be a method or preset name"):
        dcache.apply(pipe, str(path), speed="2x", calibration_run=lambda: run(pipe, 1))


def test_a_method_declares_its_main_knob_in_its_own_config(pipe):
    """speed= sweeps what the method's config class declares (`MethodConfig.main_knob`), with no table elsewhere: a
    method registered here, a subclass of fixed_interval's config under another name, is swept over its own grid."""
    from dataclasses import dataclass

    from dcache.methods import _METHODS, knob_sweep, main_knob
    from dcache.schedules.fixed_interval import FixedIntervalConfig

    @dataclass(frozen=True)
    class EveryOtherConfig(FixedIntervalConfig):
        method = "test_every_other"
        main_knob = ("interval", (2, 3))

    dcache.register_method(EveryOtherConfig)
    try:
        assert knob_sweep("test_every_other") == ("interval", (2, 3)) and main_knob("test_every_other") == "interval"
        assert knob_sweep("magcache")[0] == "threshold" and knob_sweep("no-such-method") is None
        with dcache.apply(pipe, "test_every_other", speed="2x", calibration_run=lambda: run(pipe, 1)) as handle:
            pass
        assert [r["value"] for r in handle.target.sweep] == [2, 3] and handle.config["interval"] == handle.target.value
    finally:
        _METHODS.pop("test_every_other", None)
