"""Backend switch for the fused cache ops: Triton kernels on CUDA, plain torch elsewhere.

Every public op in `dcache.kernels` asks `resolve(tensor)` (through `use_triton`, which also refuses
inputs that require grad: the ops are inference-only) which implementation to run:

    Backend.AUTO    Triton when the tensor is on CUDA and triton imports, torch otherwise (the default)
    Backend.TORCH   always the plain-torch `<op>_reference`
    Backend.TRITON  always the Triton kernel; on CPU this needs TRITON_INTERPRET=1 (the slow
                    interpreter the tests use), anywhere else it is an error that says so

    with use_backend("torch"):        # or set_backend(Backend.TORCH) for the whole process
        out = residual_apply(hidden, residual)

Triton is imported lazily (on the first Triton launch or availability check) and optionally:
`import dcache.kernels` works without triton installed, and then everything runs on torch.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from enum import Enum

import torch


class Backend(str, Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


_backend = Backend.AUTO  # process-wide choice; use_backend() swaps it and restores it


def _as_backend(b: Backend | str) -> Backend:
    try:
        return Backend(b.lower() if isinstance(b, str) and not isinstance(b, Backend) else b)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in Backend)
        raise ValueError(
            f"unknown kernel backend {b!r}; use one of {allowed} (or dcache.kernels.Backend.<NAME>)"
        ) from None


def set_backend(b: Backend | str) -> None:
    """Select the implementation for all dcache.kernels ops in this process."""
    global _backend
    _backend = _as_backend(b)


def get_backend() -> Backend:
    return _backend


@contextmanager
def use_backend(b: Backend | str) -> Iterator[Backend]:
    """`with use_backend("torch"): ...` runs the block on that backend, then restores the previous one."""
    global _backend
    previous, _backend = _backend, _as_backend(b)
    try:
        yield _backend
    finally:
        _backend = previous


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET asks for triton's CPU interpreter (it must be set before the first launch)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# The CPU interpreter pays per program (python overhead), not per element: under it the launchers
# use this many times larger tiles. The kernel code is the same; only the tile constexpr changes.
INTERPRET_TILE_SCALE = 8


def tile_elems(gpu_elems: int) -> int:
    """Elements per program for a launch: the GPU tuning value, or a larger one under the interpreter."""
    return gpu_elems * INTERPRET_TILE_SCALE if interpret_mode() else gpu_elems


@functools.cache
def _triton_modules():
    """(triton, triton.language), or None when triton cannot be imported. Imported once, on first use."""
    try:
        triton = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")
    except ImportError:  # not installed, or installed without a working build for this platform
        return None
    return triton, tl


def import_triton():
    """(triton, triton.language) for building kernels; a ValueError with the fix when triton is missing."""
    modules = _triton_modules()
    if modules is None:
        raise ValueError(
            "the Triton backend was requested but triton cannot be imported; install it "
            "(pip install triton, Linux x86-64 with CUDA) or use the torch backend: "
            "dcache.kernels.set_backend('torch')"
        )
    return modules


def triton_kernel(build):
    """Decorator for a kernel builder: `build(triton)` defines and returns a @triton.jit kernel.

        @triton_kernel
        def _op_kernel(triton):
            @triton.jit
            def op_kernel(x_ptr, ..., BLOCK: tl.constexpr): ...
            return op_kernel

        _op_kernel()[grid](...)          # built on the first call, then cached

    The build is deferred so that `import dcache.kernels` never imports triton. Kernel bodies read
    `tl` (triton.language) and `sum_combine` as globals of their module, which is where triton's
    compiler and its CPU interpreter both look names up; they are bound there before the build.

    Kernels sum with `tl.reduce(x, axis, sum_combine)` (what tl.sum does) and fill with tl.full, not
    tl.sum / tl.zeros: those two are @triton.jit functions built when triton is first imported, and
    if that import came before TRITON_INTERPRET=1 was set (in a test session another module may
    import triton first) they cannot run in the interpreter. tl.reduce is a builtin, and the
    interpreter sums natively for this combine function.
    """

    @functools.cache
    @functools.wraps(build)
    def kernel():
        triton, tl = import_triton()
        build.__globals__.update(tl=tl, sum_combine=tl.standard._sum_combine)
        return build(triton)

    return kernel


def triton_available(tensor: torch.Tensor | None = None) -> bool:
    """Whether Triton kernels can run: triton imports and (the tensor is on CUDA, or TRITON_INTERPRET=1).

    Without a tensor, "on CUDA" means a CUDA device is present.
    """
    on_cuda = tensor.is_cuda if tensor is not None else torch.cuda.is_available()
    if not (on_cuda or interpret_mode()):
        return False
    return _triton_modules() is not None


def resolve(tensor: torch.Tensor) -> Backend:
    """The concrete backend (TORCH or TRITON) an op on `tensor` runs with under the current setting."""
    if _backend is Backend.TORCH:
        return Backend.TORCH
    if _backend is Backend.AUTO:
        return Backend.TRITON if tensor.is_cuda and _triton_modules() is not None else Backend.TORCH
    # Backend.TRITON was forced: fail loudly rather than silently running something else.
    if not tensor.is_cuda and not interpret_mode():
        raise ValueError(
            f"the Triton backend was forced but the tensor is on {tensor.device}; Triton runs on CUDA. "
            "Move the tensors to a CUDA device, use the torch backend (set_backend('torch') or 'auto'), "
            "or, for testing on CPU, set TRITON_INTERPRET=1 before the first kernel launch"
        )
    import_triton()  # raises with the fix when triton is missing
    return Backend.TRITON


def use_triton(op: str, *tensors: torch.Tensor | None) -> bool:
    """Whether `op` runs its Triton kernel on these inputs (resolve() on the first).

    Both backends are for inference: the kernels record no autograd graph and the references write
    into `out=` buffers, so an input that requires grad (with grad enabled) is refused on either.
    """
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in given):
        raise ValueError(
            f"{op}: an input requires grad, but the cache ops are inference-only (no autograd graph); "
            "call it under torch.no_grad() or torch.inference_mode(), as diffusers pipelines do, or detach it"
        )
    return resolve(given[0]) is Backend.TRITON


def device_guard(tensor: torch.Tensor):
    """Launch on the tensor's GPU: triton launches on the *current* CUDA device otherwise."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()
