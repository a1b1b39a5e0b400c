"""The block hook path shared by the stack, block and module kinds.

Every block call is split in three so that, under torch.compile, only the block's own forward is traced:
    enter (eager: bookkeeping, decision, reuse) -> forward (traced) -> exit (eager: caching).
The first block's enter reads the stack input (signals, the kernels' backend); the decision block's enter asks the
schedule (dcache.decision). A kind fills in four steps: `served` (the block's output from the cache, or None),
`before_run`, `after_run` (store) and `decided` (right after the decision).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import HookRegistry

from ..adapters import HIDDEN, UnsupportedModelError
from ..cache_ops import ops_for
from ..call_state import BlockSlot, CallState
from ..decision import decide
from ..hooks import HOOK_NAME, Entries, UnitHook
from .base import UnitExecutor


class HookedBlocks(UnitExecutor):
    entry_points = ("enter", "exit")

    def __init__(self, engine: Any):
        super().__init__(engine)
        self._verified_lists: set[int] = set()  # block lists whose output format was checked (first computed call)
        for s in self.blocks:
            s.exit_work = self.exit_work(s)

    def exit_work(self, slot: BlockSlot) -> bool:
        """Whether the block's exit has more to do than FLOP accounting."""
        return slot.index == self.last_block

    def install(self) -> None:
        engine = self.engine
        entries = Entries(self.enter, self.exit, engine.abort)
        traced = Entries(self.enter_traced, self.exit_traced, engine.abort_traced)
        for slot in self.blocks:
            HookRegistry.check_if_exists_or_initialize(slot.block).register_hook(UnitHook(slot, entries, traced),
                                                                                 HOOK_NAME)

    # ------------------------------------------------------------------------------------------------ kind steps
    def decided(self, call: CallState) -> None:
        """Right after the schedule decided this call."""

    def served(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        """The block's result without running it, or None when the block must compute."""
        return None

    def before_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> None:
        """The block is about to run."""

    def after_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        """The block ran (only for blocks whose `exit_work` is set)."""

    # ------------------------------------------------------------------------------------------------ entry points
    def enter(self, slot: BlockSlot, forward: Any, args: tuple, kwargs: dict,
              compiling: bool = False) -> tuple[bool, Any]:
        """(True, state) when the block must run, (False, output) when its result comes from the cache."""
        engine = self.engine
        call = engine.call
        flops = engine.flops
        if call is None or flops.counting:  # outside a transformer call, or inside a FLOP-counting pass
            return True, None
        hidden, encoder = slot.slots.read(args, kwargs)
        if slot.index == 0:
            if isinstance(hidden, torch.Tensor):
                engine.ops = ops_for(hidden)
            engine.meter.on_stack_input(call, slot, hidden, args, kwargs)
        if call.actions is None and slot.index == self.decision_block:
            decide(engine, call)
            self.decided(call)
        # torch.Size hashes and compares as the tuple it is: FLOP-book keys without a tuple() copy per block
        shape = hidden.shape if isinstance(hidden, torch.Tensor) else ()
        if compiling and not flops.known(slot.index, shape):
            flops.count(slot.index, shape, forward, args, kwargs)
        out = self.served(call, slot, hidden, encoder)
        cost = flops.costs.get((slot.index, shape))
        if out is not None:
            call.flops_total += cost if cost is not None else flops.cost(slot.index, shape) or 0.0
            if slot.index == self.last_block:
                call.stack_output = slot.slots.split_output(out)[0]
            return False, out
        self.before_run(call, slot, hidden, encoder)
        counter = None if compiling or cost is not None else flops.start(slot.index, shape)
        return True, (call, hidden, encoder, shape, cost, counter)  # counter last (Engine.abort)

    def exit(self, slot: BlockSlot, state: Any, out: Any) -> Any:
        if state is None:
            return out
        call, hidden, encoder, shape, cost, counter = state
        if counter is not None or cost is None:
            flops = self.engine.flops
            if counter is not None:
                flops.stop(counter, slot.index, shape)
            cost = flops.cost(slot.index, shape) or 0.0
        call.flops_total += cost
        call.flops_computed += cost  # MODULE granularity: skipped modules subtract their share
        if slot.list_index not in self._verified_lists:
            self._verify_block_output(slot, hidden, out)
        if not slot.exit_work:
            return out
        self.after_run(call, slot, hidden, encoder, out)
        if slot.index == self.last_block:
            call.stack_output = slot.slots.split_output(out)[0]
        return out

    def _verify_block_output(self, slot: BlockSlot, hidden: Any, out: Any) -> None:
        """First computed call of each block list: the block returned what its adapter says (a hidden-states tensor,
        or a tuple in the adapter's order). Checked before anything is cached, so a wrong adapter (generic discovery
        guesses the order) is refused with what the block returned instead of corrupting a reused call."""
        outputs = slot.slots.outputs
        if outputs == (HIDDEN,):
            ok = isinstance(out, torch.Tensor)
        else:
            ok = isinstance(out, (tuple, list)) and len(out) == len(outputs)
            if ok:
                got = out[outputs.index(HIDDEN)]
                ok = isinstance(got, torch.Tensor) and (not isinstance(hidden, torch.Tensor)
                                                        or got.ndim == hidden.ndim)
        if ok:
            self._verified_lists.add(slot.list_index)
            return
        returned = (f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                    if isinstance(out, (tuple, list)) else type(out).__name__)
        engine = self.engine
        raise UnsupportedModelError(
            engine.transformer,
            f"block list `{slot.spec.path}`: {type(slot.block).__name__} returned {returned}, but the adapter "
            f"({engine.adapter.notes or 'registered'}) expects {outputs}; call handle.remove() and register an "
            f"adapter whose BlockList outputs match what the block returns")
