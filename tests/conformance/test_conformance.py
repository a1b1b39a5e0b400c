"""Conformance matrix: every zoo family (tests/zoo.py) x the engine's guarantees, one test case per family.

Per family, on a tiny random-weight model over ZOO_STEPS step-to-step-similar inputs:
  * all-COMPUTE is bit-identical to the unwrapped model, and so is the model after `remove()`;
  * stack reuse and block reuse really skip blocks (counted) and stay finite and close to uncached;
  * a dynamic run's exported plan replays bit-exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
import zoo
from diffusers.hooks import HookRegistry, ModelHook

import dcache
from dcache import Action, Plan, Schedule

STEPS = zoo.ZOO_STEPS
# Reusing a cached residual on smoothly drifting inputs must stay close to the uncached output:
# relative L2 error ||cached - uncached|| / ||uncached|| below this bound on every step.
REL_ERROR_BOUND = 0.35


class AllCompute(Schedule):
    def decide(self, ctx):
        return Action.COMPUTE


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    return _first_tensor(out.sample if hasattr(out, "sample") else out[0])


def run_steps(model, entry, steps=STEPS, batch=1):
    with torch.no_grad():
        return [_first_tensor(model(**entry.make_inputs(s, batch=batch))).clone() for s in range(steps)]


class _CountComputes(ModelHook):
    """Innermost hook (registered before dcache's): counts the block forwards that really run."""

    def __init__(self, counts, index, model):
        super().__init__()
        self.counts, self.index, self.model = counts, index, model

    def pre_forward(self, module, *args, **kwargs):
        engine = getattr(self.model, "_dcache_engine", None)
        if engine is None or not engine.flops.counting:  # dcache's one-off FLOP-counting pass is not a compute
            self.counts[self.index] += 1
        return args, kwargs


def count_block_computes(model):
    """Register counting hooks on every block (call before dcache.apply); returns (counts, remove_fn)."""
    blocks = [b for _li, b in dcache.adapter_for(model).blocks(model)]
    counts = {i: 0 for i in range(len(blocks))}
    for i, block in enumerate(blocks):
        HookRegistry.check_if_exists_or_initialize(block).register_hook(_CountComputes(counts, i, model), "test_count")

    def remove():
        for block in blocks:
            HookRegistry.check_if_exists_or_initialize(block).remove_hook("test_count", recurse=False)
    return counts, remove


def rel_error(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


FAMILIES = sorted(zoo.ZOO)  # one case per zoo family in every test below
_MODELS: dict = {}
_REFERENCES: dict = {}


def model_of(family):
    """The family's tiny model, built once per session (its weights are seeded, so every test sees the same)."""
    if family not in _MODELS:
        _MODELS[family] = zoo.ZOO[family].make_model()
    return _MODELS[family]


def reference_of(family):
    """The unwrapped model's outputs over STEPS steps, computed once per family."""
    if family not in _REFERENCES:
        _REFERENCES[family] = run_steps(model_of(family), zoo.ZOO[family])
    return _REFERENCES[family]


def getattr_path(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("family", FAMILIES)
def test_all_compute_and_remove_are_bit_identical(family):
    model, entry, reference = model_of(family), zoo.ZOO[family], reference_of(family)
    with dcache.apply(model, AllCompute(), num_steps=STEPS):
        cached = run_steps(model, entry)
    assert all(torch.equal(a, b) for a, b in zip(cached, reference))
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, entry), reference))


@pytest.mark.parametrize("granularity", ["stack", "block", "module"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_skips_blocks_and_stays_close(family, granularity):
    model, entry, reference = model_of(family), zoo.ZOO[family], reference_of(family)
    adapter = dcache.adapter_for(model)
    n_blocks = len(adapter.blocks(model))
    if granularity == "module":
        units = [f"b{i}.{m}" for i, (_li, b) in enumerate(adapter.blocks(model)) for m in adapter.module_names(b)]
        if not units:
            pytest.skip(f"{family} declares no inner modules")
        reuse_row = "R" * len(units)
    elif granularity == "stack":
        units, reuse_row = ["stack"], "R"
    else:
        units = [f"b{i}" for i in range(n_blocks)]
        reuse_row = "".join("R" if i % 2 else "C" for i in range(n_blocks))
    layout = [len(list(getattr_path(model, spec.path))) for spec in adapter.block_lists]
    rows = ["C" * len(units) if s % 2 == 0 else reuse_row for s in range(STEPS)]
    plan = Plan(model_class=type(model).__name__, block_layout=layout, granularity=granularity, units=units,
                num_steps=STEPS, actions={"call0": rows})
    counts, remove_counters = count_block_computes(model)
    try:
        with dcache.apply(model, plan, num_steps=STEPS) as handle:
            cached = run_steps(model, entry)
    finally:
        remove_counters()
    computed_steps = STEPS // 2 + STEPS % 2
    if granularity == "module":
        assert set(counts.values()) == {STEPS}  # blocks run; their attention / MLP modules are reused
    elif granularity == "stack":
        assert set(counts.values()) == {computed_steps}, counts
    else:
        expected = {i: STEPS if i % 2 == 0 else computed_steps for i in range(n_blocks)}
        assert counts == expected
    assert handle.stats().compute_ratio < 1.0
    for s, (a, b) in enumerate(zip(cached, reference)):
        assert torch.isfinite(a).all()
        assert rel_error(a, b) < REL_ERROR_BOUND, f"step {s}: relative error {rel_error(a, b):.3f}"


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamic_plan_replays_bit_exactly(family):
    model, entry = model_of(family), zoo.ZOO[family]
    handle = dcache.apply(model, "fbcache", num_steps=STEPS, threshold=5.0, warmup_steps=1)
    first = run_steps(model, entry)
    plan = handle.plan()
    handle.remove()
    assert plan.compute_ratio() < 1.0, "fbcache at threshold 5 should reuse some steps"
    with dcache.apply(model, plan, num_steps=STEPS):
        replay = run_steps(model, entry)
    assert all(torch.equal(a, b) for a, b in zip(first, replay))
    assert all(math.isfinite(float(t.abs().max())) for t in first)


FORECAST_ROWS = "CCCCFFCFFC"  # 4 computed steps fill every forecaster's window before the first forecast
FORECASTERS = ("foca", "hyca", "spectrum", "dmd")


@pytest.mark.parametrize("granularity", ["stack", "block", "module"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plans_forecast_every_unit_kind_with_a_forecaster(family, granularity):
    """A plan's extras["forecaster"] (dcache.schedules.forecasters) serves its FORECAST cells on every unit kind; the
    forecaster rotates with the family so that each one meets every family kind without multiplying the cases."""
    model, entry, reference = model_of(family), zoo.ZOO[family], reference_of(family)
    adapter = dcache.adapter_for(model)
    blocks = adapter.blocks(model)
    if granularity == "module":
        units = [f"b{i}.{m}" for i, (_li, b) in enumerate(blocks) for m in adapter.module_names(b)]
        if not units:
            pytest.skip(f"{family} declares no inner modules")
    else:
        units = ["stack"] if granularity == "stack" else [f"b{i}" for i in range(len(blocks))]
    assert len(FORECAST_ROWS) == STEPS
    forecast_row = "F" * len(units)
    if granularity == "block":  # as in the reuse case above: every other block forecast, the rest computed
        forecast_row = "".join("F" if i % 2 else "C" for i in range(len(units)))
    rows = ["C" * len(units) if c == "C" else forecast_row for c in FORECAST_ROWS]
    layout = [len(list(getattr_path(model, spec.path))) for spec in adapter.block_lists]
    forecaster = FORECASTERS[FAMILIES.index(family) % len(FORECASTERS)]
    plan = Plan(model_class=type(model).__name__, block_layout=layout, granularity=granularity, units=units,
                num_steps=STEPS, actions={"call0": rows}, forecast_order=1,
                extras={"forecaster": {"name": forecaster}})
    counts, remove_counters = count_block_computes(model)
    try:
        with dcache.apply(model, plan, num_steps=STEPS) as handle:
            cached = run_steps(model, entry)
            assert handle.plan().extras["forecaster"]["name"] == forecaster  # a replay forecasts the same way
    finally:
        remove_counters()
    computed = FORECAST_ROWS.count("C")
    if granularity == "stack":
        assert set(counts.values()) == {computed}, counts
    elif granularity == "block":
        assert counts == {i: STEPS if i % 2 == 0 else computed for i in range(len(units))}
    else:  # blocks run at module granularity; their attention / MLP modules are forecast
        assert set(counts.values()) == {STEPS}
    assert handle.stats().compute_ratio < 1.0
    for s, (a, b) in enumerate(zip(cached, reference)):
        assert torch.isfinite(a).all()
        assert rel_error(a, b) < REL_ERROR_BOUND, f"step {s} ({forecaster}): relative error {rel_error(a, b):.3f}"
