"""A module a block calls more than once per forward (Adapter.shared: CogView4 / EasyAnimate run one `ff` on the image
tokens, then on the text tokens) gets one cache per call: a reused step returns, call by call, what that same call
computed at the last computed step (not the image output twice, which would not even have the text's shape)."""

from __future__ import annotations

import pytest
import torch
import zoo

import dcache
from dcache import Granularity, Schedule


class ReuseFF(Schedule):
    """MODULE granularity: step 0 computes everything, later steps reuse every `ff` unit."""

    granularity = Granularity.MODULE

    def __init__(self, units):
        self.ff = [i for i, u in enumerate(units) if u.endswith(".ff")]
        self.units = units
        self.name = "reuse-ff"

    def decide(self, ctx):
        if ctx.step == 0:
            return "C" * len(self.units)
        return "".join("R" if i in self.ff else "C" for i in range(len(self.units)))


@pytest.mark.parametrize("name", ["cogview4"])  # the zoo's EasyAnimate has a txt_ff: its ff runs once per block
def test_each_call_of_a_shared_module_reuses_its_own_output(name):
    entry = zoo.ZOO[name]
    model = entry.make_model()
    adapter = dcache.adapter_for(model)
    assert "ff" in adapter.shared
    block = adapter.blocks(model)[0][1]
    seen: list[torch.Tensor] = []
    hook = block.ff.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        probe = dcache.apply(model, "taylorseer", num_steps=1)  # MODULE granularity: read the unit names
        names = list(probe.engine.units)
        probe.remove()
        with dcache.apply(model, ReuseFF(names), num_steps=2) as handle:
            for step in range(2):
                model(**entry.make_inputs(step), return_dict=False)
    hook.remove()
    (img0, txt0), (img1, txt1) = seen[:2], seen[2:4]
    assert img0.shape != txt0.shape  # image and text tokens: mixing the two caches could not go unnoticed
    assert len(seen) == 4 and torch.equal(img1, img0) and torch.equal(txt1, txt0)
    stats = handle.stats()
    assert stats.units_reused == len([u for u in names if u.endswith(".ff")])
    assert 0.0 < stats.compute_ratio < 1.0
