"""Generation tracking through the pipeline's scheduler: its *instance*'s `set_timesteps` opens a generation and
its `step` advances the step index (dcache.generations.records.StepTracker keeps the record).

The wrappers are methods bound to the instance, so a deep copy of the scheduler (some pipelines copy it) gets
wrappers bound to the copy, which run the copy's own state and do not drive the engine. In a two-transformer pipeline
(Wan 2.2's transformer_2) the first transformer's engine hooks the scheduler and hands every generation and step on
to its followers.

The same wrapper runs the per-step actions of schedules that set `acts_on_steps` (dcache.runtime.step_actions): after
the scheduler computed x_{i+1}, before the step index advances.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import torch

from ..compat.diffusers import calling_pipeline
from ..runtime.step_actions import SchedulerStep, scheduler_step_sample, updated_sample, with_updated_sample

if TYPE_CHECKING:  # the engine builds its scheduler hook
    from ..runtime.engine import Engine


class SchedulerHook:
    def __init__(self, engine: Engine):
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
        # Both run under the engine's guard lock: a generation belongs to one thread (dcache.runtime.concurrency).
        @functools.wraps(set_timesteps)
        def wrapped_set_timesteps(sched, *args, **kwargs):
            with engine.guard.lock:
                out = set_timesteps(sched, *args, **kwargs)
                if sched is hook.hooked:
                    for eng in (engine, *engine.followers):
                        eng.on_set_timesteps(sched)
                return out

        @functools.wraps(step)
        def wrapped_step(sched, *args, **kwargs):
            with engine.guard.lock:
                if sched is hook.hooked:  # refused before the scheduler moves: the owner's generation stays whole
                    engine.guard.check_not_taken()
                    engine.guard.refuse_foreign(engine.tracker.record, "a scheduler step")
                out = step(sched, *args, **kwargs)
                if sched is hook.hooked:
                    engines = (engine, *engine.followers)
                    if any(eng.schedule.acts_on_steps for eng in engines):
                        out = run_step_actions(engines, sched, args, kwargs, out)
                    for eng in engines:
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

    def follow_calling_pipeline(self, take_over: bool = False) -> None:
        """A call outside any generation of the hooked scheduler: when another pipeline object that shares the
        transformer is calling (`Pipeline(**pipe.components)` with its own scheduler), hook that scheduler and start
        the generation its set_timesteps (already run) began, so it is tracked like the pipeline applied to.
        take_over: the call comes from another thread than the open generation's; the caller's generation replaces
        it (dcache.runtime.concurrency), and nothing changes when the caller has none to start."""
        engine = self.engine
        caller = calling_pipeline(engine.transformer)
        if caller is None or caller is engine.pipeline:
            return
        if take_over and not isinstance(getattr(getattr(caller, "scheduler", None), "timesteps", None), torch.Tensor):
            return
        engine.pipeline = caller
        self.hook()
        if isinstance(getattr(self.hooked, "timesteps", None), torch.Tensor):
            engine.on_set_timesteps(self.hooked)

    def follow_replaced_scheduler(self) -> None:
        """A call outside any generation after `pipe.scheduler = ...` replaced the hooked scheduler: the pipeline
        already ran the new one's set_timesteps (unwrapped, so no generation was opened); wrap it and start the
        generation that call began, as the wrapper would have. Without this the first generation after the
        replacement had no step count and its plan could not be exported."""
        engine = self.engine
        scheduler = self.current()
        if engine.leader is not None or self.hooked is None or scheduler is None or scheduler is self.hooked:
            return
        self.hook()
        if isinstance(getattr(scheduler, "timesteps", None), torch.Tensor):
            for eng in (engine, *engine.followers):
                eng.on_set_timesteps(scheduler)


def run_step_actions(engines: tuple, scheduler: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """Hand the step that just ran to every engine whose schedule acts on steps and whose transformer ran in it (in a
    two-expert pipeline only the expert of this step); each may replace x_{i+1}. Returns the scheduler's output,
    updated in place of x_{i+1}."""
    sample, updated = scheduler_step_sample(args, kwargs), updated_sample(out)
    if not isinstance(sample, torch.Tensor) or not isinstance(updated, torch.Tensor):
        return out
    for eng in engines:
        rec = eng.tracker.record
        if not eng.schedule.acts_on_steps or rec is None or rec.finished:
            continue
        actions = {}
        for call in reversed(rec.calls):  # the calls of this step are the last ones recorded
            if call.step != rec.step:
                break
            actions.setdefault(call.branch, call.actions)
        if not actions:
            continue
        event = SchedulerStep(rec.step, rec.num_steps, sample, updated, scheduler, actions)
        replaced = eng.schedule.after_step(event)
        if replaced is None:
            continue
        if not isinstance(replaced, torch.Tensor) or replaced.shape != updated.shape:
            raise ValueError(f"{type(eng.schedule).__name__}.after_step returned "
                             f"{getattr(replaced, 'shape', type(replaced).__name__)} for a step whose latent has "
                             f"shape {tuple(updated.shape)}; return a tensor of the latent's shape, or None.")
        updated = replaced.to(updated.dtype)
        out = with_updated_sample(out, updated)
    return out
