"""`dcache.apply(pipe, method, controlnet=...)`: cache the pipeline's ControlNet model too, with its own state.

ControlNet pipelines (Flux, SD3, Qwen-Image, Sana, Z-Image, Cosmos, HunyuanDiT) run `pipe.controlnet` before the
transformer at every step. Off by default (controlnet=None: the ControlNet runs every step, as without dcache);
the cache itself is dcache.runtime.controlnet_cache (what is cached, rescaling, branches). Settings:

    controlnet="follow"       the transformer's schedule decides for the ControlNet too: at step j it computes iff
                              the transformer's schedule computes some unit at step j in a branch it follows (the
                              transformer's branch of the same name, else all of them: Flux and Qwen-Image share
                              one ControlNet call between cond and uncond), else it forecasts where the row
                              forecasts and reuses otherwise (Taylor order: the transformer schedule's). The
                              ControlNet runs before the transformer, so the decision is asked ahead of the
                              transformer's call, of a copy of its schedule: only a schedule that decides from
                              the step alone (no signals this generation: fixed_interval, fora, keyframe, a plan,
                              a calibrated magcache, ...) can be followed; under one that reads signals measured
                              during the call (fbcache's probe, teacache's modulated input, an uncalibrated
                              magcache) the ControlNet computes every step and ControlNetNotFollowed says so.
    controlnet="fixed_interval" (a method or preset name; a method config file written by config.to_json(); a
    MethodConfig) or controlnet={"method": "fixed_interval", "interval": 3, ...}
                              its own schedule and knobs, deciding before each ControlNet call from the step
                              alone: a stack schedule that reads no signals (signals measured inside a model's
                              call have nowhere to come from in a call that is skipped whole).
    controlnet=None / False   uncached (the default).

Multi-ControlNet wrappers (FluxMultiControlNetModel, SD3MultiControlNetModel, QwenImageMultiControlNetModel,
HunyuanDiT2DMultiControlNetModel: `pipe.controlnet.nets`) are cached net by net, each with its own cache, its own
schedule instance and its own conditioning scale (the wrapper sums scaled samples, which could not be rescaled);
their stats are named `controlnet.nets.<i>`. Stats: `handle.stats()` counts every ControlNet call (one unit each,
its FLOPs the whole call's) beside the transformer's, per model in `.experts` and in the total.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from torch import nn

from ..actions import Action, Granularity
from ..model.adapters import UnsupportedModelError
from ..config import MethodConfig
from ..runtime.controlnet_cache import ControlNetCache
from ..plans.plan import Plan, PlanSchedule
from ..schedule import CallContext, GenerationInfo, Schedule, normalize_actions
from ..runtime.signal_providers import signal_name

FOLLOW = "follow"
COMPUTE, FORECAST, REUSE = Action.COMPUTE.value, Action.FORECAST.value, Action.REUSE.value
_EXAMPLE = "controlnet='follow' or controlnet={'method': 'fixed_interval', 'interval': 2}"


class ControlNetNotFollowed(UserWarning):
    """controlnet='follow' under a schedule that decides from signals measured during the transformer's call: the
    ControlNet runs first, so it computes every step of such a generation."""


def controlnet_models(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """(name, module) of every ControlNet model to cache: `pipe.controlnet`, or each net of a multi wrapper."""
    module = getattr(pipeline, "controlnet", None) if pipeline is not None else None
    if not isinstance(module, nn.Module):
        return []
    nets = getattr(module, "nets", None)
    if isinstance(nets, nn.ModuleList):
        seen: dict[int, tuple[str, nn.Module]] = {}
        for i, net in enumerate(nets):
            seen.setdefault(id(net), (f"controlnet.nets.{i}", net))  # one net listed twice: one cache
        return list(seen.values())
    return [("controlnet", module)]


def check_controlnet_option(pipeline: Any, setting: Any) -> Any:
    """Validate `controlnet=` before anything is hooked; returns None (off), FOLLOW, or the own-schedule method
    (a name, a file path, a MethodConfig, a Schedule, or (name, knobs) from a dict)."""
    if setting is None or setting is False:
        return None
    if setting is True:
        raise ValueError(f"controlnet=True does not say how to decide for the ControlNet; use {_EXAMPLE}.")
    if isinstance(setting, dict):
        setting = dict(setting)
        method = setting.pop("method", None)
        if not isinstance(method, str):
            raise ValueError(f"controlnet={setting!r}: the dict needs a 'method' (a method name), e.g. "
                             f"controlnet={{'method': 'fixed_interval', 'interval': 2}}; or pass controlnet='follow' "
                             f"to let the transformer's schedule decide.")
        if method == FOLLOW:
            if setting:
                raise ValueError(f"controlnet={{'method': 'follow', ...}} takes no knobs (got {sorted(setting)}): it "
                                 f"follows the transformer's schedule; give the ControlNet its own schedule with "
                                 f"controlnet={{'method': 'fixed_interval', ...}} to set knobs.")
            resolved: Any = FOLLOW
        else:
            resolved = (method, setting)
    elif isinstance(setting, Plan):
        raise ValueError("controlnet=<Plan>: a plan replays the transformer's decisions on its units; pass the plan "
                         "as the method and controlnet='follow' to replay it for the ControlNet too.")
    elif isinstance(setting, (str, os.PathLike, MethodConfig, Schedule)):
        resolved = FOLLOW if setting == FOLLOW else setting
    else:
        raise TypeError(f"controlnet={setting!r} ({type(setting).__name__}) is not a ControlNet setting; use "
                        f"{_EXAMPLE}, a method name, a MethodConfig, or None (uncached).")
    if pipeline is None:
        raise ValueError("controlnet= caches the pipeline's ControlNet model (`pipe.controlnet`): apply dcache to "
                         "the pipeline, dcache.apply(pipe, method, controlnet='follow'), not to its transformer.")
    if not controlnet_models(pipeline):
        raise ValueError(f"controlnet={setting!r}: this {type(pipeline).__name__} has no ControlNet model "
                         f"(`pipe.controlnet`); leave controlnet= out for pipelines without one.")
    return resolved


def attach_controlnets(pipeline: Any, engine: Any, resolved: Any, resolve_schedule: Any,
                       count_flops: bool = True) -> dict[str, ControlNetCache]:
    """Hook every ControlNet model of the pipeline with its decider; `resolve_schedule(method, knobs, module)` builds
    an own schedule (dcache.api.apply_cache's). Returns {name: ControlNetCache}; on an error the ones hooked are
    removed."""
    if resolved is None:
        return {}
    models = controlnet_models(pipeline)
    for _, module in models:
        if getattr(module, "_dcache_controlnet", None) is not None:
            raise RuntimeError(f"dcache already caches this {type(module).__name__}; call handle.remove() on the "
                               f"handle that does before applying another.")
    if isinstance(resolved, Schedule) and len(models) > 1:
        raise ValueError(f"controlnet=<Schedule>: a Schedule instance keeps one model's state, and this pipeline "
                         f"has {len(models)} ControlNets; pass a method name or config (one schedule is built per "
                         f"net).")
    caches: dict[str, ControlNetCache] = {}
    try:
        for name, module in models:
            decider = FollowTransformer(engine) if resolved == FOLLOW else own_schedule(resolved, module,
                                                                                      resolve_schedule)
            caches[name] = ControlNetCache(name, module, decider, engine, count_flops)
    except BaseException:
        for cache in caches.values():
            cache.remove()
        raise
    return caches


def own_schedule(resolved: Any, module: nn.Module, resolve_schedule: Any) -> "OwnSchedule":
    method, knobs = resolved if isinstance(resolved, tuple) else (resolved, {})
    fix = ("Use a schedule that decides from the step alone (e.g. controlnet={'method': 'fixed_interval', "
           "'interval': 2}) or controlnet='follow'.")
    try:
        schedule, name, _ = resolve_schedule(method, knobs, module)
    except UnsupportedModelError as exc:  # the method reads the model's blocks: a ControlNet call is one unit
        first = str(exc).splitlines()[0]
        raise ValueError(f"controlnet={_describe(resolved)}: the method reads the model's block layout, which a "
                         f"ControlNet cached as one call does not have ({first}). {fix}") from None
    except (ValueError, TypeError, KeyError) as exc:  # an unknown method or a bad knob: its own message, named
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(
            f"controlnet={_describe(resolved)}: {exc}") from None
    problems = []
    if isinstance(schedule, PlanSchedule):
        problems.append("it replays a plan of the transformer's units")
    if Granularity(schedule.granularity) != Granularity.STACK:
        problems.append(f"its granularity is {Granularity(schedule.granularity).value!r} (the ControlNet call is "
                        f"one unit: 'stack' schedules only)")
    if schedule.signals:
        names = ", ".join(sorted(signal_name(s) for s in schedule.signals))
        problems.append(f"it decides from signals ({names}) that a skipped ControlNet call cannot measure")
    if schedule.forecaster is not None and not getattr(schedule.forecaster, "any_history", False):
        problems.append("its learned forecaster predicts the transformer's block residuals")
    if problems:
        raise ValueError(f"controlnet={_describe(resolved)}: {name!r} cannot decide for a ControlNet: "
                         + "; ".join(problems) + f". {fix}")
    return OwnSchedule(schedule, name)


def _describe(resolved: Any) -> str:
    if isinstance(resolved, tuple):
        return repr({"method": resolved[0], **resolved[1]})
    return repr(resolved) if isinstance(resolved, (str, os.PathLike)) else type(resolved).__name__


def _timestep(record: Any, step: int) -> float | None:
    timesteps = record.timesteps
    return timesteps[step] if timesteps and step < len(timesteps) else None


class OwnSchedule:
    """The ControlNet's own schedule: one unit, decided before each ControlNet call from the step and branch."""

    def __init__(self, schedule: Schedule, name: str):
        self.schedule = schedule
        self.label = name
        self.forecast_order = int(schedule.forecast_order)

    def start(self, record: Any, model_class: str) -> None:
        self.schedule.reset(GenerationInfo(num_steps=record.num_steps, timesteps=record.timesteps,
                                           units=("controlnet",), model_class=model_class, num_blocks=1))

    def end(self, complete: bool) -> None:
        self.schedule.end(complete)

    def decide(self, step: int, branch: str, record: Any, call_index: int, last_compute_step: int | None) -> str:
        ctx = CallContext(step=step, num_steps=record.num_steps, branch=branch, call_index=call_index,
                          timestep=_timestep(record, step), signals={}, last_compute_step=last_compute_step)
        return normalize_actions(self.schedule.decide(ctx), 1)

    def may_reuse(self, branch: str) -> bool:
        return self.schedule.may_reuse(branch, 0)


class FollowTransformer:
    """controlnet='follow': the transformer schedule's decision for this step, asked of a copy of the schedule
    ahead of the transformer's call (the schedule's own state is untouched)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.warned = False

    @property
    def label(self) -> str:
        return f"follow:{self.engine.schedule.name}"

    @property
    def forecast_order(self) -> int:
        return int(self.engine.order)

    def start(self, record: Any, model_class: str) -> None:
        pass

    def end(self, complete: bool) -> None:
        pass

    def may_reuse(self, branch: str) -> bool:
        return True

    def decide(self, step: int, branch: str, record: Any, call_index: int, last_compute_step: int | None) -> str:
        engine = self.engine
        schedule = engine.schedule
        if schedule.signals:
            self._warn(schedule)
            return COMPUTE
        done = {c.branch: c.actions for c in record.calls if c.step == step}  # transformer calls already run
        before = list(dict.fromkeys(c.branch for c in record.calls if c.step == step - 1))
        followed = [branch] if branch in done or branch in before else before
        if not followed:  # the generation's first step (nothing to follow yet)
            return COMPUTE
        rows, twin = [], None
        for i, name in enumerate(followed):
            if name in done:
                rows.append(done[name])
                continue
            twin = twin or _twin(schedule)
            bstate = engine.branches.get(name)
            ctx = CallContext(step=step, num_steps=record.num_steps, branch=name, call_index=len(record.calls) + i,
                              timestep=_timestep(record, step), signals={},
                              last_compute_step=bstate.last_compute_step if bstate is not None else None)
            rows.append(normalize_actions(twin.decide(ctx), len(engine.units)))
        cells = "".join(rows)
        return COMPUTE if COMPUTE in cells else FORECAST if FORECAST in cells else REUSE

    def _warn(self, schedule: Schedule) -> None:
        if self.warned:
            return
        self.warned = True
        names = ", ".join(sorted(signal_name(s) for s in schedule.signals))
        warnings.warn(f"controlnet='follow': {schedule.name!r} decides from signals measured during the transformer's "
                      f"call ({names}), which runs after the ControlNet at every step, so the ControlNet computes at "
                      f"every step of such a generation. To cache it, give it its own schedule: controlnet={{"
                      f"'method': 'fixed_interval', 'interval': 2}}.", ControlNetNotFollowed, stacklevel=2)


def _twin(schedule: Schedule) -> Schedule:
    """A copy of the schedule's decision state (numbers): modules and tensors it refers to are shared, not copied."""
    memo = {id(v): v for v in vars(schedule).values() if isinstance(v, (nn.Module, torch.Tensor))}
    if schedule.forecaster is not None:
        memo[id(schedule.forecaster)] = schedule.forecaster
    return copy.deepcopy(schedule, memo)
