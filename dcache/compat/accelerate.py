"""What dcache relies on in accelerate beyond its public API: the attributes its module hooks leave on a module.

diffusers' `enable_model_cpu_offload` / `enable_sequential_cpu_offload` put accelerate hooks on the transformer
(`accelerate.hooks.add_hook_to_module`), which wrap the module's `forward` and keep the forward they wrapped; dcache
slides its own forward in *under* that wrapper, as the forward accelerate calls. accelerate is not imported here (it
is an optional dependency): the module's attributes are read as they are. Each entry says what it relies on and
since which version; `tests/compat/test_accelerate_contract.py` checks every one against the installed accelerate
(skipped without it), so an upgrade that breaks one fails there and names it.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def has_offload_hook(module: nn.Module) -> bool:
    """Whether an accelerate hook wraps `module.forward`.

    Relies on: `add_hook_to_module` sets `module._hf_hook` (the hook) and `module._old_forward` (the forward it
    wrapped), and `remove_hook_from_module` deletes both (accelerate 1.0 and later: the versions dcache's extras ask
    for). If accelerate renamed them, dcache would not see the wrapper and would register its hook on top
    of it: offloaded models would still run, but dcache's forward would be replaced when accelerate removes its
    hook after a pipeline call, and caching would stop silently.
    """
    return hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")


def wrapped_forward(module: nn.Module) -> Callable | None:
    """The forward accelerate's hook calls (the one it wrapped), or None where no accelerate hook is on `module`.

    Relies on: accelerate's wrapper calls `module._old_forward(*args, **kwargs)` at every call, reading the attribute
    then, not a copy kept at wrap time (accelerate 1.0 and later). If it kept a copy, a forward dcache puts there
    with `set_wrapped_forward` would never run.
    """
    return getattr(module, "_old_forward", None)


def set_wrapped_forward(module: nn.Module, forward: Callable) -> None:
    """Make `forward` the one accelerate's hook calls; `remove_hook_from_module` then restores it as the module's
    forward (the same attribute; see `wrapped_forward`)."""
    module._old_forward = forward


__all__ = ["has_offload_hook", "set_wrapped_forward", "wrapped_forward"]
