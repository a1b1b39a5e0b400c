"""Offloaded caches (`cache_device="cpu"`, dcache.cache_codec): the stored tensors live in host memory and are copied
back on use. On a CPU the same code path runs host to host: for every unit kind (stack, block, module, call scope)
and forecast order 0 / 1, alone and with a low cache dtype, the outputs and the decisions equal the on-device
cache's bit for bit, the stored tensors are copies (never the computed tensors themselves), and the memory report
says where the bytes are."""

from __future__ import annotations

import warnings

import pytest
import torch
from zoo import STATIC_UNIT_SCHEDULES

import dcache
from dcache.cache_codec import Stored, cache_codec
from dcache.estimate import estimate

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
