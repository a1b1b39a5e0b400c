"""Keyframe schedule: the steps it computes (fractions of the generation at any step count, per CFG branch) and its
forecasts between keyframes against closed forms on the analytic toy transformer (tests/toy_models.py)."""

from __future__ import annotations

import pytest
import toy_models as toy
import torch

import dcache
from dcache import Action, CallContext, GenerationInfo
from dcache.schedules.keyframe import KeyframeConfig, keyframe_steps


def _generation(num_steps: int | None) -> GenerationInfo:
    return GenerationInfo(num_steps=num_steps, timesteps=None, units=("stack",), model_class="ToyTransformer",
                          num_blocks=6)


def _decisions(config: KeyframeConfig, num_steps: int, branch: str) -> str:
    schedule = config.build(None)
    schedule.reset(_generation(num_steps))
    return "".join(Action(schedule.decide(CallContext(step=s, num_steps=num_steps, branch=branch, call_index=s,
                                                      timestep=None))).value for s in range(num_steps))


def test_keyframes_are_fractions_of_the_generation_at_any_step_count():
    fractions = (0.0, 0.2963, 0.5926, 0.8889)  # searched at 28 steps: steps 0, 8, 16, 24
    assert sorted(keyframe_steps(fractions, 28)) == [0, 8, 16, 24]
    assert sorted(keyframe_steps(fractions, 10)) == [0, 3, 5, 8]  # round(f * 9)
    assert sorted(keyframe_steps(fractions, 50)) == [0, 15, 29, 44]  # round(f * 49)
    assert sorted(keyframe_steps((0.5, 0.51), 3)) == [0, 1]  # step 0 always; two keyframes on one step compute once
    assert sorted(keyframe_steps((1.0,), 1)) == [0]


def test_each_branch_computes_its_own_keyframes_and_forecasts_the_rest():
    config = KeyframeConfig(keyframes=(0.0, 0.5, 1.0), uncond_keyframes=(0.0, 0.75), order=2)
    assert _decisions(config, 9, "cond") == "CFFFCFFFC"
    assert _decisions(config, 9, "uncond") == "CFFFFFCFF"
    assert _decisions(config, 9, "call0") == "CFFFCFFFC"  # every other branch follows `keyframes`
    assert _decisions(KeyframeConfig(keyframes=(0.0, 0.5), order=0), 5, "cond") == "CRRRR"[:2] + "C" + "RR"


def test_the_step_count_is_required_and_bad_keyframes_name_the_field():
    with pytest.raises(ValueError, match="num_steps"):
        KeyframeConfig().build(None).reset(_generation(None))
    for bad in ((), (0.0, 1.5), (-0.1,), ("0.5",)):
        with pytest.raises(ValueError, match="keyframes"):
            KeyframeConfig(keyframes=bad)
    with pytest.raises(ValueError, match="uncond_keyframes"):
        KeyframeConfig(uncond_keyframes=(2.0,))
    with pytest.raises(ValueError, match="order"):
        KeyframeConfig(order=4)


def _shift_only_toy(b: float = 0.7) -> toy.ToyTransformer:
    """Every block adds b * t (no attention term): with a constant input the call's Delta = v - x is 6 b t."""
    model = toy.ToyTransformer(joint=(0.0, 0.0, 0.0), single=(0.0, 0.0, 0.0))
    for block in model.blocks():
        block.ff.b = b
    return model


def _run(model, timesteps: list[float], **apply) -> list[torch.Tensor]:
    inputs = toy.toy_inputs(0, len(timesteps))  # the same latent at every step: only t changes
    with dcache.apply(model, "keyframe", num_steps=len(timesteps), **apply) if apply else _nothing():
        with torch.no_grad():
            return [model(**{**inputs, "timestep": torch.tensor([t])}) for t in timesteps]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("scope", ["call", "blocks"])
@pytest.mark.parametrize("order", [1, 2])
def test_forecast_is_exact_when_the_output_is_linear_in_the_step(scope, order):
    n = 12
    timesteps = [1.0 - s / n for s in range(n)]  # linear in the step, so is every residual and Delta
    model = _shift_only_toy()
    reference = _run(model, timesteps)
    cached = _run(model, timesteps, keyframes=(0.0, 0.1, 0.6), order=order, scope=scope)  # steps 0, 1, 7
    for out, ref in zip(cached, reference):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert model.single_blocks[-1].calls == n + 3  # the reference ran every step, the cached run steps 0, 1, 7


def test_order_2_between_keyframes_is_taylorseer_extrapolation_on_a_quadratic():
    # Delta(s) = D * c * s^2 (t = 1 + c s^2, D = 6 b): keyframes at 0, h, 2h give the table d0 = Delta(2h),
    # d1 = (Delta(2h) - Delta(h)) / h = 3 D c h, d2 = (d1(2h) - d1(h)) / h = 2 D c, so at 2h + x the forecast is
    # Delta(2h) + 3 D c h x + D c x^2 = Delta(2h + x) - D c h x: off by -(h / 2) Delta'' x (TaylorSeer's table,
    # not the interpolating parabola, which would be exact).
    h, n, c, b = 3, 10, 0.01, 0.7
    timesteps = [1.0 + c * s * s for s in range(n)]
    model = _shift_only_toy(b)
    reference = _run(model, timesteps)
    cached = _run(model, timesteps, keyframes=(0.0, h / (n - 1), 2 * h / (n - 1)), order=2, scope="call")
    x_in = toy.toy_inputs(0, n)["hidden_states"]
    big_d = 6 * b
    for s in range(2 * h + 1, n):
        x = s - 2 * h
        expected = reference[s] - big_d * c * h * x
        torch.testing.assert_close(cached[s], expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(cached[s], reference[s], atol=1e-4)  # the closed form's error is really there
    torch.testing.assert_close(cached[2 * h] - x_in, reference[2 * h] - x_in)  # a keyframe computes


def test_compute_ratio_is_the_share_of_keyframe_calls():
    model = _shift_only_toy()
    n = 28
    inputs = toy.toy_inputs(0, n)
    with dcache.apply(model, "keyframe", num_steps=n, keyframes=(0.0, 0.2963, 0.5926, 0.8889), scope="call") as handle:
        with torch.no_grad():
            for s in range(n):
                model(**{**inputs, "timestep": torch.tensor([1.0 - s / n])})
        assert handle.stats().compute_ratio == pytest.approx(4 / 28)
