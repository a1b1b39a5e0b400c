"""What the executors, the signal meter and the decision read and write while a transformer call runs.

The engine (dcache.runtime.engine) keeps the lifetime and the generations; it builds one `CallRuntime` and hands it to
its executor, meter and decision, which see nothing else of it:

    model        transformer, adapter, pipeline (the CFG difference reads its guidance scale)
    method       schedule (a lane's own copy under per-sample decisions), units (one name per action character), order
    services     flops (FlopBook), meter (SignalMeter), health (HealthMonitor), ops (kernels, chosen per call)
    generation   record, branches (BranchState per branch): the running generation's, swapped per lane
    call         call (CallState), call_inputs (args, kwargs): the running transformer call, None between calls
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ..generations.health import HealthMonitor
from ..generations.records import GenerationRecord
from ..model.adapters import Adapter
from ..schedule import Schedule
from .block_io import bind_arguments
from .cache_ops import VALIDATED, CacheOps
from .cache_state import BranchState
from .call_state import CallState
from .flops import FlopBook
from .signal_meter import SignalMeter

if TYPE_CHECKING:
    from .call_output import PlainOutput


@dataclass(eq=False)
class CallRuntime:
    transformer: nn.Module
    adapter: Adapter
    schedule: Schedule
    health: HealthMonitor
    pipeline: Any = None
    order: int = 0  # the schedule's forecast order: Taylor history depth of every cached unit
    # call scope: how the whole call's output is cached; None: x + Delta (dcache.runtime.call_scope), a
    # dcache.runtime.call_output.PlainOutput: reused whole (a ControlNet's per-block samples)
    call_output: PlainOutput | None = None
    # set once the executor laid out the units (Engine.__init__): one name per action character, the model's book
    units: tuple[str, ...] = ()
    flops: FlopBook = field(default_factory=lambda: FlopBook(enabled=False))
    ops: CacheOps = VALIDATED  # kernel entry points, re-chosen at the first block of every call (cache_ops.py)
    record: GenerationRecord | None = None
    branches: dict[str, BranchState] = field(default_factory=dict)
    call: CallState | None = None
    call_inputs: tuple[tuple, dict] | None = None  # (args, kwargs) of the running transformer call
    # the transformer's forward below dcache's call frame (TransformerHook.chain), for the FLOP-counting pass
    call_forward: Callable[..., Any] | None = None
    memos: list = field(default_factory=list)  # dcache.runtime.step_invariant hooks (Adapter.invariants)
    meter: SignalMeter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.meter = SignalMeter(self)

    def call_arguments(self) -> dict[str, Any] | None:
        """The running transformer call's arguments by name (pipelines pass them as keywords: no binding)."""
        if self.call_inputs is None:
            return None
        args, kwargs = self.call_inputs
        return bind_arguments(self.transformer, args, kwargs) if args else kwargs

    def open_call(self, call: CallState, args: tuple, kwargs: dict) -> None:
        """`call` is the running call, on these arguments."""
        self.call, self.call_inputs = call, (args, kwargs)

    def drop_call(self) -> None:
        """No call runs (it ended, raised, or waits for its rows' sub-batch: dcache.runtime.lanes)."""
        self.call, self.call_inputs = None, None

    def count_call_blocks(self, missing: list[tuple[Any, tuple]]) -> None:
        """Count the FLOPs of the running call's blocks in one pass on fake tensors (its blocks ran in a compiled
        graph, where no counter sees them); `missing`: the (block, shape) keys it needs (FlopBook.count_blocks)."""
        if self.call_inputs is None:
            return
        args, kwargs = self.call_inputs
        self._fake_pass(self.flops.count_blocks, args, kwargs, missing)

    def count_lead(self, unit: Any, shape: tuple, args: tuple, kwargs: dict) -> None:
        """Count what a transformer call on these arguments runs before its first block (FlopBook.count_lead)."""
        self._fake_pass(functools.partial(self.flops.count_lead, unit, shape), args, kwargs)

    def _fake_pass(self, count: Callable[..., None], args: tuple, kwargs: dict, *rest: Any) -> None:
        """`count(forward, args, kwargs, *rest)`: a FlopBook pass of the transformer's forward on fake tensors."""
        if self.call_forward is None:
            return
        # the memos (dcache.runtime.step_invariant) run in the pass too: what they keep there is fake, put theirs back
        # after it
        kept = [(memo, list(memo.entries), memo.hits) for memo in self.memos]
        try:
            count(self.call_forward, args, kwargs, *rest)
        finally:
            for memo, entries, hits in kept:
                memo.entries[:], memo.hits = entries, hits


__all__ = ["CallRuntime"]
