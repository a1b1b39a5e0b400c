"""FoCa (forecast then calibrate): a predictor-corrector step of the feature ODE dF/dt = g(t) over the gap.

Paper: Zheng et al., "Forecast then Calibrate: Feature Caching as ODE for Efficient Diffusion Transformers",
https://arxiv.org/abs/2508.16211 (5.50x on FLUX.1-dev, 6.45x on HunyuanVideo, "near-lossless").

The cached features along the trajectory are the solution of a feature ODE whose right-hand side g is only known
through the computed values. dcache estimates g from the last three computed values F(s_1), F(s_2), F(s_3) (the
derivative of their interpolating quadratic, any spacing: polynomial.slope_weights) and takes one step of length
tau = t - s_3 from the last computed value:
    forecast  (explicit Euler predictor)   F_p = F(s_3) + tau * g(s_3)
    calibrate (Heun / trapezoidal corrector) F_c = F(s_3) + tau/2 * (g(s_3) + g(t))
    served    F(t) = F_p + gamma * (F_c - F_p)                 gamma = `calibration` in [0, 1]
g(t) at the forecast step is the slope extrapolated from the history (the model is not run there). With
gamma = 1 the step is exact for F a polynomial of degree <= 2 (trapezoid on a linear g), whatever the spacing of
the computed steps; gamma < 1 damps the curvature term, which is what grows fastest with the gap. Unlike the
engine's Taylor table (step distances of the last gap only), the slopes use every point at its true step.

When it helps: fixed cadences with long gaps (interval >= 4), where an order-2 Taylor series overshoots and order 1
lags; and uneven keyframes (the slopes are exact on any spacing).
Memory: 3 tensors per cached unit and branch.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import HistoryForecaster, Knob, weighted_sum
from .polynomial import slope_weights


class FoCaForecaster(HistoryForecaster):
    name = "foca"
    min_samples = 3  # also its window: the last three computed values
    knobs: ClassVar[dict[str, Knob]] = {
        "calibration": Knob(0.25, 0.0, 1.0, "gamma: weight of the Heun corrector over the Euler predictor (1 = the "
                                           "full corrector, exact on quadratics; 0 = the predictor alone)"),
    }

    def extrapolate(self, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
        steps, values = steps[-3:], values[-3:]
        last, tau = steps[-1], target - steps[-1]
        g_last = slope_weights(steps, last)      # g(s_3) as weights over the three values
        g_next = slope_weights(steps, target)    # g(t), extrapolated
        gamma = self.calibration
        # F_p + gamma (F_c - F_p) = F(s_3) + tau * [(1 - gamma/2) g(s_3) + gamma/2 g(t)]
        weights = [tau * ((1.0 - gamma / 2.0) * a + gamma / 2.0 * b) for a, b in zip(g_last, g_next)]
        weights[-1] += 1.0
        return weighted_sum(weights, values)
