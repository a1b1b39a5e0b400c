"""dcache's `seacache` against diffusers' own SeaCache hook on the bundled tiny model (split CFG, 28 steps).

Same settings -> the same decisions (number of computed stack passes per branch) and the same images up to float
rounding (the residual extrapolation is written in another order). diffusers has no Flux layout for its indicator:
its `raw_vision_callback` gets the pipeline's own unpacking of the 2x2-packed tokens, which dcache's Flux adapter
does too.
"""

from __future__ import annotations

import math

import pytest
import torch

import dcache

diffusers = pytest.importorskip("diffusers")
if not hasattr(diffusers, "SeaCacheConfig"):
    pytest.skip("this diffusers has no SeaCache", allow_module_level=True)
bundled = pytest.importorskip("dcache.pipelines.bundled")

LABELS, STEPS = [0, 3, 7], 28


def _unpack(module, args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    b, n, d = hidden.shape
    side = math.isqrt(n)
    x = hidden.reshape(b, side, side, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, 2 * side, 2 * side)
    return [sample.unsqueeze(1) for sample in x]  # [C, T=1, H, W] each


@pytest.fixture(scope="module")
def pipe():
    try:
        return bundled.load_tiny_pipeline()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def generate(pipe):
    return pipe(LABELS, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="pt",
                cfg_mode="split").images.float()


@pytest.mark.parametrize("threshold, max_consecutive", [(0.138, 2), (0.894, 5), (4.0, 2)])
def test_same_decisions_and_images_as_diffusers_seacache(pipe, threshold, max_consecutive):
    computes = []
    first_attn = pipe.transformer.transformer_blocks[0].attn  # runs only when diffusers computes the stack
    handle = first_attn.register_forward_hook(lambda *a: computes.append(1))
    config = diffusers.SeaCacheConfig(threshold=threshold, max_consecutive_cached=max_consecutive,
                                      raw_vision_callback=_unpack)
    pipe.transformer.enable_cache(config)
    try:
        theirs = generate(pipe)
    finally:
        pipe.transformer.disable_cache()
        handle.remove()
    # diffusers decides once per batch (on the batch's signal): compare with dcache's batch decisions
    with dcache.apply(pipe, "seacache", threshold=threshold, max_consecutive=max_consecutive,
                      decisions="batch") as cached:
        ours = generate(pipe)
        stats = cached.stats()
    assert stats.calls_fully_computed == len(computes) < 2 * STEPS  # 2 calls per step (cond, uncond)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)  # measured max |diff| <= 3.9e-7 (pixels in [0, 1])
