"""Everything dcache relies on in diffusers beyond its public API: the only core module that touches its internals.

Each entry says what it relies on and since which diffusers version that holds (COMPATIBILITY.md, "diffusers
versions", lists the versions tried). `tests/compat/test_diffusers_contract.py` checks every assumption against the
installed diffusers, one test per entry, so an upgrade that breaks one fails there and names it.

Public API the rest of the core uses directly (no entry here): `diffusers.hooks.ModelHook` and `HookRegistry`
(`check_if_exists_or_initialize`, `register_hook`, `remove_hook`), `ModelMixin`, `diffusers.models.transformers`,
`diffusers.utils.logging`. Of its behaviour dcache relies on one point the contract tests check too: a registered
hook keeps the module forward's signature (`inspect.signature` follows `__wrapped__`), which dcache reads to find a
transformer's timestep argument under other libraries' hooks (0.40 and later; a `(module, *args, **kwargs)` before).
The bundled pipelines (a layer above the core) pass `cache_context(name, step_index=, num_inference_steps=, sigma=)`,
which diffusers takes since 0.41.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from diffusers.hooks import ModelHook
from diffusers.hooks.hooks import StateManager
from torch import nn


# ---- hook chain ----------------------------------------------------------------------------------------------------

def original_forward(hook: ModelHook) -> Callable:
    """The forward below `hook` in its module's hook chain (the model's own forward, or the next hook's).

    Relies on: `HookRegistry.register_hook` sets `hook.fn_ref` (a `HookFunctionReference`) and, for a hook with a
    `new_forward`, `fn_ref.original_forward` to the module's forward before the hook (0.33 and later). Read at every
    call, not kept: it is the registry's to change. Dynamo traces this helper inline; a frame dynamo skips
    (`torch.compiler.disable(recursive=False)`) reads the attribute itself, as a helper called there is traced.
    """
    return hook.fn_ref.original_forward


def registered_hooks(module: nn.Module) -> dict[str, ModelHook]:
    """The hooks on `module`'s own registry by name ({} when it has none); creates no registry.

    Relies on: the registry lives in the module attribute `_diffusers_hook` and keeps its hooks in `.hooks`, a dict
    by name (0.33 and later).
    """
    registry = getattr(module, "_diffusers_hook", None)
    return dict(getattr(registry, "hooks", {}))


# ---- cache_context -------------------------------------------------------------------------------------------------

class _ContextListener(StateManager):
    """A StateManager that keeps no state: it hands every `cache_context` name on to `receive`."""

    def __init__(self, receive: Callable[[str | None], None]):
        super().__init__(dict)
        self._receive = receive

    def set_context(self, context: Any) -> None:
        # 0.41 and later pass a CacheContext (its `.name`); earlier versions pass the name itself
        self._receive(None if context is None else getattr(context, "name", context))


class ContextHook(ModelHook):
    """A hook that hears the pipeline's `transformer.cache_context(name)`: `receive(name)` on entering, `receive(None)`
    on leaving (the branch names "cond" / "uncond" of a CFG call).

    Relies on: `cache_context` calls `set_context` on every `StateManager` attribute of every hook whose class sets
    `_is_stateful = True`, on the module and its submodules (0.35 and later; a `CacheContext` since 0.41, a name
    before); a stateful hook must implement `reset_state` (`HookRegistry.reset_stateful_hooks`).
    """

    _is_stateful = True

    def __init__(self, receive: Callable[[str | None], None]):
        super().__init__()
        self.context_listener = _ContextListener(receive)

    def reset_state(self, module: nn.Module) -> nn.Module:
        return module


# ---- diffusers' own caches -----------------------------------------------------------------------------------------

# The modules of diffusers.hooks that hold a feature cache (`transformer.enable_cache(config)` and the apply_*
# functions): a hook defined in one of them is a cache.
CACHE_HOOK_MODULES = ("first_block_cache", "mag_cache", "sea_cache", "faster_cache", "taylorseer_cache",
                      "pyramid_attention_broadcast", "text_kv_cache")


def enabled_cache_config(transformer: nn.Module) -> Any | None:
    """The config of `transformer.enable_cache(config)` while it is on, else None. One attribute read.

    Relies on: `CacheMixin.enable_cache` stores its config in `_cache_config` and `disable_cache` sets it back to
    None (0.33 and later).
    """
    return getattr(transformer, "_cache_config", None)


def diffusers_cache(transformer: nn.Module) -> str | None:
    """A description of a diffusers feature cache on `transformer` (enable_cache, or an apply_* function's hooks on
    it or its submodules), or None. Costs one attribute read when enable_cache is on.

    Relies on: `enabled_cache_config` and `registered_hooks`; each diffusers cache defines its hooks in a module of
    `diffusers.hooks` named in CACHE_HOOK_MODULES (0.33 and later; each name from the version that added that cache:
    first_block_cache 0.35, taylorseer_cache 0.36, mag_cache 0.37, text_kv_cache 0.38, sea_cache 0.41).
    """
    config = enabled_cache_config(transformer)
    if config is not None:
        return f"diffusers' {type(config).__name__} (transformer.enable_cache)"
    for module in transformer.modules():
        for hook in registered_hooks(module).values():
            source = type(hook).__module__.rsplit(".", 1)[-1]
            if source in CACHE_HOOK_MODULES:
                return f"diffusers' {source} hooks ({type(hook).__name__})"
    return None


# ---- context parallel ----------------------------------------------------------------------------------------------

def context_parallel_mesh(transformer: nn.Module) -> Any | None:
    """The device mesh of every rank holding a token shard of `transformer` (ring x ulysses, flattened) under
    `transformer.enable_parallelism(config=ContextParallelConfig(...))`, else None.

    Relies on: `enable_parallelism` stores a `ParallelConfig` in `_parallel_config`, whose `context_parallel_config`
    keeps the flattened mesh in `_flattened_mesh` (0.36 and later).
    """
    config = getattr(transformer, "_parallel_config", None)
    context = getattr(config, "context_parallel_config", None)
    return getattr(context, "_flattened_mesh", None)


# ---- pipelines -----------------------------------------------------------------------------------------------------

def calling_pipeline(transformer: Any, depth: int = 40) -> Any:
    """The pipeline object whose method is calling `transformer` right now: the nearest caller frame whose `self`
    has this `.transformer` and a `.scheduler`; None when there is none (transformer-only use). Walks at most
    `depth` frames; the engine asks only at a call outside any open generation (once per generation).

    Relies on: a diffusers pipeline calls its denoiser from one of its own methods (`__call__`) as
    `self.transformer(...)`, with its scheduler at `self.scheduler` (every version); CPython frames
    (`sys._getframe`, `f_locals`).
    """
    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if owner is not None and owner is not transformer and hasattr(owner, "scheduler") \
                and getattr(owner, "transformer", None) is transformer:
            return owner
        frame, depth = frame.f_back, depth - 1
    return None


# ---- models --------------------------------------------------------------------------------------------------------

def loaded_from(model: nn.Module) -> str | None:
    """The hub id or folder `model` was loaded from (`from_pretrained`), or None (built in code, or no config).

    Relies on: `ConfigMixin` records the `pretrained_model_name_or_path` of `from_pretrained` in the model's config as
    `_name_or_path` (a pipeline's component: '<pipeline folder>/transformer'; from the hub: '<cache>/models--org--name/
    snapshots/<rev>/transformer') (0.41 and later: the versions dcache supports). If the key moved, dcache would not
    find a calibration by the model's source: MagCache / TeaCache tables and calibrated plans would ask to be
    calibrated again.
    """
    where = dict(getattr(model, "config", None) or {}).get("_name_or_path")
    return where if isinstance(where, str) and where else None


def qwen_image_modulate(block: nn.Module, x: Any, mod_params: Any, index: Any = None) -> Any:
    """A `QwenImageTransformerBlock`'s AdaLN modulation of `x` [B, L, D] by `mod_params` [B', 3*D] (shift, scale,
    gate); `index` [B, L] picks per token between the two halves of a doubled batch (zero_cond_t). Returns
    (modulated x, gate).

    Relies on: the block's `_modulate(x, mod_params, index=None)` (0.41 and later: the versions dcache supports). If it
    changed, TeaCache's modulated-input signal on Qwen-Image would raise at the first call (nothing else reads it).
    """
    return block._modulate(x, mod_params, index)


__all__ = ["original_forward", "registered_hooks", "ContextHook", "CACHE_HOOK_MODULES", "enabled_cache_config",
           "diffusers_cache", "context_parallel_mesh", "calling_pipeline", "loaded_from", "qwen_image_modulate"]
