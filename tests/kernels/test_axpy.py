"""axpy: out = y + alpha * x (x on the tail tokens when shorter), on both backends."""

import pytest
import torch

from dcache.kernels import axpy, axpy_reference


def tail_tokens(L: int) -> int:
    return L if L == 1 else L - (L // 5 + 1)


def test_matches_fp32_reference(backend, shape, dtype, device, gen, rand, design_bound):
    B, L, D = shape
    y = rand(shape, dtype, device, gen)
    x = rand((B, tail_tokens(L), D), dtype, device, gen)
    alpha = -0.3719
    got = axpy(y, x, alpha)
    assert got.dtype == dtype
    design_bound(got, axpy_reference(y, x, alpha), axpy_reference(y.float(), x.float(), alpha))


@pytest.mark.parametrize("alpha_kind", ["tensor-fp32", "tensor-bf16", "cpu-scalar-tensor", "int"])
def test_alpha_forms(backend, dtype, alpha_kind, device, gen, rand, design_bound):
    y = rand((3, 333, 64), dtype, device, gen)
    x = rand((3, 301, 64), dtype, device, gen)
    alpha = {
        "tensor-fp32": torch.tensor(1.7, device=device),                       # read on the device
        "tensor-bf16": torch.tensor([0.625], dtype=torch.bfloat16, device=device),  # one-element, any float
        "cpu-scalar-tensor": torch.tensor(-2.25),                              # a host scalar
        "int": 3,
    }[alpha_kind]
    got = axpy(y, x, alpha)
    alpha32 = alpha.float() if isinstance(alpha, torch.Tensor) else alpha
    design_bound(got, axpy_reference(y, x, alpha), axpy_reference(y.float(), x.float(), alpha32))


def test_in_place_touches_only_the_tail(backend, small_shape, dtype, device, gen, rand, design_bound):
    B, L, D = small_shape
    y0 = rand(small_shape, dtype, device, gen)
    x = rand((B, tail_tokens(L), D), dtype, device, gen)
    y = y0.clone()
    got = axpy(y, x, 0.5, out=y)
    assert got is y
    design_bound(got, axpy_reference(y0, x, 0.5), axpy_reference(y0.float(), x.float(), 0.5))
    assert torch.equal(y[:, : L - x.shape[1]], y0[:, : L - x.shape[1]])


def test_alpha_zero_returns_y_exactly(backend, device, gen, rand):
    y = rand((2, 17, 33), torch.bfloat16, device, gen)
    x = rand((2, 9, 33), torch.bfloat16, device, gen)
    assert torch.equal(axpy(y, x, 0.0), y)


@pytest.mark.parametrize(
    "alpha,message",
    [
        ("0.5", "python number"),
        (torch.ones(2), "one-element"),
        (torch.tensor(1), "floating"),       # an integer tensor
        (True, "python number"),
    ],
)
def test_bad_alpha_raises_value_error(backend, alpha, message, device):
    y = torch.zeros(1, 4, 8, device=device)
    with pytest.raises(ValueError, match=message):
        axpy(y, y, alpha)


def test_bad_shapes_raise_value_error(backend, device):
    y = torch.zeros(2, 4, 8, device=device)
    with pytest.raises(ValueError, match="L_x <= L"):
        axpy(y, torch.zeros(2, 5, 8, device=device), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        axpy(y.double(), y.double(), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        axpy(y, y, 1.0, out=torch.zeros_like(y, dtype=torch.bfloat16))
