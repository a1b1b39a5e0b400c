"""rel_l1_stats: the two sums behind the relative L1 change used by FBCache, TeaCache and EasyCache.

    rel_l1_stats(a, b)                  -> float32 [2]    = [sum |a - b|, sum |b|]
    rel_l1_stats(a, b, per_sample=True) -> float32 [B, 2]   the same sums per index of dim 0
    rel_l1(a, b)                        -> float32 []     = sum |a - b| / max(sum |b|, eps)
                                                          (= mean|a - b| / mean|b|: the means share a count)
a and b: same shape, any float dtypes; math in fp32. Results stay on the device (no host sync):
compare them to a threshold on the device or read them once per call.
Returning the two sums (rather than the ratio) lets multi-GPU runs all-reduce them before dividing.
"""

from __future__ import annotations

import torch

from ._common import EPS, MAX_GRID_Y, check_float, check_int32_size, check_same_device, contiguous
from .backend import device_guard, tile_elems, triton_kernel, use_triton

BLOCK = 4096  # elements per program; each writes one partial pair
NUM_WARPS = 8

tl = sum_combine = None  # triton.language and tl.sum's combine function, bound by @triton_kernel


@triton_kernel
def _rel_l1_stats_kernel(triton):
    @triton.jit
    def rel_l1_stats_kernel(
        a_ptr, b_ptr,        # [S, n] each (S samples, n elements per sample)
        partial_ptr,         # [S, n_blocks, 2] float32 partial sums
        n, n_blocks,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        s = tl.program_id(1).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + s * n + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + s * n + offs, mask=mask, other=0.0).to(tl.float32)
        dst = partial_ptr + (s * n_blocks + pid) * 2
        tl.store(dst, tl.reduce(tl.abs(a - b), 0, sum_combine))
        tl.store(dst + 1, tl.reduce(tl.abs(b), 0, sum_combine))

    return rel_l1_stats_kernel


def _rel_l1_stats_triton(a: torch.Tensor, b: torch.Tensor, samples: int) -> torch.Tensor:
    """[samples, 2] sums over contiguous, non-empty a and b viewed as [samples, n]."""
    n = a.numel() // samples
    check_int32_size("rel_l1_stats", n, "one sample of `a`")
    if samples > MAX_GRID_Y:
        raise ValueError(
            f"rel_l1_stats: per_sample=True over {samples} samples exceeds the {MAX_GRID_Y} the launch grid "
            "allows; reshape to fewer samples or use the torch backend"
        )
    block = tile_elems(BLOCK)
    n_blocks = -(-n // block)
    partials = torch.empty(samples, n_blocks, 2, device=a.device, dtype=torch.float32)
    with device_guard(a):
        _rel_l1_stats_kernel()[(n_blocks, samples)](a, b, partials, n, n_blocks, BLOCK=block, num_warps=NUM_WARPS)
    return partials.sum(dim=1)  # fixed order: the same inputs give bit-identical sums


def rel_l1_stats_reference(a: torch.Tensor, b: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """Plain torch, fp32 math."""
    if not per_sample:  # the engine's per-call case: 5 ops, no reshapes (.float() is free on fp32)
        a32, b32 = a.float(), b.float()
        return torch.stack([(a32 - b32).abs().sum(), b32.abs().sum()])
    rows = a.shape[0] if per_sample else 1
    a32, b32 = a.float().reshape(rows, -1), b.float().reshape(rows, -1)
    sums = torch.stack([(a32 - b32).abs().sum(dim=1), b32.abs().sum(dim=1)], dim=1)  # [rows, 2]
    return sums if per_sample else sums[0]


def rel_l1_stats(a: torch.Tensor, b: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """[sum|a - b|, sum|b|] as float32 [2], or [B, 2] per index of dim 0 when per_sample."""
    op = "rel_l1_stats"
    check_float(op, "a", a)
    check_float(op, "b", b)
    check_same_device(op, a=a, b=b)
    if a.shape != b.shape:
        raise ValueError(
            f"{op}: `a` has shape {tuple(a.shape)} and `b` {tuple(b.shape)}; they must match "
            "(compare the same tensor at two steps)"
        )
    if per_sample and a.dim() == 0:
        raise ValueError(f"{op}: per_sample=True needs a batch dim 0, but `a` is 0-dim; use per_sample=False")
    samples = a.shape[0] if per_sample else 1
    if a.numel() == 0:
        sums = torch.zeros(samples, 2, device=a.device, dtype=torch.float32)
        return sums if per_sample else sums[0]
    if use_triton(op, a, b):
        sums = _rel_l1_stats_triton(contiguous(a), contiguous(b), samples)
        return sums if per_sample else sums[0]
    return rel_l1_stats_reference(a, b, per_sample)


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum|a - b| / sum|b| as a 0-dim float32 tensor on the device (no host sync); 0 when both are 0."""
    sums = rel_l1_stats(a, b)
    return sums[0] / sums[1].clamp_min(EPS)
