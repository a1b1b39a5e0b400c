"""`dcache.apply`: one call to put a caching method on a pipeline or a transformer."""

from __future__ import annotations

import copy
import os
from typing import Any

from torch import nn

from .engine_factory import APPLIED, attach, build_engine, resolve_schedule
from ..memory.budget import Budget
from ..memory.cache_codec import cache_codec
from ..config import MethodConfig
from .controlnet import attach_controlnets, check_controlnet_option
from .experts import check_expert_names, expert_method, extra_experts
from .handle import Handle
from ..runtime.hooks import refuse_other_cache
from ..memory.report import parse_bytes
from ..methods import DEFAULT_METHOD, preset_scope, target_resolver
from ..plans.plan import Plan
from ..schedule import Schedule
from .setup_file import Setup, setup_file, setup_of


def apply(target: Any, method: str | MethodConfig | Plan | Schedule | os.PathLike = DEFAULT_METHOD, *,
          num_steps: int | None = None, count_flops: bool = True, memoize: bool = True, scope: str | None = None,
          speed: str | float | None = None, quality: str | None = None, calibration_run: Any = None,
          experts: dict[str, Any] | None = None, controlnet: Any = None, max_cache_memory: str | int | None = None,
          cache_dtype: str | None = None, cache_scale: str | None = None, cache_device: str | None = None,
          fit: str | None = None, decisions: str | None = None, **overrides: Any) -> Handle:
    """Hook a caching method into a diffusers pipeline (or a bare transformer) and return its Handle.

    method:    a method name ("magcache", "fbcache", ...), a preset name, a plan file path (*.json), a setup file
               (*.json with "format": "dcache.setup", *.yaml: every argument below in one file, dcache.api.setup_file;
               arguments given here override the file's), a config object, a Plan, or a Schedule instance.
    num_steps: transformer-only use: the number of denoising steps (a pipeline's scheduler tells it otherwise).
    memoize:   compute step-invariant work outside the blocks (RoPE tables) once instead of every call
               (dcache.runtime.step_invariant; exact: keyed on the same input tensors). False leaves those modules
               alone.
    scope:     "blocks" (default; a plan recorded in call scope replays in it, a preset that names a scope runs
               in it): cache the block stack, recompute the embedders and output head every call.
               "call": cache the whole transformer map x -> v (EasyCache's Delta = v - x, dcache.runtime.call_scope); a
               reused call then skips everything, which matters on small models and batch 1, but the output head
               is reused too. Only for schedules that decide before the call runs (no probe blocks).
    speed / quality: a target instead of a raw threshold: speed="2x" picks, among the settings of the method's main
               knob whose ideal speed-up reaches 2, the one with the best PSNR on `calibration_run`; quality=
               "psnr>=30" the fastest setting that keeps 30 dB there (schedules.tuning.targets.resolve_target; the
               sweep is `handle.target`). calibration_run() runs one uncached-comparable generation (e.g.
               lambda: pipe(prompt, num_inference_steps=28, generator=torch.Generator().manual_seed(1))).
    experts:   pipelines with a second denoising transformer (Wan 2.2's `transformer_2`, dcache.api.experts) cache it
               too, with its own state and the same method by default; per expert: {"transformer_2": {"warmup_steps":
               2}} (overrides on top), {"transformer_2": "fbcache"} (another method, config, Plan or plan file) or
               {"transformer_2": None} (uncached). handle.stats() sums the experts (per expert in .experts);
               handle.plan(expert="transformer_2") is one expert's plan.
    controlnet: ControlNet pipelines: cache the ControlNet model (`pipe.controlnet`, each net of a multi-ControlNet)
               too, with its own state (dcache.api.controlnet; off by default): "follow" (the transformer's schedule
               decides, for schedules that decide from the step alone), or its own schedule: a method name or
               {"method": "fixed_interval", "interval": 3}. Reused calls serve the cached per-block samples
               (rescaled to the call's conditioning scale). handle.stats() counts its calls and FLOPs per model
               (.experts["controlnet"]) and in the total; the plan holds the transformer's decisions only.
    max_cache_memory: a budget for the cached tensors, e.g. "4GiB" (also `--set max_cache_memory=4GiB`): checked at
               a generation's first call against its real shapes, before anything is cached; over budget the call
               raises dcache.memory.budget.MemoryBudgetError with the numbers and the config changes that fit.
    cache_dtype: store the cached residuals, module outputs and Taylor tables in "bfloat16", "float16" or
               "float8_e4m3fn" (also `--set cache_dtype=bfloat16`), restored to the compute dtype on use; None keeps
               the compute dtype. cache_scale: for float8, "tensor" (default) or "token": the fp32 absmax scale
               stored beside each tensor (dcache.memory.cache_codec).
    cache_device: "cpu" keeps the cache in host memory (pinned; on CUDA the next unit's tensors are copied back on
               a side stream while the current unit runs); exact: the outputs are the on-device cache's, bit for bit.
    fit:       "auto" with max_cache_memory: over budget at the first call, pick the most accurate cache storage that
               fits (offload to host memory, then bfloat16, then float8 per token, then per tensor) instead of
               refusing, and say which (a dcache.memory.budget.CacheFitChoice warning; handle.fit_choice).
    decisions: "sample" (default): every sample of a batched transformer call, and each CFG half of a batched-CFG
               call, is decided, cached and served on its own, so a request's output does not depend on what it is
               batched with, and transformer-only loops may batch requests at different steps (dcache.runtime.lanes,
               docs/serving.md); handle.stats().per_sample has each sample's counts. Rows that decide alike run as
               one call (a batch that decides alike runs as without dcache: all-compute is the uncached batch, bit
               for bit). "batch": one decision per batched call, for batches known to move together.
    overrides: config fields, e.g. apply(pipe, "magcache", threshold=0.1).
    """
    arguments = dict(locals())  # as given: handle.setup() writes them back as a setup file
    setup = setup_file(method)
    if setup is not None:
        return _apply_setup(target, setup, arguments)
    num_steps = _check_num_steps(num_steps)
    pipeline, transformer = _split_target(target)
    limit = parse_bytes(max_cache_memory) if max_cache_memory is not None else None
    codec = cache_codec(cache_dtype, cache_scale, cache_device)
    if fit not in (None, "auto"):
        raise ValueError(f"fit={fit!r} is not a fit mode; use fit='auto' (with max_cache_memory) to let dcache pick a "
                         f"cache storage that fits the budget, or leave it out to be refused over budget.")
    if fit is not None and max_cache_memory is None:
        raise ValueError("fit='auto' chooses among cache storages that fit max_cache_memory; give the budget too, "
                         "e.g. dcache.apply(pipe, 'taylorseer', max_cache_memory='8GiB', fit='auto').")
    expert_settings = check_expert_names(pipeline, experts)
    controlnet_setting = check_controlnet_option(pipeline, controlnet)
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
    if scope is None:
        scope = preset_scope(method)  # e.g. a call-scope preset; None: the schedule's own (a plan's, else blocks)
    chosen = None
    if speed is not None or quality is not None:
        method, chosen = target_resolver()(target, method, speed=speed, quality=quality,
                                           calibration_run=calibration_run, num_steps=num_steps, scope=scope,
                                           overrides=overrides)
        overrides = {}
        arguments.update(method=method, overrides={}, speed=None, quality=None)
    handle = attach(pipeline, transformer, method, overrides, target=chosen, setup=lambda: setup_of(arguments),
                    num_steps=num_steps, count_flops=count_flops, memoize=memoize, scope=scope, cache_codec=codec,
                    decisions=decisions)
    engine = handle.engine
    try:
        for expert_name, module in extra_experts(pipeline):
            picked = expert_method(method, overrides, expert_settings[expert_name])
            if picked is None:
                continue
            if isinstance(picked[0], Schedule):
                raise ValueError(f"a Schedule instance keeps one expert's state; give {expert_name} its own: "
                                 f"dcache.apply(pipe, schedule, experts={{{expert_name!r}: another_schedule}}) "
                                 f"(or a method name, which builds one per expert).")
            sub_schedule, sub_name, sub_config = resolve_schedule(picked[0], picked[1], module)
            sub = build_engine(module, sub_schedule, sub_name, pipeline=pipeline, num_steps=num_steps,
                               count_flops=count_flops, memoize=memoize, scope=engine.scope, leader=engine,
                               cache_codec=codec, decisions=decisions)
            handle.experts[expert_name] = Handle(sub, sub_name, sub_config)
        handle.controlnets = attach_controlnets(pipeline, engine, controlnet_setting, resolve_schedule, count_flops)
        if handle.controlnets and engine.lanes is not None:
            engine.lanes.batch_reason = ("a cached ControlNet runs on the whole batch and decides with the "
                                         "transformer's step")
    except BaseException:
        handle.remove()  # nothing half-applied
        raise
    if limit is not None:
        handle._budget = Budget(handle, pipeline, transformer, limit, method if isinstance(method, (str, os.PathLike))
                                else copy.deepcopy(method), _with_codec(overrides, cache_dtype, cache_scale,
                                                                        cache_device), scope, fit=fit)
    return handle


# apply's arguments that a setup file does not hold (code, or a choice made per run); given beside a setup file,
# they pass through.
_NOT_IN_SETUPS = ("count_flops", "speed", "quality", "calibration_run")


def _apply_setup(target: Any, setup: Setup, arguments: dict[str, Any]) -> Handle:
    """apply with a setup file's arguments, under the ones given beside it (those not at their defaults)."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(apply).parameters.items()
                if p.default is not inspect.Parameter.empty and name != "method"}
    given = {name: arguments[name] for name, default in defaults.items() if arguments[name] is not default
             and not (isinstance(default, bool) and arguments[name] == default)}
    passing = {name: given.pop(name) for name in _NOT_IN_SETUPS if name in given}
    merged = setup.with_overrides(**given, **arguments["overrides"])
    return apply(target, **merged.apply_arguments(), **passing)


def _check_num_steps(num_steps: Any) -> int | None:
    """num_steps at apply time (not mid-generation): None, or an int >= 1 (numpy ints too; bools and floats are not
    step counts)."""
    import numbers

    if num_steps is None:
        return None
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} is invalid: it must be an int >= 1 (the number of denoising steps "
                         f"of a transformer-only generation), e.g. dcache.apply(transformer, 'fbcache', "
                         f"num_steps=28).")
    return int(num_steps)


def _with_codec(overrides: dict, cache_dtype: Any, cache_scale: Any, cache_device: Any) -> dict:
    """The budget's estimates run apply again: with the same cache storage, so they count the bytes it stores."""
    codec = {k: v for k, v in (("cache_dtype", cache_dtype), ("cache_scale", cache_scale),
                               ("cache_device", cache_device)) if v is not None}
    return {**overrides, **codec}


def _split_target(target: Any) -> tuple[Any, nn.Module]:
    if isinstance(target, nn.Module) and not hasattr(target, "scheduler"):
        return None, target
    transformer = getattr(target, "transformer", None)
    if isinstance(transformer, nn.Module):
        return target, transformer
    raise TypeError(f"dcache.apply needs a diffusers pipeline with a `.transformer` or a transformer module, got "
                    f"{type(target).__name__}. UNet pipelines are not supported: dcache caches transformer blocks.")


