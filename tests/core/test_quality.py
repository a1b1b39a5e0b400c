"""dcache/quality.py against closed forms and the reference formulas each caller measured with."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dcache.quality import feature_stats, frechet_distance, median, psnr, psnr_per_image, ssim_per_image


def _images(seed: int, shape=(3, 3, 16, 16)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(*shape, generator=g)
    return a, (a + 0.05 * torch.randn(*shape, generator=g)).clamp(0, 1)


def test_psnr_closed_form_and_identical_images():
    a = torch.zeros(2, 1, 4, 4)
    assert psnr(a + 0.1, a) == pytest.approx(20.0)  # range 1, MSE 0.01
    assert psnr(a, a) == math.inf
    assert psnr(a + 0.1, a, data_range=None, dtype=torch.float32) == pytest.approx(20.0)  # [0, 1] data: range 1
    assert psnr(a, a, floor=1e-20, at_floor=100.0) == 100.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_psnr_parameters_give_each_callers_formula_bit_for_bit(seed):
    a, b = _images(seed)
    mse64 = torch.mean((a.double() - b.double()) ** 2).item()
    mse32 = float(((a.float() - b.float()) ** 2).mean())
    # dcache generate / the benchmarks: float64, images in [0, 1]
    assert psnr(a, b) == 10.0 * float(np.log10(1.0 / mse64))
    # the target sweeps: float32, range 1 for [0, 1] references, else the reference's max - min
    assert psnr(a, b, data_range=None, dtype=torch.float32) == 10.0 * math.log10(1.0 / mse32)
    wide = b * 4 - 2  # a reference in [-2, 2]
    lo, hi = float(wide.min()), float(wide.max())
    mse_wide = float(((a.float() - wide) ** 2).mean())
    assert psnr(a, wide, data_range=None, dtype=torch.float32) == 10.0 * math.log10((hi - lo) ** 2 / mse_wide)
    # the profiled-method tests: float32, MSE floored at 1e-20 (identical images: 200 dB)
    assert psnr(a, b, dtype=torch.float32, floor=1e-20, at_floor=200.0) == 10 * math.log10(1.0 / max(mse32, 1e-20))
    assert psnr(a, a, dtype=torch.float32, floor=1e-20, at_floor=200.0) == 10 * math.log10(1.0 / 1e-20)
    # dcache eval: per image, float64
    per = psnr_per_image(a, b)
    assert per.dtype == torch.float64 and per.shape == (3,)
    assert per[1].item() == (10.0 * torch.log10(1.0 / ((a[1].double() - b[1].double()) ** 2).mean())).item()


@pytest.mark.parametrize("side", [32, 16, 8, 5, 3])  # window 11, 11, 7, 5, 3
def test_ssim_is_torchmetrics_ssim_bit_for_bit(side):
    tm = pytest.importorskip("torchmetrics.functional.image")
    a, b = _images(side, (2, 3, side, side))
    k = min(11, side - (1 - side % 2))
    ref = tm.structural_similarity_index_measure(a.double(), b.double(), data_range=1.0, kernel_size=k,
                                                 sigma=1.5 * k / 11, reduction="none")
    ours = ssim_per_image(a, b)
    assert ours.dtype == torch.float64 and torch.equal(ours, ref.double())
    assert ssim_per_image(a, a).tolist() == pytest.approx([1.0, 1.0], abs=1e-12)


def test_frechet_distance_closed_forms_and_regularised_sqrtm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64)
    shift = torch.tensor([1.0, 0, 0, 0, 0, 2.0], dtype=torch.float64)
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(x + shift, x) == pytest.approx(5.0, rel=1e-9)  # only the means differ: |mu_a - mu_b|^2
    # eps I on both covariances (features with a dead, always-zero dimension): the regularised closed form
    dead = torch.cat([x, torch.zeros(200, 1, dtype=torch.float64)], 1)
    other = torch.cat([x * 1.5, torch.zeros(200, 1, dtype=torch.float64)], 1)
    linalg = pytest.importorskip("scipy.linalg")
    (mu_a, s_a), (mu_b, s_b) = feature_stats(dead), feature_stats(other)
    eye = 1e-6 * np.eye(7)
    sa, sb = s_a.numpy() + eye, s_b.numpy() + eye
    expected = float(((mu_a - mu_b) ** 2).sum()) + np.trace(sa + sb - 2 * linalg.sqrtm(sa @ sb).real)
    assert frechet_distance(dead, other, eps=1e-6) == pytest.approx(expected, rel=1e-9)


def test_median_of_repeats():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(median([]))
