"""What every history forecaster shares: its knobs (validated, named in errors), the fallback while the history is
short, and serving each cached stream of a unit.

A forecaster of this package extrapolates one unit's own computed values, so it serves any unit (`any_history`):
a stack segment's residual, a block's residual, a module's output, the call scope's Delta = v - x. For each cached
stream (hidden, encoder) it is given the unit's last computed values and their steps (dcache.runtime.cache_state:
hist.samples)

    steps   = [s_1, ..., s_K]                 increasing step indices of the computed values (K <= depth)
    values  = [F(s_1), ..., F(s_K)]           tensors of one shape, e.g. [B, T, C] or [B, C, H, W]

and returns F(step) for a step after s_K. While fewer than `min_samples` values were computed (the first steps of a
generation) the engine's Taylor table of the schedule's order serves the forecast instead (reuse at order 0).
A forecaster whose work splits into a part that reads the kept values only (`fit`: HyCa's backtests, DMD's Gram
matrices and modes) and a part per forecast step (`extrapolate_fitted`) does the first once per computed value: the
unit's history keeps the fit (`hist.fitted`) until its next computed value, so the forecasts in between share it.
A sample's forecast never reads another sample of the batch: the linear forecasters weigh whole tensors by scalars,
the data-dependent ones (HyCa, DMD) decide per element or per sample.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dcache.runtime.forecast import Forecaster


@dataclass(frozen=True)
class Knob:
    """One setting of a forecaster: default, allowed range (inclusive) and meaning."""

    default: Any
    low: float | None = None
    high: float | None = None
    doc: str = ""

    def check(self, field: str, value: Any) -> Any:
        kind = type(self.default)
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if isinstance(value, bool) and kind is not bool:
            ok = False
        if not ok:
            raise ValueError(f"{field}={value!r} must be {'a number' if kind is float else 'an ' + kind.__name__} "
                             f"({self.doc}); leave it out for the default {self.default!r}.")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise ValueError(f"{field}={value!r} must be in [{self.low}, {self.high}] ({self.doc}); leave it out "
                             f"for the default {self.default!r}.")
        return kind(value)


class HistoryForecaster(Forecaster):
    """Base class: subclasses set `name`, `knobs`, `min_samples` and `extrapolate` (and `needed_depth` where the
    window is not the `window` setting or `min_samples`)."""

    any_history = True
    knobs: ClassVar[dict[str, Knob]] = {}
    min_samples: int = 2

    def __init__(self, field: str = "forecaster", **settings: Any):
        unknown = sorted(set(settings) - set(self.knobs))
        if unknown:
            close = [c for u in unknown for c in difflib.get_close_matches(u, list(self.knobs), n=1)]
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{field}: forecaster {self.name!r} has no setting(s) {', '.join(map(repr, unknown))}."
                             f"{hint} Its settings are {sorted(self.knobs) or 'none'}.")
        for key, knob in self.knobs.items():
            setattr(self, key, knob.check(f"{field}.{key}", settings.get(key, knob.default)))
        self.depth = self.needed_depth()
        self.num_steps: int | None = None

    def needed_depth(self) -> int:
        """Computed values per unit this forecaster reads (its window; may depend on the settings)."""
        return int(getattr(self, "window", self.min_samples))

    def reset(self, generation) -> None:
        self.num_steps = generation.num_steps

    def settings(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.knobs}

    def to_extras(self) -> dict:
        return {"name": self.name, **self.settings()}

    def __call__(self, hist, step: int) -> list[torch.Tensor]:
        samples = hist.samples
        if len(samples) < self.min_samples:
            return hist.forecast(step)  # the engine's Taylor table (reuse at order 0) until the history is long enough
        steps = [float(s) for s, _ in samples]
        out = []
        for i in range(len(samples[-1][1])):
            values = [vals[i] for _, vals in samples]
            out.append(self.extrapolate_fitted(self._fit(hist, i, steps, values), steps, values, float(step)))
        return out

    def _fit(self, hist, stream: int, steps: list[float], values: list[torch.Tensor]):
        """fit(steps, values) of one stream, computed once per set of kept values: the unit's history keeps it in
        `hist.fitted` until a new value is computed (dcache.runtime.cache_state.UnitHistory.samples), so the forecasts
        between two computed steps share it."""
        if type(self).fit is HistoryForecaster.fit:
            return None
        key = (self, stream)
        if key not in hist.fitted:
            hist.fitted[key] = self.fit(steps, values)
        return hist.fitted[key]

    def fit(self, steps: list[float], values: list[torch.Tensor]):
        """The part of a forecast that depends on the kept values only, not on the step forecast (None: nothing)."""
        return None

    def extrapolate(self, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
        """F(target) from F(steps[k]) = values[k] (steps increasing, target > steps[-1])."""
        return self.extrapolate_fitted(self.fit(steps, values), steps, values, target)

    def extrapolate_fitted(self, fit, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
        """extrapolate, given `fit` = fit(steps, values). A subclass overrides this one where it has a fit, else
        `extrapolate`."""
        if type(self).extrapolate is HistoryForecaster.extrapolate:
            raise NotImplementedError(f"{type(self).__name__} defines neither extrapolate nor extrapolate_fitted")
        return self.extrapolate(steps, values, target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.settings().items())})"


def weighted_sum(weights: list[float], values: list[torch.Tensor]) -> torch.Tensor:
    """sum_k w_k values[k], accumulated in float32 (at least), returned in the values' dtype."""
    work = torch.promote_types(values[-1].dtype, torch.float32)
    out = torch.zeros_like(values[-1], dtype=work)
    for w, v in zip(weights, values):
        if w != 0.0:
            out.add_(v.to(work), alpha=float(w))
    return out.to(values[-1].dtype)
