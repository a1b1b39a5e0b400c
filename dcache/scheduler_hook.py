"""Generation tracking through the pipeline's scheduler: its *instance*'s `set_timesteps` opens a generation and
its `step` advances the step index (dcache.generation.StepTracker keeps the record).

The wrappers are methods bound to the instance, so a deep copy of the scheduler (some pipelines copy it) gets
wrappers bound to the copy, which run the copy's own state and do not drive the engine. In a two-transformer pipeline
(Wan 2.2's transformer_2) the first transformer's engine hooks the scheduler and hands every generation and step on
to its followers.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from .generation import calling_pipeline


class SchedulerHook:
    def __init__(self, engine: Any):
        self.engine = engine
        self.hooked: Any = None  # the scheduler instance whose methods are wrapped now

    def current(self) -> Any:
        pipeline = self.engine.pipeline
        return getattr(pipeline, "scheduler", None) if pipeline is not None else None

    def hook(self) -> None:
        """Wrap the pipeline's current scheduler, once (a follower engine never wraps: its leader drives it)."""
        engine = self.engine
        scheduler = self.current()
        if scheduler is None or scheduler is self.hooked or engine.leader is not None:
            return
        self.unhook()
        hook = self
        set_timesteps, step = getattr(scheduler, "set_timesteps").__func__, getattr(scheduler, "step").__func__

        # functools.wraps keeps the scheduler's own name, docstring and (through __wrapped__) signature: diffusers'
        # retrieve_timesteps reads `inspect.signature(scheduler.set_timesteps)` to decide whether sigmas/timesteps
        # may be passed, and refuses them when it sees a bare (*args, **kwargs).
        @functools.wraps(set_timesteps)
        def wrapped_set_timesteps(sched, *args, **kwargs):
            out = set_timesteps(sched, *args, **kwargs)
            if sched is hook.hooked:
                for eng in (engine, *engine.followers):
                    eng.on_set_timesteps(sched)
            return out

        @functools.wraps(step)
        def wrapped_step(sched, *args, **kwargs):
            out = step(sched, *args, **kwargs)
            if sched is hook.hooked:
                for eng in (engine, *engine.followers):
                    if eng.tracker.on_scheduler_step():
                        eng.finish_generation()
            return out

        scheduler.set_timesteps = types.MethodType(wrapped_set_timesteps, scheduler)
        scheduler.step = types.MethodType(wrapped_step, scheduler)
        self.hooked = scheduler
        engine.scheduler_name = type(scheduler).__name__

    def unhook(self) -> None:
        scheduler = self.hooked
        if scheduler is not None:
            for name in ("set_timesteps", "step"):
                scheduler.__dict__.pop(name, None)
        self.hooked = None

    def follow_calling_pipeline(self) -> None:
        """A call outside any generation of the hooked scheduler: when another pipeline object that shares the
        transformer is calling (`Pipeline(**pipe.components)` with its own scheduler), hook that scheduler and start
        the generation its set_timesteps (already run) began, so it is tracked like the pipeline applied to."""
        engine = self.engine
        caller = calling_pipeline(engine.transformer)
        if caller is None or caller is engine.pipeline:
            return
        engine.pipeline = caller
        self.hook()
        if isinstance(getattr(self.hooked, "timesteps", None), torch.Tensor):
            engine.on_set_timesteps(self.hooked)
