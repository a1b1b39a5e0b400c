"""adaptive_keyframe against analytic toys in call scope: the measured error is the forecast's true error, a ratio is
a hard budget spent by the last step, and a tolerance puts the computed steps where the trajectory bends."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.cache_utils import CacheMixin
from torch import nn

import dcache
from dcache.model.adapters import HIDDEN, Adapter, BlockList, register_adapter
from dcache.schedules.adaptive_keyframe import AdaptiveKeyframeConfig, growth

N = 40


class CurveBlock(nn.Module):
    """out = x + f(t): the call's Delta = v - x is f(t), a function of the timestep alone."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, hidden_states, temb):
        return hidden_states + self.f(temb)[:, None, None]


class CurveToy(nn.Module, CacheMixin):
    def __init__(self, f):
        super().__init__()
        self.blocks = nn.ModuleList([CurveBlock(f)])

    def forward(self, hidden_states, timestep):
        temb = timestep.to(hidden_states.dtype).expand(hidden_states.shape[0])
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        return hidden_states


register_adapter(Adapter(model_class="CurveToy", block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
                         modules=()), overwrite=True)


def run(model, steps=N):
    """A generation of `steps` calls with t = 1 - i / steps (the latent held still: Delta depends on t only)."""
    x = torch.zeros(1, 4, 3)
    return [model(hidden_states=x, timestep=torch.tensor([1.0 - i / steps])).clone() for i in range(steps)]


def computed_steps(handle):
    return [c.step for c in handle.engine.record.calls if "C" in c.actions]


def test_the_measured_error_is_the_true_error_of_the_forecast():
    # Delta = t^2 with order 1: between computed steps a line through the last two; the error at a computed step s
    # after gap h is |f(s) - (f(c) + (f(c) - f(c')) / (c - c') h)| / |f(s)|, known in closed form.
    model = CurveToy(lambda t: t ** 2)
    with dcache.apply(model, "adaptive_keyframe", compute_ratio=0.25, order=1, scope="call", num_steps=N) as handle:
        run(model)
    branch = handle.engine.schedule._branches[next(iter(handle.engine.schedule._branches))]
    steps = computed_steps(handle)
    f = lambda s: (1.0 - s / N) ** 2
    expected = []
    for a, b, c in zip(steps, steps[1:], steps[2:]):
        line = f(b) + (f(b) - f(a)) / (b - a) * (c - b)
        expected.append(abs(f(c) - line) / abs(f(c)))
    assert len(branch.errors) >= 3
    assert branch.errors == pytest.approx(expected[:len(branch.errors)], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_a_compute_ratio_is_a_budget_spent_by_the_last_step(ratio):
    model = CurveToy(lambda t: torch.sin(6 * t))
    with dcache.apply(model, "adaptive_keyframe", compute_ratio=ratio, scope="call", num_steps=N) as handle:
        run(model)
    steps = computed_steps(handle)
    assert len(steps) == round(ratio * N) and steps[0] == 0 and steps[-1] == N - 1
    assert handle.stats().compute_ratio == pytest.approx(round(ratio * N) / N)


def test_a_tolerance_spends_computes_where_the_trajectory_bends():
    # Delta = t outside a narrow bump around t = 0.5: a line the forecast follows exactly, and a bend it cannot.
    bump = lambda t: t + 0.3 * torch.exp(-((t - 0.5) / 0.06) ** 2)
    model = CurveToy(bump)
    with dcache.apply(model, "adaptive_keyframe", compute_ratio=None, tolerance=0.01, order=1, scope="call",
                      num_steps=N, max_gap=8) as handle:
        run(model)
    steps = computed_steps(handle)
    inside = [s for s in steps if 0.35 <= 1 - s / N <= 0.65]  # 12 of the 40 steps
    outside = [s for s in steps if s not in inside]
    assert len(inside) / 12 > 2 * len(outside) / 28, steps
    with dcache.apply(CurveToy(lambda t: t), "adaptive_keyframe", compute_ratio=None, tolerance=0.01, order=1,
                      scope="call", num_steps=N, max_gap=8) as straight:
        run(straight.engine.transformer)
    assert len(computed_steps(straight)) < len(steps)  # a line needs fewer computes at the same tolerance


def test_a_tolerance_grows_the_gap_at_most_twofold_per_computed_step():
    model = CurveToy(lambda t: t)  # a line: every measured error ~0, so only the growth limit holds the gaps
    with dcache.apply(model, "adaptive_keyframe", compute_ratio=None, tolerance=0.1, order=1, scope="call",
                      num_steps=N) as handle:
        run(model)
    steps = computed_steps(handle)
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert all(later <= 2 * earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    assert max(gaps) > 4  # and they do grow where the forecast is exact


def test_the_error_growth_exponent_is_fitted_and_clamped():
    assert growth([2.0, 2.0], [0.1, 0.2], order=2) == 1.0  # one gap length: no evidence
    assert growth([1.0, 2.0, 4.0], [0.01, 0.04, 0.16], order=2) == pytest.approx(2.0)
    assert growth([1.0, 2.0], [0.1, 0.1], order=2) == 0.5
    assert growth([1.0, 2.0], [0.01, 1.0], order=1) == 2.0


def test_the_knobs_say_what_they_must_be():
    with pytest.raises(ValueError, match=r"compute_ratio=None is invalid.*tolerance"):
        AdaptiveKeyframeConfig(compute_ratio=None)
    with pytest.raises(ValueError, match=r"tolerance=0.1 is invalid.*compute_ratio=None"):
        AdaptiveKeyframeConfig(tolerance=0.1)
    with pytest.raises(ValueError, match="needs the step count"):
        model = CurveToy(lambda t: t)
        with dcache.apply(model, "adaptive_keyframe", scope="call"):
            run(model)
    assert math.isfinite(AdaptiveKeyframeConfig().compute_ratio)
