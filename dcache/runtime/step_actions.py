"""Per-step actions: a method that acts on the scheduler's update, once per denoising step, through the engine.

The engine wraps the pipeline's scheduler instance (dcache.generations.scheduler_tracking). After every
`scheduler.step` of a generation it hands a schedule that sets `acts_on_steps = True` the step's update

    x_i      the latent the step started from (the `sample` argument of scheduler.step), shape [B, C, ...]
    x_{i+1}  the latent the scheduler returned (`prev_sample`)

and the actions the step's transformer calls ran with; `Schedule.after_step(step)` may return a replacement for
x_{i+1} (same shape), e.g. ERTACache's timestep adjustment x_{i+1} <- x_i + phi_i (x_{i+1} - x_i), which for a
first-order (Euler) solver is the update with the interval Delta t_i scaled by phi_i.

Plans carry a step action as `extras["step_action"] = {"name": ..., ...}`; the name is looked up in the registry
below (method packages register theirs when imported, like plan forecasters: dcache.runtime.forecast), so the core
never names one and a replayed plan acts on its steps as the method that wrote it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..plans.extensions import PlanExtension

if TYPE_CHECKING:  # pragma: no cover
    from ..plans.plan import Plan
    from ..schedule import GenerationInfo


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


# Plans carry a step action in extras["step_action"]; method packages register its loader (dcache.plans.extensions).
STEP_ACTIONS: PlanExtension[StepAction] = PlanExtension(
    "step_action", "step action", "dcache.runtime.step_actions.register_step_action", "replay without it")


def register_step_action(name: str, loader: Callable[[dict, "Plan"], StepAction]) -> None:
    """Make plans whose extras["step_action"]["name"] == name loadable; loader(spec, plan) builds the action."""
    STEP_ACTIONS.register(name, loader)


def step_action_from_plan(plan: "Plan") -> StepAction | None:
    """The step action a plan carries in extras["step_action"], or None."""
    return STEP_ACTIONS.from_plan(plan)


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
