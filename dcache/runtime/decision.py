"""The decision step of one transformer call: signals to the host, the schedule's row, feasibility.

    values = every signal the schedule reads (one host transfer, dcache.runtime.signal_meter)
    row    = schedule.decide(CallContext(step, branch, timestep, values, ...))    one action character per unit
    row'   = the unit kind's `feasible(row)`: COMPUTE where a unit has nothing cached in this branch
"""

from __future__ import annotations

from typing import Any, Protocol

from .cache_state import BranchState
from .call_runtime import CallRuntime
from .call_state import CallState
from ..schedule import CallContext, normalize_actions
from .signal_providers import signal_name
from .unit_store import finite_flags, read_cached

_COMPUTE = "C"


class Feasibility(Protocol):
    """What the decision asks the unit kind (dcache.runtime.executors.base.UnitExecutor)."""

    def feasible(self, row: str, bstate: BranchState) -> str: ...

    def decided_served(self, call: CallState) -> list[tuple[Any, str]]: ...


def decide(runtime: CallRuntime, units: Feasibility, call: CallState) -> None:
    """Set `call.actions` (and the pre signals recorded with them); `units`: the executor of the call's unit kind."""
    bstate = call.bstate
    meter = runtime.meter
    values = meter.read(call)
    timesteps = call.record.timesteps
    timestep = timesteps[call.step] if timesteps and call.step < len(timesteps) else None
    ctx = CallContext(step=call.step, num_steps=call.record.num_steps, branch=call.branch,
                      call_index=call.call_index, timestep=timestep, signals=values,
                      last_compute_step=bstate.last_compute_step)
    call.signal_values = {signal_name(k): v for k, v in values.items() if k in meter.pre}
    row = normalize_actions(runtime.schedule.decide(ctx), len(runtime.units))
    call.actions = units.feasible(row, bstate)
    if call.actions != _COMPUTE * len(call.actions):
        _compute_non_finite(runtime, units, call)


def _compute_non_finite(runtime: CallRuntime, units: Feasibility, call: CallState) -> None:
    """Units whose served tensors (the cached value, or its forecast at this step) are not finite compute instead (one
    host read for all of them). What was read is kept in `call.served` for the unit to serve without reading it
    again."""
    row = list(call.actions)
    served = {key: read_cached(runtime.schedule, call.bstate.units[key], action, call.step)
              for key, action in units.decided_served(call)}
    for (key, tensors), finite in zip(served.items(), finite_flags(list(served.values()))):
        unit = unit_of(key)
        if finite:
            call.served[key] = tensors
        elif row[unit] != _COMPUTE:
            row[unit] = _COMPUTE
            runtime.health.served_non_finite(f"{call.branch}/{runtime.units[unit]}", call.step)
    actions = "".join(row)
    if actions != call.actions:
        call.actions = actions
        call.served = {k: v for k, v in call.served.items() if row[unit_of(k)] != _COMPUTE}


def unit_of(key: Any) -> int:
    """The action-row index of a cache key: a block's or module's index, a module's k-th call (index, k), or the
    one unit of the stack ("seg", list) and call scopes."""
    if isinstance(key, int):
        return key
    return key[0] if isinstance(key, tuple) and isinstance(key[0], int) else 0
