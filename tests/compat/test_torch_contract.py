"""What dcache assumes of torch beyond its public API, checked against the installed torch.

One test per entry of dcache/compat/torch.py (eval_frame_callback is checked in test_diffusers_contract.py), named
after the assumption: when an upgrade breaks one, it fails here with a message that names it.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from dcache.compat import torch as compat


def test_pytrees_flatten_and_rebuild_nested_outputs():
    x, y = torch.ones(2), torch.zeros(3)
    tree = (Transformer2DModelOutput(sample=x), {"b": [y, 1.5], "a": None})
    leaves, spec = compat.tree_flatten(tree)
    assert any(t is x for t in leaves) and any(t is y for t in leaves), \
        "tree_flatten does not reach tensors in diffusers outputs, dicts and lists (dcache.compat.torch.tree_flatten)"
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt[0], Transformer2DModelOutput) and rebuilt[0].sample is x and rebuilt[1]["b"][0] is y, \
        "tree_unflatten does not rebuild what tree_flatten took apart (dcache.compat.torch.tree_unflatten)"
    doubled = compat.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, tree)
    assert torch.equal(doubled[0].sample, x * 2) and doubled[1]["b"][1] == 1.5, \
        "tree_map does not map the leaves in place in the tree (dcache.compat.torch.tree_map)"


def test_fake_tensor_mode_runs_a_model_on_shapes_alone():
    layer = nn.Linear(4, 8)
    with compat.fake_tensor_mode() as fake:
        x = fake.from_tensor(torch.randn(3, 4))
        out = layer(x)  # real parameters meet a fake input: allow_non_fake_inputs
    assert out.shape == (3, 8) and out.dtype == torch.float32, \
        "FakeTensorMode(allow_non_fake_inputs=True) no longer runs a module on fakes (dcache.compat.torch)"
    assert type(out).__name__ == "FakeTensor", "ops under fake_tensor_mode return real tensors (dcache.compat.torch)"


def test_tensor_version_grows_on_in_place_writes_and_is_shared_by_views():
    t = torch.zeros(4)
    view = t[1:3]
    before = compat.tensor_version(t)
    view.add_(1)
    assert compat.tensor_version(t) > before, \
        "a write through a view does not bump its base's Tensor._version (dcache.compat.torch.tensor_version)"
    assert compat.tensor_version(view) == compat.tensor_version(t), \
        "a view and its base do not share one version counter (dcache.compat.torch.tensor_version)"
    same = compat.tensor_version(t)
    _ = t + 1
    assert compat.tensor_version(t) == same, "an out-of-place op bumps Tensor._version (dcache.compat.torch)"


def test_view_base_is_the_viewed_tensor():
    t = torch.zeros(4, 4)
    assert compat.view_base(t) is None, "Tensor._base of a tensor owning its storage is not None (dcache.compat.torch)"
    assert compat.view_base(t[0]) is t and compat.view_base(t[0][1:]) is t, \
        "Tensor._base of a view (of a view) is not the tensor owning the storage (dcache.compat.torch.view_base)"


def test_foreach_lerp_moves_each_target_toward_its_end():
    targets, ends = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.full((2,), 3.0)]
    compat.foreach_lerp_(targets, ends, 0.25)
    assert torch.allclose(targets[0], torch.full((3,), 0.25)) and torch.allclose(targets[1], torch.full((2,), 1.5)), \
        "torch._foreach_lerp_ no longer computes t += w (e - t) in place (dcache.compat.torch.foreach_lerp_)"


def test_a_dispatch_mode_sees_each_op_and_nests_under_a_later_mode():
    class Seen(compat.DispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    outer, inner = Seen(), Seen()
    with outer, inner:
        torch.ones(2, device="meta") * 3
    assert "aten.mul.Tensor" in inner.ops, "a TorchDispatchMode no longer sees aten ops (dcache.compat.torch)"
    assert "aten.mul.Tensor" in outer.ops, \
        "an op run by a later-entered mode no longer reaches the earlier one (dcache.compat.torch.DispatchMode)"


def test_op_is_functional_tells_writes_and_views_from_new_tensors():
    aten = torch.ops.aten
    assert compat.op_is_functional(aten.mul.Tensor) and compat.op_is_functional(aten.mm.default)
    assert not compat.op_is_functional(aten.add_.Tensor), "an in-place op reads as functional (op_is_functional)"
    assert not compat.op_is_functional(aten.view.default), "a view reads as functional (op_is_functional)"
    assert not compat.op_is_functional(aten.mul.out), "an out= overload reads as functional (op_is_functional)"
