"""axpy: out = y + alpha * x, with x applied to the TAIL tokens of y when it is shorter.

Used for ERTACache's rectification (v_i ≈ v_j + k_i · (v_j − v_j')) and, with alpha = 1, for
applying a cached residual (`residual_apply`, which launches this same kernel).

Shapes (tokens are dim -2, hidden is dim -1):
    y, out  [*, L, D]
    x       [*, L_x, D] with L_x <= L and the same leading dims; it covers the last L_x tokens:
            out[..., :L-L_x, :] = y[..., :L-L_x, :]
            out[..., L-L_x:, :] = y[..., L-L_x:, :] + alpha * x
    (x of exactly y's shape works for any number of dims.)
alpha: a python number or a one-element tensor (read on the device: no host sync).
out:   None (a new tensor), or y itself (in place: only the tail is touched), or a tensor that does
       not overlap y or x. The result has y's dtype; the math is fp32.
"""

from __future__ import annotations

import numbers

import torch

from ._common import MAX_GRID_Y, check_float, check_int32_size, check_output, check_same_device, contiguous
from .backend import device_guard, tile_elems, triton_kernel, use_triton

BLOCK = 2048  # elements per program: 8 per thread at 8 warps (16-byte bf16 vectors, two in fp32)
NUM_WARPS = 8

tl = None  # triton.language, bound by @triton_kernel when the first kernel is built


@triton_kernel
def _axpy_kernel(triton):
    @triton.jit
    def axpy_kernel(
        y_ptr, x_ptr, out_ptr,          # y, out: [B, row_elems]; x: [B, row_elems - head_elems]
        alpha_ptr, alpha,               # alpha is read from alpha_ptr when ALPHA_FROM_PTR, else the scalar
        row_elems,                      # L * D: elements of one batch row of y / out
        head_elems,                     # (L - L_x) * D: leading elements of a row that x does not cover
        start,                          # first element of a row this launch writes (head_elems when in place)
        ALPHA_FROM_PTR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(1).to(tl.int64)                       # batch row
        offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] element index in the row
        mask = offs < row_elems
        in_x = mask & (offs >= head_elems)
        y = tl.load(y_ptr + b * row_elems + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + b * (row_elems - head_elems) + (offs - head_elems), mask=in_x, other=0.0)
        if ALPHA_FROM_PTR:
            a = tl.load(alpha_ptr).to(tl.float32)
        else:
            a = alpha
        out = y + a * x.to(tl.float32)                          # head elements: x = 0, out = y
        tl.store(out_ptr + b * row_elems + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    return axpy_kernel


def tail_layout(op: str, y: torch.Tensor, x: torch.Tensor, y_name: str = "y", x_name: str = "x"):
    """Validate the tail alignment of x against y; return (batch, row_elems, head_tokens).

    The kernels see y as [batch, row_elems] and x as [batch, row_elems - head_tokens * D].
    """
    if x.shape == y.shape:
        head = 0
    elif x.dim() >= 2 and x.dim() == y.dim() and x.shape[:-2] == y.shape[:-2] and x.shape[-1] == y.shape[-1] \
            and x.shape[-2] <= y.shape[-2]:
        head = y.shape[-2] - x.shape[-2]
    else:
        raise ValueError(
            f"{op}: `{x_name}` has shape {tuple(x.shape)} and `{y_name}` {tuple(y.shape)}; `{x_name}` must have "
            f"`{y_name}`'s shape, or [*, L_x, D] against [*, L, D] with L_x <= L and equal leading dims "
            f"(it is added to the last L_x tokens). Reshape it, e.g. to [B, L_x, D]"
        )
    if y.dim() >= 2 and head > 0:
        batch = y.numel() // max(y.shape[-2] * y.shape[-1], 1)
        row = y.shape[-2] * y.shape[-1]
    else:  # same shape: one flat row
        batch, row = 1, y.numel()
    return batch, row, head


def parse_alpha(op: str, alpha, device: torch.device):
    """A python float, or a one-element float tensor on `device` (CPU scalars become python floats)."""
    if isinstance(alpha, numbers.Real) and not isinstance(alpha, bool):
        return float(alpha)
    if isinstance(alpha, torch.Tensor) and alpha.numel() == 1 and alpha.is_floating_point():
        if alpha.device == device:
            return alpha.reshape(())
        if alpha.device.type == "cpu":
            return float(alpha)  # already on the host: no sync
        raise ValueError(f"{op}: `alpha` is on {alpha.device} but the tensors are on {device}; move it there")
    raise ValueError(
        f"{op}: `alpha` must be a python number or a one-element floating tensor, got "
        f"{type(alpha).__name__}"
        f"{'' if not isinstance(alpha, torch.Tensor) else f' of shape {tuple(alpha.shape)} and dtype {alpha.dtype}'}"
    )


def _axpy_triton(y: torch.Tensor, x: torch.Tensor, alpha, out: torch.Tensor, op: str = "axpy") -> torch.Tensor:
    """Launch on validated, contiguous y, x, out (out may be y)."""
    batch, row, head = tail_layout(op, y, x)
    head_elems = head * y.shape[-1] if head else 0
    start = head_elems if out.data_ptr() == y.data_ptr() else 0  # in place: the head is already right
    n = row - start
    if n == 0 or batch == 0:
        return out
    check_int32_size(op, row, "one batch row of `y`")
    if batch > MAX_GRID_Y:
        raise ValueError(
            f"{op}: {batch} batch rows with a shorter `x` exceed the {MAX_GRID_Y} the launch grid allows; "
            "merge leading dims into fewer, longer rows or use the torch backend"
        )
    from_ptr = isinstance(alpha, torch.Tensor)
    block = tile_elems(BLOCK)
    grid = (-(-n // block), batch)
    with device_guard(y):
        _axpy_kernel()[grid](
            y, x, out,
            alpha if from_ptr else y, 0.0 if from_ptr else alpha,
            row, head_elems, start,
            ALPHA_FROM_PTR=from_ptr, BLOCK=block, num_warps=NUM_WARPS,
        )
    return out


def axpy_reference(y: torch.Tensor, x: torch.Tensor, alpha, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: copy the head tokens (unless in place), add alpha * x to the tail."""
    if out is None and x.shape == y.shape and x.dtype == y.dtype and not isinstance(alpha, torch.Tensor):
        return torch.add(y, x, alpha=alpha)  # the common reuse case: one op (same opmath as the tail add below)
    if out is None:
        out = torch.empty_like(y)
    head = 0 if x.shape == y.shape else y.shape[-2] - x.shape[-2]
    if head and out.data_ptr() != y.data_ptr():
        out[..., :head, :].copy_(y[..., :head, :])
    y_tail = y[..., head:, :] if head else y
    out_tail = out[..., head:, :] if head else out
    if isinstance(alpha, torch.Tensor) or x.dtype != y.dtype:
        out_tail.copy_(y_tail.float() + alpha * x.float())  # fp32 math, one rounding to y's dtype
    else:
        torch.add(y_tail, x, alpha=alpha, out=out_tail)       # torch computes this in fp32 too (opmath)
    return out


def prepare(op: str, y: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, y_name: str, x_name: str):
    """Shared validation of axpy / residual_apply: (y, x, out) contiguous, out allocated."""
    check_float(op, y_name, y)
    check_float(op, x_name, x)
    check_same_device(op, **{y_name: y, x_name: x, "out": out})
    tail_layout(op, y, x, y_name, x_name)
    if out is None:
        out = torch.empty_like(y, memory_format=torch.contiguous_format)
    else:
        check_output(op, "out", out, y.shape, y.dtype)
    return contiguous(y), contiguous(x), out


def axpy(y: torch.Tensor, x: torch.Tensor, alpha, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = y + alpha * x (x on the tail tokens of y if shorter); see the module docstring."""
    y, x, out = prepare("axpy", y, x, out, "y", "x")
    alpha = parse_alpha("axpy", alpha, y.device)
    if use_triton("axpy", y, x, alpha):
        return _axpy_triton(y, x, alpha, out)
    return axpy_reference(y, x, alpha, out)
