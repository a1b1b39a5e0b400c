"""A pipeline called under `torch.inference_mode()` (how serving stacks call it) gives the bit-identical images and
decisions of the same call under `torch.no_grad()`, with the step-invariant memo on (its default)."""

from __future__ import annotations

import pytest
import torch
from compat_kit import make_pipeline, seeded

import dcache

METHODS = [("fbcache", {}), ("magcache", dict(ratios=[1.0] * 6, threshold=0.2)), ("seacache-cadence", {}),
           ("taylorseer", {}), ("magcache", dict(ratios=[1.0] * 6, threshold=0.2, scope="call"))]


@pytest.mark.parametrize("method,kw", METHODS, ids=[f"{m}-{kw.get('scope', 'blocks')}" for m, kw in METHODS])
def test_inference_mode_equals_no_grad_with_memo(method, kw):
    pipe = make_pipeline()
    outputs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with dcache.apply(pipe, method, **kw) as handle, mode():
            out = pipe(labels=[1, 2], num_inference_steps=6, guidance_scale=2.0, generator=seeded(0))
            outputs.append((out.clone(), handle.plan().actions, sum(m.hits for m in handle.engine.memos)))
    (ref, plan, hits), (out, plan_im, hits_im) = outputs
    assert plan_im == plan
    assert torch.equal(out, ref)
    assert hits > 0 and hits_im == 0  # the memo works under no_grad and stands aside under inference_mode
