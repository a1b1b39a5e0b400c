"""max_cache_memory: refused at the first call with the numbers, before anything is cached; options that fit."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcache
from dcache.budget import MemoryBudgetError
from dcache.memory import parse_bytes
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
        assert handle.engine._cache_bytes() == 0 and handle.memory().peak_bytes == 0  # nothing was cached
    finally:
        handle.remove()
    text = str(info.value)
    assert "1 branch(es)" in text and "max_cache_memory" in text
    # order 0 halves the Taylor tables (2 -> 1 tensor per output): exactly at the budget, so it fits
    assert "Options that fit: order=0" in text
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
