"""Fused ops for the cache path: memory-bound elementwise work and small reductions.

Each op lives in its own file with a Triton kernel (`_<op>_kernel`), its launcher (`_<op>_triton`)
and a plain-torch reference (`<op>_reference`); the public function validates its inputs and picks
the implementation with `resolve` (Triton on CUDA, torch elsewhere; see `backend.py`).
Importing this package never imports triton.
"""

from .axpy import axpy, axpy_reference
from .backend import Backend, get_backend, resolve, set_backend, triton_available, use_backend
from .relative_l1 import rel_l1, rel_l1_stats, rel_l1_stats_reference
from .residual_apply import residual_apply, residual_apply_reference
from .residual_capture import residual_capture, residual_capture_reference
from .taylor import taylor_forecast, taylor_forecast_reference, taylor_update, taylor_update_reference

__all__ = [
    "Backend",
    "axpy",
    "axpy_reference",
    "get_backend",
    "rel_l1",
    "rel_l1_stats",
    "rel_l1_stats_reference",
    "residual_apply",
    "residual_apply_reference",
    "residual_capture",
    "residual_capture_reference",
    "resolve",
    "set_backend",
    "taylor_forecast",
    "taylor_forecast_reference",
    "taylor_update",
    "taylor_update_reference",
    "triton_available",
    "use_backend",
]
