"""STACK granularity: one unit, the blocks between the probe (front) and tail (back) blocks, reused as one residual.

Stack reuse without rewriting any forward: the middle blocks of each block list form a segment; on REUSE the first
middle block of a list returns `input + cached segment residual` (FORECAST: its Taylor forecast) and the other middle
blocks pass their input through untouched (no compute); probe and tail blocks always run. Where one list's segment
output flows unchanged into the next list's (Flux: double -> single blocks) the two segments are one *run* with one
cached residual per stream (`_segment_start`). Cache keys: ("seg", first list of the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..call_runtime import CallRuntime
from ..call_state import BlockSlot, CallState
from ..cache_state import BranchState
from ..unit_store import add_cached, apply_cached, store_residuals
from .base import COMPUTE
from .hooked_blocks import HookedBlocks, traced_ops, traced_residuals


@dataclass
class StackRun:
    """The stack kind's state of one transformer call."""

    # the open run of middle segments (start list, its hidden and encoder inputs) and a finished run whose store
    # waits for the next list's first block (which may continue it, see StackExecutor._segment_start)
    run: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
    finished_run: tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None
    probe_residual: torch.Tensor | None = None
    # computed call: what the transformer added *between* the open run's middle blocks (ControlNet / VACE
    # residuals: the next block's input is not the tensor the previous block returned). Kept out of the cached
    # residual, because on a reused call the forward loop adds this call's own samples after every pass-through
    # block again. run_last_out: (hidden, encoder) the previous middle block returned.
    run_last_out: tuple[Any, Any] | None = None
    run_between: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    # a segment of a list whose stream is edited in place (BlockList.adds_in_place): its blocks' own residuals,
    # summed as each block returns (run_block_in: the running block's inputs)
    run_own: list[torch.Tensor | None] | None = None
    run_block_in: tuple[Any, Any] | None = None


def assign_stack_roles(slots: list[BlockSlot], probe: int, tail: int) -> None:
    """probe / middle / tail roles, and each list's first and last middle block."""
    n = len(slots)
    if probe < 0 or tail < 0 or probe + tail >= n:
        fix = (f"use probe_blocks + tail_blocks <= {n - 1} (e.g. probe_blocks=1, tail_blocks=0)" if n > 1 else
               "a model with one block has no room for a probe block and a cached middle: use a method that "
               "needs no probe block (e.g. 'fixed_interval', 'magcache', or taylorseer with "
               "granularity='block')")
        raise ValueError(f"probe_blocks={probe} and tail_blocks={tail} leave no block to cache in a model with "
                         f"{n} block{'s' if n != 1 else ''}; {fix}.")
    for s in slots:
        s.role = "probe" if s.index < probe else "tail" if s.index >= n - tail else "middle"
    middle = [s for s in slots if s.role == "middle"]
    for li in {s.list_index for s in middle}:
        members = [s for s in middle if s.list_index == li]
        members[0].segment_first = True
        members[-1].segment_last = True


# A call of the stack kind: its unit state is the StackRun.
StackCall = CallState[StackRun]


class StackExecutor(HookedBlocks[StackRun]):
    kind = "stack"

    def __init__(self, runtime: CallRuntime):
        super().__init__(runtime)
        self.segment_lists = tuple(s.list_index for s in self.blocks if s.segment_first)

    def assign_roles(self, slots: list[BlockSlot], probe: int, tail: int) -> None:
        assign_stack_roles(slots, probe, tail)
        self.decision_block = probe

    def exit_work(self, slot: BlockSlot) -> bool:  # the probe output (signals), middle blocks (runs), the last block
        return (slot.index == self.last_block or (slot.role == "probe" and slot.index == self.decision_block - 1)
                or slot.role == "middle")

    def unit_names(self) -> tuple[str, ...]:
        return ("stack",)

    def new_call(self) -> StackRun:
        return StackRun()

    def servable(self, bstate: BranchState, unit: int) -> bool:
        return bool(bstate.units) and all(bstate.units.get(("seg", li)) is not None
                                          for li in self.segment_lists if li not in bstate.chained)

    def end_call(self, call: StackCall | None) -> None:
        super().end_call(call)  # a decided call: what its graph computed first
        if call is not None and call.actions is not None and call.unit.finished_run is not None:
            self._store_run(call)  # the forward returned before the next list's first block

    # ------------------------------------------------------------------------------------------------ block steps
    def decided(self, call: StackCall) -> None:
        self.runtime.meter.after_probe_decision(call, call.unit.probe_residual)

    def served(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        if slot.role != "middle":  # probe and tail blocks always run
            return None
        action = call.actions[0]
        if action == COMPUTE:
            return None
        if not slot.segment_first or slot.list_index in call.bstate.chained:
            return slot.slots.make_output(hidden, encoder)  # skipped: the run's residual was applied already
        runtime = self.runtime
        return apply_cached(runtime.ops, runtime.schedule, slot, call.bstate.units[("seg", slot.list_index)], action,
                            call.step, hidden, encoder, call)

    def before_run(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any) -> None:
        if slot.role != "middle":
            return
        state = call.unit
        if slot.segment_first:
            self._segment_start(call, slot, hidden, encoder)
        elif state.run_own is None and state.run_last_out is not None:
            self._note_between(state, hidden, encoder)
        if state.run_own is not None:
            state.run_block_in = (hidden, encoder)

    def after_run(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        state = call.unit
        if slot.role == "probe" and slot.index == self.decision_block - 1:
            residual = self.runtime.meter.on_probe_output(call, slot.slots.split_output(out)[0])
            if residual is not None:
                state.probe_residual = residual
        elif slot.role == "middle":
            self._after_middle(call, slot, out)

    def _after_middle(self, call: StackCall, slot: BlockSlot, out: Any, traced: bool = False) -> None:
        """A middle block ran: the open run's bookkeeping; its last block finishes the run."""
        state = call.unit
        if state.run is not None:
            out_h, out_e = slot.slots.split_output(out)
            state.run_last_out = (out_h, out_e)
            if state.run_own is not None:  # read now: the transformer may write into out_h once we return
                for i, (o, x) in enumerate(zip((out_h, out_e), state.run_block_in)):
                    if isinstance(o, torch.Tensor) and isinstance(x, torch.Tensor) and o.shape == x.shape:
                        state.run_own[i] = o - x if state.run_own[i] is None else state.run_own[i] + (o - x)
            if slot.segment_last:
                start, seg_h, seg_e = state.run
                state.run = None
                state.finished_run = (start, seg_h, seg_e, out_h, out_e)
                if slot.list_index == self.segment_lists[-1]:
                    self._store_run(call, traced)

    # ------------------------------------------------------------------------------------------------ decided calls
    def decided_served(self, call: StackCall) -> list[tuple[Any, str]]:
        action = call.actions[0]
        if action == COMPUTE:
            return []
        return [(("seg", li), action) for li in self.segment_lists if li not in call.bstate.chained]

    def block_ran(self, call: StackCall, slot: BlockSlot) -> bool:
        return slot.role != "middle" or call.actions[0] == COMPUTE

    def traced_served(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        if slot.role != "middle" or call.actions[0] == COMPUTE:
            return None
        if not slot.segment_first or slot.list_index in call.bstate.chained:
            return slot.slots.make_output(hidden, encoder)
        return add_cached(traced_ops(), slot, call.decided.served[("seg", slot.list_index)], hidden, encoder)

    def traced_before_run(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any) -> None:
        if slot.role != "middle":
            return
        state = call.unit
        if slot.segment_first:
            self._segment_start(call, slot, hidden, encoder, traced=True)
        elif state.run_own is None and state.run_last_out is not None:
            self._note_between(state, hidden, encoder)
        if state.run_own is not None:
            state.run_block_in = (hidden, encoder)

    def traced_after_run(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        if slot.role == "middle":  # probe blocks: a decided call reads no signal
            self._after_middle(call, slot, out, traced=True)

    # ------------------------------------------------------------------------------------------------ runs
    def _segment_start(self, call: StackCall, slot: BlockSlot, hidden: Any, encoder: Any,
                       traced: bool = False) -> None:
        """A computed call enters a list's middle segment. When the previous list's segment output flows into this
        block unchanged (the same tensor objects: the transformer does nothing between the two lists, as in Flux's
        double -> single blocks), the two segments are one run with one cached residual per stream, so a skipped
        call adds 2 residuals instead of 4 and a computed one stores 2 instead of 4. Exact for REUSE and Taylor
        FORECAST (both linear in the cached residuals: r_run = r_0 + r_1); `Schedule.segment_runs` turns it off
        (a learned forecaster keeps one unit per list, the units its predictor was trained on)."""
        state = call.unit
        bstate, li = call.bstate, slot.list_index
        schedule = self.runtime.schedule
        done = state.finished_run
        if done is not None and hidden is done[3] and encoder is done[4] and schedule.segment_runs \
                and state.run_own is None and not slot.spec.adds_in_place:
            state.finished_run = None
            state.run = done[:3]  # continue the run: its inputs stay those of its first list
            if traced:  # the branch state changes eagerly, after the graph (HookedBlocks.end_decided)
                call.decided.edits.append(("chain", li))
            else:
                bstate.chained.add(li)
                bstate.units.pop(("seg", li), None)  # a per-list residual from before would be stale
            return
        self._store_run(call, traced)
        if traced:
            call.decided.edits.append(("unchain", li))
        else:
            bstate.chained.discard(li)
        state.run_last_out, state.run_between = None, [None, None]
        state.run_own = [None, None] if slot.spec.adds_in_place else None
        if call.decided.may_reuse[0] if traced else schedule.may_reuse(call.branch, 0):
            state.run = (li, hidden, encoder)

    @staticmethod
    def _note_between(state: StackRun, hidden: Any, encoder: Any) -> None:
        """A middle block of the open run receives something other than what the previous one returned: the
        transformer added to the stream between them (`h = h + controlnet_block_samples[i]`). Accumulate it per
        stream; the run's cached residual is (out - in) - sum(additions), the blocks' own contribution."""
        for i, (now, before) in enumerate(zip((hidden, encoder), state.run_last_out)):
            if now is before or not isinstance(now, torch.Tensor) or not isinstance(before, torch.Tensor) \
                    or now.shape != before.shape:
                continue
            added = now - before
            total = state.run_between[i]
            state.run_between[i] = added if total is None else total + added

    def _store_run(self, call: StackCall, traced: bool = False) -> None:
        """Cache the finished run's residual (out - in per stream) under its first list's key (traced: computed in
        the graph, stored after it)."""
        state = call.unit
        done, state.finished_run = state.finished_run, None
        if done is None:
            return
        start, seg_h, seg_e, out_h, out_e = done
        if state.run_own is not None:  # in-place edits: the residual is the blocks' own, summed block by block
            own_h, own_e = state.run_own
            out_h = seg_h + own_h if own_h is not None else out_h
            out_e = seg_e + own_e if own_e is not None and seg_e is not None else out_e
            state.run_own = None
        add_h, add_e = state.run_between
        if add_h is not None:
            out_h = out_h - add_h
        if add_e is not None:
            out_e = out_e - add_e
        if traced:
            call.decided.edits.append(("store", ("seg", start), traced_residuals([out_h, out_e], [seg_h, seg_e])))
            return
        runtime = self.runtime
        store_residuals(runtime.ops, call, ("seg", start), runtime.order, [out_h, out_e], [seg_h, seg_e])
