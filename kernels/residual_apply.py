"""residual_apply: reuse a cached residual, out = hidden + residual, on the tail tokens.

Shapes (tokens are dim -2, hidden is dim -1):
    hidden, out  [B, L, D]   (any leading dims)
    residual     [B, L_r, D] with L_r <= L: the last L_r tokens (MM-DiT image tokens after the text tokens)
    out[:, :L-L_r] = hidden[:, :L-L_r]
    out[:, L-L_r:] = hidden[:, L-L_r:] + residual
`out` may be `hidden` itself (in place: only the tail is read and written, 3 passes over L_r·D).
Result dtype = hidden's dtype; the add is done in fp32 and rounded once.

This is axpy with alpha = 1: it launches the same Triton kernel (`_residual_apply_kernel` below is
that kernel) so that the two ops cannot drift apart.
"""

from __future__ import annotations

import torch

from .axpy import _axpy_kernel, _axpy_triton, axpy_reference, prepare
from .backend import use_triton

_residual_apply_kernel = _axpy_kernel  # y + alpha * x on the tail, launched with alpha = 1.0


def _residual_apply_triton(hidden: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _axpy_triton(hidden, residual, 1.0, out, op="residual_apply")


def residual_apply_reference(
    hidden: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain torch: out[..., :L-L_r] = hidden head (unless in place); torch.add on the tail."""
    return axpy_reference(hidden, residual, 1.0, out)


def residual_apply(hidden: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden + residual on the last residual.shape[-2] tokens; see the module docstring."""
    hidden, residual, out = prepare("residual_apply", hidden, residual, out, "hidden", "residual")
    if use_triton("residual_apply", hidden, residual):
        return _residual_apply_triton(hidden, residual, out)
    return residual_apply_reference(hidden, residual, out)
