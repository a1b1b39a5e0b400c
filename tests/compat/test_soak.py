"""Soak: many consecutive generations with varying settings on one applied pipeline.

No growth in hooks, scheduler wrappers, generation records or live tensor memory, and identical outputs for repeated
identical calls. 200 generations in `make test`; 500 with `--run-long` (tests/compat/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from compat_kit import dcache_hook_count, hook_names, live_tensor_bytes, make_pipeline, seeded

import dcache

SETTINGS = [
    dict(),
    dict(num_inference_steps=3, guidance_scale=3.0),
    dict(height=2, width=6, num_images_per_prompt=2),
    dict(guidance_scale=3.0, cfg_mode="batched"),
    dict(labels=[5], guidance_scale=2.0, cache_context=False),
]
MEMORY_SLACK = 256 * 1024  # bytes of live tensors a long run may add (allocator / dynamo-free noise), ~1 cached step


def soak(generations: int) -> None:
    pipe = make_pipeline()
    handle = dcache.apply(pipe, "fbcache", threshold=0.5)
    first: dict[int, torch.Tensor] = {}
    hooks = None
    memory = None
    for i in range(generations):
        k = i % len(SETTINGS)
        kwargs = dict(labels=[1, 2], generator=seeded(k), num_inference_steps=4)
        kwargs.update(SETTINGS[k])
        out = pipe(**kwargs)
        if k not in first:
            first[k] = out
        else:
            assert torch.equal(out, first[k]), f"generation {i} differs from the first call with the same settings"
        if i == 2 * len(SETTINGS) - 1:  # every setting seen twice: caches, flop tables and shapes are warm
            hooks = hook_names(pipe.transformer)
            memory = live_tensor_bytes()
    assert hook_names(pipe.transformer) == hooks
    assert live_tensor_bytes() <= memory + MEMORY_SLACK
    engine = handle.engine
    assert engine.generations == generations
    assert engine.record is not None and len(engine.record.calls) <= 2 * 4  # only the last generation is kept
    assert "step" in vars(pipe.scheduler) and "set_timesteps" in vars(pipe.scheduler)
    handle.remove()
    assert dcache_hook_count(pipe.transformer) == 0 and "step" not in vars(pipe.scheduler)


def test_soak_200_generations():
    soak(200)


@pytest.mark.long
def test_soak_500_generations():
    soak(500)
