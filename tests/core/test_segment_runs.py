"""Stack segments of consecutive block lists merge into one run when the transformer passes one list's output
straight to the next (the bundled Flux model: double-stream -> single-stream blocks). One residual per stream is
then cached and applied instead of one per list; the result must be what per-list segments give (REUSE and Taylor
FORECAST are linear in the residuals), and a schedule with its own forecaster keeps its per-list units."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 12


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe):
    return pipe(labels=[1, 4], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(3),
                output_type="pt").images


def taylor(hist, step):  # the engine's own Taylor read, as a schedule-supplied forecaster
    return hist.read(True, step)


@pytest.mark.parametrize("method, config", [("fbcache", {"threshold": 0.3, "warmup_steps": 0}),
                                            ("magcache", {"threshold": 0.1, "order": 1, "max_skip_steps": 4})])
def test_merged_run_equals_per_list_segments(pipe, method, config):
    config = dict(config, decisions="batch")  # the branch states read below are the batch's (dcache.runtime.lanes)
    with dcache.apply(pipe, method, **config) as merged:
        images = generate(pipe)
        engine = merged.engine
        assert len(engine.segment_lists) == 2  # double- and single-stream lists both have middle blocks
        for branch in engine.branches.values():
            assert set(branch.units) == {("seg", engine.segment_lists[0])}  # one run, two streams
            assert branch.chained == {engine.segment_lists[1]}
        merged_stats = merged.stats()
    assert merged_stats.units_computed < merged_stats.calls  # some calls came from the cache
    with dcache.apply(pipe, method, **config) as per_list:
        object.__setattr__(per_list.engine.schedule, "forecaster", taylor)  # per-list units, same arithmetic
        reference = generate(pipe)
        for branch in per_list.engine.branches.values():
            assert set(branch.units) == {("seg", li) for li in per_list.engine.segment_lists}
            assert not branch.chained
        assert per_list.stats().per_step == merged_stats.per_step  # the same decisions, call by call
    # (x + r0) + r1 vs x + (r0 + r1): the same decisions, float rounding apart
    assert (images - reference).abs().max() < 1e-4


def test_runs_split_where_the_transformer_changes_the_stream_between_lists(pipe):
    """A transformer that touches the hidden stream between the lists (here: a forward pre-hook on the first
    single-stream block that returns a copy) must get one cached residual per list, and stay correct."""
    first_single = pipe.transformer.single_transformer_blocks[0]

    def copy_inputs(module, args, kwargs):
        kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"].clone())
        return args, kwargs

    handle_pre = first_single.register_forward_pre_hook(copy_inputs, with_kwargs=True)
    try:
        with dcache.apply(pipe, "fbcache", threshold=0.3, warmup_steps=0) as h:
            generate(pipe)
            for branch in h.engine.branches.values():
                assert set(branch.units) == {("seg", li) for li in h.engine.segment_lists}
                assert not branch.chained
            assert h.stats().units_reused > 0
    finally:
        handle_pre.remove()
