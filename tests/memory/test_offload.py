"""Offloaded caches (`cache_device="cpu"`, dcache.memory.cache_codec): the stored tensors live in host memory and are
copied back on use. On a CPU the same code path runs host to host: for every unit kind (stack, block, module, call
scope) and forecast order 0 / 1, alone and with a low cache dtype, the outputs and the decisions equal the on-device
cache's bit for bit, the stored tensors are copies (never the computed tensors themselves), and the memory report
says where the bytes are."""

from __future__ import annotations

import warnings

import pytest
import torch
from zoo import STATIC_UNIT_SCHEDULES

import dcache
from dcache.memory.cache_codec import Stored, cache_codec
from dcache.memory.estimate import estimate

STEPS = 8  # the step count of the `flux` inputs (tests/memory/conftest.py)
UNITS = STATIC_UNIT_SCHEDULES


def _run(flux, method, config, scope, **storage):
    model, inputs = flux
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = dcache.apply(model, method, num_steps=STEPS, scope=scope, **storage, **config)
    stored = []
    try:
        with torch.no_grad():
            outs = []
            for kw in inputs:
                outs.append(model(**kw, return_dict=False)[0])
                for bstate in handle.engine.branches.values():
                    stored += [s for h in bstate.units.values() for s in (h.tables or []) if isinstance(s, Stored)]
        return torch.stack(outs), [c.actions for c in handle.engine.record.calls], handle.memory(), stored
    finally:
        handle.remove()


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("kind", list(UNITS))
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_offloaded_cache_gives_the_on_device_outputs_bit_for_bit(flux, kind, order, dtype):
    method, config, scope = UNITS[kind]
    codec = {"cache_dtype": dtype} if dtype else {}
    ref, ref_actions, ref_mem, _ = _run(flux, method, config(order), scope, **codec)
    out, actions, mem, stored = _run(flux, method, config(order), scope, cache_device="cpu", **codec)
    assert actions == ref_actions and any("C" != a for row in actions for a in row)  # reuse / forecast happened
    assert torch.equal(out, ref)
    assert stored and all(s.home == torch.device("cpu") and s.data.device.type == "cpu" for s in stored)
    assert mem.peak_bytes == ref_mem.peak_bytes and mem.by_branch == ref_mem.by_branch
    assert mem.cache_device == "cpu" and ref_mem.cache_device is None and "offloaded" in str(mem)


def test_offload_copies_instead_of_aliasing_the_computed_tensor():
    codec = cache_codec(cache_device="cpu")
    x = torch.randn(3, 5)
    before = x.clone()
    stored = codec.encode(x)
    assert stored.data.data_ptr() != x.data_ptr() and torch.equal(stored.data, x)
    x.add_(1.0)  # a later in-place change of the computed tensor leaves the cache as it was
    assert torch.equal(codec.decode(stored), before)


def test_the_estimate_reports_an_offloaded_cache_in_host_memory(flux):
    model, inputs = flux
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_device = estimate(model, "taylorseer", inputs[0], branches=("cond",), num_steps=STEPS)
        offloaded = estimate(model, "taylorseer", inputs[0], branches=("cond",), num_steps=STEPS,
                             cache_device="cpu")
    assert offloaded.memory.peak_bytes == on_device.memory.peak_bytes > 0
    assert offloaded.memory.cache_device == "cpu" and offloaded.memory.device_bytes == 0
    assert on_device.memory.device_bytes == on_device.memory.peak_bytes


@pytest.mark.parametrize("value", ["cuda", "disk", 3])
def test_a_bad_cache_device_names_the_field_and_the_values(value):
    with pytest.raises(ValueError, match=r"cache_device=.*allowed values: 'cpu'"):
        cache_codec(cache_device=value)


@pytest.mark.parametrize("storage", [{"cache_device": "cpu"}, {"cache_dtype": "bfloat16"},
                                     {"cache_dtype": "bfloat16", "cache_device": "cpu"}])
@pytest.mark.parametrize("kind", ["stack", "block"])
def test_a_kept_dtype_runs_the_plain_historys_taylor_math(flux, kind, storage, monkeypatch):
    """A bf16 model whose cache keeps bf16 (offloaded, or cache_dtype='bfloat16'): the Taylor kernels see the tables
    in the dtype the plain on-device history gives them, so the outputs match on every backend. (With fp32 copies of
    the tables, the result equalled the plain cache's on the torch backend but not on CUDA's Triton kernels.)"""
    import dcache.memory.cache_codec
    import dcache.runtime.cache_state
    from dcache.runtime.cache_ops import ops_for

    seen: list[tuple[str, torch.dtype]] = []

    class Recording:
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            op = getattr(self.ops, name)
            if not name.startswith("taylor_"):
                return op

            def recorded(table, *args, **kwargs):
                seen.append((name, table.dtype))
                return op(table, *args, **kwargs)
            return recorded

    for module in (dcache.runtime.cache_state, dcache.memory.cache_codec):
        monkeypatch.setattr(module, "ops_for", lambda t: Recording(ops_for(t)))
    model, inputs = flux
    bf16 = (model.to(torch.bfloat16), [{k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point()
                                        else v for k, v in kw.items()} for kw in inputs])
    try:
        method, config, scope = UNITS[kind]
        ref, ref_actions, *_ = _run(bf16, method, config(1), scope)
        plain, seen[:] = list(seen), []
        out, actions, *_ = _run(bf16, method, config(1), scope, **storage)
    finally:
        model.to(torch.float32)
    assert plain and {d for _, d in plain} == {torch.bfloat16}
    assert seen == plain  # the same ops, in the same order, on tables of the same dtype
    assert actions == ref_actions and torch.equal(out, ref)
