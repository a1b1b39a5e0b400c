"""Quality numbers in plain torch: PSNR, SSIM, the Frechet distance of two feature sets, and the median of repeats.

One definition for every layer that reports quality (the target sweeps of `dcache.schedules.tuning`, `dcache
generate`, `dcache eval`, the benchmarks and the tests). Where callers measure differently (data range, precision,
one number per batch or per image, the score of identical images), the difference is a parameter named at the call.
No optional package: torch and the standard library only.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------------------------
# PSNR
# ------------------------------------------------------------------------------------------------------------------


def psnr(a: torch.Tensor, b: torch.Tensor, *, data_range: float | None = 1.0, dtype: torch.dtype = torch.float64,
         floor: float = 0.0, at_floor: float = math.inf) -> float:
    """Peak signal-to-noise ratio of a whole batch in dB: 10 log10(range^2 / MSE), the MSE over every element.

    data_range: the signal's range (1.0: images in [0, 1]); None: 1.0 when the reference `b` lies in [0, 1], else
        its max - min.
    dtype: the precision of the difference and its mean (float64; float32 where a caller measures in float32).
    floor, at_floor: an MSE <= floor scores at_floor (default: identical inputs, MSE 0, score inf; a caller that
        needs a finite number, e.g. for JSON, passes e.g. floor=1e-20, at_floor=100.0).
    """
    x, y = a.detach().to(dtype), b.detach().to(dtype)
    if data_range is None:
        lo, hi = float(y.min()), float(y.max())
        data_range = 1.0 if lo >= 0.0 and hi <= 1.0 else max(hi - lo, 1e-12)
    mse = float(((x - y) ** 2).mean())
    return at_floor if mse <= floor else 10.0 * math.log10(data_range ** 2 / mse)


def check_image_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two image batches [N, C, H, W] of one shape, else a ValueError with both shapes."""
    if a.shape != b.shape or a.ndim != 4:
        raise ValueError(f"expected two image batches [N, C, H, W] of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}.")


def psnr_per_image(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """10 log10(range^2 / MSE_i) per image i, float64 [N]; inf where an image is identical."""
    check_image_pair(a, b)
    mse = ((a.double() - b.double()) ** 2).flatten(1).mean(1)
    return 10.0 * torch.log10(data_range ** 2 / mse)  # mse 0 -> inf


# ------------------------------------------------------------------------------------------------------------------
# SSIM (Wang et al. 2004, Gaussian window)
# ------------------------------------------------------------------------------------------------------------------

def gaussian_window(size: int, sigma: float, dtype: torch.dtype = torch.float64,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """[size, size] window w = g g^T, g_j = exp(-(x_j / sigma)^2 / 2) / sum, x_j = j - (size - 1) / 2."""
    x = torch.arange((1 - size) / 2, (1 + size) / 2, step=1, dtype=dtype, device=device)
    g = torch.exp(-torch.pow(x / sigma, 2) / 2)
    g = (g / g.sum()).unsqueeze(0)  # [1, size]
    return torch.matmul(g.t(), g)


def ssim_per_image(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """SSIM per image, float64 [N], on the images in float64.

    Local statistics under a Gaussian window (size k = 11, or the largest odd size that fits small images;
    sigma = 1.5 k / 11) on the reflect-padded images, so the SSIM map has the image's size:
        mu_a = w * a, var_a = max(w * a^2 - mu_a^2, 0), cov = w * (a b) - mu_a mu_b   (likewise for b)
        SSIM = (2 mu_a mu_b + C1)(2 cov + C2) / ((mu_a^2 + mu_b^2 + C1)(var_a + var_b + C2)),
        C1 = (0.01 range)^2, C2 = (0.03 range)^2,
    averaged over channels and pixels. This is the definition torchmetrics' structural_similarity_index_measure
    uses (bit-identical in float64; tests/eval/test_metrics.py compares them).
    """
    check_image_pair(a, b)
    a, b = a.double(), b.double()
    n, c = a.shape[:2]
    side = min(a.shape[-2:])
    k = min(11, side - (1 - side % 2))
    pad = (k - 1) // 2
    window = gaussian_window(k, 1.5 * k / 11, a.dtype, a.device).expand(c, 1, k, k)
    a = F.pad(a, (pad, pad, pad, pad), mode="reflect")
    b = F.pad(b, (pad, pad, pad, pad), mode="reflect")
    local = F.conv2d(torch.cat((a, b, a * a, b * b, a * b)), window, groups=c)  # [5 N, C, H, W]
    mu_a, mu_b, e_aa, e_bb, e_ab = local.split(n)
    mu_aa, mu_bb, mu_ab = mu_a.pow(2), mu_b.pow(2), mu_a * mu_b
    var_a = torch.clamp(e_aa - mu_aa, min=0.0)
    var_b = torch.clamp(e_bb - mu_bb, min=0.0)
    cov = e_ab - mu_ab
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    ssim_map = ((2 * mu_ab + c1) * (2 * cov + c2)) / ((mu_aa + mu_bb + c1) * (var_a + var_b + c2))
    return ssim_map.reshape(n, -1).mean(-1)


# ------------------------------------------------------------------------------------------------------------------
# Frechet distance
# ------------------------------------------------------------------------------------------------------------------

def feature_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], unbiased covariance [F, F]) in float64 of features [N, F] (N >= 2)."""
    x = features.detach().double().reshape(features.shape[0], -1)
    if x.shape[0] < 2:
        raise ValueError(f"a Frechet distance needs at least 2 images per set, got {x.shape[0]}; use more seeds or "
                         f"prompts.")
    mu = x.mean(0)
    xc = x - mu
    return mu, xc.T @ xc / (x.shape[0] - 1)


def frechet_distance(a: torch.Tensor, b: torch.Tensor, *, eps: float = 0.0) -> float:
    """Frechet distance between Gaussians fitted to features a [N, F] and b [M, F] (on the CPU or not):

        FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^(1/2)),   S = covariance + eps I

    tr((S_a S_b)^(1/2)) = sum_i sqrt(lambda_i(S_a S_b)); S_a S_b is similar to S_a^(1/2) S_b S_a^(1/2), which is
    PSD, so its eigenvalues are real and >= 0 (tiny negative / imaginary parts are round-off and are dropped).
    No scipy.linalg.sqrtm, no iteration; float64 throughout. eps > 0 (e.g. 1e-6) keeps the covariances of features
    with dead (always zero) dimensions regular. This is FID when the features are InceptionV3 pool3.
    """
    mu_a, s_a = feature_stats(a)
    mu_b, s_b = feature_stats(b)
    if eps:
        eye = eps * torch.eye(s_a.shape[0], dtype=s_a.dtype, device=s_a.device)
        s_a, s_b = s_a + eye, s_b + eye
    eig = torch.linalg.eigvals(s_a @ s_b).real.clamp_min(0)
    value = float(((mu_a - mu_b) ** 2).sum() + s_a.trace() + s_b.trace() - 2 * eig.sqrt().sum())
    return max(value, 0.0)


# ------------------------------------------------------------------------------------------------------------------
# Repeats
# ------------------------------------------------------------------------------------------------------------------

def median(values: Iterable[float]) -> float:
    """The median of repeated measurements (timings); nan when there are none."""
    values = list(values)
    return float(statistics.median(values)) if values else float("nan")


__all__ = ["psnr", "psnr_per_image", "check_image_pair", "gaussian_window", "ssim_per_image", "feature_stats",
           "frechet_distance", "median"]
