"""residual_apply: out = hidden with the residual added to the tail tokens, on both backends."""

import pytest
import torch

from dcache.kernels import residual_apply, residual_apply_reference


def tail_tokens(L: int) -> int:
    """A residual shorter than the sequence (text tokens first), except for 1-token sequences."""
    return L if L == 1 else L - (L // 8 + 1)


def test_matches_fp32_reference(backend, shape, dtype, device, gen, rand, design_bound):
    check_against_reference(shape, dtype, "new", "tail", device, gen, rand, design_bound)


# (how `out` is passed, how many tokens the residual covers)
VARIANTS = [("out", "full"), ("inplace", "tail"), ("inplace", "full")]


@pytest.mark.parametrize("mode,coverage", VARIANTS, ids=[f"{m}-{c}" for m, c in VARIANTS])
def test_out_and_in_place(backend, small_shape, dtype, mode, coverage, device, gen, rand, design_bound):
    check_against_reference(small_shape, dtype, mode, coverage, device, gen, rand, design_bound)


def check_against_reference(shape, dtype, mode, coverage, device, gen, rand, design_bound):
    B, L, D = shape
    L_r = L if coverage == "full" else tail_tokens(L)
    hidden = rand(shape, dtype, device, gen)
    residual = rand((B, L_r, D), dtype, device, gen, scale=0.5)
    ref32 = residual_apply_reference(hidden.float(), residual.float())
    same = residual_apply_reference(hidden, residual)

    h = hidden.clone()
    if mode == "new":
        got = residual_apply(h, residual)
    elif mode == "out":
        buf = torch.full_like(h, float("nan"))
        got = residual_apply(h, residual, out=buf)
        assert got is buf
    else:
        got = residual_apply(h, residual, out=h)
        assert got is h
    assert got.dtype == dtype
    design_bound(got, same, ref32)
    # The head tokens are copied bit for bit; an out-of-place call leaves hidden as it was.
    assert torch.equal(got[:, : L - L_r], hidden[:, : L - L_r])
    if mode != "inplace":
        assert torch.equal(h, hidden)


def test_empty_residual_copies_hidden(backend, device, gen, rand):
    hidden = rand((2, 5, 33), torch.bfloat16, device, gen)
    got = residual_apply(hidden, hidden[:, :0])
    assert torch.equal(got, hidden) and got.data_ptr() != hidden.data_ptr()


def test_leading_dims_and_non_contiguous_inputs(backend, device, gen, rand, design_bound):
    # [B, heads, L, D] leading dims; hidden and residual are transposed views (made contiguous inside).
    hidden = rand((2, 3, 40, 24), torch.float16, device, gen).transpose(-1, -2).contiguous().transpose(-1, -2)
    residual = rand((2, 3, 24, 31), torch.float16, device, gen).transpose(-1, -2)
    assert not hidden.is_contiguous() and not residual.is_contiguous()
    got = residual_apply(hidden, residual)
    design_bound(got, residual_apply_reference(hidden, residual),
                 residual_apply_reference(hidden.float(), residual.float()))


def test_mixed_dtypes_keep_hidden_dtype(backend, device, gen, rand, design_bound):
    hidden = rand((1, 77, 130), torch.bfloat16, device, gen)
    residual = rand((1, 70, 130), torch.float32, device, gen)  # an fp32 cache applied to bf16 states
    got = residual_apply(hidden, residual)
    assert got.dtype == torch.bfloat16
    design_bound(got, residual_apply_reference(hidden, residual),
                 residual_apply_reference(hidden.float(), residual))


@pytest.mark.parametrize(
    "hidden_shape,residual_shape,out,message",
    [
        ((1, 4, 8), (1, 5, 8), None, "L_x <= L"),           # residual longer than the sequence
        ((1, 4, 8), (1, 4, 7), None, "L_x <= L"),           # hidden size differs
        ((2, 4, 8), (1, 4, 8), None, "leading dims"),       # batch differs
        ((1, 4, 8), (1, 4, 8), "int", "dtype"),             # integer tensors
        ((1, 4, 8), (1, 4, 8), "noncontig", "contiguous"),  # out cannot be written in place
        ((1, 4, 8), (1, 4, 8), "shape", "shape"),           # out of the wrong shape
        ((1, 4, 8), (1, 4, 8), "meta", "one device"),       # tensors on two devices
    ],
)
def test_bad_inputs_raise_value_error(backend, hidden_shape, residual_shape, out, message, device):
    hidden = torch.zeros(hidden_shape, device=device)
    residual = torch.zeros(residual_shape, device=device)
    kwargs = {}
    if out == "int":
        hidden = hidden.int()
    elif out == "noncontig":
        kwargs["out"] = torch.zeros(1, 8, 4, device=device).transpose(1, 2)
    elif out == "shape":
        kwargs["out"] = torch.zeros(1, 4, 9, device=device)
    elif out == "meta":
        residual = residual.to("meta")
    with pytest.raises(ValueError, match=message):
        residual_apply(hidden, residual, **kwargs)
