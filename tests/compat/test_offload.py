"""diffusers' memory hooks composed with dcache, applied before or after `dcache.apply`.

On a CPU-only machine offloading to the CPU moves nothing, but every hook still runs, so these tests check the hook
composition: outputs equal dcache without offloading, caching stays active across generations, and `remove()` leaves
the other library's hooks working.

  model CPU offload      accelerate `CpuOffload` hook on the transformer's `forward`; re-installed by
                         `maybe_free_model_hooks()` at the end of every pipeline call
  sequential offload     accelerate `AlignDevicesHook` on every leaf module
  group offloading       diffusers HookRegistry "group_offloading", block level and leaf level
  layerwise casting      diffusers HookRegistry "layerwise_casting" (bf16 storage, fp32 compute)
"""

from __future__ import annotations

import accelerate.hooks
import pytest
import torch
from compat_kit import BLOCK_LAYOUT, NUM_BLOCKS, dcache_hook_count, hook_names, make_pipeline, seeded

import dcache
from dcache import Plan

STEPS = 4
CPU = torch.device("cpu")


def block_plan() -> Plan:
    rows = ["C" * NUM_BLOCKS, "CRCRC", "CCRRC", "CRRRC"]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="block",
                units=[f"b{i}" for i in range(NUM_BLOCKS)], num_steps=STEPS, actions={"cond": rows, "uncond": rows})


def stack_plan() -> Plan:
    rows = ["C", "R", "C", "R"]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=STEPS, actions={"cond": rows, "uncond": rows}, probe_blocks=1)


PLANS = {"block": block_plan, "stack": stack_plan}

DIFFUSERS_HOOKS = {
    "group-block": lambda pipe: pipe.transformer.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="block_level", num_blocks_per_group=1),
    "group-leaf": lambda pipe: pipe.transformer.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="leaf_level"),
    "layerwise-casting": lambda pipe: pipe.transformer.enable_layerwise_casting(
        storage_dtype=torch.bfloat16, compute_dtype=torch.float32),
}


def generate(pipe):
    return pipe([1, 2], generator=seeded(0), num_inference_steps=STEPS, guidance_scale=3.0)


def reference(plan: str, memory: str | None = None) -> torch.Tensor:
    """dcache with `plan` on a pipeline that has `memory` applied *first* (casting changes numbers; offload does
    not)."""
    pipe = make_pipeline()
    if memory == "layerwise-casting":
        DIFFUSERS_HOOKS[memory](pipe)
    handle = dcache.apply(pipe, PLANS[plan]())
    out = generate(pipe)
    handle.remove()
    return out


_REFS: dict = {}


def cached_reference(plan: str, memory: str | None) -> torch.Tensor:
    key = (plan, memory if memory == "layerwise-casting" else None)
    if key not in _REFS:
        _REFS[key] = reference(*key)
    return _REFS[key]


@pytest.mark.parametrize("plan", ["block", "stack"])
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("memory", list(DIFFUSERS_HOOKS))
def test_diffusers_hooks_compose(memory, order, plan):
    """Group offloading / layerwise casting before or after dcache: same outputs, caching active, clean removal."""
    pipe = make_pipeline()
    bare_hooks = None
    if order == "before":
        DIFFUSERS_HOOKS[memory](pipe)
        bare_hooks = hook_names(pipe.transformer)
    handle = dcache.apply(pipe, PLANS[plan]())
    if order == "after":
        DIFFUSERS_HOOKS[memory](pipe)
    first, second = generate(pipe), generate(pipe)
    assert torch.equal(first, cached_reference(plan, memory))
    assert torch.equal(first, second)
    assert handle.stats().compute_ratio < 1.0
    handle.remove()
    assert dcache_hook_count(pipe.transformer) == 0
    if bare_hooks is not None:
        assert hook_names(pipe.transformer) == bare_hooks  # the other library's hooks are untouched


@pytest.fixture
def offload_calls(monkeypatch):
    """Counts accelerate's CpuOffload.pre_forward on transformers (the hook that moves a model onto the device)."""
    calls = {"n": 0}
    original = accelerate.hooks.CpuOffload.pre_forward

    def counting(self, module, *args, **kwargs):
        if type(module).__name__ == "FluxTransformer2DModel":
            calls["n"] += 1
        return original(self, module, *args, **kwargs)

    monkeypatch.setattr(accelerate.hooks.CpuOffload, "pre_forward", counting)
    return calls


def test_model_cpu_offload_after_apply(offload_calls):
    """dcache first, then enable_model_cpu_offload: cached outputs, the offload hook runs on every transformer call."""
    pipe = make_pipeline()
    handle = dcache.apply(pipe, block_plan())
    pipe.enable_model_cpu_offload(device="cpu")
    offload_calls["n"] = 0
    first, second = generate(pipe), generate(pipe)
    assert offload_calls["n"] >= 2 * 2 * STEPS  # two calls per step (split CFG), two generations
    assert torch.equal(first, cached_reference("block", None)) and torch.equal(first, second)
    assert handle.stats().compute_ratio < 1.0


def test_model_cpu_offload_before_apply_keeps_caching():
    """enable_model_cpu_offload first (the order diffusers' docs show), then dcache: every generation is cached."""
    pipe = make_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    handle = dcache.apply(pipe, block_plan())
    first, second = generate(pipe), generate(pipe)
    assert torch.equal(first, cached_reference("block", None))
    assert handle.stats().compute_ratio < 1.0  # stats of the second generation
    assert torch.equal(first, second)


def test_remove_keeps_model_cpu_offload_working(offload_calls):
    pipe = make_pipeline()
    handle = dcache.apply(pipe, block_plan())
    pipe.enable_model_cpu_offload(device="cpu")
    generate(pipe)
    handle.remove()
    offload_calls["n"] = 0
    pipe([1], generator=seeded(0), num_inference_steps=1)  # one transformer call
    assert offload_calls["n"] >= 1, "accelerate's offload hook no longer runs on the transformer after remove()"


def _sequential_offload_works_without_dcache() -> str | None:
    pipe = make_pipeline()
    try:
        pipe.enable_sequential_cpu_offload(device="cpu")
        generate(pipe)
    except Exception as exc:  # noqa: BLE001 - report any upstream failure as the skip reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


@pytest.mark.parametrize("order", ["before", "after"])
def test_sequential_cpu_offload(order):
    """Sequential offload puts accelerate hooks on leaf modules; dcache's hooks sit on blocks and the transformer."""
    upstream = _sequential_offload_works_without_dcache()
    if upstream is not None:
        pytest.skip(f"enable_sequential_cpu_offload fails here without dcache (accelerate/torch, CPU-only): "
                    f"{upstream}")
    pipe = make_pipeline()
    if order == "before":
        pipe.enable_sequential_cpu_offload(device="cpu")
    handle = dcache.apply(pipe, block_plan())
    if order == "after":
        pipe.enable_sequential_cpu_offload(device="cpu")
    first, second = generate(pipe), generate(pipe)
    assert torch.equal(first, cached_reference("block", None)) and torch.equal(first, second)
    handle.remove()
