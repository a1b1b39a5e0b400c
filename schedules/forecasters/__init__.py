"""Forecasters beyond Taylor: what a FORECAST serves, from the unit's own computed history.

    name        file          formula (see each file)                                          paper
    "taylor"    (the engine)  sum_k d_k (t - s)^k / k! over the schedule's Taylor table          arXiv 2503.06923
    "foca"      foca.py       Euler predictor + Heun corrector of the feature ODE               arXiv 2508.16211
    "hyca"      hyca.py       per-element choice of reuse / line / quadratic by backtest        arXiv 2510.04188
    "spectrum"  spectrum.py   Chebyshev series fitted by ridge regression over the history      arXiv 2603.01623
    "dmd"       dmd.py        dynamic mode decomposition of the history (exponential modes)     Schmid 2010
    "l2p"       l2p.py        per-step weights over the history, least squares on calibration   arXiv 2604.26365
                              runs (fit: dcache.schedules.tuning.l2p_fit.fit_l2p)

A schedule with a `forecaster` knob (taylorseer, keyframe, fixed_interval, seacache) takes a name or a dict
{"name": ..., setting: value}:

    dcache.apply(pipe, "keyframe", forecaster="spectrum")
    dcache.apply(pipe, "taylorseer", forecaster={"name": "foca", "calibration": 0.5})

and a plan takes the same dict in its extras: plan.extras["forecaster"] = {"name": "dmd", "window": 5} (a plan
replays FORECAST cells with it; dcache.runtime.forecast). Every forecaster serves stacks, blocks, modules and the call
scope.
"""

from __future__ import annotations

import difflib
from typing import Any

from dcache.runtime.forecast import Forecaster, register_forecaster

from .base import HistoryForecaster
from .dmd import DMDForecaster
from .foca import FoCaForecaster
from .hyca import HyCaForecaster
from .l2p import L2PForecaster
from .spectrum import SpectrumForecaster

TAYLOR = "taylor"  # the engine's own Taylor table: no forecaster object
FORECASTERS: dict[str, type[HistoryForecaster]] = {
    cls.name: cls for cls in (FoCaForecaster, HyCaForecaster, SpectrumForecaster, DMDForecaster, L2PForecaster)}

KNOB_DOC = ("what a FORECAST serves: 'taylor' (the Taylor table of `order`), or 'foca', 'hyca', 'spectrum', 'dmd', "
            "'l2p' (dcache.schedules.forecasters), as a name or {'name': ..., setting: value}")


def build_forecaster(spec: Any, field: str = "forecaster") -> Forecaster | None:
    """The forecaster a knob value names (None for 'taylor'); a ValueError naming `field` and the fix otherwise."""
    if isinstance(spec, str):
        name, settings = spec, {}
    elif isinstance(spec, dict) and isinstance(spec.get("name"), str):
        name, settings = spec["name"], {k: v for k, v in spec.items() if k != "name"}
    else:
        raise ValueError(f"{field}={spec!r:.80} must be a forecaster name or a dict with a 'name' key, e.g. "
                         f"'spectrum' or {{'name': 'spectrum', 'degree': 2}}; known names: {known()}.")
    if name == TAYLOR:
        if settings:
            raise ValueError(f"{field}: 'taylor' takes no settings here (got {sorted(settings)}); its order is the "
                             f"schedule's `order` knob.")
        return None
    cls = FORECASTERS.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, [TAYLOR, *FORECASTERS], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{field}={name!r} is not a forecaster.{hint} Known: {known()}.")
    return cls(field, **settings)


def known() -> str:
    return ", ".join(repr(n) for n in [TAYLOR, *sorted(FORECASTERS)])


def _load(spec: dict, plan: Any) -> Forecaster:
    """A plan's extras["forecaster"] (dcache.runtime.forecast): a bad setting is a PlanError that names the field."""
    from dcache.plans.plan import PlanError

    try:
        forecaster = build_forecaster(spec, "plan field 'extras.forecaster'")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if forecaster is None:  # pragma: no cover - 'taylor' is not registered as a plan forecaster
        raise PlanError("plan field 'extras.forecaster' names 'taylor': remove the key to forecast with Taylor.")
    return forecaster


for _name in FORECASTERS:
    register_forecaster(_name, _load)

__all__ = ["FORECASTERS", "KNOB_DOC", "TAYLOR", "build_forecaster", "config_forecaster", "forecaster_knob",
           "known", "DMDForecaster", "FoCaForecaster", "HyCaForecaster", "L2PForecaster", "SpectrumForecaster"]


def forecaster_knob() -> Any:
    """The `forecaster` field of a method config ('taylor' by default: the engine's Taylor table)."""
    from dcache import knob

    return knob(TAYLOR, types=(str, dict), doc=KNOB_DOC)


def config_forecaster(config: Any, field: str = "forecaster") -> Forecaster | None:
    """Validate and build a config's forecaster (call it from the config's check()). A bad value is the config's own
    teaching error: "KeyframeConfig.forecaster='spectrm' is invalid: it must be a forecaster name or ...; forecaster=
    'spectrm' is not a forecaster. Did you mean 'spectrum'? Known: ...". """
    value = getattr(config, field)
    try:
        return build_forecaster(value, field)
    except ValueError as exc:
        raise config.invalid(field, value, f"a forecaster name or {{'name': ..., setting: value}} of "
                                           f"dcache.schedules.forecasters; {exc}") from None
