"""Presets that carry a scope and a main knob of their own (dcache.methods.register_preset): dcache.apply runs them
in their scope unless told otherwise, and speed= / quality= sweep the preset's knob in that scope. References: the
same method applied by hand with the same knobs and scope (bit-identical), and the sweep itself."""

from __future__ import annotations

import importlib

import pytest
import torch

import dcache
from dcache.pipelines.bundled import load_tiny_pipeline

registry = importlib.import_module("dcache.methods")  # the module (dcache.methods is also a function's name)

STEPS = 8
NAME = "test-cadence-call"


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


@pytest.fixture()
def preset():
    registry.presets()  # the built-in methods first, so this one is not overwritten by their registration
    made = registry.register_preset(NAME, "fixed_interval", "every other step, whole calls", scope="call",
                                    main_knob=("interval", (2, 3, 4)), interval=2, forecast_order=1)
    yield made
    registry._PRESETS.pop(NAME, None)


def run(pipe, seed=0):
    return pipe(labels=[2, 5], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images


def test_a_preset_runs_in_its_scope_and_equals_the_method_applied_by_hand(pipe, preset):
    with dcache.apply(pipe, NAME) as handle:
        assert handle.engine.scope == "call"
        out = run(pipe)
        ratio = handle.stats().compute_ratio
    with dcache.apply(pipe, "fixed_interval", interval=2, forecast_order=1, scope="call") as by_hand:
        assert torch.equal(run(pipe), out)
        assert by_hand.stats().compute_ratio == ratio
    with dcache.apply(pipe, NAME, scope="blocks") as handle:  # an explicit scope wins
        assert handle.engine.scope == "blocks"
    assert registry.preset_scope(NAME) == "call" and registry.preset_scope("fixed_interval") is None


def test_speed_target_sweeps_the_presets_own_knob_in_its_scope(pipe, preset):
    assert registry.knob_sweep(NAME) == ("interval", (2, 3, 4))
    with dcache.apply(pipe, NAME, speed="2.5x", calibration_run=lambda: run(pipe, 1)) as handle:
        assert handle.engine.scope == "call"
    target = handle.target
    assert target.met and target.knob == "interval" and [r["value"] for r in target.sweep] == [2, 3, 4]
    fast = [r for r in target.sweep if r["ideal_speedup"] >= 2.5]
    chosen = next(r for r in target.sweep if r["value"] == target.value)
    assert chosen in fast and chosen["psnr"] == max(r["psnr"] for r in fast)
    assert handle.config["interval"] == target.value and handle.config["forecast_order"] == 1
