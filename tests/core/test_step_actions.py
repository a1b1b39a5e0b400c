"""Per-step actions through the engine (dcache.runtime.step_actions): a schedule with `acts_on_steps` sees every
scheduler step of a generation (x_i, x_{i+1}, the step's actions) and may replace x_{i+1}; other schedules are never
asked."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache import Action, Schedule
from dcache.pipelines.bundled import load_tiny_pipeline

LABELS = [1, 4]
STEPS = 6


class Frozen(Schedule):
    """Computes every call and keeps the latent where step 0 started: x_{i+1} <- x_0 for every i."""

    acts_on_steps = True

    def __init__(self):
        self.events = []
        self.start = None

    def decide(self, ctx):
        return Action.REUSE if ctx.step % 2 else Action.COMPUTE

    def after_step(self, step):
        self.events.append((step.step, step.num_steps, dict(step.actions), step.reused))
        if self.start is None:
            self.start = step.sample.clone()
        return self.start


class Observer(Schedule):
    """acts_on_steps left False: after_step must never be called."""

    def decide(self, ctx):
        return Action.COMPUTE

    def after_step(self, step):  # pragma: no cover - the assertion is that this never runs
        raise AssertionError("after_step was called for a schedule that does not act on steps")


class WrongShape(Frozen):
    def after_step(self, step):
        return step.updated[:1]


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def latents(pipe, **kw):
    return pipe(labels=LABELS, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(3),
                output_type="latent", **kw).images


def test_a_step_action_replaces_the_scheduler_update(pipe):
    schedule = Frozen()
    with dcache.apply(pipe, schedule):
        out = latents(pipe)
    assert torch.equal(out, schedule.start)  # every step returned x_0: the generation ends where it started
    assert [e[0] for e in schedule.events] == list(range(STEPS))
    assert all(e[1] == STEPS for e in schedule.events)
    for step, _, actions, reused in schedule.events:
        assert set(actions) == {"cond", "uncond"}  # split CFG: both branches' rows of the step
        assert reused == (step % 2 == 1)


def test_schedules_that_do_not_act_on_steps_are_never_asked_and_change_nothing(pipe):
    reference = latents(pipe)
    with dcache.apply(pipe, Observer()):
        assert torch.equal(latents(pipe), reference)


def test_a_step_action_of_the_wrong_shape_is_refused_with_the_shapes(pipe):
    with dcache.apply(pipe, WrongShape()):
        with pytest.raises(ValueError,
                           match=r"WrongShape.after_step returned .* return a tensor of the latent's shape"):
            latents(pipe)
    reference = latents(pipe)  # the pipeline is usable again after the error and the removal
    assert torch.isfinite(reference).all()
