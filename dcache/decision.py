"""The decision step of one transformer call: signals to the host, the schedule's row, feasibility.

    values = every signal the schedule reads (one host transfer, dcache.signal_meter)
    row    = schedule.decide(CallContext(step, branch, timestep, values, ...))    one action character per unit
    row'   = the unit kind's `feasible(row)`: COMPUTE where a unit has nothing cached in this branch
"""

from __future__ import annotations

from typing import Any

from .call_state import CallState
from .schedule import CallContext, normalize_actions
from .signal_providers import signal_name


def decide(engine: Any, call: CallState) -> None:
    """Set `call.actions` (and the pre signals recorded with them)."""
    bstate = call.bstate
    meter = engine.meter
    values = meter.read(call)
    timesteps = call.record.timesteps
    timestep = timesteps[call.step] if timesteps and call.step < len(timesteps) else None
    ctx = CallContext(step=call.step, num_steps=call.record.num_steps, branch=call.branch,
                      call_index=call.call_index, timestep=timestep, signals=values,
                      last_compute_step=bstate.last_compute_step)
    call.signal_values = {signal_name(k): v for k, v in values.items() if k in meter.pre}
    row = normalize_actions(engine.schedule.decide(ctx), len(engine.units))
    call.actions = engine.executor.feasible(row, bstate)
