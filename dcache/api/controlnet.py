"""`dcache.apply(pipe, method, controlnet=...)`: cache the pipeline's ControlNet model too, with its own state.

ControlNet pipelines (Flux, SD3, Qwen-Image, Sana, Z-Image, Cosmos, HunyuanDiT) run `pipe.controlnet` before the
transformer at every step. Off by default (controlnet=None: the ControlNet runs every step, as without dcache).
Settings:

    controlnet="follow"       the transformer's schedule decides for the ControlNet too: at step j it computes iff
                              the transformer's schedule computes some unit at step j in a branch it follows (the
                              transformer's branch of the same name, else all of them: Flux and Qwen-Image share
                              one ControlNet call between cond and uncond), else it forecasts where the row
                              forecasts and reuses otherwise (Taylor order: the transformer schedule's). The
                              ControlNet runs before the transformer, so the decision is asked ahead of the
                              transformer's call, of a copy of its schedule: a schedule that decides from the
                              step and from signals measured after the transformer's earlier computed calls
                              (fixed_interval, fora, keyframe, a plan, magcache, adaptive_keyframe, ...) can be
                              followed, the copy reading the values the transformer's own decision will read;
                              under one that reads signals measured during the call itself (fbcache's probe,
                              teacache's modulated input, easycache's input change) the ControlNet computes every
                              step and ControlNetNotFollowed says so.
    controlnet="fixed_interval" (a method or preset name; a method config file written by config.to_json(); a
    MethodConfig) or controlnet={"method": "fixed_interval", "interval": 3, ...}
                              its own schedule and knobs, deciding before each ControlNet call from the step
                              alone: a stack schedule that reads no signals (signals measured inside a model's
                              call have nowhere to come from in a call that is skipped whole).
    controlnet=None / False   uncached (the default).

The mechanism is the transformer's call scope: each ControlNet model gets an `Engine` (dcache.runtime.engine) with
scope="call", whose call executor reuses the ControlNet's whole output, its per-block samples rescaled to the call's
conditioning scale (dcache.runtime.call_output: what is cached, rescaling), and whose schedule is a
`FollowerSchedule` ("follow") or the method's own. The engine follows the transformer's engine: its generations and
steps are the transformer's (a ControlNet call outside one runs uncached and is not recorded); its branches are the
ControlNet calls of one step in their order (call0, call1, ...): one per step in Flux / Qwen-Image (shared by both
CFG branches of the transformer), one batched call in SD3 / Sana, a cond and an uncond call in Cosmos.

Multi-ControlNet wrappers (FluxMultiControlNetModel, SD3MultiControlNetModel, QwenImageMultiControlNetModel,
HunyuanDiT2DMultiControlNetModel: `pipe.controlnet.nets`) are cached net by net, each with its own engine, its own
schedule instance and its own conditioning scale (the wrapper sums scaled samples, which could not be rescaled);
their stats are named `controlnet.nets.<i>`. Stats: `handle.stats()` counts every ControlNet call (one unit each,
its FLOPs the whole call's) beside the transformer's, per model in `.experts` and in the total; `handle.memory()`
reports the cached samples as one more part (kind "controlnet").
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from torch import nn

from ..actions import Action, Granularity
from ..config import MethodConfig
from ..generations.stats import Stats, stats_from_record
from ..memory.report import MemoryReport, engine_report
from ..model.adapters import Adapter, UnsupportedModelError
from ..plans.plan import Plan, PlanSchedule
from ..runtime.call_output import PlainOutput
from ..runtime.engine import Engine
from ..runtime.signal_providers import signal_name
from ..schedule import CallContext, Schedule, normalize_actions

FOLLOW = "follow"
COMPUTE, FORECAST, REUSE = Action.COMPUTE.value, Action.FORECAST.value, Action.REUSE.value
_EXAMPLE = "controlnet='follow' or controlnet={'method': 'fixed_interval', 'interval': 2}"
SCALE = "conditioning_scale"  # the ControlNet forward's argument its samples are linear in


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


def attach_controlnets(pipeline: Any, engine: Engine, resolved: Any, resolve_schedule: Any,
                       count_flops: bool = True) -> dict[str, "CachedControlNet"]:
    """Give every ControlNet model of the pipeline an engine led by the transformer's `engine`; `resolve_schedule(
    method, knobs, module)` builds an own schedule (dcache.api.engine_factory's). Returns {name: CachedControlNet};
    on an error the ones hooked are removed."""
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
    caches: dict[str, CachedControlNet] = {}
    try:
        for name, module in models:
            if resolved == FOLLOW:
                schedule, label = FollowerSchedule(engine), f"follow:{engine.schedule.name}"
            else:
                schedule, label = own_schedule(resolved, module, resolve_schedule)
            caches[name] = CachedControlNet(module, schedule, label, engine, count_flops)
    except BaseException:
        for cache in caches.values():
            cache.remove()
        raise
    return caches


class CachedControlNet:
    """One ControlNet model (or one net of a multi-ControlNet wrapper) and the call-scope engine that caches it,
    led by the transformer's engine (its generations and steps); what `handle.stats()` / `handle.memory()` /
    `handle.remove()` read of it."""

    def __init__(self, module: nn.Module, schedule: Schedule, label: str, leader: Engine, count_flops: bool = True):
        self.module, self.label = module, label
        self.engine = Engine(module, whole_model(module), schedule, count_flops=count_flops, memoize=False,
                             scope="call", leader=leader, decisions="batch", call_output=PlainOutput(SCALE),
                             own_generations=False)
        module._dcache_controlnet = self

    def remove(self) -> None:
        """Unhook: the model's forward is its own again (bit-identical outputs); stats stay readable."""
        self.engine.remove()
        if getattr(self.module, "_dcache_controlnet", None) is self:
            del self.module._dcache_controlnet

    def memory(self) -> MemoryReport:
        """The cached samples: peak and live bytes, per call of the step (kind "controlnet"), as handle.memory()
        reports a transformer's."""
        report = engine_report(self.engine)
        by_branch = {branch: {"controlnet" if kind == "call" else kind: n for kind, n in kinds.items()}
                     for branch, kinds in report.by_branch.items()}
        return MemoryReport(peak_bytes=report.peak_bytes, live_bytes=report.live_bytes, by_branch=by_branch)

    def stats(self) -> Stats:
        """The ControlNet's calls in the last generation: one unit per call (computed / reused / forecast) and its
        FLOPs, the whole call's (counted once per input shape)."""
        eng = self.engine
        rec = eng.record if eng.record is not None and eng.record.calls else None
        return stats_from_record(rec, method=self.label, granularity="call", generations=eng.generations,
                                 units_per_call=1, blocks_per_call=0, cache_bytes=self.memory().peak_bytes)


def whole_model(module: nn.Module) -> Adapter:
    """The adapter of a model cached as one call: no blocks to lay out or hook."""
    return Adapter(model_class=type(module).__name__, block_lists=(), notes="cached as one call")


def own_schedule(resolved: Any, module: nn.Module, resolve_schedule: Any) -> tuple[Schedule, str]:
    """The ControlNet's own schedule and its name: one unit, decided before each ControlNet call from the step
    and branch alone (refused, by name, when it cannot)."""
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
    return schedule, name


def _describe(resolved: Any) -> str:
    if isinstance(resolved, tuple):
        return repr({"method": resolved[0], **resolved[1]})
    return repr(resolved) if isinstance(resolved, (str, os.PathLike)) else type(resolved).__name__


class FollowerSchedule(Schedule):
    """controlnet='follow': at each ControlNet call, the transformer engine's decision for the same step and branch
    (the one it took if its call ran, else the one it will take: asked of a copy of its schedule, whose own state is
    untouched, with the post-call signals the branch's decision will read), one unit: COMPUTE if any followed unit
    computes, else FORECAST if any forecasts, else REUSE."""

    granularity = Granularity.STACK

    def __init__(self, leader: Engine):
        self.leader = leader
        self.name = f"follow:{leader.schedule.name}"
        self.forecast_order = int(leader.order)  # the samples' Taylor order: the transformer schedule's
        self.warned = False

    def decide(self, ctx: CallContext) -> str:
        leader = self.leader
        schedule, record = leader.schedule, leader.record
        if leader.meter.pre:  # measured during the transformer's own call of this step, which runs after this one
            self._warn(schedule)
            return COMPUTE
        if record is None:
            return COMPUTE
        step, branch = ctx.step, ctx.branch
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
            bstate = leader.branches.get(name)
            # signals measured after the branch's earlier computed calls: what its own decision will read
            signals = leader.meter.peek_post(bstate) if bstate is not None and schedule.signals else {}
            asked = CallContext(step=step, num_steps=record.num_steps, branch=name,
                                call_index=len(record.calls) + i, timestep=ctx.timestep, signals=signals,
                                last_compute_step=bstate.last_compute_step if bstate is not None else None)
            rows.append(normalize_actions(twin.decide(asked), len(leader.units)))
        cells = "".join(rows)
        return COMPUTE if COMPUTE in cells else FORECAST if FORECAST in cells else REUSE

    def _warn(self, schedule: Schedule) -> None:
        if self.warned:
            return
        self.warned = True
        names = ", ".join(sorted(signal_name(s) for s in self.leader.meter.pre))
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
