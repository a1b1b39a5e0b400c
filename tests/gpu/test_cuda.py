"""dcache on CUDA: what the CPU suite cannot check.

  * every conformance family in bfloat16 on CUDA: an all-compute schedule is bit-identical to the unhooked model,
    and so is the model after remove();
  * regional torch.compile with inductor (diffusers' compile_repeated_blocks) under a static plan: the decisions
    of eager dcache, outputs within bf16 rounding of eager dcache, no recompile in a second generation;
  * cache_device="cpu" on CUDA (pinned host cache, the next unit prefetched on a side stream) is bit-identical to the
    on-device cache, for plain reuse and for a Taylor forecast.
"""

from __future__ import annotations

import pytest
import torch
import zoo

import dcache
from dcache import Schedule
from dcache.schedule import Action

STEPS = 6
DEVICE = torch.device("cuda")


class AllCompute(Schedule):
    name = "all-compute"
    granularity = "block"

    def decide(self, ctx):
        return Action.COMPUTE  # one action: every unit computes


def to_device(value, dtype):
    """value on DEVICE, floating tensors in `dtype`, through lists, tuples and dicts (Z-Image takes lists of
    tensors, Kandinsky 5 and Bria-FIBO nested ones)."""
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE, dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, dtype) for k, v in value.items()}
    return value


def bf16_model(entry):
    """The family's model on DEVICE in bfloat16, its `_keep_in_fp32_modules` kept in float32 as
    `from_pretrained(torch_dtype=torch.bfloat16)` keeps them (Kandinsky 5's embeddings and modulations)."""
    model = entry.make_model().to(DEVICE, torch.bfloat16)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            module.to(torch.float32)
    return model


def run_steps(model, entry, dtype=torch.bfloat16):
    outs = []
    with torch.no_grad():
        for step in range(STEPS):
            kwargs = {k: to_device(v, dtype) for k, v in entry.make_inputs(step).items()}
            out = model(**kwargs, return_dict=False)[0]
            if isinstance(out, (list, tuple)):  # Z-Image: one tensor per sample
                out = torch.cat([o.flatten() for o in out])
            outs.append(out.clone())
    return outs


@pytest.mark.parametrize("family", sorted(zoo.ZOO))
def test_all_compute_is_bit_identical_in_bf16_on_cuda(family):
    entry = zoo.ZOO[family]
    model = bf16_model(entry)
    reference = run_steps(model, entry)
    with dcache.apply(model, AllCompute(), num_steps=STEPS):
        cached = run_steps(model, entry)
    assert all(torch.equal(a, b) for a, b in zip(cached, reference))
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, entry), reference))


def test_regional_inductor_compile_with_a_plan_matches_eager_dcache():
    import torch._dynamo
    from torch._dynamo.utils import counters

    entry = zoo.ZOO["flux"]
    eager_model = entry.make_model().to(DEVICE, torch.bfloat16)
    with dcache.apply(eager_model, "fixed_interval", num_steps=STEPS, interval=2) as handle:
        eager = run_steps(eager_model, entry)
        eager_rows = [c.actions for c in handle.engine.record.calls]
    torch._dynamo.reset()
    counters.clear()
    model = entry.make_model().to(DEVICE, torch.bfloat16)
    model.compile_repeated_blocks(backend="inductor")
    with dcache.apply(model, "fixed_interval", num_steps=STEPS, interval=2) as handle:
        first = run_steps(model, entry)
        graphs = int(counters["stats"]["unique_graphs"])
        again = run_steps(model, entry)
        compiled_rows = [c.actions for c in handle.engine.record.calls]
    torch._dynamo.reset()
    assert compiled_rows == eager_rows
    assert int(counters["stats"]["unique_graphs"]) == graphs  # the second generation compiled nothing new
    for a, b in zip(first, eager):  # inductor fuses: bf16 rounding differs, the numbers agree
        assert float((a.float() - b.float()).abs().max()) <= 0.05 * float(b.float().abs().max()) + 1e-2
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("method,settings", [("fixed_interval", {"interval": 2}),
                                             ("taylorseer", {"interval": 2, "order": 1, "warmup_steps": 1})])
def test_offloaded_cache_with_prefetch_is_bit_identical_to_the_on_device_cache(method, settings):
    entry = zoo.ZOO["flux"]
    model = entry.make_model().to(DEVICE, torch.bfloat16)
    with dcache.apply(model, method, num_steps=STEPS, **settings) as handle:
        on_device = run_steps(model, entry)
        reused = handle.stats().compute_ratio
    with dcache.apply(model, method, num_steps=STEPS, cache_device="cpu", **settings) as handle:
        assert handle.engine.cache_codec.prefetch is not None  # CUDA: the side-stream prefetch is on
        offloaded = run_steps(model, entry)
        assert handle.memory().cache_device == "cpu"
    assert reused < 1.0
    assert all(torch.equal(a, b) for a, b in zip(offloaded, on_device))
