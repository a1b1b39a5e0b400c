"""The block hook path shared by the stack, block and module kinds.

Every block call is split in three so that, under torch.compile, only the block's own forward is traced:
    enter (eager: bookkeeping, decision, reuse) -> forward (traced) -> exit (eager: caching).
The first block's enter reads the stack input (signals, the kernels' backend); the decision block's enter asks the
schedule (dcache.runtime.decision). A kind fills in four steps: `served` (the block's output from the cache, or None),
`before_run`, `after_run` (store) and `decided` (right after the decision).

A call decided when it opened (a schedule that decides from the step alone, while dynamo compiles the transformer:
Engine.step_decided) takes `traced_block` instead, which dynamo captures in the model's graph: it reads the action
row, the residuals `decided_early` read out of the cache and the schedule's `may_reuse`, and writes the residuals
it computes into `call.decided.edits`; `end_call` stores them and counts the call's FLOPs, eagerly. A kind that
supports it fills in `decided_served` (the cache keys a reused call reads) and `traced_served` / `traced_before_run`
/ `traced_after_run` (the module kind: its modules' `traced_module`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry

from ...compat.torch import tree_flatten, tree_map
from ...model.adapters import HIDDEN, UnsupportedModelError
from ..cache_ops import AUTOGRAD, TORCH_DIRECT, CacheOps, ops_for
from ..call_runtime import CallRuntime
from ..call_state import DECIDING, RESUMED, BlockSlot, CallDecided, CallState, DecidedCall, UnitState
from ..decision import decide
from ..flops import FirstBlockReached
from ..hooks import HOOK_NAME, NOT_DECIDED, Entries, UnitHook
from ..unit_store import keep_tensors, read_cached, residual_pairs
from .base import UnitExecutor, UnitRun

_COUNTING = "counting"  # a block's enter state inside a whole-call counting pass (FlopBook.count_blocks)


def traced_ops() -> CacheOps:
    """The cache ops of the traced path: plain torch, which dynamo captures (what the torch backend runs eagerly)."""
    return AUTOGRAD if torch.is_grad_enabled() else TORCH_DIRECT


def traced_residuals(outs: list, ins: list) -> list[torch.Tensor]:
    """residual = out - in per stream, computed in the graph (ops.store without a buffer)."""
    return [o - x for o, x in residual_pairs(outs, ins)]


def _kept(out: Any) -> Any:
    """A copy of a block's output that the transformer may write into in place before the next block
    (BlockList.adds_in_place)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


@dataclass(slots=True)
class BlockRun(UnitRun):
    """A running block's hook state."""

    hidden: Any  # the block's hidden-states input
    encoder: Any  # its encoder-states input (None for single-stream blocks)
    cost: float | None  # its FLOPs on `shape` when known before it ran


class HookedBlocks(UnitExecutor[UnitState]):
    entry_points = ("enter", "exit", "abort_unit")
    traces_decided_calls = True

    def __init__(self, runtime: CallRuntime):
        super().__init__(runtime)
        self._verified_lists: set[int] = set()  # block lists whose output format was checked (first computed call)
        for s in self.blocks:
            s.exit_work = self.exit_work(s)

    def exit_work(self, slot: BlockSlot) -> bool:
        """Whether the block's exit has more to do than FLOP accounting."""
        return slot.index == self.last_block

    def install(self) -> None:
        entries = Entries(self.enter, self.exit, self.abort_unit)
        traced = Entries(self.enter_traced, self.exit_traced, self.abort_unit_traced)
        path = self.traced_block if self.traces_decided_calls else None
        for slot in self.blocks:
            HookRegistry.check_if_exists_or_initialize(slot.block).register_hook(
                UnitHook(slot, entries, traced, path), HOOK_NAME)

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
        runtime = self.runtime
        call = runtime.call
        flops = runtime.flops
        if flops.counting:  # inside a FLOP-counting pass: a whole-call one counts every block on its own
            if flops.counting_lead:  # a pass that counts what runs before the first block ends here
                raise FirstBlockReached()
            if flops.counting_blocks:
                hidden = slot.slots.read(args, kwargs)[0]
                shape = hidden.shape if isinstance(hidden, torch.Tensor) else ()
                if not flops.known(slot.index, shape):
                    flops.enter(slot.index, shape)
                    return True, _COUNTING
            return True, None
        if call is None:  # outside a transformer call
            return True, None
        hidden, encoder = slot.slots.read(args, kwargs)
        if slot.index == 0:
            if isinstance(hidden, torch.Tensor):
                runtime.ops = ops_for(hidden)
            if call.phase == RESUMED:  # its signals were measured when it decided (dcache.runtime.lanes)
                call.stack_input = hidden
            else:
                runtime.meter.on_stack_input(call, slot, hidden, args, kwargs)
        if slot.index < self.decision_block and call.phase == RESUMED:
            out = call.probe_outputs.get(slot.index)
            if out is not None:  # it ran, and was counted, when the call decided: once per call
                return False, out
        if slot.index == self.decision_block and (call.actions is None or call.phase == RESUMED):
            if call.actions is None:
                decide(runtime, self, call)
            self.decided(call)
            if call.phase == DECIDING:
                raise CallDecided()
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
        return True, BlockRun(call, shape, counter, hidden, encoder, cost)

    def exit(self, slot: BlockSlot, state: BlockRun | str | None, out: Any) -> Any:
        if state is None:
            return out
        if not isinstance(state, BlockRun):  # _COUNTING
            self.runtime.flops.exit()
            return out
        call, hidden, encoder, cost = state.call, state.hidden, state.encoder, state.cost
        if state.counter is not None or cost is None:
            flops = self.runtime.flops
            if state.counter is not None:
                flops.stop(state.counter, slot.index, state.shape)
            cost = flops.cost(slot.index, state.shape) or 0.0
        call.flops_total += cost
        call.flops_computed += cost  # MODULE granularity: skipped modules subtract their share
        if slot.list_index not in self._verified_lists:
            self._verify_block_output(slot, hidden, out)
        if slot.index < self.decision_block and call.phase == DECIDING:  # served when the call resumes
            call.probe_outputs[slot.index] = _kept(out) if slot.spec.adds_in_place else out
        if not slot.exit_work:
            return out
        self.after_run(call, slot, hidden, encoder, out)
        if slot.index == self.last_block:
            call.stack_output = slot.slots.split_output(out)[0]
        return out

    # ------------------------------------------------------------------------------------------------ decided calls
    def decided_early(self, call: CallState) -> None:
        """Read what the call's reused / forecast units serve (a forecast is evaluated here, at the call's step) and
        the schedule's may_reuse: the traced path then reads no step and no history."""
        bstate, schedule = call.bstate, self.runtime.schedule
        served = {key: read_cached(schedule, bstate.units[key], action, call.step, call)
                  for key, action in self.decided_served(call)}
        may_reuse = tuple(schedule.may_reuse(call.branch, i) for i in range(len(self.runtime.units)))
        call.decided = DecidedCall(served, may_reuse)

    def traced_block(self, slot: BlockSlot, forward: Any, args: tuple, kwargs: dict) -> Any:
        """A block's hook while dynamo traces it (dcache.runtime.hooks.UnitHook): serve it or run it and keep its
        residual, as plain tensor work; NOT_DECIDED when the call was not decided when it opened."""
        call = self.runtime.call
        if call is None or call.decided is None:
            return NOT_DECIDED
        hidden, encoder = slot.slots.read(args, kwargs)
        call.decided.shapes[slot.index] = hidden.shape if isinstance(hidden, torch.Tensor) else ()
        out = self.traced_served(call, slot, hidden, encoder)
        if out is not None:
            return out
        self.traced_before_run(call, slot, hidden, encoder)
        out = forward(*args, **kwargs)
        if slot.list_index not in self._verified_lists and not self._output_ok(slot, hidden, out):
            self._refuse_block_output(slot, out)
        self.traced_after_run(call, slot, hidden, encoder, out)
        return out

    def traced_served(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> Any:
        return None

    def traced_before_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any) -> None:
        """The block is about to run (traced)."""

    def traced_after_run(self, call: CallState, slot: BlockSlot, hidden: Any, encoder: Any, out: Any) -> None:
        """The block ran (traced)."""

    def block_ran(self, call: CallState, slot: BlockSlot) -> bool:
        """Whether the block computed in the call's action row."""
        return True

    def end_decided(self, call: CallState) -> None:
        """A decided call returned: store what its graph computed (`edits`, in order) and count its FLOPs."""
        runtime = self.runtime
        decided = call.decided
        bstate = call.bstate
        for edit in decided.edits:
            if edit[0] == "store":
                keep_tensors(call, edit[1], runtime.order, edit[2])
            elif edit[0] == "outputs":  # MODULE: a computed module's output pytree
                leaves, spec = tree_flatten(edit[2])
                hist = keep_tensors(call, edit[1], runtime.order, [t for t in leaves if isinstance(t, torch.Tensor)])
                hist.layout = (spec, [isinstance(t, torch.Tensor) for t in leaves])
            elif edit[0] == "chain":  # STACK: this list's segment continued the previous list's run
                bstate.chained.add(edit[1])
                bstate.units.pop(("seg", edit[1]), None)
            else:
                bstate.chained.discard(edit[1])
        decided.edits.clear()
        shapes = decided.shapes
        if shapes and call.record.input_shape is None and 0 in shapes:
            call.record.input_shape = tuple(shapes[0])
        flops = runtime.flops
        missing = [(i, shape) for i, shape in shapes.items()
                   if not flops.known(i, shape) and (i, shape) not in flops.uncounted]
        if flops.enabled and missing:
            runtime.count_call_blocks(missing)
        for slot in self.blocks:
            shape = shapes.get(slot.index)
            if shape is None:  # the block ran eagerly: its exit counted it
                continue
            cost = flops.cost(slot.index, shape) or 0.0
            call.flops_total += cost
            if self.block_ran(call, slot):
                call.flops_computed += cost

    def end_call(self, call: CallState | None) -> None:
        if call is not None and call.decided is not None:
            self.end_decided(call)

    def _output_ok(self, slot: BlockSlot, hidden: Any, out: Any) -> bool:
        """The block returned what its adapter says (a hidden-states tensor, or a tuple in the adapter's order)."""
        outputs = slot.slots.outputs
        if outputs == (HIDDEN,):
            return isinstance(out, torch.Tensor)
        ok = isinstance(out, (tuple, list)) and len(out) == len(outputs)
        if ok:
            got = out[outputs.index(HIDDEN)]
            ok = isinstance(got, torch.Tensor) and (not isinstance(hidden, torch.Tensor) or got.ndim == hidden.ndim)
        return ok

    def _verify_block_output(self, slot: BlockSlot, hidden: Any, out: Any) -> None:
        """First computed call of each block list: the block returned what its adapter says (a hidden-states tensor,
        or a tuple in the adapter's order). Checked before anything is cached, so a wrong adapter (generic discovery
        guesses the order) is refused with what the block returned instead of corrupting a reused call."""
        if self._output_ok(slot, hidden, out):
            self._verified_lists.add(slot.list_index)
            return
        self._refuse_block_output(slot, out)

    def _refuse_block_output(self, slot: BlockSlot, out: Any) -> None:
        outputs = slot.slots.outputs
        returned = (f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                    if isinstance(out, (tuple, list)) else type(out).__name__)
        runtime = self.runtime
        raise UnsupportedModelError(
            runtime.transformer,
            f"block list `{slot.spec.path}`: {type(slot.block).__name__} returned {returned}, but the adapter "
            f"({runtime.adapter.notes or 'registered'}) expects {outputs}; call handle.remove() and register an "
            f"adapter whose BlockList outputs match what the block returns")
