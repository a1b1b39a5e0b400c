"""Call scope (`scope="call"`, dcache.runtime.call_scope): the whole transformer call is the unit.

The decision is taken before the transformer runs (the row addresses the one "stack" unit, so stack schedules and
plans work unchanged); REUSE returns x + Delta without running the transformer (FORECAST: Delta's Taylor forecast),
COMPUTE runs the bare model (no block is hooked) and caches Delta = v - x and the output's layout. With a schedule's
`cfg_difference`, the unconditional branch's served calls are Delta_c - D^ (dcache.runtime.cfg_difference). FLOPs are
the whole call's, counted on the first computed call of each input shape. Cache key: "call".
"""

from __future__ import annotations

import functools
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from ...actions import Signal
from ..cache_ops import ops_for
from ..call_scope import CALL_UNIT, latent_input, output_layout
from ..call_state import DECIDING, RESUMED, BlockSlot, CallDecided, CallState
from ..cfg_difference import CfgDifference
from ..decision import decide
from ..cache_state import BranchState
from ..unit_store import read_cached, store_residuals
from .base import COMPUTE, FORECAST, UnitExecutor
from .hooked_blocks import traced_ops
from .stack import assign_stack_roles


def serve_call(layout: Any, x: Any, delta: Any) -> Any:
    """A reused call's output, x + Delta in the call's output layout. Under torch.compile the transformer's eager
    frame calls it, so dynamo compiles it as a graph of its own (with fullgraph=True a call must compile a frame)."""
    return layout.build(traced_ops().apply(x, delta))



class CallExecutor(UnitExecutor):
    kind = "call"
    entry_points = ("call_enter", "call_exit")

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.latent = None  # the running call's latent input x
        # split CFG: the unconditional branch served through the CFG difference (dcache.runtime.cfg_difference)
        self.cfg = CfgDifference(engine) if getattr(engine.schedule, "cfg_difference", False) else None

    def assign_roles(self, slots: list[BlockSlot], probe: int, tail: int) -> None:
        assign_stack_roles(slots, probe, tail)  # the stack's layout (check_scope refused probe and tail blocks)

    def unit_names(self) -> tuple[str, ...]:
        return ("stack",)

    def decided_served(self, call: CallState) -> list[tuple[Any, str]]:
        """The cached Delta a reused call serves (dcache.runtime.decision checks it is finite)."""
        action = call.actions[0]
        return [] if action == COMPUTE or CALL_UNIT not in call.bstate.units else [(CALL_UNIT, action)]

    def servable(self, bstate: BranchState, unit: int) -> bool:
        hist = bstate.units.get(CALL_UNIT)
        return hist is not None and bstate.call_layout is not None and hist.matches([self.latent])

    def end_call(self, call: CallState | None) -> None:
        self.latent = None

    def abort_call(self, call: CallState | None) -> None:
        if call is not None and isinstance(call.unit, FlopCounterMode):  # counting the whole call
            self.engine.flops.stop(call.unit, None, None)
        self.latent = None

    # ------------------------------------------------------------------------------------------------ entry points
    def call_enter(self, forward: Any, args: tuple, kwargs: dict, compiling: bool = False) -> tuple[bool, Any]:
        """Decide before the transformer runs. (True, None) runs it; (False, out) returns x + Delta (or its Taylor
        forecast) without running it (compiling: out is a function that builds it, for dynamo to compile). The unit
        is the whole call, so its FLOPs (embedders and head included) are counted on the first computed call of each
        input shape."""
        engine = self.engine
        call = engine.call  # opened by Engine.begin_call
        x = latent_input(engine.call_arguments() or {}, args)
        if x is None:
            raise ValueError(f"scope='call' reads the latent input `hidden_states` of the transformer call, but "
                             f"{type(engine.transformer).__name__} got {type(x).__name__}; use scope='blocks'.")
        engine.ops = ops_for(x)
        self.latent = x
        bstate = call.bstate
        if call.record.input_shape is None:
            call.record.input_shape = tuple(x.shape)
        if call.phase != RESUMED:  # a resumed call (dcache.runtime.lanes) measured and decided when it opened
            if Signal.INPUT_DELTA in engine.meter.wanted:
                engine.meter.input_delta(call, x.detach().clone())  # pipelines may update their latents in place
            decide(engine, call)
        if call.phase == DECIDING:
            raise CallDecided()
        action = call.actions[0]
        shape = x.shape
        flops = engine.flops
        if action == COMPUTE:
            if compiling:
                flops.count(CALL_UNIT, shape, forward, args, kwargs)  # a dispatch mode would stop dynamo
            else:
                call.unit = flops.start(CALL_UNIT, shape)
            return True, None
        forecast = action == FORECAST
        delta = self.cfg.served(call, forecast) if self.cfg is not None else None  # dcache.runtime.cfg_difference
        if delta is None:
            delta = read_cached(engine.schedule, bstate.units[CALL_UNIT], action, call.step, call)[0]
        if self.cfg is not None:
            self.cfg.note(call, delta, computed=False)
        call.flops_total = flops.cost(CALL_UNIT, shape) or 0.0
        if compiling:  # the caller (hooks.transformer_call) runs it: dynamo compiles x + Delta too
            return False, functools.partial(serve_call, bstate.call_layout, x, delta)
        return False, bstate.call_layout.build(engine.ops.apply(x, delta))

    def call_exit(self, out: Any) -> Any:
        """Computed call: cache Delta = v - x and the output's layout; post signals read x and v."""
        engine = self.engine
        call, x = engine.call, self.latent
        if call is None or x is None:
            return out
        bstate = call.bstate
        flops = engine.flops
        if call.unit is not None:
            counter, call.unit = call.unit, None
            flops.stop(counter, CALL_UNIT, x.shape)
        call.flops_total = call.flops_computed = flops.cost(CALL_UNIT, x.shape) or 0.0
        layout, v = output_layout(out, x, type(engine.transformer).__name__)
        bstate.call_layout = layout
        call.stack_input, call.stack_output = x, v
        if self.cfg is not None:  # before the branch's cache learns this step: it scores the cache's forecast of it
            self.cfg.note(call, (v - x).detach(), computed=True)
        if engine.schedule.may_reuse(call.branch, 0):
            store_residuals(engine.ops, call, CALL_UNIT, engine.order, [v], [x])
        return out
