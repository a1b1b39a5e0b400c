"""A cached value holding NaN or infinity is never served: the call computes that unit instead
(dcache.runtime.decision), `handle.stats().health.non_finite_served` names it and one DCacheHealthWarning says so per
handle.

The NaN is injected into the stored tensors after every transformer call (a forward hook on the transformer, which
runs after dcache stored the call's results). References: the uncached pipeline (every served unit is recomputed,
so a cache of NaN gives the uncached images) and the clean cached run (a row whose cache is intact is untouched)."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcache
from dcache.generations.health import DCacheHealthWarning
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 12
LABELS = [3, 0]
BATCH_ROUNDING = 1e-5  # a row run in another sub-batch than in the reference (tests/core/test_per_sample.py)


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def _images(pipe, latents) -> torch.Tensor:
    return pipe(labels=LABELS, num_inference_steps=STEPS, latents=latents, output_type="pt").images


def _noise(pipe) -> torch.Tensor:
    return torch.randn((len(LABELS), *pipe.sample_shape()), generator=torch.Generator().manual_seed(0))


def _poison(branch_states) -> None:
    """Every cached tensor of these branch states becomes NaN (in place, as a corrupted cache would be)."""
    for bstate in branch_states:
        for history in bstate.units.values():
            for table in history.tables or []:
                table.fill_(float("nan"))


def _run(pipe, method, noise, poison, **apply_kwargs):
    """(images, health facts, the non-finite-served warnings) of one cached generation; poison(engine) is called
    after every transformer call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dcache.apply(pipe, method, **apply_kwargs) as handle:
            hook = pipe.transformer.register_forward_hook(lambda *_: poison(handle.engine))
            try:
                images = _images(pipe, noise)
                images_again = _images(pipe, noise)  # the warning is said once per handle
            finally:
                hook.remove()
            health = handle.stats().health
    said = [w for w in caught if issubclass(w.category, DCacheHealthWarning) and "when step" in str(w.message)]
    assert torch.equal(images, images_again)
    return images, health, said


# units: the stack (fixed_interval, teacache), modules (taylorseer's default), blocks, the whole call (easycache)
@pytest.mark.parametrize("method,knobs", [("fixed_interval", {"interval": 2}), ("teacache", {"threshold": 0.8}),
                                          ("taylorseer", {}), ("taylorseer", {"granularity": "block"}),
                                          ("easycache", {"scope": "call"})])
def test_a_cache_of_nan_is_recomputed_to_the_uncached_images(pipe, method, knobs):
    noise = _noise(pipe)
    reference = _images(pipe, noise)
    clean, clean_health, clean_said = _run(pipe, method, noise, lambda engine: None, decisions="batch", **knobs)
    assert clean_said == [] and clean_health["non_finite_served"] == []
    assert (clean - reference).abs().max() > 1e-4  # the clean cache did serve something
    poisoned, health, said = _run(pipe, method, noise, lambda engine: _poison(engine.branches.values()),
                                  decisions="batch", **knobs)
    assert torch.equal(poisoned, reference)  # every unit to serve was NaN: every call computed, as uncached
    assert {unit.split("/")[0] for unit in health["non_finite_served"]} == {"cond", "uncond"}
    assert len(said) == 1 and "cache_dtype" in str(said[0].message)


def test_per_sample_only_the_poisoned_row_is_recomputed(pipe):
    """Per-sample decisions: the NaN is in sample 1's cache only. Sample 1 computes every call (its uncached image);
    sample 0 keeps its own cached decisions and image."""
    noise = _noise(pipe)
    reference = _images(pipe, noise)
    clean, _, clean_said = _run(pipe, "teacache", noise, lambda engine: None, threshold=0.8)
    poisoned, health, said = _run(pipe, "teacache", noise,
                                  lambda engine: _poison(engine.lanes.lanes[1].branches.values()), threshold=0.8)
    assert clean_said == [] and len(said) == 1 and health["non_finite_served"]
    assert (poisoned[1] - reference[1]).abs().max() < BATCH_ROUNDING
    assert (poisoned[0] - clean[0]).abs().max() < BATCH_ROUNDING
    assert (clean[0] - reference[0]).abs().max() > 1e-4  # sample 0 was served from its cache
