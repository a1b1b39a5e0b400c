"""L2P: a learned per-step linear predictor, fitted on calibration runs, evaluated as one weighted sum.

Paper: Beyond Fixed Formulas: Data-Driven Linear Predictor for Efficient Diffusion Models (L2P, CVPR 2026),
https://arxiv.org/abs/2604.26365: forecasting caches (Taylor, FoCa, ...) all serve a fixed linear combination of a
few cached features; learning those coefficients per timestep from a few cached trajectories (MSE, ~20 s on a GPU)
gives 4.15x on FLUX.1-dev at PSNR 31.5 and up to 7.18x on Qwen-Image.

The forecast of a unit at step t from its last K computed values F(s_1..s_K) (the schedule's cadence fixes s):

    F^(t) = sum_k w_{t,s,k} F(s_k)                    w: K scalars per (t, s_1..s_K), one table for every unit

Fitting (dcache.schedules.tuning.l2p_fit.fit_l2p) runs the pipeline uncached on calibration inputs, records the
call's Delta = v - x at every step of every branch, and solves for each (t, s) the ridge-regularised least squares

    w = argmin_w sum_{runs, branches} |sum_k w_k Delta(s_k) - Delta(t)|^2 + lambda tr(G)/K |w - p|^2
      = (G + lambda tr(G)/K I)^-1 (g + lambda tr(G)/K p)
    G_ij = sum <Delta(s_i), Delta(s_j)>,   g_i = sum <Delta(s_i), Delta(t)>

(in float64 over every element: the closed form of the paper's MSE objective for shared weights), where p is the
weights of the Taylor forecast of the same order through the last order + 1 values (Lagrange extrapolation), so
lambda -> inf gives Taylor back and the fitted weights never fit the calibration data worse than it.
The least squares score one forecast from the uncached history; a cached generation forecasts from its own drifted
history, which a weaker pull can amplify, so lambda is a choice per model: fit_l2p(..., ridge="auto") runs the first
calibration input cached with each of lambda = 10, 1, 0.1, 0.01, 0.001 and 0 (plain least squares) and keeps the one
whose finished sample is closest to the uncached run's (with 4 uniform keyframes and lambda down to 0.01 it chose 10
on tiny-digits at CFG 1.5, 1 on tiny-shapes at CFG 4 and 0.01, the weakest offered, on tiny-motion at CFG 5).

With split CFG the runs also give a second table, `difference_weights`, fitted the same way on the CFG difference
D = Delta_cond - Delta_uncond, which `cfg_difference=True` forecasts (dcache.runtime.cfg_difference): the sample's
error is then e_cond + (g - 1) e_D, so a table fitted on D itself serves it better than the branches' shared
weights, whose errors need not cancel in D (open loop on tiny-motion at CFG 5, the guided output's squared error
fell 14-28 %; in a finished generation the choice is the tuning batch's: it won at 3 + 3 keyframes there and lost at
4 + 4 and 5 + 5). The tables hold every forecast of the placement and its computed steps after the first, where
cfg_difference checks both paths' forecasts against the computed values.

At run time a (t, s) the table lacks (another cadence, another step count) is served by the engine's Taylor table
instead, and a DCacheHealthWarning says so once per forecaster, naming the step count or the missing entry and the
refit. When it helps: a fixed cadence (keyframe, fixed_interval, a plan) at low
compute ratios, on the step count and guidance it was fitted at; the weights are fitted on the call's Delta and are
used as they are for stacks, blocks and modules too. Memory: `window` tensors per cached unit and branch.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from dcache.generations.health import warn_once

from .base import HistoryForecaster, Knob, weighted_sum


def table_key(target: int, steps: list[int]) -> str:
    """The weights' key: "t|s_1,...,s_K" (steps increasing)."""
    return f"{int(target)}|{','.join(str(int(s)) for s in steps)}"


class L2PForecaster(HistoryForecaster):
    name = "l2p"
    knobs: ClassVar[dict[str, Knob]] = {
        "weights": Knob({}, doc="{'t|s_1,...,s_K': [w_1, ..., w_K]}: the fitted table (fit_l2p writes it)"),
        "difference_weights": Knob({}, doc="the same for D = Delta_cond - Delta_uncond, which cfg_difference=True "
                                           "forecasts (fit_l2p writes it from split-CFG runs; empty: Taylor)"),
        "window": Knob(3, 1, 16, "K: computed values per unit a forecast combines (the most recent ones)"),
        "fitted_steps": Knob(0, 0, 100000, "the step count the table was fitted at; another count is served by "
                                           "Taylor (0: any)"),
    }
    min_samples = 1

    def __init__(self, field: str = "forecaster", **settings: Any):
        super().__init__(field, **settings)
        for table in ("weights", "difference_weights"):
            for key, value in getattr(self, table).items():
                if not _valid_entry(key, value, self.window):
                    raise ValueError(f"{field}.{table}[{key!r}] = {value!r:.80} is not an entry of an L2P table: a "
                                     f"key 't|s_1,...,s_K' (integers, steps increasing and before t, K <= window="
                                     f"{self.window}) and a list of K finite numbers; refit with "
                                     f"dcache.schedules.tuning.l2p_fit.fit_l2p.")
        self.served = 0  # forecasts served from the table / by the Taylor fallback (for tests and reports)
        self.fallbacks = 0
        self._said: set[str] = set()  # the fallbacks already warned about (warn_once: per forecaster and kind)

    def reset(self, generation) -> None:
        super().reset(generation)
        if self.weights and self.fitted_steps not in (0, self.num_steps):
            count = f"has {self.num_steps} steps" if self.num_steps else "has no known step count"
            warn_once(self._said, "steps", (
                f"forecaster l2p: its table was fitted at {self.fitted_steps} steps and this generation {count}, so "
                f"every forecast uses the Taylor table of the schedule's order instead (the weights belong to the "
                f"step grid they were fitted on). Refit with dcache.schedules.tuning.l2p_fit.fit_l2p on runs at the "
                f"step count you generate at."))

    def lookup(self, hist, step: int, difference: bool = False) -> list[torch.Tensor] | None:
        """The table's forecast at `step` from the history's last `window` computed values, or None where the table
        (`difference_weights` for the CFG difference) has no entry or was fitted at another step count. Counts and
        says nothing: cfg_difference also reads it at computed steps, to check its forecasts."""
        samples = hist.samples[-self.window:]
        if not samples or self.fitted_steps not in (0, self.num_steps):
            return None
        weights = (self.difference_weights if difference else self.weights).get(
            table_key(step, [s for s, _ in samples]))
        if weights is None:
            return None
        return [weighted_sum(weights, [values[i] for _, values in samples]) for i in range(len(samples[-1][1]))]

    def __call__(self, hist, step: int) -> list[torch.Tensor]:
        samples = hist.samples[-self.window:]
        served = self.lookup(hist, step)
        if served is None and samples and self.fitted_steps in (0, self.num_steps):
            key = table_key(step, [s for s, _ in samples])
            if self.weights and "placement" not in self._said:  # format the text once
                warn_once(self._said, "placement", (
                    f"forecaster l2p: its table has no weights for the forecast at step {step} from computed steps "
                    f"{[s for s, _ in samples]} ({key!r}): it was fitted for another placement of the computed steps "
                    f"(other keyframes, another schedule). Such forecasts use the Taylor table of the schedule's "
                    f"order; refit with fit_l2p using the method and knobs you generate with."))
        if served is None:
            self.fallbacks += 1
            return hist.forecast(step)  # the engine's Taylor table of the schedule's order
        self.served += 1
        return served


def _valid_entry(key: Any, value: Any, window: int) -> bool:
    if not isinstance(key, str) or key.count("|") != 1 or not isinstance(value, (list, tuple)):
        return False
    target, steps = key.split("|")
    try:
        t, s = int(target), [int(x) for x in steps.split(",")] if steps else []
    except ValueError:
        return False
    ordered = all(a < b for a, b in zip(s, s[1:])) and bool(s) and s[-1] < t
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in value)
    return ordered and len(s) == len(value) <= window and numbers
