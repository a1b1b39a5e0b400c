"""dcache.memory.meta_ops.MetaOpMemo: a meta forward with remembered op outputs gives exactly what torch's own meta
kernels give (output shapes, strides, dtypes, FLOPs), on every family of the zoo; ops that write to or alias their
inputs, and tensors off the meta device, are left to torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from zoo import READS_TENSOR_VALUES, ZOO

from dcache.compat.torch import tree_map
from dcache.memory.estimate import meta_model, to_meta
from dcache.memory.meta_ops import MetaOpMemo


def _metadata(result) -> list[tuple]:
    leaves = []
    tree_map(lambda t: leaves.append((tuple(t.shape), t.stride(), t.dtype, t.device.type))
             if isinstance(t, torch.Tensor) else t, result)
    return leaves


def _forward(model, inputs, memo: MetaOpMemo | None):
    counter = FlopCounterMode(display=False)
    with torch.no_grad():
        if memo is None:
            with counter:
                out = model(**inputs)
        else:
            with memo, counter:  # the counter is pushed last: it sees every op before the memo answers
                out = model(**inputs)
    return _metadata(out), counter.get_total_flops()


@pytest.mark.parametrize("family", sorted(set(ZOO) - READS_TENSOR_VALUES))  # the rest has no meta forward
def test_remembered_outputs_equal_torchs_meta_kernels(family):
    entry = ZOO[family]
    model = meta_model(entry.make_model())
    inputs = entry.make_inputs(step=1, batch=2)
    meta_inputs = to_meta(inputs)
    reference = _forward(model, meta_inputs, None)
    first = MetaOpMemo.for_model(model)
    assert _forward(model, meta_inputs, first) == reference
    second = MetaOpMemo.for_model(model)  # the model keeps what the first pass learned
    assert _forward(model, meta_inputs, second) == reference
    assert second.hits > 0 and second.misses == 0
    assert reference[0]  # the forward returned tensors


def test_ops_that_write_or_alias_run_and_off_meta_tensors_keep_their_values():
    x = torch.empty(4, 6, device="meta")
    memo = MetaOpMemo()
    with memo:
        twice = [x * 2, x * 2]
        written = x.add_(1)
        view = x.view(6, 4)
        real = torch.arange(6.0) * 2
    assert written is x  # in-place: the argument itself, not a remembered new tensor
    assert view._base is x  # a view still aliases its base
    assert twice[0] is not twice[1] and twice[1].shape == (4, 6)
    assert memo.hits == 1  # the second x * 2 only
    assert torch.equal(real, torch.tensor([0.0, 2.0, 4.0, 6.0, 8.0, 10.0]))  # a CPU op ran on its values
