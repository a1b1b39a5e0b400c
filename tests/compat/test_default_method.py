"""The default method works on any supported model from its first generation: `dcache.apply(pipe)` runs the
preset `cadence-2x` (every other step computed, a parabola through the last three computed calls on the others,
whole calls), whose decisions need no calibration. MagCache, named explicitly, calibrates itself on a model without a
shipped curve: its first generation computes every step and measures the magnitude ratios.

References: the uncached pipeline (bit for bit where every call computes), SeaCache applied by hand with the
preset's knobs and scope (bit for bit), the offline calibration `calibrate_magcache` on the same pipeline (the
measured curve), and MagCache given that curve explicitly (second generation, bit for bit).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_kit import make_pipeline

import dcache
from dcache.methods import DEFAULT_METHOD
from dcache.schedules.tuning.calibrate import calibrate_magcache
from dcache.schedules.magcache import MagCacheSelfCalibration

STEPS = 10


def run(pipe, seed: int = 0, **kw):
    return pipe(labels=[1, 2], num_inference_steps=STEPS, guidance_scale=3.0,
                generator=torch.Generator().manual_seed(seed), **kw)


def test_default_method_caches_from_the_first_generation_of_an_uncalibrated_model():
    pipe = make_pipeline()
    reference = run(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to calibrate, nothing to say
        handle = dcache.apply(pipe)  # no method: the default
        first = run(pipe)
    assert handle.method == DEFAULT_METHOD == "cadence-2x" and handle.engine.scope == "call"
    # steps 0, 2, 4, 6, 8 and the last (9) computed on both branches: 6 of 10 calls each
    assert handle.stats().compute_ratio == pytest.approx(0.6)
    rows = {"".join(row) for row in handle.plan().actions.values()}
    assert rows == {"CFCFCFCFCC"}
    assert float((first - reference).norm() / reference.norm()) < 0.05
    handle.remove()
    with dcache.apply(pipe, "seacache", gate=False, max_consecutive=1, order=2, scope="call"):
        assert torch.equal(run(pipe), first)  # the preset is these knobs in call scope, nothing more
    assert torch.equal(run(pipe), reference)


def test_magcache_on_an_uncalibrated_model_says_so_once_and_first_generation_is_uncached():
    pipe = make_pipeline()
    reference = run(pipe)
    with pytest.warns(MagCacheSelfCalibration, match="dcache calibrate --model <model> --method magcache"):
        handle = dcache.apply(pipe, "magcache")
    assert handle.method == "magcache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", MagCacheSelfCalibration)  # no second notice during the generations
        first = run(pipe)
        assert torch.equal(first, reference)
        assert handle.stats().compute_ratio == 1.0
        second = run(pipe)
    assert handle.stats().compute_ratio < 0.8  # cached from the second generation on
    assert float((second - reference).norm() / reference.norm()) < 0.05
    handle.remove()
    assert torch.equal(run(pipe), reference)


def test_measured_curve_is_the_offline_calibration_and_replays_like_it():
    pipe = make_pipeline()
    offline = calibrate_magcache(pipe, lambda: run(pipe), register=False)
    with pytest.warns(MagCacheSelfCalibration):
        handle = dcache.apply(pipe, "magcache")
    run(pipe)
    measured = handle.engine.schedule.measured
    assert set(measured) == {"cond", "uncond"}
    for branch, curve in measured.items():
        assert len(curve) == STEPS
        # every step but the last (its ratio would arrive with a call after the generation) equals the offline table
        assert curve[:-1] == pytest.approx(offline[branch][:-1], rel=1e-4)
        assert curve[-1] == curve[-2]
    second = run(pipe, seed=1)
    decisions = handle.plan()
    handle.remove()
    with dcache.apply(pipe, "magcache", ratios=list(measured["cond"]), ratios_uncond=list(measured["uncond"])) as h:
        explicit = run(pipe, seed=1)
        assert h.plan().actions == decisions.actions
    assert torch.equal(second, explicit)


def test_an_interrupted_first_generation_measures_again():
    pipe = make_pipeline()
    with pytest.warns(MagCacheSelfCalibration):
        handle = dcache.apply(pipe, "magcache")
    calls = {"n": 0}

    def stop_mid_generation(module, args, kwargs, output):  # call 11 = step 5 of 10, cond
        calls["n"] += 1
        if calls["n"] == 11:
            raise KeyboardInterrupt

    hook = pipe.transformer.register_forward_hook(stop_mid_generation, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        run(pipe)
    hook.remove()
    reference = run(pipe)  # measures (all computed)
    assert handle.stats().compute_ratio == 1.0
    run(pipe)
    assert handle.stats().compute_ratio < 1.0
    handle.remove()
    assert torch.equal(run(pipe), reference)
