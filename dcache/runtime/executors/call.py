"""Call scope (`scope="call"`, dcache.runtime.call_scope): the whole transformer call is the unit.

The decision is taken before the transformer runs (the row addresses the one "stack" unit, so stack schedules and
plans work unchanged); REUSE returns x + Delta without running the transformer (FORECAST: Delta's Taylor forecast),
COMPUTE runs the bare model (no block is hooked) and caches Delta = v - x and the output's layout. With a schedule's
`cfg_difference`, the unconditional branch's served calls are Delta_c - D^ (dcache.runtime.cfg_difference). FLOPs are
the whole call's, counted on the first computed call of each input shape. Cache key: "call".

A model whose output is not shaped like its latent input (a ControlNet's per-block samples) is cached whole instead
(`CallRuntime.call_output`, dcache.runtime.call_output.PlainOutput): REUSE / FORECAST serve the output's cached
tensors (their Taylor forecast), rescaled to the call's scale argument; FLOPs and servability are keyed by the shapes
of all of its tensor arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from ..cache_ops import ops_for
from ..call_output import served_later
from ..call_runtime import CallRuntime
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


@dataclass
class WholeCall:
    """The call kind's state of one transformer call."""

    counter: FlopCounterMode | None = None  # open around a computed call whose FLOPs on its shape are unknown


WholeCallState = CallState[WholeCall]


class CallExecutor(UnitExecutor[WholeCall]):
    kind = "call"
    entry_points = ("call_enter", "call_exit")

    def __init__(self, runtime: CallRuntime):
        super().__init__(runtime)
        self.latent = None  # the running call's latent input x
        # split CFG: the unconditional branch served through the CFG difference (dcache.runtime.cfg_difference)
        self.cfg = CfgDifference(runtime) if getattr(runtime.schedule, "cfg_difference", False) else None
        self.output = runtime.call_output  # None: x + Delta; a PlainOutput: the whole output reused
        self.entry: tuple | None = None  # PlainOutput: the running call's (signature, scale)

    def new_call(self) -> WholeCall:
        return WholeCall()

    def assign_roles(self, slots: list[BlockSlot], probe: int, tail: int) -> None:
        if slots:  # a model cached as one call lays out no blocks
            assign_stack_roles(slots, probe, tail)  # the stack's layout (check_scope refused probe and tail blocks)

    def unit_names(self) -> tuple[str, ...]:
        return ("stack",)

    def decided_served(self, call: WholeCallState) -> list[tuple[Any, str]]:
        """The cached Delta a reused call serves (dcache.runtime.decision checks it is finite)."""
        action = call.actions[0]
        return [] if action == COMPUTE or CALL_UNIT not in call.bstate.units else [(CALL_UNIT, action)]

    def servable(self, bstate: BranchState, unit: int) -> bool:
        hist = bstate.units.get(CALL_UNIT)
        if self.output is not None:
            return hist is not None and hist.tables is not None and \
                self.output.factor(bstate.call_layout, *self.entry) is not None
        return hist is not None and bstate.call_layout is not None and hist.matches([self.latent])

    def end_call(self, call: WholeCallState | None) -> None:
        self.latent = self.entry = None

    def abort_call(self, call: WholeCallState | None) -> None:
        if call is not None and call.unit.counter is not None:  # counting the whole call
            counter, call.unit.counter = call.unit.counter, None
            self.runtime.flops.stop(counter, None, None)
        self.latent = self.entry = None

    # ------------------------------------------------------------------------------------------------ entry points
    def call_enter(self, forward: Any, args: tuple, kwargs: dict, compiling: bool = False) -> tuple[bool, Any]:
        """Decide before the transformer runs. (True, None) runs it; (False, out) returns x + Delta (or its Taylor
        forecast) without running it (compiling: out is a function that builds it, for dynamo to compile). The unit
        is the whole call, so its FLOPs (embedders and head included) are counted on the first computed call of each
        input shape."""
        runtime = self.runtime
        call = runtime.call  # opened by Engine.begin_call
        if call is None:  # outside the generations of an engine that opens none itself (Engine's own_generations)
            return True, None
        if self.output is not None:
            return self._enter_plain(call, forward, args, kwargs, compiling)
        x = latent_input(runtime.call_arguments() or {}, args)
        if x is None:
            raise ValueError(f"scope='call' reads the latent input `hidden_states` of the transformer call, but "
                             f"{type(runtime.transformer).__name__} got {type(x).__name__}; use scope='blocks'.")
        runtime.ops = ops_for(x)
        self.latent = x
        bstate = call.bstate
        if call.record.input_shape is None:
            call.record.input_shape = tuple(x.shape)
        if call.phase != RESUMED:  # a resumed call (dcache.runtime.lanes) measured and decided when it opened
            if runtime.meter.latent_providers:
                runtime.meter.on_latents(call, x.detach().clone())  # pipelines may update their latents in place
            decide(runtime, self, call)
        shape = x.shape
        action = self._decided(call, shape, forward, args, kwargs, compiling)
        if action == COMPUTE:
            return True, None
        flops = runtime.flops
        forecast = action == FORECAST
        delta = self.cfg.served(call, forecast) if self.cfg is not None else None  # dcache.runtime.cfg_difference
        if delta is None:
            delta = read_cached(runtime.schedule, bstate.units[CALL_UNIT], action, call.step, call)[0]
        if self.cfg is not None:
            self.cfg.note(call, delta, computed=False)
        call.flops_total = flops.cost(CALL_UNIT, shape) or 0.0
        if compiling:  # the caller (hooks.transformer_call) runs it: dynamo compiles x + Delta too
            return False, functools.partial(serve_call, bstate.call_layout, x, delta)
        return False, bstate.call_layout.build(runtime.ops.apply(x, delta))

    def _decided(self, call: WholeCallState, key: Any, forward: Any, args: tuple, kwargs: dict,
                 compiling: bool) -> str:
        """The decided call's action (a call opened to decide only stops here); a computed call's FLOPs are counted
        under `key`, its FLOP-book key."""
        if call.phase == DECIDING:
            raise CallDecided()
        action = call.actions[0]
        if action == COMPUTE:
            flops = self.runtime.flops
            if compiling:
                flops.count(CALL_UNIT, key, forward, args, kwargs)  # a dispatch mode would stop dynamo
            else:
                call.unit.counter = flops.start(CALL_UNIT, key)
        return action

    def call_exit(self, out: Any) -> Any:
        """Computed call: cache Delta = v - x and the output's layout; post signals read x and v."""
        runtime = self.runtime
        call, x = runtime.call, self.latent
        if self.output is not None and call is not None and self.entry is not None:
            return self._exit_plain(call, out)
        if call is None or x is None:
            return out
        bstate = call.bstate
        flops = runtime.flops
        if call.unit.counter is not None:
            counter, call.unit.counter = call.unit.counter, None
            flops.stop(counter, CALL_UNIT, x.shape)
        call.flops_total = call.flops_computed = flops.cost(CALL_UNIT, x.shape) or 0.0
        layout, v = output_layout(out, x, type(runtime.transformer).__name__)
        bstate.call_layout = layout
        call.stack_input, call.stack_output = x, v
        if self.cfg is not None:  # before the branch's cache learns this step: it scores the cache's forecast of it
            self.cfg.note(call, (v - x).detach(), computed=True)
        if runtime.schedule.may_reuse(call.branch, 0):
            store_residuals(runtime.ops, call, CALL_UNIT, runtime.order, [v], [x])
        return out

    # ------------------------------------------------------------------------------------------------ whole outputs
    def _enter_plain(self, call: WholeCallState, forward: Any, args: tuple, kwargs: dict,
                     compiling: bool) -> tuple[bool, Any]:
        """call_enter for an output reused whole (dcache.runtime.call_output): (False, the cached tensors, or their
        forecast, rescaled to this call's scale, in the output's structure) or (True, None) to run the model."""
        runtime, output = self.runtime, self.output
        self.entry = signature, scale = output.key(runtime.call_arguments() or {}, args, kwargs)
        if call.phase != RESUMED:
            decide(runtime, self, call)
        action = self._decided(call, signature, forward, args, kwargs, compiling)
        if action == COMPUTE:
            return True, None
        bstate = call.bstate
        tensors = read_cached(runtime.schedule, bstate.units[CALL_UNIT], action, call.step, call)
        call.flops_total = runtime.flops.cost(CALL_UNIT, signature) or 0.0
        out = bstate.call_layout.build(tensors, output.factor(bstate.call_layout, signature, scale))
        return False, served_later(out) if compiling else out

    def _exit_plain(self, call: WholeCallState, out: Any) -> Any:
        """call_exit for an output reused whole: cache its tensors and structure (a history that another scale,
        other argument shapes or another structure would mix starts over)."""
        runtime, output = self.runtime, self.output
        signature, scale = self.entry
        flops = runtime.flops
        if call.unit.counter is not None:
            counter, call.unit.counter = call.unit.counter, None
            flops.stop(counter, CALL_UNIT, signature)
        call.flops_total = call.flops_computed = flops.cost(CALL_UNIT, signature) or 0.0
        if runtime.schedule.may_reuse(call.branch, 0):
            bstate = call.bstate
            layout, tensors = output.layout(out, signature, scale)
            if not output.continues(bstate.call_layout, layout):
                bstate.units.pop(CALL_UNIT, None)
            bstate.call_layout = layout
            bstate.history(CALL_UNIT, runtime.order).update(tensors, call.step)
        return out
