"""Building engines: the one factory `dcache.apply`, the expert and ControlNet hooks, and `dcache.memory.estimate`
share.

    schedule, name, config = resolve_schedule("magcache", {"threshold": 0.1}, transformer)
    engine = build_engine(transformer, schedule, name, pipeline=pipe, scope="blocks", ...)   # hooked, registered
    handle = attach(pipe, transformer, "magcache", {"threshold": 0.1})                      # both, and a Handle

`apply` adds what only a user's call needs on top (setup files, speed / quality targets, experts, ControlNet, the
memory budget); `estimate` attaches to a meta-device copy of the model. Neither imports the other.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..config import MethodConfig
from ..runtime.engine import Engine
from ..model.families import adapter_for
from .handle import Handle
from ..generations.health import HealthMonitor
from ..files.atomic import read_json
from ..methods import config_for, main_knob
from ..plans.plan import MAX_PLAN_BYTES, Plan, PlanError, PlanSchedule
from ..schedule import Schedule
from .setup_file import names_a_file

# The engines built here (weakly held: a removed handle's engine goes when it is dropped). An engine found on a model
# but missing here was copied with it (copy.deepcopy of a hooked pipeline or transformer): dcache.apply removes it.
APPLIED: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def build_engine(transformer: nn.Module, schedule: Schedule, name: str, *, pipeline: Any = None,
                 num_steps: int | None = None, count_flops: bool = True, memoize: bool = True,
                 scope: str | None = None, cache_codec: Any = None, decisions: str | None = None,
                 leader: Engine | None = None, warn: bool | None = None) -> Engine:
    """Hook `schedule` into `transformer` (its family's adapter) and register the engine on it.

    scope None: the plan's recorded scope for a plan, else "blocks"; decisions None: "sample". warn: health warnings
    (None: no health monitor, as for an expert that follows a leader); a plan that does not fit the model is refused
    (PlanError) with nothing left hooked."""
    if scope is None:
        scope = schedule.plan.extras.get("scope", "blocks") if isinstance(schedule, PlanSchedule) else "blocks"
    health = None if warn is None else _health_monitor(transformer, name, warn)  # None: the engine's silent one
    engine = Engine(transformer, adapter_for(transformer), schedule, pipeline=pipeline, num_steps=num_steps,
                    count_flops=count_flops, memoize=memoize, scope=scope, cache_codec=cache_codec,
                    decisions=decisions or "sample", leader=leader, health=health)
    if isinstance(schedule, PlanSchedule):
        check_plan_fits(schedule.plan, engine)
    transformer._dcache_engine = engine
    APPLIED.add(engine)
    return engine


def attach(pipeline: Any, transformer: nn.Module, method: Any, overrides: dict, *, target: Any = None,
           setup: Callable[[], Any] | None = None, **engine_options: Any) -> Handle:
    """resolve_schedule + build_engine -> the Handle of that engine. engine_options: build_engine's keywords; a
    Schedule instance gets no health warnings (the tools' recording and calibration runs compute every step on
    purpose) and batch decisions unless asked for per-sample ones (the tools read the object after the run)."""
    schedule, name, config = resolve_schedule(method, overrides, transformer)
    engine_options.setdefault("warn", not isinstance(method, Schedule))
    if isinstance(method, Schedule) and engine_options.get("decisions") is None:
        engine_options["decisions"] = "batch"  # its caller reads the one object after the run, not per-sample copies
    engine = build_engine(transformer, schedule, name, pipeline=pipeline, **engine_options)
    return Handle(engine, name, config, target, setup=setup)


def resolve_schedule(method: Any, overrides: dict, transformer: nn.Module) -> tuple[Schedule, str, dict]:
    if isinstance(method, Schedule):
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} cannot be applied to a Schedule instance; configure it "
                             f"before passing it.")
        return method, method.name, method.config_dict()
    if isinstance(method, Plan):
        return _plan_schedule(method, overrides)
    if isinstance(method, MethodConfig):
        config = type(method).with_overrides(**{**method.__dict__, **overrides}) if overrides else method
        return config.build(transformer), config.method, config.to_dict()
    if isinstance(method, (str, os.PathLike)):
        text = str(method)
        if names_a_file(text):
            return _from_file(Path(text), overrides, transformer)
        config = config_for(text, **overrides)
        return config.build(transformer), text, config.to_dict()
    raise TypeError(f"method must be a name, a plan path, a config, a Plan or a Schedule, not "
                    f"{type(method).__name__}.")


def _plan_schedule(plan: Plan, overrides: dict) -> tuple[Schedule, str, dict]:
    if overrides:
        raise ValueError(f"a plan replays fixed decisions; overrides {sorted(overrides)} do not apply to it.")
    return PlanSchedule(plan), f"plan:{plan.provenance.get('method', 'static')}", {"plan": plan.provenance}


def _from_file(path: Path, overrides: dict, transformer: nn.Module) -> tuple[Schedule, str, dict]:
    if not path.is_file():
        raise PlanError(f"plan/config file {str(path)!r} does not exist.")
    data = read_json(path, MAX_PLAN_BYTES, "plan/config file", "fix it or write it again (handle.plan().save(path), "
                     "config.to_json())", PlanError)  # a size cap, and deep nesting / huge integers as PlanError
    if isinstance(data, dict) and data.get("format") == "dcache.plan":
        return _plan_schedule(Plan.from_dict(data, source=f"plan file {str(path)!r}"), overrides)
    if isinstance(data, dict) and "method" in data and "format" not in data:
        from ..methods import config_from_dict

        config = config_from_dict({**data, **overrides})
        return config.build(transformer), config.method, config.to_dict()
    raise PlanError(f"{str(path)!r} is neither a dcache plan (a JSON object with \"format\": \"dcache.plans.plan\", "
                    f"written by handle.plan().save(path)), a setup (\"format\": \"dcache.setup\", written by "
                    f"handle.setup().save(path)) nor a method config (a JSON object with \"method\" and no "
                    f"\"format\", written by config.to_json()).")


def check_plan_fits(plan: Plan, engine: Engine) -> None:
    from collections import Counter

    layout = Counter(s.list_index for s in engine.blocks)
    try:
        plan.check_model(type(engine.transformer).__name__,
                         [layout[i] for i in range(len(engine.adapter.block_lists))], engine.units)
    except PlanError:
        engine.remove()
        raise


def _health_monitor(transformer: nn.Module, name: str, warn: bool) -> HealthMonitor:
    """Warnings for the methods and plans dcache ships on a real model; facts only for a meta-device model
    (dcache.memory.estimate simulates generations)."""
    real = next((p.device.type != "meta" for p in transformer.parameters()), True)
    base = name.split(":", 1)[0]
    return HealthMonitor(name, knob=lambda: main_knob(base) if base != "plan" else None, warn=warn and real)
