"""Two feature caches on one transformer are refused with the fix, in either order.

diffusers' own caches (`transformer.enable_cache(...)`, or its apply_* functions) and dcache would each serve work on
the other's outputs: the image would be the other cache's while dcache's stats say every call computed.
"""

from __future__ import annotations

import pytest
import torch
from compat_kit import dcache_hook_count, make_pipeline, seeded
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

import dcache


def generate(pipe):
    return pipe([1, 7], num_inference_steps=6, guidance_scale=2.0, generator=seeded(0))


def test_dcache_after_diffusers_enable_cache_is_refused_and_nothing_is_hooked():
    pipe = make_pipeline()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    with pytest.raises(RuntimeError, match=r"FirstBlockCacheConfig \(transformer.enable_cache\).*disable_cache\(\)"):
        dcache.apply(pipe, "fbcache", threshold=0.0)
    assert dcache_hook_count(pipe.transformer) == 0
    pipe.transformer.disable_cache()
    with dcache.apply(pipe, "fbcache", threshold=0.0):  # the fix works
        generate(pipe)


def test_diffusers_hooks_applied_directly_are_found_too():
    pipe = make_pipeline()
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=0.5))
    with pytest.raises(RuntimeError, match="first_block_cache hooks"):
        dcache.apply(pipe, "fbcache", threshold=0.0)


def test_diffusers_enable_cache_after_dcache_refuses_the_next_call():
    pipe = make_pipeline()
    reference = generate(pipe)
    handle = dcache.apply(pipe, "fbcache", threshold=0.0, decisions="batch")  # the batch runs whole, as uncached
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    with pytest.raises(RuntimeError, match="enabled after dcache.apply; the call is refused"):
        generate(pipe)
    pipe.transformer.disable_cache()
    assert torch.equal(generate(pipe), reference)  # all-compute dcache alone again: the uncached image
    assert handle.stats().compute_ratio == 1.0
    handle.remove()
