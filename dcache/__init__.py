"""dcache: feature caching for diffusion transformers in Hugging Face diffusers pipelines.

    handle = dcache.apply(pipe, "magcache")
    image = pipe(prompt).images[0]
    print(handle.stats()); handle.plan().save("plan.json"); handle.remove()
"""

from .actions import Action, Granularity, Signal
from .adapters import Adapter, BlockList, UnsupportedModelError, adapter_for, register_adapter
from .api import apply
from .concurrency import ConcurrentGenerationError
from .config import MethodConfig, knob
from .handle import Handle
from .methods import config_for, config_from_dict, methods, presets, register_method, register_preset
from .plan import Plan, PlanError, PlanSchedule
from .schedule import CallContext, GenerationInfo, Schedule
from .signal_providers import ProviderView, SignalProvider, register_signal
from .stats import Stats

__version__ = "0.1.0"

__all__ = ["apply", "Handle", "Plan", "PlanError", "PlanSchedule", "Schedule", "CallContext", "GenerationInfo",
           "Action", "Granularity", "Signal", "SignalProvider", "ProviderView", "register_signal", "Adapter",
           "BlockList", "register_adapter", "adapter_for", "UnsupportedModelError", "MethodConfig", "knob",
           "register_method", "register_preset", "methods", "presets", "config_for", "config_from_dict",
           "Stats", "ConcurrentGenerationError", "__version__"]
