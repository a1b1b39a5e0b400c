"""Engine invariants through a real pipeline: the bundled tiny model (split and batched CFG, scheduler-driven)."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache import Action, Plan, PlanError, Schedule, quality
from dcache.pipelines.bundled import load_tiny_pipeline

LABELS = [0, 3, 7]
STEPS = 12


class AllCompute(Schedule):
    def decide(self, ctx):
        return Action.COMPUTE


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe, steps=STEPS, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return pipe(labels=LABELS, num_inference_steps=steps, generator=gen, output_type="pt", **kw).images


@pytest.fixture(scope="module")
def reference(pipe):
    return generate(pipe)


def test_all_compute_and_remove_are_bit_identical(pipe, reference):
    with dcache.apply(pipe, AllCompute()) as handle:
        assert torch.equal(generate(pipe), reference)
    assert handle.stats().compute_ratio == 1.0
    assert torch.equal(generate(pipe), reference)


def test_generation_records_follow_the_scheduler_and_the_cfg_contexts(pipe):
    with dcache.apply(pipe, "fbcache", threshold=0.2) as handle:
        generate(pipe)
        generate(pipe, steps=8)
        stats = handle.stats()
    assert stats.generations == 2
    assert stats.num_steps == 8 and stats.calls == 16
    assert stats.branches == ["cond", "uncond"]


def test_batched_cfg_is_one_branch_over_the_whole_batch(pipe):
    reference = generate(pipe, cfg_mode="batched")
    with dcache.apply(pipe, "magcache", ratios=[1.0] * STEPS, threshold=0.3, max_skip_steps=2) as handle:
        cached = generate(pipe, cfg_mode="batched")
    stats = handle.stats()
    assert stats.branches == ["cond_uncond"] and stats.units_reused > 0
    assert torch.isfinite(cached).all() and (cached - reference).abs().max() < 0.5


def test_dynamic_plan_replays_bit_exactly_and_state_does_not_leak(pipe, tmp_path):
    # one plan holds one set of decisions: a batch's (per-sample decisions keep one per sample, dcache.runtime.lanes)
    with dcache.apply(pipe, "fbcache", threshold=0.2, decisions="batch") as handle:
        first = generate(pipe)
        second = generate(pipe)  # identical call: identical output (no state leaks between generations)
        plan = handle.plan()
    assert torch.equal(first, second)
    assert 0 < plan.compute_ratio() < 1
    path = plan.save(tmp_path / "tiny.plan.json")
    with dcache.apply(pipe, str(path)):
        assert torch.equal(generate(pipe), first)


def test_plan_for_other_step_count_fails_clearly_or_interpolates(pipe):
    with dcache.apply(pipe, "fbcache", threshold=0.2) as handle:
        generate(pipe)
        plan = handle.plan()
    with dcache.apply(pipe, plan):
        with pytest.raises(PlanError, match="made for 12 steps but the pipeline runs 20"):
            generate(pipe, steps=20)
    stretched = Plan.from_dict({**plan.to_dict(), "interpolate_steps": True})
    with dcache.apply(pipe, stretched) as handle:
        out = generate(pipe, steps=20)
    assert torch.isfinite(out).all() and handle.stats().units_reused > 0


def test_cached_output_stays_close_to_uncached(pipe, reference):
    # 0.2: each sample decides at batch 1 with its own probe block, which a batched call where every sample computes
    # runs again (stats count it); at 0.1 two reused calls of 24 per sample do not pay for that on 8 blocks
    with dcache.apply(pipe, "fbcache", threshold=0.2) as handle:
        cached = generate(pipe)
    psnr = quality.psnr(cached, reference, dtype=torch.float32, floor=1e-12, at_floor=120.0)
    assert handle.stats().compute_ratio < 1.0
    assert psnr > 20.0, psnr
