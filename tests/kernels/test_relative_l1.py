"""rel_l1_stats / rel_l1: [sum|a - b|, sum|b|] (total or per sample), on both backends.

Compared with a relative tolerance to a float64 formula written out here.
"""

import pytest
import torch

from dcache.kernels import rel_l1, rel_l1_stats


def sums64(a, b, per_sample):
    rows = a.shape[0] if per_sample else 1
    a64, b64 = a.double().reshape(rows, -1).cpu(), b.double().reshape(rows, -1).cpu()
    sums = torch.stack([(a64 - b64).abs().sum(1), b64.abs().sum(1)], dim=1)
    return sums if per_sample else sums[0]


def close_pair(shape, dtype, device, gen, rand):
    """b, and a = b plus a small change: the regime where the relative L1 decides to reuse."""
    b = rand(shape, dtype, device, gen)
    a = (b.float() + rand(shape, torch.float32, device, gen, scale=0.05)).to(dtype)
    return a, b


@pytest.mark.parametrize("per_sample", [False, True], ids=["total", "per-sample"])
def test_matches_float64(backend, shape, dtype, per_sample, device, gen, rand, rel_close):
    a, b = close_pair(shape, dtype, device, gen, rand)
    got = rel_l1_stats(a, b, per_sample=per_sample)
    assert got.dtype == torch.float32 and got.device == a.device
    assert got.shape == ((shape[0], 2) if per_sample else (2,))
    rel_close(got, sums64(a, b, per_sample))


def test_rel_l1_is_ratio_of_the_sums(backend, dtype, device, gen, rand, rel_close):
    a, b = close_pair((2, 77, 130), dtype, device, gen, rand)
    got = rel_l1(a, b)
    assert got.shape == () and got.dtype == torch.float32
    want = sums64(a, b, False)
    rel_close(got, want[0] / want[1])


def test_mixed_dtypes_and_leading_shapes(backend, device, gen, rand, rel_close):
    a = rand((3, 5, 7, 11), torch.bfloat16, device, gen)
    b = rand((3, 5, 7, 11), torch.float32, device, gen)
    rel_close(rel_l1_stats(a, b, per_sample=True), sums64(a, b, True))


def test_zero_inputs_give_zero_not_nan(backend, device):
    z = torch.zeros(2, 9, 5, device=device)
    assert rel_l1(z, z).item() == 0.0
    assert rel_l1_stats(z, z, per_sample=True).eq(0).all()


@pytest.mark.parametrize("case,message", [("shape", "must match"), ("dtype", "dtype"), ("zero-dim", "0-dim")])
def test_bad_inputs_raise_value_error(backend, case, message, device):
    a = torch.zeros(2, 4, 8, device=device)
    b, kwargs = torch.zeros_like(a), {}
    if case == "shape":
        b = torch.zeros(2, 4, 9, device=device)
    elif case == "dtype":
        a = a.to(torch.int32)
    else:
        a, b, kwargs = torch.tensor(1.0, device=device), torch.tensor(2.0, device=device), {"per_sample": True}
    with pytest.raises(ValueError, match=message):
        rel_l1_stats(a, b, **kwargs)
