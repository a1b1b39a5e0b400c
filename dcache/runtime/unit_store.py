"""Writing a unit's result into its branch cache and serving it back (shared by every unit kind).

Stored per unit and branch (dcache.runtime.cache_state.UnitHistory): the residual r = out - in of each stream (hidden,
encoder) for stacks, blocks and the call scope's Delta = v - x; a module unit's output tensors as they are. Served:
    REUSE     out = in + r_last                                  (residual units)
    FORECAST  out = in + sum_k d_k (step - last_step)^k / k!     (Taylor table; or the schedule's `forecaster`)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..actions import Action
from .cache_ops import CacheOps
from .call_state import BlockSlot, CallState
from .cache_state import UnitHistory

if TYPE_CHECKING:
    from ..schedule import Schedule

FORECAST = Action.FORECAST.value


def residual_pairs(outs: list, ins: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(out, in) per stream (hidden, encoder) that has a residual; a stream whose length changed inside the unit
    keeps its tail tokens (the image)."""
    pairs = []
    for o, x in zip(outs, ins):
        if o is None or x is None or not isinstance(o, torch.Tensor):
            continue
        if o.shape != x.shape:
            x = x[:, -o.shape[1]:] if x.ndim >= 2 and x.shape[1] > o.shape[1] else x
        pairs.append((o, x))
    return pairs


def store_residuals(ops: CacheOps, call: CallState, key: Any, order: int, outs: list, ins: list) -> None:
    """Cache residual = out - in per stream (hidden, encoder), reusing the old buffer in place when possible."""
    hist = call.bstate.history(key, order)
    previous = hist.store_buffers()
    residuals = []
    for o, x in residual_pairs(outs, ins):
        buffer = previous[len(residuals)] if len(previous) > len(residuals) else None
        if buffer is not None and (buffer.shape != o.shape or buffer.dtype != o.dtype):
            buffer = None
        residuals.append(ops.store(o, x, buffer))
    hist.update(residuals, call.step)


def keep_tensors(call: CallState, key: Any, order: int, residuals: list[torch.Tensor]) -> UnitHistory:
    """Cache tensors computed in a compiled graph (the units' traced path: residuals, a module's outputs), copied into
    the unit's own buffers, since a graph's outputs may be the graph's memory (CUDA graphs rewrite them at the next
    replay)."""
    hist = call.bstate.history(key, order)
    previous = hist.store_buffers()
    kept = []
    for i, r in enumerate(residuals):
        buffer = previous[i] if i < len(previous) else None
        if buffer is not None and buffer.shape == r.shape and buffer.dtype == r.dtype:
            kept.append(buffer.copy_(r))
        else:
            kept.append(r.clone() if order == 0 else r)  # a Taylor table copies what it is given
    hist.update(kept, call.step)
    return hist


def read_cached(schedule: Schedule, hist: UnitHistory, action: str, step: int,
                call: CallState | None = None) -> list[torch.Tensor]:
    """The cached tensors a REUSE / FORECAST serves at `step` (a schedule's own forecaster, e.g. learned, first);
    what the decision already read for the call's finite check (`CallState.served`) is not read again."""
    if call is not None and hist.key in call.served:
        return call.served.pop(hist.key)
    forecast = action == FORECAST
    forecaster = schedule.forecaster if forecast else None
    return forecaster(hist.plain(), step) if forecaster is not None else hist.read(forecast, step)


def apply_cached(ops: CacheOps, schedule: Schedule, slot: BlockSlot, hist: UnitHistory, action: str, step: int,
                 hidden: torch.Tensor, encoder: torch.Tensor | None, call: CallState | None = None) -> Any:
    """A block's output without running it: its inputs plus the cached residuals, in the block's output format."""
    return add_cached(ops, slot, read_cached(schedule, hist, action, step, call), hidden, encoder)


def finite_flags(groups: list[list[torch.Tensor]]) -> list[bool]:
    """Per group of tensors, whether all of them are free of NaN and infinity: one float32 sum per tensor (a NaN or
    an infinity makes it non-finite; +inf and -inf make NaN), one host read for all the groups."""
    sums = [[t.sum(dtype=torch.float32) for t in ts if t.is_floating_point() and t.numel()] for ts in groups]
    flat = [s for group in sums for s in group]
    if not flat:
        return [True] * len(groups)
    finite = torch.isfinite(torch.stack([s.to(flat[0].device) for s in flat])).tolist()
    flags, i = [], 0
    for group in sums:
        flags.append(all(finite[i:i + len(group)]))
        i += len(group)
    return flags


def add_cached(ops: CacheOps, slot: BlockSlot, cached: list[torch.Tensor], hidden: torch.Tensor,
               encoder: torch.Tensor | None) -> Any:
    """A block's output from its inputs plus `cached` (the residuals a REUSE / FORECAST serves)."""
    out_h = ops.apply(hidden, cached[0])
    out_e = encoder
    if encoder is not None and len(cached) > 1:
        out_e = ops.apply(encoder, cached[1])
    return slot.slots.make_output(out_h, out_e)
