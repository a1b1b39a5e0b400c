"""An interrupted generation never leaks into the next one.

A generation is interrupted at every transformer call index (KeyboardInterrupt, or an error, raised inside the
call), in pipeline mode (`dcache.apply(pipe, ...)`: the scheduler marks generations) and transformer-only mode
(`dcache.apply(pipe.transformer, ..., num_steps=N)`: the timestep marks them), with and without diffusers'
`cache_context`; the next full generation's output, stats and plan must equal those of a fresh handle on the same
pipeline, for a dynamic method (FBCache) and a replayed plan.
"""

from __future__ import annotations

import pytest
import torch
from compat_kit import dcache_hook_count, make_pipeline, seeded

import dcache

STEPS = 3
CALLS = 2 * STEPS  # split CFG: cond + uncond per step


class Interrupt:
    """A forward pre-hook on the first block that raises at the `at`-th transformer call (0-based): the error
    surfaces inside the transformer call, as Ctrl-C or an out-of-memory error would."""

    def __init__(self, pipe, at: int, error: type[BaseException]):
        self.at, self.error, self.seen = at, error, 0
        self.handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.seen += 1
        if self.seen - 1 == self.at:
            raise self.error(f"interrupted at call {self.at}")


def generate(pipe, context: bool) -> torch.Tensor:
    return pipe([1, 7], num_inference_steps=STEPS, guidance_scale=2.0, cache_context=context, generator=seeded(0))


def apply(pipe, mode: str, method):
    if mode == "pipeline":
        return dcache.apply(pipe, method) if not isinstance(method, tuple) else dcache.apply(pipe, method[0],
                                                                                             **method[1])
    target = pipe.transformer
    if isinstance(method, tuple):
        return dcache.apply(target, method[0], num_steps=STEPS, **method[1])
    return dcache.apply(target, method, num_steps=STEPS)


FBCACHE = ("fbcache", {"threshold": 0.5})


def summary(handle) -> dict:
    stats = handle.stats().to_dict()
    stats.pop("generations")  # the interrupted run counts as a generation started
    plan = handle.plan().to_dict()
    plan["provenance"].pop("created")  # a clock reading
    return {"stats": stats, "plan": plan}


@pytest.fixture(scope="module")
def pipe():
    return make_pipeline()


@pytest.fixture(scope="module")
def references(pipe):
    """(mode, context, method name) -> output, stats and plan of a fresh handle's first generation."""
    out = {}
    for mode in ("pipeline", "transformer"):
        for context in (True, False):
            with apply(pipe, mode, FBCACHE) as h:
                image = generate(pipe, context)
                out[mode, context, "fbcache"] = (image, summary(h))
                plan = h.plan()
            with apply(pipe, mode, plan) as h:
                out[mode, context, "plan"] = (generate(pipe, context), summary(h), plan)
    return out


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("context", [True, False], ids=["cache_context", "call_order"])
@pytest.mark.parametrize("mode", ["pipeline", "transformer"])
@pytest.mark.parametrize("method", ["fbcache", "plan"])
def test_an_interrupted_generation_does_not_leak_into_the_next(pipe, references, mode, context, method, error):
    ref = references[mode, context, method]
    spec = FBCACHE if method == "fbcache" else ref[2]
    for at in range(CALLS):
        handle = apply(pipe, mode, spec)
        try:
            interrupt = Interrupt(pipe, at, error)
            with pytest.raises(error, match=f"interrupted at call {at}"):
                generate(pipe, context)
            interrupt.handle.remove()
            image = generate(pipe, context)
            assert torch.equal(image, ref[0]), f"output differs after an interrupt at call {at}"
            assert summary(handle) == ref[1], f"stats / plan differ after an interrupt at call {at}"
        finally:
            handle.remove()
        assert dcache_hook_count(pipe.transformer) == 0
