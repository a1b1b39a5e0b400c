"""cfg_difference=True with a calibration_run: the run decides whether the CFG difference is served
(schedules.tuning.targets.choose_cfg_difference), against the analytic toy of test_cfg_difference.

There the CFG difference D = t is linear, so its first-order forecast is exact and the run-time check always serves
it. Whether the finished sample gains depends on the unconditional branch's own Delta = a(t): with a = t^3 the
own forecast's error at the last step adds to the error of the earlier served steps and the difference wins; with
a = t^4 - t^2 that error cancels part of it, and the exact difference makes the sample worse. Only a comparison
with the uncached generation shows the second case, and the calibration run makes it.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import dcache
from dcache.generations.health import DCacheHealthWarning
from dcache.quality import psnr

from .test_cfg_difference import CfgToy, keyframes, run


class QuarticToyBlock(nn.Module):
    """Delta_cond = t^4 - t^2 + t, Delta_uncond = t^4 - t^2: the same CFG difference as CfgToyBlock."""

    def forward(self, hidden_states, encoder_hidden_states, temb):
        e = encoder_hidden_states.mean(dim=(1, 2))[:, None, None]
        t = temb[:, None, None]
        return hidden_states + t ** 4 - t ** 2 + e * t


def toy(quartic: bool) -> CfgToy:
    model = CfgToy()
    if quartic:
        model.blocks[0] = QuarticToyBlock()
    return model


def sample(model) -> torch.Tensor:
    """The finished sample of the toy's guided loop (guidance 2, step 0.1)."""
    x = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(0))
    for vc, vu in run(model):
        x = x - 0.1 * (vu + 2.0 * (vc - vu))
    return x


def measured(model, reference: torch.Tensor, cfg_difference: bool) -> float:
    with dcache.apply(model, "keyframe", cfg_difference=cfg_difference, **keyframes()):
        return psnr(sample(model), reference, data_range=None, dtype=torch.float32)


@pytest.mark.parametrize("quartic", [False, True], ids=["difference-wins", "difference-loses"])
def test_the_calibration_run_keeps_the_setting_closer_to_the_uncached_sample(quartic):
    model = toy(quartic)
    reference = sample(model)
    without, with_it = measured(model, reference, False), measured(model, reference, True)
    assert abs(with_it - without) > 1.0  # the toy separates the two cases clearly
    with pytest.warns(DCacheHealthWarning, match="left off") if quartic else _no_warning():
        handle = dcache.apply(model, "keyframe", cfg_difference=True, calibration_run=lambda: sample(model),
                              **keyframes())
    try:
        assert handle.engine.schedule.cfg_difference is (with_it > without)
        assert with_it > without if not quartic else with_it < without
        rows = {row["value"]: row["psnr"] for row in handle.target.sweep}
        assert rows[False] == pytest.approx(without, abs=1e-4) and rows[True] == pytest.approx(with_it, abs=1e-4)
        served = sample(model)  # the handle generates as the chosen setting does, bit for bit
    finally:
        handle.remove()
    with dcache.apply(model, "keyframe", cfg_difference=not quartic, **keyframes()):
        assert torch.equal(served, sample(model))


def test_a_calibration_run_without_anything_to_decide_is_refused_with_the_fix():
    model = toy(quartic=False)
    with pytest.raises(ValueError, match=r"calibration_run= alone chooses nothing.*cfg_difference=True"):
        dcache.apply(model, "keyframe", calibration_run=lambda: sample(model), **keyframes())


@contextlib.contextmanager
def _no_warning():
    """Any DCacheHealthWarning inside is an error (the calibration kept the difference: nothing to say)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DCacheHealthWarning)
        yield
