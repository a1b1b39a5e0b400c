"""The dtypes and weights users load: bf16 / fp16 transformers (caches kept in the model's dtype, all-compute
bit-identical) and a torchao int8 weight-only transformer (every unit kind), against the same model uncached."""

from __future__ import annotations

import pytest
import torch
import zoo

import dcache

STEPS = 8
UNIT_KINDS = [("fixed_interval", dict(interval=2), dict(interval=1)),  # stack
              ("taylorseer", dict(granularity="block", interval=2), dict(granularity="block", interval=1)),
              ("taylorseer", dict(granularity="module", interval=2), dict(granularity="module", interval=1)),
              ("magcache", dict(ratios=[1.0] * STEPS, threshold=0.5, scope="call"),
               dict(ratios=[1.0] * STEPS, max_skip_steps=0, scope="call"))]
KIND_IDS = ["stack", "block", "module", "call"]


def _flux(dtype=torch.float32):
    return zoo.ZOO["flux"].make_model().to(dtype)


def _generation(model, dtype, method=None, kw=None, seen=None):
    entry = zoo.ZOO["flux"]
    handle = dcache.apply(model, method, num_steps=STEPS, **kw) if method else None
    outs = []
    try:
        with torch.no_grad():
            for step in range(STEPS):
                inputs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and "ids" not in k else v
                          for k, v in entry.make_inputs(step).items()}
                outs.append(model(**inputs).sample)
                if handle is not None and seen is not None:
                    seen.update(t.dtype for b in handle.engine.branches.values() for h in b.units.values()
                                for t in (h.tables or []))
    finally:
        if handle is not None:
            handle.remove()
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method,reuse,all_compute", UNIT_KINDS, ids=KIND_IDS)
def test_half_precision_caches_in_the_model_dtype(dtype, method, reuse, all_compute):
    model = _flux(dtype)
    reference = _generation(model, dtype)
    assert reference.dtype == dtype
    assert torch.equal(_generation(model, dtype, method, all_compute), reference)
    seen: set = set()
    cached = _generation(model, dtype, method, reuse, seen)
    assert seen == {dtype}  # cached tensors in the model's dtype, no silent upcast (or downcast)
    assert torch.isfinite(cached).all()
    err = float((cached.float() - reference.float()).norm() / reference.float().norm())
    fp32_err = float((_generation(_flux(), torch.float32, method, reuse) - _generation(_flux(), torch.float32))
                     .norm() / _generation(_flux(), torch.float32).norm())
    assert err < fp32_err + 0.02, (err, fp32_err)  # half precision adds rounding, not a different error


@pytest.mark.parametrize("method,reuse,all_compute", UNIT_KINDS, ids=KIND_IDS)
def test_torchao_int8_weight_only_transformer(method, reuse, all_compute):
    quantization = pytest.importorskip("torchao.quantization")
    model = _flux()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    reference = _generation(model, torch.float32)
    assert torch.equal(_generation(model, torch.float32, method, all_compute), reference)
    cached = _generation(model, torch.float32, method, reuse)
    err = float((cached - reference).norm() / reference.norm())
    assert 0 < err < 0.1, err
