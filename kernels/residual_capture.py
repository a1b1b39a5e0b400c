"""residual_capture: store a fresh residual and, in the same pass, the statistics caches decide on.

    residual = out - inp                                  [*, D], written into `buffer` when given
    stats    = float32 [5] on the device:
        [0] sum |r - prev|          relative L1 change = [0] / [1]   (FBCache, TeaCache, EasyCache)
        [1] sum |prev|
        [2] sum r^2                 norm ratio ‖r‖ / ‖prev‖ = sqrt([2] / [3])
        [3] sum prev^2
        [4] mean over tokens of ‖r_tok‖₂ / max(‖prev_tok‖₂, eps)      (MagCache's γ, arXiv 2506.09045)
    Tokens are all rows of the [*, D] view (norms over the last dim). Without `prev`, every entry that
    depends on it is 0 (only [2] is filled).

`buffer` may alias `prev` (update the cached residual in place): the statistics still compare
against the OLD prev values, because each element is read before it is overwritten.
`r` is formed in fp32 and the statistics use that fp32 value; the stored residual is rounded to
the buffer's dtype (`out`'s dtype when no buffer is given).
"""

from __future__ import annotations

import torch

from ._common import EPS, check_float, check_int32_size, check_output, check_same_device, contiguous
from .backend import device_guard, tile_elems, triton_kernel, use_triton

TILE = 2048        # elements per [BLOCK_ROWS, BLOCK_D] tile: 8 per thread at 8 warps (~55 registers)
MAX_BLOCK_D = 1024  # wider rows are walked in chunks of this many columns
NUM_WARPS = 8
N_STATS = 5

tl = sum_combine = None  # triton.language and tl.sum's combine function, bound by @triton_kernel


@triton_kernel
def _residual_capture_kernel(triton):
    @triton.jit
    def residual_capture_kernel(
        out_ptr, inp_ptr, prev_ptr, res_ptr,   # [n_rows, D] each; res_ptr may equal prev_ptr
        partial_ptr,                           # [n_programs, 5] float32 partial sums
        n_rows, D,
        inv_rows,                              # 1 / n_rows, so the partials of [4] sum to a mean
        eps,
        HAS_PREV: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)        # [R]
        row_ok = rows < n_rows
        base = rows.to(tl.int64)[:, None] * D                     # [R, 1] element offset of each row
        abs_diff = tl.full([BLOCK_ROWS, BLOCK_D], 0.0, tl.float32)  # running |r - prev|
        abs_prev = tl.full([BLOCK_ROWS, BLOCK_D], 0.0, tl.float32)  # running |prev|
        sq_r = tl.full([BLOCK_ROWS, BLOCK_D], 0.0, tl.float32)      # running r^2 (row sums give ‖r_tok‖²)
        sq_prev = tl.full([BLOCK_ROWS, BLOCK_D], 0.0, tl.float32)   # running prev^2
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)                     # [C]
            mask = row_ok[:, None] & (cols < D)[None, :]          # [R, C]
            idx = base + cols[None, :]
            r = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) \
                - tl.load(inp_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_PREV:
                p = tl.load(prev_ptr + idx, mask=mask, other=0.0).to(tl.float32)  # read before res overwrites it
                abs_diff += tl.abs(r - p)
                abs_prev += tl.abs(p)
                sq_prev += p * p
            sq_r += r * r
            tl.store(res_ptr + idx, r.to(res_ptr.dtype.element_ty), mask=mask)
        row_sq_r = tl.reduce(sq_r, 1, sum_combine)                # [R] ‖r_tok‖²
        stats = partial_ptr + pid * 5
        tl.store(stats + 2, tl.reduce(row_sq_r, 0, sum_combine))
        if HAS_PREV:
            row_sq_prev = tl.reduce(sq_prev, 1, sum_combine)      # [R] ‖prev_tok‖²
            ratio = tl.sqrt(row_sq_r) / tl.maximum(tl.sqrt(row_sq_prev), eps)
            ratio = tl.where(row_ok, ratio, 0.0)
            tl.store(stats + 0, tl.reduce(abs_diff, None, sum_combine))
            tl.store(stats + 1, tl.reduce(abs_prev, None, sum_combine))
            tl.store(stats + 3, tl.reduce(row_sq_prev, 0, sum_combine))
            tl.store(stats + 4, tl.reduce(ratio, 0, sum_combine) * inv_rows)
        else:
            tl.store(stats + 0, 0.0)
            tl.store(stats + 1, 0.0)
            tl.store(stats + 3, 0.0)
            tl.store(stats + 4, 0.0)

    return residual_capture_kernel


def _block_shape(D: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_D): a TILE-element tile, full rows when D <= MAX_BLOCK_D."""
    block_d = min(max(16, 1 << (D - 1).bit_length()), MAX_BLOCK_D)
    return tile_elems(TILE) // block_d, block_d


def _residual_capture_triton(out, inp, prev, residual):
    """Launch on validated, contiguous, non-empty tensors; returns the stats [5]."""
    D = out.shape[-1]
    n_rows = out.numel() // D
    check_int32_size("residual_capture", n_rows, "the row count of `out`")
    block_rows, block_d = _block_shape(D)
    n_programs = -(-n_rows // block_rows)
    partials = torch.empty(n_programs, N_STATS, device=out.device, dtype=torch.float32)
    with device_guard(out):
        _residual_capture_kernel()[(n_programs,)](
            out, inp, prev if prev is not None else out, residual, partials,
            n_rows, D, 1.0 / n_rows, EPS,
            HAS_PREV=prev is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=NUM_WARPS,
        )
    return partials.sum(dim=0)  # fixed order: the same inputs give bit-identical stats


def residual_capture_reference(out, inp, prev=None, buffer=None):
    """Plain torch, fp32 math: stats are taken before `buffer` (which may be `prev`) is written."""
    r = out.float() - inp.float()                                 # [*, D]
    sq_r = r.square().sum(dim=-1)                                 # [*] ‖r_tok‖²
    zero = sq_r.new_zeros(())
    if prev is None:
        stats = torch.stack([zero, zero, sq_r.sum(), zero, zero])
    else:
        p = prev.float()
        sq_prev = p.square().sum(dim=-1)                          # [*] ‖prev_tok‖²
        ratio = sq_r.sqrt() / sq_prev.sqrt().clamp_min(EPS)
        stats = torch.stack([(r - p).abs().sum(), p.abs().sum(), sq_r.sum(), sq_prev.sum(), ratio.mean()])
    residual = buffer.copy_(r) if buffer is not None else r.to(out.dtype)
    return residual, stats


def residual_capture(
    out: torch.Tensor,
    inp: torch.Tensor,
    prev: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
    *,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual = out - inp, stats float32 [5]); see the module docstring.

    stats=False: only store the residual (stats is None). The engine's cache writes take this path: on the torch
    backend it is a single subtraction into the buffer, without the reductions nobody reads.
    """
    op = "residual_capture"
    check_float(op, "out", out)
    check_float(op, "inp", inp)
    check_same_device(op, out=out, inp=inp, prev=prev, buffer=buffer)
    if out.dim() == 0:
        raise ValueError(f"{op}: `out` is 0-dim; pass [*, D] tensors (norms are taken over the last dim)")
    if inp.shape != out.shape:
        raise ValueError(
            f"{op}: `inp` has shape {tuple(inp.shape)} but `out` has {tuple(out.shape)}; they must match. "
            "For MM-DiT streams, slice both to the same tokens first (e.g. the image tokens `x[:, -L_img:]`)"
        )
    if prev is not None:
        check_float(op, "prev", prev)
        if prev.shape != out.shape:
            raise ValueError(
                f"{op}: `prev` has shape {tuple(prev.shape)} but `out` has {tuple(out.shape)}; pass the previous "
                "residual of the same stream (or None on the first capture)"
            )
    if buffer is not None:
        check_output(op, "buffer", buffer, out.shape)
    if out.numel() == 0:
        empty = buffer if buffer is not None else torch.empty_like(out)
        return empty, torch.zeros(N_STATS, device=out.device, dtype=torch.float32)
    out, inp = contiguous(out), contiguous(inp)
    prev = contiguous(prev) if prev is not None else None
    if use_triton(op, out, inp, prev):
        residual = buffer if buffer is not None else torch.empty_like(out, memory_format=torch.contiguous_format)
        sums = _residual_capture_triton(out, inp, prev, residual)
        return residual, (sums if stats else None)
    if not stats:  # torch computes the difference in fp32 (opmath) and rounds once, like the reference
        return (torch.sub(out, inp, out=buffer) if buffer is not None else out - inp), None
    return residual_capture_reference(out, inp, prev, buffer)
