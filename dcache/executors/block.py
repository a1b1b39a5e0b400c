"""BLOCK granularity: one unit per transformer block, in execution order across block lists ("b0", "b1", ...).

A reused block returns `input + its cached residual` per stream (FORECAST: the Taylor forecast of the residual);
a computed one stores `output - input`. Cache keys: the block's index.
"""

from __future__ import annotations

from typing import Any

from ..call_state import BlockSlot, CallState
from ..unit_store import apply_cached, store_residuals
from .base import COMPUTE
from .hooked_blocks import HookedBlocks


class BlockExecutor(HookedBlocks):
    kind = "block"

    def exit_work(self, slot: BlockSlot) -> bool:
        return True  # every computed block stores its residual

    def unit_names(self) -> tuple[str, ...]:
        return tuple(f"b{s.index}" for s in self.blocks)

    def served(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        action = call.actions[slot.index]
        if action == COMPUTE:
            return None
        engine = self.engine
        return apply_cached(engine.ops, engine.schedule, slot, call.bstate.units[slot.index], action, call.step,
                            hidden, encoder)

    def after_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        engine = self.engine
        if engine.schedule.may_reuse(call.branch, slot.index):
            out_h, out_e = slot.slots.split_output(out)
            store_residuals(engine.ops, call, slot.index, engine.order, [out_h, out_e], [hidden, encoder])
