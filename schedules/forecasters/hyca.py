"""HyCa: a hybrid of solvers, chosen per feature dimension from how each one would have done on the history.

Paper: "HyCa: hybrid ODE solvers for feature caching" (ICLR 2026), https://arxiv.org/abs/2510.04188: feature
dimensions evolve differently (some stay put, some drift linearly, some curve), so one solver for all of them is
wrong for most; HyCa gives each dimension the solver that fits its temporal behaviour (5.55x FLUX, 5.56x
HunyuanVideo, 6.24x Qwen-Image). The paper clusters dimensions offline; dcache chooses online, per element of the
cached tensor, from the unit's own history, so it needs no calibration run:

    solvers   p_0 = reuse F(s_K),  p_1 = the line through the last 2 values,  p_2 = the quadratic through the last 3
              (Lagrange extrapolation at the true steps: polynomial.lagrange_weights)
    backtest  for each of the last B computed values F(s_j), j = K-B+1..K: predict it with every solver from the
              values before it, e_p = sum_j |p(s_j; F(s_<j)) - F(s_j)|                 (per element)
    served    F(t)[i] = p*(t)[i],  p* = argmin_p e_p[i]   (ties: the lowest order)

Exact wherever a dimension follows the polynomial of its chosen solver; and where extrapolation amplifies noise
(a dimension that jitters around a level), reuse wins the backtest and is served there, which no single Taylor
order does. Only solvers with a backtest are candidates: with K values, orders up to K - 2.

When it helps: units whose dimensions mix static and drifting behaviour (stack residuals, call-scope Delta); a fixed
cadence or keyframes with at least 3 computed values before the first long gap.
Memory: 3 + B tensors per cached unit and branch, and the choice (one byte per element), kept from the first
forecast after a computed value to the next computed value. Cost: the backtests, about B x 3 weighted sums, once per
computed value (the choice depends on the kept values only); each forecast then about 3 weighted sums.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import HistoryForecaster, Knob, weighted_sum
from .polynomial import lagrange_weights


def solver_forecast(order: int, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
    """p_order(target): Lagrange extrapolation through the last order + 1 values (order 0: the last value)."""
    return weighted_sum(lagrange_weights(steps[-order - 1:], target), values[-order - 1:])


class HyCaForecaster(HistoryForecaster):
    name = "hyca"
    min_samples = 3
    fit_bytes = 1  # the per-element choice (uint8), kept until the next computed value
    knobs: ClassVar[dict[str, Knob]] = {
        "max_order": Knob(1, 1, 3, "highest solver order among the candidates (reuse, line, quadratic, cubic)"),
        "backtests": Knob(1, 1, 8, "B: how many of the last computed values each solver is scored on"),
    }

    def needed_depth(self) -> int:
        return self.max_order + 1 + self.backtests  # the highest solver's points + the values it is scored on

    def fit(self, steps: list[float], values: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """The candidate orders and the per-element choice among them (uint8, the values' shape): the backtests read
        the kept values only, so the forecasts until the next computed value share them."""
        orders = [p for p in range(self.max_order + 1) if p + 2 <= len(steps)]  # each needs p + 1 values + 1 to score
        first = max(orders[-1] + 1, len(steps) - self.backtests)  # the same scored values for every solver
        choice = best = None
        for i, p in enumerate(orders):
            err = torch.zeros_like(values[-1], dtype=torch.float32)
            for j in range(first, len(steps)):
                guess = solver_forecast(p, steps[:j], values[:j], steps[j])
                err += (guess.float() - values[j].float()).abs()
            # per element, the first (lowest order) of the smallest errors: argmin over the candidates, kept as a
            # running minimum (a stacked argmin over its first dimension is ~30x slower on CPU); uint8: <= 4 of them
            if choice is None:
                choice, best = torch.zeros_like(err, dtype=torch.uint8), err
            else:
                choice = torch.where(err < best, i, choice).to(torch.uint8)
                best = torch.minimum(best, err)
        return orders, choice

    def extrapolate_fitted(self, fit: tuple[list[int], torch.Tensor], steps: list[float], values: list[torch.Tensor],
                           target: float) -> torch.Tensor:
        orders, choice = fit
        out = solver_forecast(orders[0], steps, values, target)
        for i, p in enumerate(orders[1:], start=1):
            out = torch.where(choice == i, solver_forecast(p, steps, values, target), out)
        return out
