"""The interface every unit kind implements, and the block layout they share.

A unit is what one action character addresses: the block stack (`stack`), one block (`block`), one inner module of a
block (`module`), or the whole transformer call (`call`). Each kind has one executor (a `UnitExecutor` subclass in
this package) that the engine builds once per apply:

    layout            the engine's `BlockSlot`s (every kind lays out the blocks: FLOP book, GenerationInfo)
    unit_names()      one name per action character, in row order
    install / remove  the hooks of the kind's units (block and module hooks; the call kind hooks nothing)
    start_generation  per-generation work (the module kind re-hooks modules swapped since, e.g. by LoRA)
    new_call()        the kind's own state of one transformer call (CallState.unit: StackRun, ModuleCalls, WholeCall)
    servable(...)     whether a unit has something cached in a branch (else the decision step computes it)
    decided_early     a call decided when it opened: what the units' traced path reads (block kinds)
    enter / exit      the unit's hook entry points: serve it from the cache, or run it and store its result (enter
                      hands exit a `UnitRun`, the hook's state)
    abort_unit        the unit hook's third entry point: its forward raised
    end_call / abort_call   the transformer call ended / raised
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...actions import Action
from ...model.adapters import Adapter
from ..call_runtime import CallRuntime
from ..call_state import BlockSlot, CallState, UnitState
from ..hooks import traced_twins
from ..cache_state import BranchState
from ..block_io import StreamSlots

# Action letters as plain strings: the hot path compares them per unit, and Enum.value is a property lookup.
COMPUTE, REUSE, FORECAST = Action.COMPUTE.value, Action.REUSE.value, Action.FORECAST.value


@dataclass(slots=True)
class UnitRun:
    """A running unit's hook state: what its `enter` hands its `exit` (and its `abort_unit` if the forward raises)."""

    call: CallState
    shape: tuple  # the unit's input shape: its FLOP-book key with the unit
    counter: FlopCounterMode | None  # open around the forward while the unit's FLOPs on `shape` are unknown


class UnitExecutor(Generic[UnitState]):
    kind: str = ""  # "stack" | "block" | "module" | "call"
    entry_points: tuple[str, ...] = ()  # hook entry points that get a `_traced` twin (dcache.runtime.hooks)
    segment_lists: tuple[int, ...] = ()  # STACK: block lists with a cached middle segment, in order
    composed_units: list[tuple[int, tuple[int, ...]]] = []  # MODULE: (unit, its input units), Adapter.composed
    # its units have a traced path for calls decided when they open (Engine.step_decided;
    # dcache.runtime.hooks.UnitHook)
    traces_decided_calls: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        traced_twins(cls, cls.entry_points)

    def __init__(self, runtime: CallRuntime):
        self.runtime = runtime
        self.decision_block = 0  # the block whose hook decides (STACK: the first after the probe blocks)
        self.blocks = layout_blocks(runtime.transformer, runtime.adapter)
        self.assign_roles(self.blocks, int(runtime.schedule.probe_blocks), int(runtime.schedule.tail_blocks))
        self.last_block = len(self.blocks) - 1

    # ------------------------------------------------------------------------------------------------ layout
    def assign_roles(self, slots: list[BlockSlot], probe: int, tail: int) -> None:
        if probe or tail:
            raise ValueError(f"probe_blocks/tail_blocks apply to STACK granularity only, not {self.kind}.")

    def unit_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ lifetime
    def install(self) -> None:
        """Register the kind's hooks (after the transformer hook)."""

    def remove(self) -> None:
        """Remove hooks the transformer's recursive removal cannot reach (modules swapped out of the tree)."""

    def start_generation(self) -> None:
        """A generation starts."""

    def new_call(self) -> UnitState:
        raise NotImplementedError

    def decided_early(self, call: CallState) -> None:
        """The call was decided when it opened (Engine.begin_call): prepare what its traced path reads."""

    def end_call(self, call: CallState | None) -> None:
        """The transformer call returned (call: None when it was not tracked)."""

    def abort_call(self, call: CallState | None) -> None:
        """The transformer call or one of its units raised."""

    def abort_unit(self, state: UnitRun | str | None) -> None:
        """A unit's forward raised (state: what its enter returned) or the transformer call did (state None): close
        the unit's FLOP counter and drop the call (its record entry is never written)."""
        if isinstance(state, UnitRun):
            self.runtime.flops.stop(state.counter, None, None)
        self.abort_call(self.runtime.call)
        self.runtime.drop_call()

    # ------------------------------------------------------------------------------------------------ decisions
    def decided_served(self, call: CallState) -> list[tuple[Any, str]]:
        """(cache key, action) of every cached unit the decided call serves."""
        return []

    def servable(self, bstate: BranchState, unit: int) -> bool:
        """True when `unit` can be served from the branch's cache now."""
        hist = bstate.units.get(unit)
        return hist is not None and hist.tables is not None

    def feasible(self, row: str, bstate: BranchState) -> str:
        """The schedule's row with COMPUTE wherever a unit has nothing cached yet in this branch (first call, new
        shapes)."""
        if COMPUTE * len(row) == row:
            return row
        return "".join(a if a == COMPUTE or self.servable(bstate, i) else COMPUTE for i, a in enumerate(row))


def layout_blocks(transformer: nn.Module, adapter: Adapter) -> list[BlockSlot]:
    """One BlockSlot per block of the adapter's block lists, in execution order (none for an adapter that lists no
    block lists: a model cached as one call, a ControlNet)."""
    slots: list[BlockSlot] = []
    slot_cache: dict[tuple[type, int], StreamSlots] = {}
    for list_index, block in adapter.blocks(transformer):
        spec = adapter.block_lists[list_index]
        key = (type(block), list_index)
        if key not in slot_cache:
            slot_cache[key] = StreamSlots.for_block(block, spec)
        slots.append(BlockSlot(len(slots), list_index, block, spec, slot_cache[key],
                               modules=adapter.module_names(block)))
    if not slots and adapter.block_lists:
        raise ValueError(f"{type(transformer).__name__} has no blocks in {adapter.block_lists}; "
                         f"nothing to cache.")
    return slots
