"""The three kernel entry points the engine calls on every transformer call, chosen once per call.

The public ops in `dcache.kernels` validate their inputs (dtype, device, shapes, contiguity, grad) and then pick
Triton or torch. In the engine's hot path the inputs are tensors the engine itself read out of the block call or
cached from an earlier one, so that validation re-proves the same facts a dozen times per call; on a small model at
batch 1 it costs as much as the arithmetic. The engine therefore resolves the backend once per call:

  * grad enabled (e.g. a learned forecaster trained through the engine, `schedules/tuning/search/disca.py`): plain
    differentiable torch compositions (the kernels write into out= buffers and are inference-only);
  * Triton (CUDA): the public, validated ops;
  * torch otherwise: the `*_reference` implementations directly, which are what the public ops run on this
    backend anyway, so results are bit-identical either way.

    apply(hidden [.., L, D], residual [.., L_r, D])  -> hidden with residual added to its last L_r tokens
    store(out, inp, buffer | None)                   -> residual = out - inp (written into buffer when given)
    rel_l1(a, b)                                     -> float32 [2] = [sum|a - b|, sum|b|]
    taylor_update(table, new, dist, filled)          -> new `filled` (table updated in place; UnitHistory)
    taylor_forecast(table, dist_ahead, filled)       -> the order-(filled - 1) forecast (UnitHistory)

The Taylor pair serves a history's own tables (dcache.runtime.cache_state), whose shapes, dtypes, devices and distances
the history guarantees; at module granularity their validation cost as much as the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dcache.kernels import (Backend, rel_l1_stats, rel_l1_stats_reference, residual_apply, residual_apply_reference,
                            residual_capture, resolve, taylor_forecast, taylor_forecast_reference, taylor_update,
                            taylor_update_reference)


@dataclass(frozen=True)
class CacheOps:
    name: str
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    rel_l1: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    taylor_update: Callable[..., int]
    taylor_forecast: Callable[..., torch.Tensor]


def _store_validated(out: torch.Tensor, inp: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    return residual_capture(out, inp, buffer=buffer, stats=False)[0]


def _store_torch(out: torch.Tensor, inp: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    # what residual_capture(stats=False) runs on the torch backend: one subtraction (fp32 opmath, one rounding)
    return torch.sub(out, inp, out=buffer) if buffer is not None else out - inp


def _apply_autograd(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Differentiable hidden + residual on the last residual.shape[-2] tokens (no out= buffer)."""
    head = hidden.shape[-2] - residual.shape[-2] if hidden.dim() >= 2 and residual.dim() >= 2 else 0
    tail = (hidden[..., head:, :] if head else hidden) + residual.to(hidden.dtype)
    return torch.cat([hidden[..., :head, :], tail], dim=-2) if head else tail


def _store_autograd(out: torch.Tensor, inp: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    return out - inp  # a fresh tensor: writing into a cached buffer would cut the graph


VALIDATED = CacheOps("validated", residual_apply, _store_validated, rel_l1_stats, taylor_update, taylor_forecast)
AUTOGRAD = CacheOps("autograd", _apply_autograd, _store_autograd, rel_l1_stats_reference, taylor_update_reference,
                    taylor_forecast_reference)
TORCH_DIRECT = CacheOps("torch", residual_apply_reference, _store_torch, rel_l1_stats_reference,
                        taylor_update_reference, taylor_forecast_reference)


def ops_for(tensor: torch.Tensor) -> CacheOps:
    """The ops for one transformer call whose hidden states are `tensor`."""
    if torch.is_grad_enabled():
        return AUTOGRAD
    if resolve(tensor) is Backend.TRITON:
        return VALIDATED
    return TORCH_DIRECT
