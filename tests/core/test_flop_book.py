"""The FLOP book lives on the model across apply / remove: a re-applied cache does not pay the counting pass again,
and its compute ratio is the same as the first handle's; another layout (other module units) starts a new book, kept
beside the first: going back to the first layout finds its counts."""

from __future__ import annotations

import pytest
import torch

import dcache
from dcache import Action, Schedule
from dcache.pipelines.bundled import load_tiny_pipeline


class EveryOther(Schedule):
    name = "every-other"

    def decide(self, ctx):
        return Action.COMPUTE if ctx.step % 2 == 0 else Action.REUSE


def generate(pipe):
    return pipe(labels=[1, 2], num_inference_steps=6, generator=torch.Generator().manual_seed(0),
                output_type="pt").images


def test_reapplying_reuses_the_counts_and_gives_the_same_ratio():
    pipe = load_tiny_pipeline()
    with dcache.apply(pipe, EveryOther()) as first:
        generate(pipe)
        book, ratio = first.engine.flops, first.stats().compute_ratio
    counted = dict(book.costs)
    with dcache.apply(pipe, EveryOther()) as again:
        assert again.engine.flops is book
        generate(pipe)
        assert again.stats().compute_ratio == ratio
    assert book.costs == counted  # nothing was counted twice
    with dcache.apply(pipe, "taylorseer") as module_level:  # module units: another layout, another book
        assert module_level.engine.flops is not book
        generate(pipe)
    with dcache.apply(pipe, EveryOther()) as back:  # the first layout again: its book was kept
        assert back.engine.flops is book
        generate(pipe)
    assert book.costs == counted
    assert 0.0 < ratio < 1.0 and len(counted) == len(first.engine.blocks)


def test_a_forward_that_cannot_run_on_fake_tensors_warns_once_and_is_not_retried():
    """`.item()` reads a value, which fake tensors do not have: the count fails, is reported once with the reason,
    and the unit is not counted again on later calls with the same shape."""
    import warnings

    from dcache.runtime.flops import FlopBook, FlopsUncounted

    calls = []

    def forward(x):
        calls.append(1)
        return x * x.sum().item()

    book = FlopBook()
    x = torch.ones(2, 3)
    with pytest.warns(FlopsUncounted, match=r"unit 'b0' \(input shape \(2, 3\)\).*count_flops=False"):
        book.count("b0", (2, 3), forward, (x,), {})
    assert not book.known("b0", (2, 3)) and book.cost("b0", (2, 3)) is None and "b0" in str(book.uncounted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlopsUncounted)
        book.count("b0", (2, 3), forward, (x,), {})  # not tried again: no second warning
    assert len(calls) == 1
    book.count("b1", (2, 3), lambda t: t @ t.T, (x,), {})  # a countable forward is counted as before
    assert book.cost("b1", (2, 3)) == 2 * 2 * 2 * 3
