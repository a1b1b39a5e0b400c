"""benchmarks/frontier.py's scenarios per bundled model: every keyframe budget lands in its band, in the model's own
CFG mode, and the untuned / transferred keyframe plans have the budget's counts."""

import importlib.util
import sys
from pathlib import Path

import pytest

FRONTIER = Path(__file__).resolve().parents[2] / "benchmarks" / "frontier.py"


@pytest.fixture(scope="module")
def frontier():
    spec = importlib.util.spec_from_file_location("dcache_benchmark_frontier_test", FRONTIER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["digits", "motion", "shapes"])
def test_every_budget_is_inside_its_band(frontier, model):
    tol = frontier.methods.BAND_TOL
    for scenario in frontier.ALL[model].values():
        budgets = scenario.budgets()
        assert {band for band, _, _ in budgets} == set(scenario.bands), scenario.name  # every band has a budget
        for band, cond, uncond in budgets:
            calls = cond + (uncond if scenario.branches == 2 else 0)
            ratio = calls / (scenario.steps * scenario.branches)
            assert band / tol <= ratio <= band * tol, (model, scenario.name, band, cond, uncond, ratio)


def test_batched_cfg_decides_once_per_step(frontier):
    shapes = frontier.ALL["shapes"]["cfg4"]
    assert shapes.mode == "batched" and shapes.branches == 1
    assert frontier.ALL["motion"]["cfg5"].branches == 2


def test_uniform_and_transferred_plans_match_the_budgets(frontier):
    scenario = frontier.ALL["motion"]["cfg5"]
    plans = frontier.uniform_plans(scenario)
    for band, cond, uncond in scenario.budgets():
        plan = plans[f"{cond}+{uncond}"]
        assert len(plan["keyframes"]) == cond and plan["keyframes"][0] == 0.0 and plan["keyframes"][-1] == 1.0
        assert len(plan.get("uncond_keyframes", plan["keyframes"])) == uncond
    assert frontier.transferred_plans("motion", scenario) == {}  # 20 steps: tiny-digits' 28-step plans do not fit
    shapes = frontier.ALL["shapes"]["cfg4"]
    moved = frontier.transferred_plans("shapes", shapes)
    assert set(moved) == set(frontier.uniform_plans(shapes)) and moved["5"] == frontier.KEYFRAMES["nocfg"]["5"]
