"""Objects a plan carries by name in one of its extras keys (a learned forecaster, a per-step action), built by a
loader that the method package defining them registers, so the core never names one.

    FORECASTERS = PlanExtension("forecaster", "forecaster", "dcache.runtime.forecast.register_forecaster",
                                "forecast with Taylor")
    FORECASTERS.register("disca", load_disca)       # in the method's file
    forecaster = FORECASTERS.from_plan(plan)        # None when the plan has no extras["forecaster"]

A plan naming an unregistered object is refused (dcache.PlanError) with the known names, a close match and the fix.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

T = TypeVar("T")


class PlanError(ValueError):
    """A plan file that cannot be used as asked; the message says why and what to do. (Defined here, below
    dcache.plans.plan, which re-exports it, because the extension loaders raise it too.)"""


class PlanExtension(Generic[T]):
    def __init__(self, key: str, what: str, register_with: str, without: str):
        """key: the extras key ({"name": ..., ...}); what: the object's kind, for messages; register_with: the
        function that registers a loader; without: what a replay does when the key is removed."""
        self.key, self.what, self.register_with, self.without = key, what, register_with, without
        self.loaders: dict[str, Callable[[dict, "Plan"], T]] = {}  # name -> loader(spec, plan); PlanError on bad specs

    def register(self, name: str, loader: Callable[[dict, "Plan"], T]) -> None:
        """Make plans whose extras[key]["name"] == name loadable; loader(spec, plan) builds the object."""
        self.loaders[name] = loader

    def from_plan(self, plan: "Plan") -> T | None:
        """The object the plan carries in extras[key], or None."""
        from ..plugins import load_method_packages

        spec: Any = plan.extras.get(self.key) if isinstance(plan.extras, dict) else None
        if spec is None:
            return None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise PlanError(f"plan field 'extras.{self.key}' must be an object with a string 'name' (the registered "
                            f"{self.what}), got {spec!r:.80}; re-export the plan, or remove 'extras.{self.key}' to "
                            f"{self.without}.")
        name = spec["name"]
        if name not in self.loaders:
            load_method_packages()  # the method packages register their loaders on import
        loader = self.loaders.get(name)
        if loader is None:
            close = difflib.get_close_matches(name, list(self.loaders), n=2)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise PlanError(f"plan {self.what} {name!r} is not registered.{hint} Known: "
                            f"{', '.join(sorted(self.loaders)) or 'none'}; install the method package that wrote the "
                            f"plan (or register it with {self.register_with}), or remove 'extras.{self.key}' to "
                            f"{self.without}.")
        return loader(spec, plan)


__all__ = ["PlanExtension", "PlanError"]
