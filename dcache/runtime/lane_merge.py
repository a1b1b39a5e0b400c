"""One branch cache for a sub-batch of per-sample lanes, and back (dcache.runtime.lanes).

Rows of a batched call that decided the same action row at the same step run as one sub-batch. Their units are
served and stored by the ordinary executors, on one BranchState whose cached tensors are the lanes' own stacked
along the batch dimension:

    order 0 (REUSE):   table [1, ...] per lane        -> [n, ...]
    order k (Taylor):  table [k + 1, 1, ...] per lane -> [k + 1, n, ...]     (same last step and fill: one table)
    kept samples:      [1, ...] per lane and step     -> [n, ...]

After the call every unit the call wrote is cut back into the lanes, row j to lane j (`split_branch`). Signal
references (probe residual, previous inputs, provider memories) are not merged: they were read and written when
each lane decided on its own row.

What each row already evaluated while it decided is not evaluated again for the sub-batch: the forecasts its finite
check read (`merge_forecasts`: the rows' own, stacked).

`merge_branches` returns None where the lanes' caches cannot be one batch (a low-precision cache, the CFG difference's
state, Taylor tables at different steps, a cached tensor without a batch dimension): those rows then run one by one.
"""

from __future__ import annotations

from typing import Any

import torch

from ..actions import Action
from .cache_state import BranchState, UnitHistory
from .call_state import CallState
from .decision import unit_of

FORECAST = Action.FORECAST.value

_Snapshot = tuple[int, Any, int, int]  # (id(tables), last_step, filled, number of kept samples) of a merged history


def merge_branches(states: list[BranchState], computes_all: bool) -> tuple[BranchState, dict] | None:
    """The lanes' branch states as one (their cached tensors stacked in lane order) and a snapshot of it for
    `split_branch`; None where they cannot be. computes_all: the call computes every unit, so a REUSE table
    (order 0) is not read and is left out (the call writes a new one)."""
    first = states[0]
    if any(s.codec is not None or s.cfg_reference is not None or s.cfg_difference is not None
           or s.chained != first.chained or s.depth != first.depth for s in states):
        return None
    merged = BranchState(chained=set(first.chained), last_compute_step=first.last_compute_step,
                         call_layout=first.call_layout, depth=first.depth, fit_bytes=first.fit_bytes)
    for key in {k for s in states for k in s.units}:
        hists = [s.units.get(key) for s in states]
        plain = all(h is not None and type(h) is UnitHistory and h.tables is not None for h in hists)
        if not plain:
            if any(h is not None and (h.order or h.depth) for h in hists):
                return None  # a Taylor table or kept samples some lane lacks: the lanes are at different places
            continue  # a unit some lane has nothing cached for is computed by all of them (the same action row)
        if computes_all and hists[0].order == 0 and not hists[0].depth:
            continue
        history = _merge_history(hists)
        if history is None:
            return None
        merged.units[key] = history
    return merged, _snapshot(merged)


def _merge_history(hists: list[UnitHistory]) -> UnitHistory | None:
    first = hists[0]
    batch_dim = 0 if first.order == 0 else 1
    if any(h.order != first.order or h.filled != first.filled or (first.order and h.last_step != first.last_step)
           or [s for s, _ in h.samples] != [s for s, _ in first.samples] or len(h.tables) != len(first.tables)
           for h in hists):
        return None
    tables = [[h.tables[i] for h in hists] for i in range(len(first.tables))]
    if not all(_stackable(ts, batch_dim) for ts in tables):
        return None
    merged = UnitHistory(first.order, first.depth)
    merged.key, merged.layout, merged.filled, merged.last_step = first.key, first.layout, first.filled, first.last_step
    merged.tables = [torch.cat(ts, dim=batch_dim) for ts in tables]
    for j, (step, _) in enumerate(first.samples):
        per_stream = [[h.samples[j][1][i] for h in hists] for i in range(len(first.samples[j][1]))]
        if not all(_stackable(ts, 0) for ts in per_stream):
            return None
        merged.samples.append((step, [torch.cat(ts) for ts in per_stream]))
    return merged


def merge_forecasts(calls: list[CallState]) -> dict[Any, list[torch.Tensor]]:
    """The forecasts the rows' decisions evaluated (CallState.served of their FORECAST units, each [1, ...]), stacked
    in row order, for the sub-batch's call to serve: a forecast is evaluated once per row, not again on the stacked
    Taylor tables. A unit whose forecasts do not stack is left out (the sub-batch evaluates it)."""
    first = calls[0]
    merged = {}
    for key, tensors in first.served.items():
        if first.actions[unit_of(key)] != FORECAST \
                or not all(key in c.served and len(c.served[key]) == len(tensors) for c in calls):
            continue
        per_stream = [[c.served[key][i] for c in calls] for i in range(len(tensors))]
        if all(_stackable(ts, 0) for ts in per_stream):
            merged[key] = [torch.cat(ts) for ts in per_stream]
    return merged


def _stackable(tensors: list[torch.Tensor], dim: int) -> bool:
    """One row each along `dim`, the same shape otherwise."""
    shape = tensors[0].shape
    return len(shape) > dim and shape[dim] == 1 and all(t.shape == shape for t in tensors)


def _snapshot(merged: BranchState) -> dict[Any, _Snapshot]:
    return {key: (id(h.tables), h.last_step, h.filled, len(h.samples)) for key, h in merged.units.items()}


def split_branch(merged: BranchState, before: dict[Any, _Snapshot], states: list[BranchState]) -> None:
    """Write what the sub-batch's call changed back into the lanes (row j of every written tensor to lane j): units
    it stored, units it dropped (a stack segment chained into the previous one), the chained lists and the call's
    output layout. Units it only served stay as each lane has them."""
    n = len(states)
    for key in set(before) - set(merged.units):
        for s in states:
            s.units.pop(key, None)
    for key, history in merged.units.items():
        if before.get(key) == (id(history.tables), history.last_step, history.filled, len(history.samples)):
            continue  # served, not written
        batch_dim = 0 if history.order == 0 else 1
        for j, s in enumerate(states):
            own = s.history(key, history.order)
            own.layout, own.filled, own.last_step = history.layout, history.filled, history.last_step
            own.tables = [_row(t, j, n, batch_dim, key) for t in history.tables or []] if history.tables else None
            own.samples = [(step, [_row(t, j, n, 0, key) for t in ts]) for step, ts in history.samples]
    for s in states:
        s.chained = set(merged.chained)
        s.call_layout = merged.call_layout


def _row(t: torch.Tensor, j: int, n: int, dim: int, key: Any) -> torch.Tensor:
    if t.dim() <= dim or t.shape[dim] != n:
        raise RuntimeError(f"dcache: the cached tensor of unit {key!r} has shape {tuple(t.shape)}, with no batch "
                           f"dimension of {n} rows at dim {dim} to give each sample its own; apply with "
                           f"decisions='batch' for this model.")
    row = t.narrow(dim, j, 1)
    return row if dim == 0 else row.contiguous()  # a Taylor table is updated in place: its own memory


__all__ = ["merge_branches", "split_branch", "merge_forecasts"]
