"""The FLOP book lives on the model across apply / remove: a re-applied cache does not pay the counting pass again,
and its compute ratio is the same as the first handle's; another layout (other module units) starts a new book."""

from __future__ import annotations

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
    assert 0.0 < ratio < 1.0 and len(counted) == len(first.engine.blocks)
