"""Input checks and small helpers shared by the op files. Errors are ValueErrors that name the op,
the argument, what was given and how to fix it (never `assert`)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Triton kernels index a tensor (or one batch row of it) with int32 offsets; the margin keeps the
# offsets of the last (partly masked) block from wrapping around.
MAX_INDEX = 2**31 - 2**20

# CUDA's limit on grid dim 1, where the kernels put batch rows / samples.
MAX_GRID_Y = 65535

# Guards divisions by a norm or a sum that can be zero (same value as torch.nn.functional.normalize).
EPS = 1e-12


def check_float(op: str, name: str, t) -> None:
    """`t` is a tensor of a supported floating dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: `{name}` has dtype {t.dtype}; supported are float32, bfloat16 and float16. "
            f"Cast it first, e.g. `{name}.to(torch.bfloat16)`"
        )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    given = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {where}; move them with `.to(device)`")


def check_output(op: str, name: str, t: torch.Tensor, shape: torch.Size, dtype: torch.dtype | None = None) -> None:
    """A tensor the op writes into: right shape (and dtype if given), contiguous (it cannot be copied)."""
    check_float(op, name, t)
    if t.shape != shape:
        raise ValueError(f"{op}: `{name}` has shape {tuple(t.shape)} but must have shape {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: `{name}` has dtype {t.dtype} but must have dtype {dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: `{name}` is written in place and must be contiguous; pass a contiguous tensor "
            f"(e.g. `torch.empty_like({name}, memory_format=torch.contiguous_format)`) or None"
        )


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """Read-only inputs: a contiguous view when possible, a copy otherwise (correct, but costs one pass)."""
    return t if t.is_contiguous() else t.contiguous()


def check_int32_size(op: str, n: int, what: str) -> None:
    if n > MAX_INDEX:
        raise ValueError(
            f"{op}: {what} has {n} elements, more than the {MAX_INDEX} (about 2**31) the Triton kernel indexes; "
            "split the batch, or use the torch backend (set_backend('torch'))"
        )

