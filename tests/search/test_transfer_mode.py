"""Searched plans are written to replay at other step counts: forecasting plans with their computed steps placed in
normalised time (interpolate_steps="keyframes"), reuse-only plans at the nearest planned step."""

from __future__ import annotations

from dcache import Plan
from dcache.schedules.tuning.search.core import FrontPoint, Measured, write_front


def plan(rows, order=0):
    return Plan(model_class="FluxTransformer2DModel", block_layout=[2, 6], granularity="stack", units=["stack"],
                num_steps=len(rows), actions={"cond": rows}, forecast_order=order)


def test_saved_search_plans_name_how_they_replay_at_other_step_counts(tmp_path):
    write_front(tmp_path, "test", [FrontPoint("forecast", plan(["C", "F", "F", "C"], order=1), Measured(30.0, 0.5)),
                                   FrontPoint("reuse", plan(["C", "R", "C", "R"]), Measured(28.0, 0.5))])
    forecast = Plan.load(tmp_path / "plans" / "forecast.plan.json")
    reuse = Plan.load(tmp_path / "plans" / "reuse.plan.json")
    assert forecast.interpolate_steps == "keyframes" and reuse.interpolate_steps is True
    # at 7 steps the forecasting plan still computes twice (its keyframes 0 and 1 of the generation), once each
    assert [forecast.row(i, "cond", 7) for i in range(7)] == ["C", "F", "F", "F", "F", "F", "C"]
    assert sum(reuse.row(i, "cond", 8) == "C" for i in range(8)) == 4  # nearest step keeps the compute ratio
