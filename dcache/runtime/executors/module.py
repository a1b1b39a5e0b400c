"""MODULE granularity: one unit per (block, inner module), e.g. attention / feed-forward ("b3.attn", ...).

Blocks are hooked as for the block kind (FLOP accounting, the stack input's signals, the decision at block 0) but
always run; each inner module is hooked too. A reused module returns its cached output pytree (FORECAST: the Taylor
forecast of its tensors); a computed one stores its output tensors. Cache keys: the unit index, and (unit, k) for
the k-th call of a module a block calls more than once per forward (Adapter.shared).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry
from torch import nn

from ...compat.torch import tree_flatten, tree_unflatten
from ...model.adapters import composed_indices, reuse_composed_inputs, submodule
from ..call_runtime import CallRuntime
from ..call_state import CallState
from ..hooks import HOOK_NAME, NOT_DECIDED, Entries, UnitHook
from ..cache_state import BranchState
from ..unit_store import read_cached
from .base import COMPUTE, UnitRun
from .hooked_blocks import HookedBlocks


@dataclass
class ModuleCalls:
    """The module kind's state of one transformer call."""

    calls: dict[int, int] = field(default_factory=dict)  # shared module unit -> its calls so far in this call


@dataclass(slots=True)
class ModuleRun(UnitRun):
    """A running module's hook state."""

    key: tuple[str, int]  # its FLOP-book unit, ("m", unit)
    cache_key: Any  # the unit, or (unit, k) for the k-th call of a shared module (Adapter.shared)


ModuleCall = CallState[ModuleCalls]


class ModuleExecutor(HookedBlocks[ModuleCalls]):
    kind = "module"
    entry_points = ("enter", "exit", "abort_unit", "module_enter", "module_exit")

    def __init__(self, runtime: CallRuntime):
        super().__init__(runtime)
        pairs = [(s.index, m) for s in self.blocks for m in s.modules]
        self.names = tuple(f"b{b}.{m}" for b, m in pairs)
        self.module_unit = {(b, m): i for i, (b, m) in enumerate(pairs)}
        self.composed_units = composed_indices(runtime.adapter, self.names)
        # units a block calls more than once per forward (Adapter.shared): one cache per call, in call order
        self.shared_units = frozenset(i for i, (_, m) in enumerate(pairs) if m in runtime.adapter.shared)
        self._module_hooked: dict[int, nn.Module] = {}

    def unit_names(self) -> tuple[str, ...]:
        return self.names

    def new_call(self) -> ModuleCalls:
        return ModuleCalls()

    def cache_key(self, call: ModuleCall, unit: int) -> Any:
        """The unit's cache key at this call of its module: the k-th call of a shared unit in a block has its own
        cache, (unit, k) for k > 0."""
        if unit not in self.shared_units:
            return unit
        calls = call.unit.calls
        k = calls.get(unit, 0)
        calls[unit] = k + 1
        return unit if k == 0 else (unit, k)

    def feasible(self, row: str, bstate: BranchState) -> str:
        """As every kind, and: a reused composed unit leaves its inputs' outputs unused, so those are reused too (no
        compute, no Taylor evaluation) where they have something cached."""
        if COMPUTE * len(row) == row:
            return row
        return reuse_composed_inputs(super().feasible(row, bstate), self.composed_units,
                                     lambda unit: self.servable(bstate, unit))

    # ------------------------------------------------------------------------------------------------ hooks
    def install(self) -> None:
        super().install()
        self._hook_modules()

    def start_generation(self) -> None:
        self._hook_modules()

    def remove(self) -> None:
        for module in self._module_hooked.values():  # modules swapped out of the tree since they were hooked
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(HOOK_NAME, recurse=False)

    def _hook_modules(self) -> None:
        """(Re)hook module units; a module replaced since (e.g. by a LoRA layer loaded after apply) is re-hooked."""
        entries = Entries(self.module_enter, self.module_exit, self.abort_unit)
        traced = Entries(self.module_enter_traced, self.module_exit_traced, self.abort_unit_traced)
        for slot in self.blocks:
            for name in slot.modules:
                unit = self.module_unit[(slot.index, name)]
                module = submodule(slot.block, name)
                old = self._module_hooked.get(unit)
                if module is old:
                    continue
                if old is not None:
                    HookRegistry.check_if_exists_or_initialize(old).remove_hook(HOOK_NAME, recurse=False)
                HookRegistry.check_if_exists_or_initialize(module).register_hook(
                    UnitHook(unit, entries, traced, self.traced_module), HOOK_NAME)
                self._module_hooked[unit] = module

    # ------------------------------------------------------------------------------------------------ decided calls
    def decided_served(self, call: ModuleCall) -> list[tuple[Any, str]]:
        actions = call.actions
        return [(key, actions[key if isinstance(key, int) else key[0]]) for key, hist in call.bstate.units.items()
                if actions[key if isinstance(key, int) else key[0]] != COMPUTE and hist.tables is not None]

    def decided_early(self, call: ModuleCall) -> None:
        super().decided_early(call)
        units = call.bstate.units
        call.decided.layouts = {key: units[key].layout for key in call.decided.served}

    def traced_module(self, unit: int, forward: Any, args: tuple, kwargs: dict) -> Any:
        """A module's hook while dynamo traces it (as HookedBlocks.traced_block for blocks): its cached output, or
        run it and keep its output (stored after the graph)."""
        call = self.runtime.call
        if call is None or call.decided is None:
            return NOT_DECIDED
        decided = call.decided
        first = args[0] if args and isinstance(args[0], torch.Tensor) else next(
            (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        decided.module_calls.append((unit, tuple(first.shape) if first is not None else ()))
        cache_key = self.cache_key(call, unit)
        if call.actions[unit] != COMPUTE:
            tensors = iter(decided.served[cache_key])
            spec, is_tensor = decided.layouts[cache_key]
            return tree_unflatten([next(tensors) if is_t else None for is_t in is_tensor], spec)
        out = forward(*args, **kwargs)
        if decided.may_reuse[unit]:
            decided.edits.append(("outputs", cache_key, out))
        return out

    def end_decided(self, call: ModuleCall) -> None:
        """As every block kind, and the reused modules' share of their blocks' FLOPs is not computed."""
        super().end_decided(call)
        flops, actions = self.runtime.flops, call.actions
        for unit, shape in call.decided.module_calls:
            if actions[unit] != COMPUTE:
                call.flops_computed -= flops.cost(("m", unit), shape) or 0.0

    # ------------------------------------------------------------------------------------------------ entry points
    def module_enter(self, unit: int, forward: Any, args: tuple, kwargs: dict,
                     compiling: bool = False) -> tuple[bool, Any]:
        """(True, state) when the module must run, (False, its cached output) when it is reused or forecast."""
        runtime = self.runtime
        flops = runtime.flops
        first = args[0] if args and isinstance(args[0], torch.Tensor) else next(
            (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        shape = tuple(first.shape) if first is not None else ()
        key = ("m", unit)
        if flops.counting:  # inside the block's fake counting pass: count this module's share
            flops.enter(key, shape)
            return True, "counting"
        call = runtime.call
        if call is None or call.actions is None:
            return True, None
        action = call.actions[unit]
        cache_key = self.cache_key(call, unit)
        if action == COMPUTE:  # the block counts its modules' FLOPs; measure this module's share
            return True, ModuleRun(call, shape, flops.start(key, shape), key, cache_key)
        call.flops_computed -= flops.cost(key, shape) or 0.0
        hist = call.bstate.units.get(cache_key)
        if hist is None or hist.tables is None:  # a shared unit called more often than when it was computed
            raise RuntimeError(f"module unit {self.names[unit]} was called more times in this block than when it "
                               f"was last computed; its adapter's `shared` modules must be called the same number "
                               f"of times at every step.")
        tensors = iter(read_cached(runtime.schedule, hist, action, call.step, call))
        spec, is_tensor = hist.layout
        leaves = [next(tensors) if is_t else None for is_t in is_tensor]
        return False, tree_unflatten(leaves, spec)

    def module_exit(self, unit: int, state: ModuleRun | str | None, out: Any) -> Any:
        if state is None:
            return out
        runtime = self.runtime
        flops = runtime.flops
        if not isinstance(state, ModuleRun):  # "counting"
            flops.exit()
            return out
        call = state.call
        flops.stop(state.counter, state.key, state.shape)
        if runtime.schedule.may_reuse(call.branch, unit):
            leaves, spec = tree_flatten(out)
            hist = call.bstate.history(state.cache_key, runtime.order)
            hist.update([t for t in leaves if isinstance(t, torch.Tensor)], call.step)
            hist.layout = (spec, [isinstance(t, torch.Tensor) for t in leaves])
        return out

