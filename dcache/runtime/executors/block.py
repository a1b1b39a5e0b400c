"""BLOCK granularity: one unit per transformer block, in execution order across block lists ("b0", "b1", ...).

A reused block returns `input + its cached residual` per stream (FORECAST: the Taylor forecast of the residual);
a computed one stores `output - input`. Cache keys: the block's index.
"""

from __future__ import annotations

from typing import Any

from ..call_state import BlockSlot, CallState
from ..unit_store import add_cached, apply_cached, store_residuals
from .base import COMPUTE
from .hooked_blocks import HookedBlocks, traced_ops, traced_residuals


class BlockExecutor(HookedBlocks[None]):
    kind = "block"

    def new_call(self) -> None:
        return None  # a block's decision and cache need nothing kept across its hooks

    def exit_work(self, slot: BlockSlot) -> bool:
        return True  # every computed block stores its residual

    def unit_names(self) -> tuple[str, ...]:
        return tuple(f"b{s.index}" for s in self.blocks)

    def served(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        action = call.actions[slot.index]
        if action == COMPUTE:
            return None
        runtime = self.runtime
        return apply_cached(runtime.ops, runtime.schedule, slot, call.bstate.units[slot.index], action, call.step,
                            hidden, encoder, call)

    def after_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        runtime = self.runtime
        if runtime.schedule.may_reuse(call.branch, slot.index):
            out_h, out_e = slot.slots.split_output(out)
            store_residuals(runtime.ops, call, slot.index, runtime.order, [out_h, out_e], [hidden, encoder])

    # ------------------------------------------------------------------------------------------------ decided calls
    def decided_served(self, call: CallState) -> list[tuple[Any, str]]:
        return [(i, a) for i, a in enumerate(call.actions) if a != COMPUTE]

    def block_ran(self, call: CallState, slot: BlockSlot) -> bool:
        return call.actions[slot.index] == COMPUTE

    def traced_served(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        if call.actions[slot.index] == COMPUTE:
            return None
        return add_cached(traced_ops(), slot, call.decided.served[slot.index], hidden, encoder)

    def traced_after_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        decided = call.decided
        if decided.may_reuse[slot.index]:
            out_h, out_e = slot.slots.split_output(out)
            decided.edits.append(("store", slot.index, traced_residuals([out_h, out_e], [hidden, encoder])))
