"""residual_capture: residual = out - inp plus the five statistics, on both backends.

The residual follows the DESIGN bound; the statistics are compared with a relative tolerance to a
float64 formula written out here (independent of both implementations).
"""

import pytest
import torch

from dcache.kernels import residual_capture, residual_capture_reference

EPS = 1e-12


def stats64(out, inp, prev):
    """[sum|r - p|, sum|p|, sum r^2, sum p^2, mean_tok ‖r_tok‖ / max(‖p_tok‖, eps)] in float64."""
    r = out.double() - inp.double()
    sq_r = r.square().sum(-1)
    if prev is None:
        return torch.tensor([0.0, 0.0, sq_r.sum().item(), 0.0, 0.0], dtype=torch.float64)
    p = prev.double()
    sq_p = p.square().sum(-1)
    ratio = sq_r.sqrt() / sq_p.sqrt().clamp_min(EPS)
    return torch.stack([(r - p).abs().sum(), p.abs().sum(), sq_r.sum(), sq_p.sum(), ratio.mean()]).cpu()


def make_inputs(shape, dtype, device, gen, rand):
    """inp, out = inp + r, and a previous residual close to r (the regime where caches reuse)."""
    inp = rand(shape, dtype, device, gen)
    r = rand(shape, torch.float32, device, gen, scale=0.5)
    out = (inp.float() + r).to(dtype)
    prev = (r + rand(shape, torch.float32, device, gen, scale=0.05)).to(dtype)
    return out, inp, prev


def test_matches_fp32_reference(backend, shape, dtype, device, gen, rand, design_bound, rel_close):
    out, inp, prev = make_inputs(shape, dtype, device, gen, rand)
    residual, stats = residual_capture(out, inp, prev)
    assert residual.dtype == dtype and stats.dtype == torch.float32 and stats.shape == (5,)
    assert stats.device == out.device
    design_bound(
        residual,
        residual_capture_reference(out, inp, prev)[0],
        residual_capture_reference(out.float(), inp.float(), prev.float())[0],
    )
    rel_close(stats, stats64(out, inp, prev))


def test_without_prev_only_sum_of_squares(backend, small_shape, dtype, device, gen, rand, rel_close):
    out, inp, _ = make_inputs(small_shape, dtype, device, gen, rand)
    residual, stats = residual_capture(out, inp)
    rel_close(stats, stats64(out, inp, None))
    assert stats[[0, 1, 3, 4]].eq(0).all()


def test_buffer_aliasing_prev_uses_old_values(backend, small_shape, dtype, device, gen, rand, design_bound, rel_close):
    out, inp, prev = make_inputs(small_shape, dtype, device, gen, rand)
    cache = prev.clone()
    residual, stats = residual_capture(out, inp, prev=cache, buffer=cache)  # update the cache in place
    assert residual is cache
    rel_close(stats, stats64(out, inp, prev))  # against the OLD prev
    design_bound(
        cache,
        residual_capture_reference(out, inp)[0],
        residual_capture_reference(out.float(), inp.float())[0],
    )


def test_fp32_buffer_for_bf16_states(backend, device, gen, rand, design_bound):
    out, inp, prev = make_inputs((2, 77, 130), torch.bfloat16, device, gen, rand)
    buffer = torch.empty(out.shape, dtype=torch.float32, device=device)
    residual, _ = residual_capture(out, inp, prev, buffer=buffer)
    assert residual is buffer
    exact = out.float() - inp.float()  # the difference of two bf16 values is exact in fp32 here
    design_bound(residual, exact, exact, atol=0.0)


def test_stats_are_deterministic(backend, device, gen, rand):
    out, inp, prev = make_inputs((3, 333, 64), torch.bfloat16, device, gen, rand)
    first = residual_capture(out, inp, prev)[1]
    assert torch.equal(first, residual_capture(out, inp, prev)[1])


def test_zero_prev_rows_give_finite_ratio(backend, device):
    out = torch.zeros(1, 3, 8, device=device)
    out[0, 1] = 1.0                           # token 1 changed; tokens 0 and 2 did not
    prev = torch.zeros(1, 3, 8, device=device)
    _, stats = residual_capture(out, torch.zeros_like(out), prev)
    assert torch.isfinite(stats).all()
    assert stats[4] > 0                       # ‖r‖ / eps for token 1, 0 / eps = 0 for the others


@pytest.mark.parametrize("case,message", [
    ("inp-shape", "must match"),
    ("prev-shape", "previous residual"),
    ("buffer-noncontig", "contiguous"),
    ("buffer-shape", "shape"),
    ("zero-dim", "0-dim"),
    ("float64", "dtype"),
])
def test_bad_inputs_raise_value_error(backend, case, message, device):
    out = torch.zeros(2, 6, 8, device=device)
    inp, prev, buffer = torch.zeros_like(out), None, None
    if case == "inp-shape":
        inp = torch.zeros(2, 5, 8, device=device)
    elif case == "prev-shape":
        prev = torch.zeros(2, 6, 7, device=device)
    elif case == "buffer-noncontig":
        buffer = torch.zeros(2, 8, 6, device=device).transpose(1, 2)
    elif case == "buffer-shape":
        buffer = torch.zeros(2, 6, 9, device=device)
    elif case == "zero-dim":
        out, inp = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
    else:
        out, inp = out.double(), inp.double()
    with pytest.raises(ValueError, match=message):
        residual_capture(out, inp, prev, buffer)


@pytest.mark.parametrize("with_buffer", [False, True])
def test_store_only_path_equals_the_full_capture(backend, small_shape, dtype, device, gen, rand, with_buffer):
    """stats=False (the engine's cache write) stores the same residual as the fused capture, bit for bit."""
    out, inp, _ = make_inputs(small_shape, dtype, device, gen, rand)
    expected, _ = residual_capture(out, inp)
    buffer = torch.full_like(out, 7.0) if with_buffer else None
    residual, stats = residual_capture(out, inp, buffer=buffer, stats=False)
    assert stats is None
    assert residual.dtype == dtype and residual.shape == out.shape
    if with_buffer:
        assert residual is buffer
    assert torch.equal(residual, expected)
