"""What dcache assumes of accelerate beyond its public API, checked against the installed accelerate (skipped
without it).

One test per entry of dcache/compat/accelerate.py, named after the assumption: when an upgrade breaks one, it fails
here with a message that names it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dcache.compat import accelerate as compat

hooks = pytest.importorskip("accelerate.hooks")


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class AddOne(hooks.ModelHook):
    """An accelerate hook that changes the output, so that the test sees whether it still runs."""

    def post_forward(self, module, output):
        return output + 1


def test_an_accelerate_hook_is_seen_and_keeps_the_forward_it_wrapped():
    module = Doubler()
    own = module.forward
    assert not compat.has_offload_hook(module) and compat.wrapped_forward(module) is None
    hooks.add_hook_to_module(module, AddOne())
    assert compat.has_offload_hook(module), \
        "add_hook_to_module no longer sets _hf_hook and _old_forward (dcache.compat.accelerate.has_offload_hook)"
    assert compat.wrapped_forward(module) == own, \
        "_old_forward is not the forward accelerate wrapped (dcache.compat.accelerate.wrapped_forward)"
    hooks.remove_hook_from_module(module)
    assert not compat.has_offload_hook(module), \
        "remove_hook_from_module leaves _hf_hook or _old_forward behind (dcache.compat.accelerate.has_offload_hook)"


def test_a_forward_slid_under_the_hook_runs_and_is_restored_on_removal():
    module = Doubler()
    hooks.add_hook_to_module(module, AddOne())
    inner = compat.wrapped_forward(module)
    under = lambda x: inner(x) * 10  # noqa: E731  (as dcache's transformer_call: a forward under accelerate's)
    compat.set_wrapped_forward(module, under)
    assert module(torch.ones(1)).item() == 21, \
        "accelerate's wrapper does not call _old_forward at each call (dcache.compat.accelerate.set_wrapped_forward)"
    hooks.remove_hook_from_module(module)
    assert module.forward is under, \
        "remove_hook_from_module does not restore _old_forward as the forward (dcache.compat.accelerate)"
