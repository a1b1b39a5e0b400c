"""Spectrum: a Chebyshev series fitted by ridge regression over the computed history, evaluated at the forecast step.

Paper: "Spectrum" feature forecasting for diffusion transformers (CVPR 2026), https://arxiv.org/abs/2603.01623:
each cached feature is treated as a function of the generation's time and expanded in a Chebyshev basis, whose
coefficients are fitted to the computed steps by ridge regression; 4.79x on FLUX.1-dev, 4.67x on Wan2.1-14B.

With the step axis [0, N - 1] of a generation of N steps mapped onto x in [-1, 1] (the window's own span when N is
unknown), the last K computed values F(s_1..s_K) and Phi[k, m] = T_m(x_k) (m = 0..M, M <= K - 1):
    c    = argmin |Phi c - F|^2 + lambda |c_{1..M}|^2 = (Phi^T Phi + lambda P)^-1 Phi^T F
    F(t) = sum_m c_m T_m(x_t) = sum_k w_k F(s_k),   w = Phi (Phi^T Phi + lambda P)^-1 phi(x_t)
so a forecast is one weighted sum of the K cached tensors (w: K scalars per forecast, computed in float64).
Exact for F a polynomial of degree <= M when lambda = 0; lambda > 0 trades that for robustness when the history is
noisy or the fit has as many coefficients as points (the Taylor table's failure at long horizons: high-order terms
amplify noise). Unlike a Taylor table it uses every kept computed value at its true step (any spacing).

When it helps: long gaps between computed steps with a smooth feature trajectory (keyframe schedules, compute
ratios <= 0.25), where an order-2 Taylor series over the last three points overshoots.
Memory: `window` tensors per cached unit and branch.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from .base import HistoryForecaster, Knob, weighted_sum
from .polynomial import chebyshev_ridge_weights


class SpectrumForecaster(HistoryForecaster):
    name = "spectrum"
    knobs: ClassVar[dict[str, Knob]] = {
        "degree": Knob(2, 0, 8, "M: highest Chebyshev degree of the fit (capped at the number of points - 1)"),
        "window": Knob(4, 2, 32, "K: computed values per unit the fit uses (the most recent ones)"),
        "ridge": Knob(0.01, 0.0, 1e6, "lambda: ridge penalty on the non-constant coefficients (0 = least squares)"),
    }

    def extrapolate(self, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
        span = (0.0, float(self.num_steps - 1)) if self.num_steps and self.num_steps > 1 else (steps[0], target)
        return weighted_sum(_weights(tuple(steps), target, self.degree, self.ridge, span), values)


@functools.lru_cache(maxsize=1024)
def _weights(steps: tuple[float, ...], target: float, degree: int, ridge: float,
             span: tuple[float, float]) -> tuple[float, ...]:
    """chebyshev_ridge_weights, computed once per (steps, target, settings): every unit forecast at a step shares
    them (scalars; the solve costs more than the weighted sum on small tensors)."""
    return tuple(chebyshev_ridge_weights(list(steps), target, degree, ridge, span))
