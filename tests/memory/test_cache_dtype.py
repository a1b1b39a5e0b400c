"""Low-precision caches (`cache_dtype`, dcache.memory.cache_codec) on the zoo's tiny Flux, against the same run with a
full-precision (fp32) cache: for every unit kind (stack, block, module, call scope) and forecast order 0 / 1, the
static schedules take the same decisions, the outputs stay within a measured bound, the reported memory is 1/2
(bf16), 1/2 plus a scale per tensor (fp16) or 1/4 plus the fp32 scales (fp8) of the fp32 cache, and estimate ==
measured still holds."""

from __future__ import annotations

import warnings

import pytest
import torch
from zoo import STATIC_UNIT_SCHEDULES

import dcache
from dcache import Schedule
from dcache.memory.cache_codec import cache_codec
from dcache.memory.estimate import estimate

STEPS = 8  # the step count of the `flux` inputs (tests/memory/conftest.py)
WIDTH = 32  # hidden width of the zoo models: the per-token scale is 4 bytes per WIDTH fp8 bytes
LATENT_CHANNELS = 8  # zoo Flux's packed latent channels: the call-scope cache's last dim

UNITS = STATIC_UNIT_SCHEDULES
CODECS = [("bfloat16", None), ("float16", None), ("float8_e4m3fn", "tensor"), ("float8_e4m3fn", "token")]
# Relative L2 error of the outputs (all steps) against the fp32-cache run. Measured maxima over the orders (this
# file's cases): stack / block / module units bf16 1.1e-4, fp16 1.5e-5, fp8 1.9e-3 (tensor) / 1.6e-3 (token); call
# scope (the cached Delta = v - x is most of v) bf16 1.7e-3, fp16 2.2e-4, fp8 2.6e-2 / 2.4e-2. Bounds ~3x that.
BOUNDS = {"blocks": {"bfloat16": 4e-4, "float16": 5e-5, "float8_e4m3fn": 6e-3},
          "call": {"bfloat16": 5e-3, "float16": 7e-4, "float8_e4m3fn": 8e-2}}


def _run(flux, method, config, scope, **codec):
    model, inputs = flux
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = dcache.apply(model, method, num_steps=STEPS, scope=scope, **codec, **config)
    try:
        with torch.no_grad():
            outs = [model(**kw, return_dict=False)[0] for kw in inputs]
        return torch.stack(outs), [c.actions for c in handle.engine.record.calls], handle.memory()
    finally:
        handle.remove()


_REFERENCE: dict = {}


def _reference(flux, kind, order):
    if (kind, order) not in _REFERENCE:
        method, config, scope = UNITS[kind]
        _REFERENCE[kind, order] = _run(flux, method, config(order), scope)
    return _REFERENCE[kind, order]


@pytest.mark.parametrize("cache_dtype,cache_scale", CODECS, ids=[f"{d}-{s}" if s else d for d, s in CODECS])
@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("kind", list(UNITS))
def test_low_precision_cache_same_decisions_bounded_error_smaller_memory(flux, kind, order, cache_dtype,
                                                                         cache_scale):
    ref_out, ref_actions, ref_memory = _reference(flux, kind, order)
    method, config, scope = UNITS[kind]
    out, actions, memory = _run(flux, method, config(order), scope, cache_dtype=cache_dtype, cache_scale=cache_scale)
    assert actions == ref_actions and any(set(a) - {"C"} for a in actions)  # same decisions, and some reuse
    # computed steps before the first reuse are exact; later ones read low-precision tensors
    rel = ((out - ref_out).norm() / ref_out.norm()).item()
    assert 0 < rel <= BOUNDS[scope][cache_dtype], rel
    assert list(memory.by_kind) == list(ref_memory.by_kind) == [kind]
    ratio = memory.by_kind[kind] / ref_memory.by_kind[kind]
    if cache_dtype == "bfloat16":
        assert ratio == 0.5
    elif cache_dtype == "float16":  # plus its overflow guard: one fp32 scale per tensor (per Taylor row)
        assert 0.5 < ratio < 0.5 + 0.01
    elif cache_scale == "tensor":  # one fp32 scale per tensor (per Taylor row)
        assert 0.25 < ratio < 0.25 + 0.01
    else:  # one fp32 scale per token: 4 bytes per `last dim` bytes of fp8 (module outputs: some are wider, MLPs)
        last = LATENT_CHANNELS if kind == "call" else WIDTH
        assert ratio == pytest.approx(0.25 + 1 / last) if kind != "module" else 0.25 < ratio < 0.25 + 1 / last


class _AllCompute(Schedule):
    name = "all-compute"
    granularity = "block"

    def decide(self, ctx):
        return "C"


@pytest.mark.parametrize("cache_dtype,cache_scale", CODECS, ids=[f"{d}-{s}" if s else d for d, s in CODECS])
def test_all_compute_is_bit_identical_to_the_uncached_model(flux, cache_dtype, cache_scale):
    model, inputs = flux
    with torch.no_grad():
        plain = [model(**kw, return_dict=False)[0] for kw in inputs[:3]]
        with dcache.apply(model, _AllCompute(), num_steps=3, cache_dtype=cache_dtype, cache_scale=cache_scale):
            cached = [model(**kw, return_dict=False)[0] for kw in inputs[:3]]
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))


@pytest.mark.parametrize("cache_dtype,cache_scale", [("bfloat16", None), ("float8_e4m3fn", "token")])
def test_estimate_equals_measured_with_a_cache_dtype(flux, cache_dtype, cache_scale):
    model, inputs = flux
    config = {"granularity": "module", "interval": 2, "order": 1, "warmup_steps": 1}
    _, _, measured = _run(flux, "taylorseer", config, "blocks", cache_dtype=cache_dtype, cache_scale=cache_scale)
    est = estimate(model, "taylorseer", inputs[0], branches=(None,), num_steps=STEPS, cache_dtype=cache_dtype,
                   cache_scale=cache_scale, **config)
    full = estimate(model, "taylorseer", inputs[0], branches=(None,), num_steps=STEPS, **config)
    assert est.memory.peak_bytes == measured.peak_bytes and est.memory.by_branch == measured.by_branch
    assert est.memory.peak_bytes < full.memory.peak_bytes


def test_budget_counts_the_cache_dtype(flux):
    """max_cache_memory between the bf16 and the fp32 cache: refused in fp32, accepted with cache_dtype."""
    model, inputs = flux
    config = {"granularity": "module", "interval": 2, "order": 1, "warmup_steps": 1}
    full = estimate(model, "taylorseer", inputs[0], branches=(None,), num_steps=STEPS, **config).memory.peak_bytes
    limit = int(full * 0.75)
    for cache_dtype, fits in ((None, False), ("bfloat16", True)):
        handle = dcache.apply(model, "taylorseer", num_steps=STEPS, max_cache_memory=limit, cache_dtype=cache_dtype,
                              **config)
        try:
            with torch.no_grad():
                if fits:
                    model(**inputs[0])
                else:
                    with pytest.raises(dcache.memory.budget.MemoryBudgetError):
                        model(**inputs[0])
        finally:
            handle.remove()


@pytest.mark.parametrize("kwargs,field,allowed", [
    ({"cache_dtype": "int8"}, "cache_dtype='int8'", "'bfloat16', 'float16', 'float8_e4m3fn'"),
    ({"cache_dtype": "float8_e4m3fn", "cache_scale": "row"}, "cache_scale='row'", "'tensor', 'token'"),
    ({"cache_dtype": "bfloat16", "cache_scale": "token"}, "cache_scale='token'", "float8_e4m3fn"),
    ({"cache_scale": "tensor"}, "cache_scale='tensor'", "float8_e4m3fn"),
])
def test_invalid_values_name_the_field_and_the_allowed_values(flux, kwargs, field, allowed):
    for call in (lambda: cache_codec(**kwargs),
                 lambda: dcache.apply(flux[0], "fixed_interval", num_steps=2, **kwargs)):
        with pytest.raises(ValueError) as info:
            call()
        assert field in str(info.value) and allowed in str(info.value)
    assert getattr(flux[0], "_dcache_engine", None) is None  # nothing was applied


def test_fp8_round_trip_is_within_its_relative_precision():
    """Analytic: e4m3 keeps 3 mantissa bits, so every value decodes within 2^-4 of itself (relative, normal range);
    the per-token scale maps each token's absmax to 448 exactly."""
    x = torch.randn(2, 16, 32) * torch.logspace(-3, 3, 16).reshape(1, 16, 1)
    for scale in ("tensor", "token"):
        codec = cache_codec("float8_e4m3fn", scale)
        stored = codec.encode(x)
        assert stored.data.dtype == torch.float8_e4m3fn and stored.scale.dtype == torch.float32
        back = codec.decode(stored)
        assert back.dtype == x.dtype and back.shape == x.shape
        if scale == "token":
            assert stored.scale.shape == (2, 16, 1)
            assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-12).float().mean() > 0.97  # subnormals excepted
            assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
        else:
            assert stored.scale.numel() == 1
    half = cache_codec("bfloat16").encode(x.to(torch.bfloat16))
    assert half.data.dtype == torch.bfloat16 and half.scale is None  # never re-encoded at its own width


class _Rows(Schedule):
    """Block granularity, order 1: compute at steps 0 and 1, then `late` (REUSE "R" or FORECAST "F") for all."""

    granularity = "block"
    forecast_order = 1

    def __init__(self, late: str, forecaster=None):
        self.late, self.forecaster = late, forecaster

    def decide(self, ctx):
        return "C" if ctx.step < 2 else self.late


def test_a_schedule_forecaster_reads_decoded_tables(flux):
    """A schedule's own forecaster (e.g. DisCa's) reads hist.tables as tensors of the compute dtype; reading row d_0
    gives exactly what REUSE gives with the same cache dtype."""
    model, inputs = flux
    seen = []

    def row0(hist, step):
        seen.append([(type(t), t.dtype) for t in hist.tables])
        return [t[0] for t in hist.tables]

    outs = {}
    for name, schedule in (("reuse", _Rows("R")), ("forecaster", _Rows("F", row0))):
        with torch.no_grad(), dcache.apply(model, schedule, num_steps=4, cache_dtype="float8_e4m3fn"):
            outs[name] = [model(**kw, return_dict=False)[0] for kw in inputs[:4]]
    assert seen and all(entry == (torch.Tensor, torch.float32) for row in seen for entry in row)
    assert all(torch.equal(a, b) for a, b in zip(outs["reuse"], outs["forecaster"]))


def test_a_float16_cache_keeps_values_beyond_its_range_finite():
    """Activations above float16's 65504 are scaled into range, not stored as infinity (which turns every image the
    cache touches into NaN); within the range the stored bits equal a plain cast."""
    codec = cache_codec("float16")
    big = torch.randn(2, 7, 33) * 3e5  # |x| up to ~1.5e6
    big[0, 0, 0] = 7e6
    stored = codec.encode(big)
    back = codec.decode(stored)
    assert torch.isfinite(back).all()
    assert float(((back - big).abs() / big.abs().clamp_min(1.0)).max()) < 2e-3  # float16's relative precision
    small = torch.randn(3, 5, 9) * 100
    plain = codec.encode(small)
    assert torch.equal(plain.data, small.to(torch.float16))
    assert torch.equal(codec.decode(plain), small.to(torch.float16).float())
    rows = torch.stack([small, small * 1e4])  # a Taylor table: each row d_k scaled on its own
    table = codec.encode(rows, lead=1)
    assert torch.equal(table.data[0], small.to(torch.float16)) and torch.isfinite(codec.decode(table)).all()


def test_a_float16_cache_on_a_model_with_huge_activations_gives_a_finite_image(flux):
    """End to end: residuals beyond float16's range (the tiny Flux's MLP outputs scaled by 1e6), cached in
    float16 while blocks are reused: the outputs stay finite and within float16's precision of the fp32 cache's."""
    model, inputs = flux
    original = [b.ff.net[-1].weight.detach().clone() for b in model.transformer_blocks]
    try:
        with torch.no_grad():
            for block in model.transformer_blocks:
                block.ff.net[-1].weight.mul_(1e6)
        method, config, scope = UNITS["block"]
        reference, _, _ = _run(flux, method, config(0), scope)
        half, _, _ = _run(flux, method, config(0), scope, cache_dtype="float16")
    finally:
        with torch.no_grad():
            for block, weight in zip(model.transformer_blocks, original):
                block.ff.net[-1].weight.copy_(weight)
    assert torch.isfinite(reference).all()
    assert torch.isfinite(half).all()
    assert float((half - reference).norm() / reference.norm()) < 1e-3
