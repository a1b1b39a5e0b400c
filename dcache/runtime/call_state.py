"""What the engine keeps about each hooked block (`BlockSlot`) and about the running transformer call (`CallState`).

Both are plain records: the executors (dcache.runtime.executors) and the signal meter (dcache.runtime.signal_meter)
read and write them; nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from ..model.adapters import BlockList
from ..generations.records import GenerationRecord
from .cache_state import BranchState
from .block_io import StreamSlots


@dataclass
class BlockSlot:
    """One hooked transformer block, in the engine's layout."""

    index: int  # global execution order
    list_index: int
    block: nn.Module
    spec: BlockList
    slots: StreamSlots
    role: str = "middle"  # "probe" | "middle" | "tail" (STACK granularity; always "middle" otherwise)
    segment_first: bool = False  # STACK: first middle block of its block list
    segment_last: bool = False  # STACK: last middle block of its block list
    modules: tuple[str, ...] = ()  # inner modules (MODULE granularity units)
    exit_work: bool = True  # the block's exit has more to do than FLOP accounting (set by the executor)


# A call's phase under per-sample decisions (dcache.runtime.lanes): each row's call is first opened and run up to its
# decision alone (DECIDING: the decision point raises CallDecided), then run to its end with the rows that decided
# alike (RESUMED: no signal is measured and nothing is decided again). "" : an ordinary call.
DECIDING, RESUMED = "deciding", "resumed"


class CallDecided(Exception):
    """Raised at the decision point of a call opened to decide only (phase DECIDING); dcache.runtime.lanes catches
    it."""


# The executor kind's own state of one call (UnitExecutor.new_call): StackRun, ModuleCalls, WholeCall, or None (block).
UnitState = TypeVar("UnitState")


@dataclass
class CallState(Generic[UnitState]):
    """One transformer call, from `Engine.begin_call` to `Engine.end_call`."""

    record: GenerationRecord
    step: int
    branch: str
    call_index: int
    timestep: Any
    bstate: BranchState
    unit: UnitState  # the executor kind's own state for this call (UnitExecutor.new_call)
    actions: str | None = None  # one action character per unit, set at the decision point
    pre: dict[Any, torch.Tensor] = field(default_factory=dict)  # signal -> device tensor measured before deciding
    stack_input: torch.Tensor | None = None  # hidden states entering the first block (call scope: the latents x)
    stack_output: torch.Tensor | None = None  # hidden states the last block returned (call scope: the sample v)
    signal_values: dict[str, float] = field(default_factory=dict)  # pre signals read at the decision, by name
    flops_total: float = 0.0
    flops_computed: float = 0.0
    arguments: dict[str, Any] | None = None  # the call's bound arguments, once per call for the signal providers
    decided: "DecidedCall | None" = None  # a call decided when it opened, for the blocks' traced path
    phase: str = ""  # DECIDING / RESUMED under per-sample decisions (above)
    # (total, computed) FLOPs the call spent while it decided (phase DECIDING: the embedders, signal probes, the
    # blocks before the decision block), counted besides its share of its sub-batch's (dcache.runtime.lanes)
    prefix_flops: tuple[float, float] = (0.0, 0.0)
    shared: bool = False  # the call of a sub-batch of lanes: each lane records its own share (dcache.runtime.lanes)
    served: dict[Any, list[torch.Tensor]] = field(default_factory=dict)  # cache key -> what the decision read
    # block index -> what each block before the decision block returned while the call decided (phase DECIDING),
    # served when it resumes so that those blocks run once per call (dcache.runtime.lanes)
    probe_outputs: dict[int, Any] = field(default_factory=dict)


@dataclass
class DecidedCall:
    """What the blocks' traced path (dynamo captures it in the model's graph) reads and writes in a call decided when
    it opened (Engine.step_decided); the executor's `end_call` applies `edits` to the branch state, eagerly.

    The traced code reads nothing that changes from step to step but the action row (dynamo specialises its graph
    on the row, one graph per distinct row): the step, FLOP counts and histories stay out of it."""

    served: dict[Any, list[torch.Tensor]]  # cache key -> the tensors a reused / forecast unit adds (read eagerly)
    may_reuse: tuple[bool, ...]  # per unit: Schedule.may_reuse of the call's branch
    # in order: ("store", key, residuals) computed in the graph, ("chain", list) / ("unchain", list) (STACK runs),
    # ("outputs", key, a module's output) (MODULE)
    edits: list[tuple] = field(default_factory=list)
    shapes: dict[int, Any] = field(default_factory=dict)  # block index -> its hidden input's shape
    layouts: dict[Any, Any] = field(default_factory=dict)  # MODULE: cache key -> UnitHistory.layout of `served`
    module_calls: list[tuple[int, Any]] = field(default_factory=list)  # MODULE: (unit, input shape) per module call
