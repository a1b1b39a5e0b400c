"""Forecasters: a schedule's own FORECAST of a unit, in place of the Taylor extrapolation of its cached history.

A schedule that sets `forecaster` (e.g. a Plan whose extras carry a learned predictor) is asked, for every unit the
engine forecasts, for the unit's cached tensors at `step`:

    forecaster(hist, step) -> list[Tensor]      # same shapes, dtypes and devices as hist.reuse()

`hist` is the unit's `UnitHistory`: `hist.key` names the unit (("seg", list) for stack segments, the block index
for blocks, the module-unit index for modules, (index, k) for the k-th call (k >= 1) of a module a block calls
several times, see Adapter.shared), `hist.tables` holds its Taylor tables ([order + 1, *shape] per
cached tensor, or the tensors themselves at order 0), `hist.filled` how many table rows are valid and
`hist.last_step` the step of the last computed value. REUSE never asks the forecaster.

Plans carry a forecaster as `extras["forecaster"] = {"name": ..., ...}`; the name is looked up in the registry
below (method packages register theirs when imported, like method configs: see dcache.plugins), so the core never
names one.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .plan import Plan
    from .schedule import GenerationInfo
    from .state import UnitHistory


class Forecaster:
    """Base class: `reset` at every generation start, `__call__` for every forecast unit."""

    name = "forecaster"

    def reset(self, generation: "GenerationInfo") -> None:
        """A new generation starts (its step count and timesteps are known here)."""

    def __call__(self, hist: "UnitHistory", step: int) -> "list[torch.Tensor]":
        raise NotImplementedError

    def to_extras(self) -> dict:
        """The JSON-serialisable spec stored in a plan's extras["forecaster"] (must hold "name")."""
        raise NotImplementedError


# name -> loader(spec, plan) -> Forecaster; loaders raise dcache.PlanError with the reason and the fix.
_FORECASTERS: dict[str, Callable[[dict, "Plan"], Forecaster]] = {}


def register_forecaster(name: str, loader: Callable[[dict, "Plan"], Forecaster]) -> None:
    """Make plans whose extras["forecaster"]["name"] == name loadable; loader(spec, plan) builds the forecaster."""
    _FORECASTERS[name] = loader


def forecaster_from_plan(plan: "Plan") -> Forecaster | None:
    """The forecaster a plan carries in extras["forecaster"], or None (Taylor forecasting)."""
    from .plan import PlanError
    from .plugins import load_method_packages

    spec: Any = plan.extras.get("forecaster") if isinstance(plan.extras, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise PlanError("plan extras[\"forecaster\"] must be an object with a \"name\"; the plan file is damaged, "
                        "re-export it (e.g. with dcache search --method disca).")
    name = spec["name"]
    if name not in _FORECASTERS:
        load_method_packages()  # registers the built-in forecasters
    loader = _FORECASTERS.get(name)
    if loader is None:
        close = difflib.get_close_matches(name, list(_FORECASTERS), n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise PlanError(f"plan forecaster {name!r} is not registered.{hint} Known: {sorted(_FORECASTERS) or 'none'}; "
                        f"register it with dcache.forecast.register_forecaster, or drop extras[\"forecaster\"] to "
                        f"forecast with Taylor.")
    return loader(spec, plan)
