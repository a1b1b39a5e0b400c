"""Derivative tables for Taylor forecasting of cached features (TaylorSeer arXiv 2503.06923, CG-Taylor 2508.02240).

A table is one tensor [K+1, *shape]: table[0] = d_0, the last computed value; table[k] = d_k, the
k-th finite-difference derivative (in units of steps). Only the first `filled` entries are valid.

taylor_update(table, new, dist, filled) -> new filled          (in place, at a computed step)
    n = min(filled, K)                      derivatives that can be refreshed
    new_d_0     = new
    new_d_{k+1} = (new_d_k - old_d_k) / dist     for k < n      (dist = steps since the last update)
    returns min(filled + 1, K + 1)
taylor_forecast(table, dist_ahead, filled, out=None) -> [*shape]     (at a skipped step)
    sum_{k < filled} table[k] * dist_ahead^k / k!

Math is fp32 whatever the dtypes (a fp32 table with bf16 `new` / `out` is the usual mix); each value
is rounded once when stored. `/ dist` is done as `* (1 / dist)` with 1 / dist rounded to fp32, the
same in both backends (on GPU a fp32 divide is not correctly rounded by default).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._common import check_float, check_int32_size, check_output, check_same_device, contiguous
from .backend import device_guard, tile_elems, triton_kernel, use_triton

BLOCK = 2048  # elements per program
NUM_WARPS = 8

tl = None  # triton.language, bound by @triton_kernel when the first kernel is built


@triton_kernel
def _taylor_update_kernel(triton):
    @triton.jit
    def taylor_update_kernel(
        table_ptr,                   # [K+1, n]
        new_ptr,                     # [n]
        n,
        inv_dist,                    # 1 / dist
        N_UPDATES: tl.constexpr,     # min(filled, K): d_1..d_N are recomputed, d_0 replaced
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        cur = tl.load(new_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # new d_k, from k = 0
        row = table_ptr + offs                                                # row k of the table
        for _ in tl.static_range(N_UPDATES):
            old = tl.load(row, mask=mask, other=0.0).to(tl.float32)           # old d_k
            tl.store(row, cur.to(table_ptr.dtype.element_ty), mask=mask)
            cur = (cur - old) * inv_dist                                      # new d_{k+1}
            row += n
        tl.store(row, cur.to(table_ptr.dtype.element_ty), mask=mask)

    return taylor_update_kernel


@triton_kernel
def _taylor_forecast_kernel(triton):
    @triton.jit
    def taylor_forecast_kernel(
        table_ptr,                   # [K+1, n]
        out_ptr,                     # [n]
        n,
        coefs,                       # tuple of N_TERMS floats: dist_ahead^k / k!
        N_TERMS: tl.constexpr,       # filled
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = table_ptr + offs
        acc = tl.full([BLOCK], 0.0, tl.float32)
        for k in tl.static_range(N_TERMS):
            acc += tl.load(row, mask=mask, other=0.0).to(tl.float32) * coefs[k]
            row += n
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return taylor_forecast_kernel


def _check_table(op: str, table) -> int:
    """Validate a derivative table; return K."""
    check_float(op, "table", table)
    if table.dim() < 1 or table.shape[0] < 1:
        raise ValueError(
            f"{op}: `table` has shape {tuple(table.shape)}; it must be [K+1, *shape] with K >= 0, e.g. "
            "torch.empty(order + 1, *feature.shape, dtype=torch.float32, device=feature.device)"
        )
    if not table.is_contiguous():
        raise ValueError(
            f"{op}: `table` must be contiguous (it is state that taylor_update writes in place); allocate it "
            "with torch.empty(order + 1, *shape) and keep it"
        )
    return table.shape[0] - 1


def _check_filled(op: str, filled, lo: int, hi: int) -> None:
    if not isinstance(filled, numbers.Integral) or isinstance(filled, bool) or not lo <= filled <= hi:
        raise ValueError(
            f"{op}: `filled` is {filled!r} but must be an int in [{lo}, {hi}] for this table: the number "
            "of valid entries, as returned by the previous taylor_update (0 for a fresh table; a forecast "
            "needs at least one update)"
        )


def _check_distance(op: str, name: str, value, positive: bool) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or (positive and value <= 0):
        need = "a finite number > 0 (steps since the last update)" if positive else "a finite number (steps ahead)"
        raise ValueError(f"{op}: `{name}` is {value!r}; it must be {need}, as a python number")
    return float(value)


def taylor_coefficients(dist_ahead: float, n_terms: int) -> tuple[float, ...]:
    """(dist^k / k! for k < n_terms), in double precision; both backends round them to fp32 alike."""
    coefs, c = [], 1.0
    for k in range(n_terms):
        coefs.append(c)
        c = c * dist_ahead / (k + 1)
    return tuple(coefs)


def _taylor_update_triton(table, new, inv_dist, n_updates):
    n = new.numel()
    if n == 0:
        return
    check_int32_size("taylor_update", n, "one table entry")
    block = tile_elems(BLOCK)
    with device_guard(table):
        _taylor_update_kernel()[(-(-n // block),)](
            table, new, n, inv_dist, N_UPDATES=n_updates, BLOCK=block, num_warps=NUM_WARPS
        )


def taylor_update_reference(table, new, dist, filled):
    """Plain torch, fp32 math; returns the new `filled`."""
    K = table.shape[0] - 1
    inv_dist = 1.0 / dist
    cur = new.float()
    for k in range(min(filled, K)):
        nxt = (cur - table[k].float()) * inv_dist
        table[k].copy_(cur)
        cur = nxt
    table[min(filled, K)].copy_(cur)
    return min(filled + 1, K + 1)


def taylor_update(table: torch.Tensor, new: torch.Tensor, dist, filled: int) -> int:
    """Push a freshly computed value into the table (in place); returns the new `filled`."""
    op = "taylor_update"
    K = _check_table(op, table)
    check_float(op, "new", new)
    check_same_device(op, table=table, new=new)
    if new.shape != table.shape[1:]:
        raise ValueError(
            f"{op}: `new` has shape {tuple(new.shape)} but the table holds entries of shape "
            f"{tuple(table.shape[1:])}; the table must be [K+1, *new.shape]"
        )
    dist = _check_distance(op, "dist", dist, positive=True)
    _check_filled(op, filled, 0, K + 1)
    new = contiguous(new)
    if use_triton(op, table, new):
        _taylor_update_triton(table, new, 1.0 / dist, min(filled, K))
        return min(filled + 1, K + 1)
    return taylor_update_reference(table, new, dist, filled)


def _taylor_forecast_triton(table, coefs, out):
    n = out.numel()
    if n == 0:
        return out
    check_int32_size("taylor_forecast", n, "one table entry")
    block = tile_elems(BLOCK)
    with device_guard(table):
        _taylor_forecast_kernel()[(-(-n // block),)](
            table, out, n, coefs, N_TERMS=len(coefs), BLOCK=block, num_warps=NUM_WARPS
        )
    return out


def taylor_forecast_reference(table, dist_ahead, filled, out=None):
    """Plain torch, fp32 math: one multiply and one add pass per term, the product rounded before the add (as the
    kernel's reference has always done), into one scratch buffer: a fresh tensor per term costs as much as the
    arithmetic on a large table on CPU (page faults)."""
    coefs = taylor_coefficients(dist_ahead, filled)
    acc = table[0].float() * coefs[0]
    term = torch.empty_like(acc) if filled > 1 else None
    for k in range(1, filled):
        torch.mul(table[k].float(), coefs[k], out=term)
        acc.add_(term)
    if out is None:
        return acc.to(table.dtype)
    return out.copy_(acc)


def taylor_forecast(table: torch.Tensor, dist_ahead, filled: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_{k < filled} table[k] * dist_ahead^k / k!, in `out` (default: a new tensor of the table's dtype)."""
    op = "taylor_forecast"
    K = _check_table(op, table)
    dist_ahead = _check_distance(op, "dist_ahead", dist_ahead, positive=False)
    _check_filled(op, filled, 1, K + 1)
    if out is not None:
        check_output(op, "out", out, table.shape[1:])
        check_same_device(op, table=table, out=out)
    if use_triton(op, table):
        if out is None:
            out = torch.empty(table.shape[1:], dtype=table.dtype, device=table.device)
        return _taylor_forecast_triton(table, taylor_coefficients(dist_ahead, filled), out)
    return taylor_forecast_reference(table, dist_ahead, filled, out)
