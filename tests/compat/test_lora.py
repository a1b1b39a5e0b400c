"""LoRA (diffusers + peft) loaded, fused, unfused, re-weighted and unloaded while dcache is applied.

The reference of every case is the same LoRA loaded *before* `dcache.apply` with the same plan: the order of the two
calls must not change the numbers.
"""

from __future__ import annotations

import pytest
import torch
from compat_kit import BLOCK_LAYOUT, NUM_BLOCKS, dcache_hook_count, make_pipeline, rel_error, seeded

import dcache
from dcache import Plan

pytest.importorskip("peft")

STEPS = 4
FUSE_RTOL = 1e-5  # fuse/unfuse change the weights by float rounding only
MODULE_UNITS = ("b0.attn", "b0.ff", "b0.ff_context", "b1.attn", "b1.ff", "b1.ff_context",
                "b2.attn", "b2.proj_mlp", "b2.proj_out", "b3.attn", "b3.proj_mlp", "b3.proj_out",
                "b4.attn", "b4.proj_mlp", "b4.proj_out")


def plan(granularity: str) -> Plan:
    if granularity == "stack":
        units, reuse = ["stack"], "R"
    elif granularity == "block":
        units, reuse = [f"b{i}" for i in range(NUM_BLOCKS)], "CRCRC"
    else:
        units = list(MODULE_UNITS)
        reuse = "".join("R" if i % 2 else "C" for i in range(len(units)))
    rows = ["C" * len(units), reuse, "C" * len(units), reuse]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity=granularity,
                units=units, num_steps=STEPS, actions={"cond": rows, "uncond": rows},
                probe_blocks=1 if granularity == "stack" else 0)


def lora_state_dict(model, targets=("attn.to_q", "attn.to_k", "attn.to_v"), seed: int = 0, rank: int = 4) -> dict:
    """A peft-format LoRA for the given Linear layers, large enough to move the outputs by ~10%."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(targets):
            sd[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.3
            sd[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.3
    return sd


def generate(pipe):
    return pipe([1, 2], generator=seeded(0), num_inference_steps=STEPS, guidance_scale=3.0)


def lora_first(granularity: str, targets) -> torch.Tensor:
    pipe = make_pipeline()
    pipe.transformer.load_lora_adapter(lora_state_dict(pipe.transformer, targets), adapter_name="style", prefix=None)
    with dcache.apply(pipe, plan(granularity)):
        return generate(pipe)


@pytest.mark.parametrize("granularity", ["stack", "block"])
def test_lora_lifecycle_after_apply(granularity):
    """load -> fuse -> unfuse -> weight 0 -> unload, all after apply: each equals the same state without ordering."""
    targets = ("attn.to_q", "attn.to_k", "attn.to_v")
    pipe = make_pipeline()
    handle = dcache.apply(pipe, plan(granularity))
    no_lora = generate(pipe)
    transformer = pipe.transformer
    transformer.load_lora_adapter(lora_state_dict(transformer, targets), adapter_name="style", prefix=None)
    loaded = generate(pipe)
    reference = lora_first(granularity, targets)
    assert torch.equal(loaded, reference)
    assert rel_error(loaded, no_lora) > 0.01  # the LoRA matters
    transformer.fuse_lora(lora_scale=1.0)
    assert rel_error(generate(pipe), reference) < FUSE_RTOL
    transformer.unfuse_lora()
    assert rel_error(generate(pipe), reference) < FUSE_RTOL
    transformer.set_adapters(["style"], weights=[0.0])
    assert rel_error(generate(pipe), no_lora) < FUSE_RTOL
    transformer.unload_lora()
    assert rel_error(generate(pipe), no_lora) < FUSE_RTOL
    assert handle.stats().compute_ratio < 1.0
    handle.remove()
    assert dcache_hook_count(transformer) == 0


@pytest.mark.parametrize("granularity", ["stack", "block", "module"])
def test_lora_loaded_before_apply(granularity):
    """LoRA first (also on module units, Flux's proj_mlp / proj_out), then dcache: remove() restores the LoRA model
    exactly."""
    targets = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
    pipe = make_pipeline()
    pipe.transformer.load_lora_adapter(lora_state_dict(pipe.transformer, targets), adapter_name="style", prefix=None)
    bare = generate(pipe)
    with dcache.apply(pipe, plan(granularity)) as handle:
        cached = generate(pipe)
        assert handle.stats().compute_ratio < 1.0
    assert rel_error(cached, bare) < 0.2
    assert torch.equal(generate(pipe), bare)


def test_lora_on_a_module_unit_after_apply():
    targets = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
    pipe = make_pipeline()
    handle = dcache.apply(pipe, plan("module"))
    pipe.transformer.load_lora_adapter(lora_state_dict(pipe.transformer, targets), adapter_name="style", prefix=None)
    out = generate(pipe)
    handle.remove()
    assert torch.equal(out, lora_first("module", targets))
