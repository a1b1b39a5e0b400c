"""max_cache_memory: refused at the first call with the numbers, before anything is cached; options that fit."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcache
from dcache.memory.budget import BudgetCheck, CacheFitChoice, MemoryBudgetError
from dcache.memory.report import parse_bytes
from dcache.pipelines.bundled import load_tiny_pipeline


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def _run(pipe, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = dcache.apply(pipe, **kw)
    try:
        pipe(["3"], num_inference_steps=4, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
             output_type="pt")  # no CFG: one branch, so the first call is the whole cache
        return handle, handle.memory()
    finally:
        handle.remove()


def test_over_budget_refuses_before_caching_with_numbers_and_options(pipe):
    _, full = _run(pipe, method="taylorseer")  # module granularity, order 1: 2 tensors per module output
    budget = full.peak_bytes // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = dcache.apply(pipe, "taylorseer", max_cache_memory=budget)
    try:
        with pytest.raises(MemoryBudgetError) as info:
            pipe(["3"], num_inference_steps=4, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                 output_type="pt")
        assert handle.engine.cache_bytes() == 0 and handle.memory().peak_bytes == 0  # nothing was cached
    finally:
        handle.remove()
    text = str(info.value)
    assert "1 branch(es)" in text and "max_cache_memory" in text
    # order 0 halves the Taylor tables (2 -> 1 tensor per output): exactly at the budget, so it fits
    assert "Options that fit: order=0" in text
    # and the cache storages (on a CPU no offload: host memory is the device's), each with its bytes
    assert "cache_dtype='bfloat16': " in text and "cache_dtype='float8_e4m3fn' cache_scale='tensor': " in text
    assert "cache_device" not in text
    _, lower = _run(pipe, method="taylorseer", order=0)
    assert lower.peak_bytes <= budget


def test_within_budget_runs_and_the_hook_goes_with_remove(pipe):
    _, full = _run(pipe, method="magcache")
    handle, report = _run(pipe, method="magcache", max_cache_memory=full.peak_bytes)
    assert report.peak_bytes == full.peak_bytes
    assert not pipe.transformer._forward_pre_hooks  # removed with the handle


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512 MB", 512 * 10**6), (1e6, 10**6),
                                           ("1.5KiB", 1536)])
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["4 gigs", "", "-1GiB", True, "nanGiB"])
def test_bad_sizes_name_the_field_and_the_form(text):
    with pytest.raises(ValueError, match="max_cache_memory"):
        parse_bytes(text)


def _generate(pipe):
    return pipe(["3"], num_inference_steps=4, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                output_type="pt").images


def test_fit_auto_switches_to_the_most_accurate_storage_that_fits(pipe):
    """On a CPU, offloading saves nothing (host memory is the device's): bfloat16 comes first, and the run is the
    explicit cache_dtype='bfloat16' run bit for bit."""
    _, full = _run(pipe, method="taylorseer")
    _, half = _run(pipe, method="taylorseer", cache_dtype="bfloat16")
    handle = dcache.apply(pipe, "taylorseer", max_cache_memory=half.peak_bytes, fit="auto")
    try:
        with pytest.warns(CacheFitChoice, match="cache_dtype='bfloat16'"):
            auto = _generate(pipe)
        assert handle.fit_choice.startswith("cache_dtype='bfloat16'")
        assert handle.memory().peak_bytes == half.peak_bytes < full.peak_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheFitChoice)
            _generate(pipe)  # the next generation already fits: no second switch
    finally:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explicit_handle = dcache.apply(pipe, "taylorseer", cache_dtype="bfloat16")
    try:
        explicit = _generate(pipe)
    finally:
        explicit_handle.remove()
    assert torch.equal(auto, explicit)


def test_fit_auto_goes_down_to_float8_per_token(pipe):
    _, fp8 = _run(pipe, method="magcache", cache_dtype="float8_e4m3fn", cache_scale="token")
    handle = dcache.apply(pipe, "magcache", max_cache_memory=fp8.peak_bytes, fit="auto")
    try:
        with pytest.warns(CacheFitChoice, match="cache_scale='token'"):
            _generate(pipe)
        assert handle.memory().peak_bytes == fp8.peak_bytes
    finally:
        handle.remove()


def test_on_an_accelerator_offloading_is_the_first_choice(pipe, monkeypatch):
    """The budget counts device memory: an offloaded cache holds none there, so it fits any budget and is exact."""
    monkeypatch.setattr(BudgetCheck, "_on_accelerator", lambda self: True)
    handle = dcache.apply(pipe, "magcache", max_cache_memory=64, fit="auto")
    try:
        with pytest.warns(CacheFitChoice, match="cache_device='cpu'.* 0 B on the device"):
            _generate(pipe)
        assert handle.memory().cache_device == "cpu" and handle.memory().device_bytes == 0
    finally:
        handle.remove()


@pytest.mark.parametrize("kw,match", [({"fit": "auto"}, "give the budget too"),
                                      ({"fit": "best", "max_cache_memory": "1GiB"}, "fit='best' is not a fit mode")])
def test_fit_needs_a_budget_and_a_known_mode(pipe, kw, match):
    with pytest.raises(ValueError, match=match):
        dcache.apply(pipe, "taylorseer", **kw)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None
