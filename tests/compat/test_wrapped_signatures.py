"""Everything dcache wraps on a user's objects keeps its own name, docstring and signature.

diffusers' `retrieve_timesteps` decides whether a scheduler accepts custom `sigmas` / `timesteps` by reading
`inspect.signature(scheduler.set_timesteps)`; a bare `(*args, **kwargs)` wrapper made every Flux-style pipeline
refuse its own call. Other libraries (and users) introspect the same way.
"""

from __future__ import annotations

import inspect

from compat_kit import make_pipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

import dcache


def _introspection(fn) -> tuple:
    return (inspect.signature(fn), getattr(fn, "__name__", None), getattr(fn, "__doc__", None))


def test_scheduler_wrappers_look_like_the_scheduler_methods():
    pipe = make_pipeline()
    scheduler = pipe.scheduler
    before = {name: _introspection(getattr(scheduler, name)) for name in ("set_timesteps", "step")}
    with dcache.apply(pipe, "fbcache"):
        for name, seen in before.items():
            wrapped = getattr(scheduler, name)
            assert _introspection(wrapped) == seen, f"scheduler.{name} lost its signature under dcache"
        assert "sigmas" in inspect.signature(scheduler.set_timesteps).parameters


def test_retrieve_timesteps_accepts_custom_sigmas_and_timesteps_through_the_wrapper():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fbcache") as handle:
        timesteps, n = retrieve_timesteps(pipe.scheduler, sigmas=[1.0, 0.75, 0.5, 0.25])
        assert n == 4 and len(timesteps) == 4
        assert handle.engine.record is not None and handle.engine.record.num_steps == 4  # the engine saw it


def test_profiling_wrapper_keeps_the_step_signature():
    from dcache.schedules.tuning.profiling import ProfileSession

    pipe = make_pipeline()
    seen = _introspection(pipe.scheduler.step)
    session = ProfileSession(pipe)
    session.on_scheduler_step(lambda *a: None)
    assert _introspection(pipe.scheduler.step) == seen
    pipe(labels=[1], num_inference_steps=4)
    session.close()
