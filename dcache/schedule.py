"""The one interface between the engine (mechanism) and a caching method (policy).

A schedule sees numbers, never modules: the engine tells it where the generation is (`GenerationInfo`,
`CallContext`) and the signals it asked for; it answers with one action character per unit of the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Sequence

from .actions import ACTION_CHARS, Action, Granularity, Signal

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .config import MethodConfig
    from .runtime.step_actions import SchedulerStep


@dataclass(frozen=True)
class GenerationInfo:
    """What is known when a generation starts (one pipeline call, or one run of steps in transformer-only use)."""

    num_steps: int | None  # None when neither the scheduler nor the user told (transformer-only without num_steps)
    timesteps: tuple[float, ...] | None
    units: tuple[str, ...]  # unit names in the order of an action row
    model_class: str
    num_blocks: int


@dataclass
class CallContext:
    """One transformer call, as the schedule sees it at its decision point."""

    step: int  # scheduler step index, 0 = noisiest
    num_steps: int | None
    branch: str  # "cond", "uncond", "cond_uncond" (from diffusers' cache_context) or "call0", "call1", ...
    call_index: int  # index of this call in the generation (all branches)
    timestep: float | None
    signals: dict[Signal, float] = field(default_factory=dict)  # measured this call (pre) + last compute (post)
    last_compute_step: int | None = None  # last step at which this branch computed its stack/first unit


class Schedule:
    """Base class of every caching policy.

    Subclasses set the class attributes that shape the engine's work and implement `decide`.
      granularity:    which units the action rows address.
      signals:        the signals `decide` reads (nothing else is measured).
      probe_blocks:   STACK granularity: front blocks that always compute (Fn); their residual is PROBE_REL_L1.
      tail_blocks:    STACK granularity: back blocks that always compute (Bn).
      forecast_order: Taylor order kept for FORECAST (0 = plain reuse history only).
      forecaster:     None (FORECAST = Taylor extrapolation) or a `dcache.runtime.forecast.Forecaster` that the engine
      asks
                      for every forecast unit instead (its `depth`: computed values kept per unit for it).
      segment_runs:   STACK granularity: the middle segments of consecutive block lists are one unit ("run") where
                      the transformer passes one list's output straight to the next (Flux: double -> single blocks),
                      so one residual per stream is cached and applied instead of one per list. Exact for REUSE
                      and Taylor FORECAST (linear in the residuals); a learned forecaster is trained per list, so
                      by default a schedule with one (not `any_history`) keeps the lists apart (and so must the
                      recordings that train it).
      cfg_difference: call scope, split CFG: serve the "uncond" branch's reused / forecast calls as the "cond"
                      branch's Delta of the step minus a forecast of the CFG difference
                      (dcache.runtime.cfg_difference).
      acts_on_steps:  True if `after_step` may change the scheduler's update (dcache.runtime.step_actions); the engine
                      reads the step's latents only for such schedules.
    """

    granularity: Granularity = Granularity.STACK
    signals: frozenset[Signal] = frozenset()
    probe_blocks: int = 0
    tail_blocks: int = 0
    forecast_order: int = 0
    forecaster = None
    acts_on_steps: bool = False
    cfg_difference: bool = False
    calibrating: bool = False  # the next generation measures (computes every step); see measured_config
    name: str = "schedule"

    @property
    def segment_runs(self) -> bool:
        return self.forecaster is None or bool(getattr(self.forecaster, "any_history", False))

    def reset(self, generation: GenerationInfo) -> None:
        """A new generation starts: forget all per-generation state."""

    def end(self, complete: bool) -> None:
        """The generation ended: complete when every step ran, else it was interrupted (or abandoned)."""

    def decide(self, ctx: CallContext) -> str | Action | Sequence[Action]:
        """Actions for the units of this call: a string of action characters, one Action for all, or a sequence."""
        raise NotImplementedError

    def after_step(self, step: "SchedulerStep") -> "torch.Tensor | None":
        """After every scheduler step (only when `acts_on_steps`): a replacement for the step's result x_{i+1},
        or None to keep it."""
        return None

    def measured_config(self) -> dict | None:
        """A schedule that calibrates itself (`calibrating`: its next generation computes every step to measure
        what it needs): the config fields that carry what it measured, so that a new handle caches from its first
        generation (None until a generation measured it, and for every other schedule). Offline tuning reads it to
        calibrate once before sweeping a knob."""
        return None

    def may_reuse(self, branch: str, unit: int) -> bool:
        """False if this unit is never reused/forecast in this branch (the engine then keeps no cache for it)."""
        return True

    def config_dict(self) -> dict:
        """Provenance written into exported plans."""
        return {"name": self.name}


# Config knobs that mean the same to every schedule, as the schedule attribute each one sets (MethodSchedule).
ENGINE_KNOBS = {"granularity": "granularity", "probe_blocks": "probe_blocks", "tail_blocks": "tail_blocks",
                "order": "forecast_order", "forecast_order": "forecast_order", "cfg_difference": "cfg_difference"}


class MethodSchedule(Schedule):
    """Base class of a registered method's schedule, built from its config (`MethodConfig.build`).

    It holds what every such schedule takes from its config:
      config:         the config (`self.config`); `name` is its `method`.
      engine knobs:   a config field named in ENGINE_KNOBS sets the schedule attribute of the same meaning
                      (`order` or `forecast_order` -> forecast_order; `granularity` as a `Granularity`); a
                      subclass may still overwrite one after `super().__init__(config)`, e.g. FBCache's fitted
                      probe / tail block counts.
      forecaster:     set it in `__init__` where the config has a `forecaster` knob; `reset` resets it and
                      `plan_extras` carries it into exported plans (a subclass that overrides `reset` calls
                      `super().reset(generation)`).
      config_dict():  the config's fields (`config.to_dict()`), written into exported plans.
    """

    def __init__(self, config: "MethodConfig"):
        self.config = config
        self.name = config.method
        for f in fields(config):
            attribute = ENGINE_KNOBS.get(f.name)
            if attribute is not None:
                value = getattr(config, f.name)
                setattr(self, attribute, Granularity(value) if attribute == "granularity" else value)

    @property
    def served(self) -> Action:
        """The action of a call that does not compute: FORECAST where the schedule forecasts (forecast_order > 0
        or a forecaster), else REUSE."""
        return Action.FORECAST if self.forecast_order > 0 or self.forecaster is not None else Action.REUSE

    def reset(self, generation: GenerationInfo) -> None:
        if self.forecaster is not None:
            self.forecaster.reset(generation)

    def plan_extras(self) -> dict:
        """The forecaster rides in the exported plan, which then replays this run's forecasts
        (dcache.runtime.forecast)."""
        return {} if self.forecaster is None else {"forecaster": self.forecaster.to_extras()}

    def config_dict(self) -> dict:
        return self.config.to_dict()


def normalize_actions(decision: str | Action | Sequence[Action], num_units: int) -> str:
    """Turn a schedule's answer into a row string of exactly `num_units` action characters."""
    if isinstance(decision, Action):
        return decision.value * num_units
    row = decision if isinstance(decision, str) else "".join(Action(a).value for a in decision)
    if len(row) == 1 and num_units > 1:
        row = row * num_units
    if len(row) != num_units or not ACTION_CHARS.issuperset(row):
        raise ValueError(
            f"A schedule returned actions {row[:40]!r} (length {len(row)}) but this call has {num_units} units; "
            f"return one character per unit from 'C' (compute), 'R' (reuse), 'F' (forecast)."
        )
    return row
