"""`dcache.apply`: one call to put a caching method on a pipeline or a transformer.

Each concern is resolved by its own piece: the options' groups (dcache.api.options: storage, budget, models), a
speed / quality target (dcache.api.tune), the engines (dcache.api.engine_factory), the other experts
(dcache.api.experts), a ControlNet (dcache.api.controlnet), the memory budget (dcache.memory.budget), a setup file
(dcache.api.setup_file).
"""

from __future__ import annotations

import copy
import numbers
import os
from typing import Any

from torch import nn

from ..config import MethodConfig
from ..memory.budget import BudgetCheck
from ..methods import DEFAULT_METHOD, preset_scope
from ..plans.plan import Plan
from ..runtime.hooks import refuse_other_cache
from ..schedule import Schedule
from .controlnet import attach_controlnets, check_controlnet_option
from .engine_factory import APPLIED, attach, resolve_schedule
from .experts import attach_experts, check_expert_names, extra_experts
from .handle import Handle
from .options import SHORTHANDS, TARGET_KEYWORDS, Budget, Models, Options, Storage, options_of
from .setup_file import Setup, setup_file, setup_of
from .tune import tuned


def apply(target: Any, method: str | MethodConfig | Plan | Schedule | os.PathLike = DEFAULT_METHOD, *,
          storage: Storage | None = None, budget: Budget | None = None, models: Models | None = None,
          scope: str | None = None, decisions: str | None = None, num_steps: int | None = None,
          memoize: bool = True, count_flops: bool = True, **keywords: Any) -> Handle:
    """Hook a caching method into a diffusers pipeline (or a bare transformer) and return its Handle.

    method:    a method or preset name ("magcache", ...), a config object (dcache.tune returns one), a Plan, a plan
               file (*.json), a setup file (dcache.api.setup_file: every argument here in one file; arguments given
               beside it override its fields), or a Schedule instance.
    storage:   dcache.Storage(dtype=, scale=, device=): how the cache keeps its tensors (dcache.api.options).
    budget:    dcache.Budget(max_memory, fit=): a device-memory budget for the cache, checked at a generation's
               first call before anything is cached (dcache.memory.budget).
    models:    dcache.Models(experts=, controlnet=): the pipeline's other experts (Wan 2.2's transformer_2) and
               ControlNets, cached too.
    scope:     "blocks" (default: cache the block stack) or "call" (the whole transformer call, dcache.runtime.
               call_scope); None: a plan's or a preset's own, else "blocks".
    decisions: "sample" (default: each sample of a batch decided, cached and served on its own; dcache.runtime.lanes)
               or "batch" (one decision per batched call).
    num_steps: transformer-only use: the number of denoising steps (a pipeline's scheduler tells it otherwise).
    memoize:   compute step-invariant work outside the blocks (RoPE tables) once (dcache.runtime.step_invariant).
    count_flops: count each unit's FLOPs for handle.stats().
    keywords:  the method's config fields (apply(pipe, "magcache", threshold=0.1)); a speed / quality target
               (speed="2x" or quality="psnr>=30" with calibration_run=: dcache.tune's choice, its sweep in
               handle.target); and the flat shorthand of one group field each: cache_dtype=, cache_scale=,
               cache_device= (storage), max_cache_memory=, fit= (budget), experts=, controlnet= (models).
    """
    given = {"storage": storage, "budget": budget, "models": models, "scope": scope, "decisions": decisions,
             "num_steps": num_steps, "memoize": memoize, "count_flops": count_flops}
    setup = setup_file(method)
    if setup is not None:
        return _apply_setup(target, setup, given, keywords)
    options = options_of(storage, budget, models, keywords)
    num_steps = check_num_steps(num_steps)
    pipeline, transformer = split_target(target)
    experts = check_expert_names(pipeline, options.models.experts)
    controlnet = check_controlnet_option(pipeline, options.models.controlnet)
    check_not_applied(pipeline, transformer)
    as_given = dict(method=method, knobs=options.knobs, options=options, scope=scope, num_steps=num_steps,
                    memoize=memoize, decisions=decisions)
    scope = preset_scope(method) if scope is None else scope  # e.g. a call-scope preset; None: the schedule's own
    chosen = None
    if options.target:
        method, chosen = tuned(target, method, options.target, num_steps=num_steps, scope=scope,
                               overrides=options.knobs)
        as_given.update(method=method, knobs={})
    knobs = as_given["knobs"]
    engine_options = dict(num_steps=num_steps, count_flops=count_flops, memoize=memoize,
                          cache_codec=options.storage.codec(), decisions=decisions)
    handle = attach(pipeline, transformer, method, knobs, target=chosen, setup=lambda: setup_of(**as_given),
                    scope=scope, **engine_options)
    try:
        attach_experts(handle, pipeline, method, knobs, experts, **engine_options)
        attach_controlnet(handle, pipeline, controlnet, count_flops)
    except BaseException:
        handle.remove()  # nothing half-applied
        raise
    if options.budget is not None:
        handle.attach_budget(budget_check(handle, pipeline, transformer, method, knobs, options, scope))
    return handle


def apply_keywords() -> set[str]:
    """Every keyword dcache.apply takes besides a method's config fields."""
    import inspect

    named = {name for name, p in inspect.signature(apply).parameters.items() if p.kind is p.KEYWORD_ONLY}
    return named | set(SHORTHANDS) | set(TARGET_KEYWORDS)


def attach_controlnet(handle: Handle, pipeline: Any, setting: Any, count_flops: bool) -> None:
    """Cache the pipeline's ControlNet models (check_controlnet_option's `setting`) beside the transformer."""
    engine = handle.engine
    handle.controlnets = attach_controlnets(pipeline, engine, setting, resolve_schedule, count_flops)
    if handle.controlnets and engine.lanes is not None:
        engine.lanes.batch_reason = ("a cached ControlNet runs on the whole batch and decides with the "
                                     "transformer's step")


def budget_check(handle: Handle, pipeline: Any, transformer: nn.Module, method: Any, knobs: dict, options: Options,
                 scope: str | None) -> BudgetCheck:
    """The memory budget's check at each generation's first call: it estimates with the same method, knobs and
    cache storage, so it counts the bytes this cache stores."""
    budget = options.budget
    assert budget is not None
    return BudgetCheck(handle, pipeline, transformer, budget.limit,
                       method if isinstance(method, (str, os.PathLike)) else copy.deepcopy(method),
                       {**knobs, **options.storage.shorthand()}, scope, fit=budget.fit)


# apply's arguments that a setup file does not hold (code, or a choice made per run); given beside a setup file,
# they pass through.
_NOT_IN_SETUPS = ("count_flops", *TARGET_KEYWORDS)


def _apply_setup(target: Any, setup: Setup, given: dict[str, Any], keywords: dict[str, Any]) -> Handle:
    """apply with a setup file's arguments, under the ones given beside it (those not at their defaults)."""
    defaults = {"memoize": True, "count_flops": True}
    named = {k: v for k, v in given.items() if v is not None and v != defaults.get(k, None)}
    passing = {name: value for name, value in {**named, **keywords}.items() if name in _NOT_IN_SETUPS}
    merged = setup.with_overrides(**{k: v for k, v in {**named, **keywords}.items() if k not in _NOT_IN_SETUPS})
    return apply(target, **merged.apply_arguments(), **passing)


def check_num_steps(num_steps: Any) -> int | None:
    """num_steps at apply time (not mid-generation): None, or an int >= 1 (numpy ints too; bools and floats are not
    step counts)."""
    if num_steps is None:
        return None
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} is invalid: it must be an int >= 1 (the number of denoising steps "
                         f"of a transformer-only generation), e.g. dcache.apply(transformer, 'fbcache', "
                         f"num_steps=28).")
    return int(num_steps)


def check_not_applied(pipeline: Any, transformer: nn.Module) -> None:
    """Refuse a model dcache (or another cache) already hooks; drop the engine a deep copy carried along."""
    for module in [transformer, *(m for _, m in extra_experts(pipeline))]:
        found = getattr(module, "_dcache_engine", None)
        if found is not None and found not in APPLIED:
            # a deep copy of a hooked model carries a copy of the engine, which no handle owns: remove it, or the
            # copy could never be hooked again
            found.remove()
            del module._dcache_engine
        if getattr(module, "_dcache_engine", None) is not None:
            raise RuntimeError(f"dcache is already applied to this {type(module).__name__}; call handle.remove() "
                               f"on the first handle before applying another method.")
        refuse_other_cache(module, "so dcache.apply is refused")


def split_target(target: Any) -> tuple[Any, nn.Module]:
    """(pipeline or None, transformer) of what dcache.apply was given."""
    if isinstance(target, nn.Module) and not hasattr(target, "scheduler"):
        return None, target
    transformer = getattr(target, "transformer", None)
    if isinstance(transformer, nn.Module):
        return target, transformer
    raise TypeError(f"dcache.apply needs a diffusers pipeline with a `.transformer` or a transformer module, got "
                    f"{type(target).__name__}. UNet pipelines are not supported: dcache caches transformer blocks.")
