"""dcache: feature caching for diffusion transformers in Hugging Face diffusers pipelines.

    handle = dcache.apply(pipe, "magcache")
    image = pipe(prompt).images[0]
    print(handle.stats()); handle.plan().save("plan.json"); handle.remove()
"""

from typing import TYPE_CHECKING

# Light modules (no torch, no diffusers) are imported now; `methods` must be: it is also a submodule's name, which
# Python binds on the package once the submodule is imported, hiding a lazy function of the same name.
from .actions import Action, Granularity, Signal
from .config import MethodConfig, knob
from .methods import config_for, config_from_dict, methods, presets, register_method, register_preset
from .schedule import CallContext, GenerationInfo, MethodSchedule, Schedule

# The other public names -> the module that defines them, imported on first use (PEP 562): `import dcache` stays
# light, so the `dcache` command starts without torch / diffusers where it needs neither (`dcache --help`).
_LAZY = {
    "model.adapters": ("Adapter", "BlockList", "UnsupportedModelError", "register_adapter"),
    "model.families": ("adapter_for",),
    "api.apply_cache": ("apply",),
    "api.options": ("Budget", "Models", "Storage"),
    "api.tune": ("tune",),
    "runtime.concurrency": ("ConcurrentGenerationError",),
    "api.handle": ("Handle",),
    "plans.plan": ("Plan", "PlanError", "PlanSchedule"),
    "runtime.signal_providers": ("ProviderView", "SignalProvider", "register_signal"),
    "generations.stats": ("Stats",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from .model.adapters import Adapter, BlockList, UnsupportedModelError, register_adapter
    from .model.families import adapter_for
    from .api.apply_cache import apply
    from .api.options import Budget, Models, Storage
    from .api.tune import tune
    from .runtime.concurrency import ConcurrentGenerationError
    from .api.handle import Handle
    from .plans.plan import Plan, PlanError, PlanSchedule
    from .runtime.signal_providers import ProviderView, SignalProvider, register_signal
    from .generations.stats import Stats


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'dcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__version__ = "0.1.0"

__all__ = ["apply", "tune", "Storage", "Budget", "Models", "Handle", "Plan", "PlanError", "PlanSchedule", "Schedule",
           "MethodSchedule", "CallContext",
           "GenerationInfo", "Action", "Granularity", "Signal", "SignalProvider", "ProviderView", "register_signal",
           "Adapter", "BlockList", "register_adapter", "adapter_for", "UnsupportedModelError", "MethodConfig", "knob",
           "register_method", "register_preset", "methods", "presets", "config_for", "config_from_dict", "Stats",
           "ConcurrentGenerationError", "__version__"]
