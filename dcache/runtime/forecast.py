"""Forecasters: a schedule's own FORECAST of a unit, in place of the Taylor extrapolation of its cached history.

A schedule that sets `forecaster` (e.g. a Plan whose extras carry a learned predictor) is asked, for every unit the
engine forecasts, for the unit's cached tensors at `step`:

    forecaster(hist, step) -> list[Tensor]      # same shapes, dtypes and devices as hist.reuse()

`hist` is the unit's `UnitHistory`: `hist.key` names the unit (("seg", list) for stack segments, the block index
for blocks, the module-unit index for modules, (index, k) for the k-th call (k >= 1) of a module a block calls
several times, see Adapter.shared), `hist.tables` holds its Taylor tables ([order + 1, *shape] per
cached tensor, or the tensors themselves at order 0), `hist.filled` how many table rows are valid and
`hist.last_step` the step of the last computed value. A forecaster with `depth = K > 0` also reads `hist.samples`,
the unit's last K computed values [(step, [tensor per stream]), ...] oldest first, which the engine keeps for it
(dcache.runtime.cache_state). REUSE never asks the forecaster.

Two kinds: a learned forecaster (DisCa) predicts the units it was trained on, so call scope, stack segment runs and a
ControlNet that follows the transformer refuse it; a forecaster with `any_history = True` (the extrapolators of
schedules/forecasters/) reads nothing but the unit's own history, so it serves any unit: stacks, blocks, modules, a
segment run and the call scope's Delta alike.

Plans carry a forecaster as `extras["forecaster"] = {"name": ..., ...}`; the name is looked up in the registry
below (method packages register theirs when imported, like method configs: see dcache.plugins), so the core never
names one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..plans.extensions import PlanExtension

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..plans.plan import Plan
    from ..schedule import GenerationInfo
    from .cache_state import UnitHistory


class Forecaster:
    """Base class: `reset` at every generation start, `__call__` for every forecast unit."""

    name = "forecaster"
    depth = 0  # computed values per unit the engine keeps in hist.samples for this forecaster
    fit_bytes = 0  # bytes per element of one computed value that its fit keeps beside them (hist.fitted)
    any_history = False  # True: extrapolates any unit's history (not trained on particular units)

    def reset(self, generation: "GenerationInfo") -> None:
        """A new generation starts (its step count and timesteps are known here)."""

    def __call__(self, hist: "UnitHistory", step: int) -> "list[torch.Tensor]":
        raise NotImplementedError

    def to_extras(self) -> dict:
        """The JSON-serialisable spec stored in a plan's extras["forecaster"] (must hold "name")."""
        raise NotImplementedError


# Plans carry a forecaster in extras["forecaster"]; method packages register its loader (dcache.plans.extensions).
FORECASTERS: PlanExtension[Forecaster] = PlanExtension(
    "forecaster", "forecaster", "dcache.runtime.forecast.register_forecaster", "forecast with Taylor")


def register_forecaster(name: str, loader: Callable[[dict, "Plan"], Forecaster]) -> None:
    """Make plans whose extras["forecaster"]["name"] == name loadable; loader(spec, plan) builds the forecaster."""
    FORECASTERS.register(name, loader)


def history_depth(schedule: object) -> int:
    """How many computed values per unit the engine keeps for the schedule's forecaster (0 without one)."""
    return _forecaster_int(schedule, "depth")


def history_fit_bytes(schedule: object) -> int:
    """Bytes per element of one computed value that the schedule's forecaster keeps in its fit (0 without one)."""
    return _forecaster_int(schedule, "fit_bytes")


def _forecaster_int(schedule: object, attribute: str) -> int:
    return int(getattr(getattr(schedule, "forecaster", None), attribute, 0) or 0)


def forecaster_from_plan(plan: "Plan") -> Forecaster | None:
    """The forecaster a plan carries in extras["forecaster"], or None (Taylor forecasting)."""
    return FORECASTERS.from_plan(plan)
