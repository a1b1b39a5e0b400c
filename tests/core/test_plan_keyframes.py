"""Plans replayed at other step counts with interpolate_steps="keyframes": each computed step once, at its place in
normalised time (dcache.plans.plan.keyframe_interp), against the keyframe schedule that places the same steps."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache import Plan, PlanError
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.plans.plan import keyframe_interp, nearest_interp

KEYFRAME_STEPS = (0, 8, 15, 23)  # of 28: at 10 and 50 steps round(s (n - 1) / 27) has no ties


def test_computed_steps_move_in_normalised_time_and_compute_once():
    rows = ["C" if s in KEYFRAME_STEPS else "F" for s in range(28)]
    for n in (10, 28, 50):
        out = keyframe_interp(rows, n)
        expected = {round(s * (n - 1) / 27) for s in KEYFRAME_STEPS}
        assert len(out) == n and {j for j, r in enumerate(out) if r == "C"} == expected
        assert set(out) <= {"C", "F"}
    # nearest-step replay repeats a computed row on neighbouring steps at 50 (what makes Taylor forecasts collapse)
    assert sum(r == "C" for r in nearest_interp(rows, 50)) > len(KEYFRAME_STEPS)


def test_units_keep_their_own_computed_steps_and_idle_actions():
    out = keyframe_interp(["CR", "RC", "FR", "CC"], 7)
    assert [r[0] for r in out] == ["C", "R", "R", "R", "F", "F", "C"]  # ties go to the earlier planned step
    assert [r[1] for r in out] == ["R", "R", "C", "R", "R", "R", "C"]


def test_the_mode_round_trips_and_bad_values_are_refused(tmp_path):
    plan = Plan(model_class="M", block_layout=[1], granularity="stack", units=["stack"], num_steps=3,
                actions={"cond": ["C", "F", "C"]}, forecast_order=1, interpolate_steps="keyframes")
    path = plan.save(tmp_path / "p.json")
    again = Plan.load(path)
    assert again.interpolate_steps == "keyframes"
    assert [again.row(i, "cond", 5) for i in range(5)] == ["C", "F", "F", "F", "C"]
    with pytest.raises(PlanError, match='interpolate_steps.*true, false or "keyframes"'):
        Plan.from_dict({**plan.to_dict(), "interpolate_steps": "linear"})


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe, steps):
    return pipe(labels=[2, 7], num_inference_steps=steps, generator=torch.Generator().manual_seed(5),
                output_type="pt").images


@pytest.mark.parametrize("steps", [10, 50])
def test_a_keyframe_plan_replays_at_other_step_counts_as_the_keyframe_schedule_does(pipe, steps):
    setting = dict(keyframes=tuple(s / 27 for s in KEYFRAME_STEPS), order=2, scope="call")
    with dcache.apply(pipe, "keyframe", **setting) as handle:
        generate(pipe, 28)
        plan = handle.plan(interpolate_steps="keyframes")
    with dcache.apply(pipe, "keyframe", **setting):
        expected = generate(pipe, steps)
    with dcache.apply(pipe, Plan.from_dict(plan.to_dict())) as handle:
        replayed = generate(pipe, steps)
        computed = handle.stats().units_computed
    assert torch.equal(replayed, expected)
    assert computed == 2 * len(KEYFRAME_STEPS)  # one compute per keyframe and branch, at any step count
