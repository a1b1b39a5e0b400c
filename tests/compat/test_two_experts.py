"""Pipelines with two denoising transformers (Wan 2.2 A14B: `transformer` above the boundary, `transformer_2` below):
both are cached, each with its own state; no cache crosses the switch; stats and plans per expert and in total;
remove restores both. Reference: the uncached two-expert WanPipeline (tests/eval/tiny_video.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dcache
from dcache import Plan

STEPS = 20
BOUNDARY = 0.875  # with shift 7 the first 10 of 20 steps are above t = 875


def _tiny_video():
    if "dcache_tiny_video" not in sys.modules:
        path = Path(__file__).parents[1] / "eval" / "tiny_video.py"
        spec = importlib.util.spec_from_file_location("dcache_tiny_video", path)
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["dcache_tiny_video"]


@pytest.fixture(scope="module")
def pipe():
    return _tiny_video().tiny_wan_pipeline(boundary_ratio=BOUNDARY)


def run(pipe, seed=0, steps=STEPS):
    return pipe(prompt="a red fox runs in the snow", negative_prompt="a blue cat", num_frames=5, height=16, width=16,
                num_inference_steps=steps, guidance_scale=3.0, max_sequence_length=8, output_type="latent",
                generator=torch.Generator().manual_seed(seed)).frames


def _calls_per_expert(pipe):
    counts = {"transformer": 0, "transformer_2": 0}
    hooks = [getattr(pipe, name).register_forward_pre_hook(lambda m, a, n=name: counts.__setitem__(n, counts[n] + 1))
             for name in counts]
    return counts, hooks


def test_both_experts_are_cached_with_their_own_state(pipe):
    reference = run(pipe)
    counts, hooks = _calls_per_expert(pipe)
    run(pipe)
    uncached_counts = dict(counts)
    for h in hooks:
        h.remove()
    assert uncached_counts["transformer"] > 0 and uncached_counts["transformer_2"] > 0  # the switch happens
    with dcache.apply(pipe, "fixed_interval", interval=1) as handle:  # all compute: bit-identical
        assert torch.equal(run(pipe), reference)
        assert set(handle.experts) == {"transformer_2"}
    handle = dcache.apply(pipe, "fixed_interval", interval=2, warmup_steps=1, cutoff_steps=0)
    cached = run(pipe)
    stats = handle.stats()
    first, second = stats.experts["transformer"], stats.experts["transformer_2"]
    # every call of the generation is accounted for, in total and per expert
    assert stats.calls == sum(uncached_counts.values())
    assert first.calls == uncached_counts["transformer"] and second.calls == uncached_counts["transformer_2"]
    assert second.units_reused > 0 and first.units_reused > 0  # the second expert caches too
    assert stats.compute_ratio == pytest.approx(
        (first.block_flops_computed + second.block_flops_computed) / (first.block_flops_total
                                                                      + second.block_flops_total))
    # no cache crosses the switch: each branch's first call of transformer_2 computes
    first_step = min(i for i, row in enumerate(second.per_step) if row)
    assert set(second.per_step[first_step].values()) == {"C"}
    assert float((cached - reference).norm() / reference.norm()) < 0.2
    assert "transformer_2" in str(stats)
    # plans per expert replay bit-exactly
    plans = {name: handle.plan(expert=name) for name in ("transformer", "transformer_2")}
    with pytest.raises(ValueError, match="expert="):
        handle.plan()
    handle.remove()
    assert torch.equal(run(pipe), reference)
    assert plans["transformer_2"].extras["expert_steps"][0] == first_step
    plans = {n: Plan.from_dict(p.to_dict()) for n, p in plans.items()}
    with dcache.apply(pipe, plans["transformer"], experts={"transformer_2": plans["transformer_2"]}):
        assert torch.equal(run(pipe), cached)


def test_per_expert_settings_and_an_uncached_expert(pipe):
    reference = run(pipe)
    with dcache.apply(pipe, "fixed_interval", interval=2, experts={"transformer_2": None}) as handle:
        run(pipe)
        assert not handle.experts
        assert handle.stats().calls < 2 * STEPS  # transformer_2's calls are not dcache's
    with dcache.apply(pipe, "fixed_interval", interval=2, warmup_steps=1,
                      experts={"transformer_2": {"interval": 1}}) as handle:
        run(pipe)
        assert handle.stats(expert="transformer_2").units_reused == 0
        assert handle.stats(expert="transformer").units_reused > 0
    with pytest.raises(ValueError, match="transformer_3"):
        dcache.apply(pipe, "fbcache", experts={"transformer_3": None})
    assert getattr(pipe.transformer, "_dcache_engine", None) is None  # a refused apply leaves nothing behind
    assert torch.equal(run(pipe), reference)


def test_default_method_caches_both_experts_from_the_first_generation(pipe):
    reference = run(pipe, steps=10)
    with dcache.apply(pipe) as handle:  # cadence-2x: whole calls, no calibration
        first = run(pipe, steps=10)
        assert handle.stats().units_forecast > 0 and handle.stats().compute_ratio < 0.8
        assert handle.stats(expert="transformer_2").units_forecast > 0
    assert float((first - reference).norm() / reference.norm()) < 0.05
    assert torch.equal(run(pipe, steps=10), reference)


def test_magcache_calibrates_each_expert_on_the_first_generation(pipe):
    reference = run(pipe, steps=10)
    with pytest.warns(UserWarning, match="calibrate"):
        handle = dcache.apply(pipe, "magcache")
    assert torch.equal(run(pipe, steps=10), reference)
    run(pipe, steps=10)
    assert set(handle.engine.schedule.measured) and set(handle.experts["transformer_2"].engine.schedule.measured)
    handle.remove()
