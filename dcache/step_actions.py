"""Per-step actions: a method that acts on the scheduler's update, once per denoising step, through the engine.

The engine wraps the pipeline's scheduler instance (dcache.scheduler_hook). After every `scheduler.step` of a
generation it hands a schedule that sets `acts_on_steps = True` the step's update

    x_i      the latent the step started from (the `sample` argument of scheduler.step), shape [B, C, ...]
    x_{i+1}  the latent the scheduler returned (`prev_sample`)

and the actions the step's transformer calls ran with; `Schedule.after_step(step)` may return a replacement for
x_{i+1} (same shape), e.g. ERTACache's timestep adjustment x_{i+1} <- x_i + phi_i (x_{i+1} - x_i), which for a
first-order (Euler) solver is the update with the interval Delta t_i scaled by phi_i.

Plans carry a step action as `extras["step_action"] = {"name": ..., ...}`; the name is looked up in the registry
below (method packages register theirs when imported, like plan forecasters: dcache.forecast), so the core never
names one and a replayed plan acts on its steps as the method that wrote it did.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan
    from .schedule import GenerationInfo


@dataclass
class SchedulerStep:
    """One scheduler step of a generation, as a step action sees it (after the scheduler ran)."""

    step: int  # index of the step that ran, 0 = noisiest
    num_steps: int | None
    sample: torch.Tensor  # x_i: the latent the step started from
    updated: torch.Tensor  # x_{i+1}: the scheduler's result
    scheduler: Any  # the scheduler instance (e.g. its `order`)
    actions: dict[str, str] = field(default_factory=dict)  # {branch: action row} of the step's transformer calls

    @property
    def reused(self) -> bool:
        """Whether any call of this step was served (partly) from the cache."""
        return any(set(row) != {"C"} for row in self.actions.values())


class StepAction:
    """Base class of a plan's step action: `reset` at every generation start, `__call__` after every step."""

    name = "step_action"

    def reset(self, generation: "GenerationInfo") -> None:
        """A new generation starts."""

    def __call__(self, step: SchedulerStep) -> torch.Tensor | None:
        """A replacement for `step.updated`, or None to keep the scheduler's result."""
        raise NotImplementedError

    def to_extras(self) -> dict:
        """The JSON-serialisable spec stored in a plan's extras["step_action"] (must hold "name")."""
        raise NotImplementedError


# name -> loader(spec, plan) -> StepAction; loaders raise dcache.PlanError with the reason and the fix.
_STEP_ACTIONS: dict[str, Callable[[dict, "Plan"], StepAction]] = {}


def register_step_action(name: str, loader: Callable[[dict, "Plan"], StepAction]) -> None:
    """Make plans whose extras["step_action"]["name"] == name loadable; loader(spec, plan) builds the action."""
    _STEP_ACTIONS[name] = loader


def step_action_from_plan(plan: "Plan") -> StepAction | None:
    """The step action a plan carries in extras["step_action"], or None."""
    from .plan import PlanError
    from .plugins import load_method_packages

    spec = plan.extras.get("step_action")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise PlanError("plan field 'extras.step_action' must be an object with a string 'name' (the registered step "
                        f"action), got {spec!r}; remove the field to replay the plan without one.")
    load_method_packages()
    loader = _STEP_ACTIONS.get(spec["name"])
    if loader is None:
        close = difflib.get_close_matches(spec["name"], list(_STEP_ACTIONS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PlanError(f"plan field 'extras.step_action.name' is {spec['name']!r}, which no installed method "
                        f"registers (known: {', '.join(sorted(_STEP_ACTIONS)) or 'none'}).{hint} Install the method "
                        f"package that wrote the plan, or remove 'extras.step_action'.")
    return loader(spec, plan)


def scheduler_step_sample(args: tuple, kwargs: dict) -> Any:
    """x_i, the `sample` of a diffusers `scheduler.step(model_output, timestep, sample, ...)` call (None if absent)."""
    if "sample" in kwargs:
        return kwargs["sample"]
    return args[2] if len(args) > 2 else None


def updated_sample(out: Any) -> Any:
    """x_{i+1} from what scheduler.step returned: a SchedulerOutput (`prev_sample`) or a tuple (first entry)."""
    if isinstance(out, tuple):
        return out[0] if out else None
    return getattr(out, "prev_sample", None)


def with_updated_sample(out: Any, x_next: torch.Tensor) -> Any:
    """`out` with x_{i+1} replaced, in the form the scheduler returned it."""
    if isinstance(out, tuple):
        return (x_next, *out[1:])
    out.prev_sample = x_next
    return out


__all__ = ["SchedulerStep", "StepAction", "register_step_action", "step_action_from_plan", "scheduler_step_sample",
           "updated_sample", "with_updated_sample"]
