"""Per-sample decisions (`decisions="sample"`, the default): a sample's output never depends on its batch.

A batched transformer call of B rows (the latent input `hidden_states` is [B, ...]; with batched CFG the rows are
[uncond_0..uncond_{n-1}, cond_0..cond_{n-1}], so each CFG half of a sample is a row of its own) has one *lane* per
row. A lane is everything one generation keeps, for that row alone:

    tracker, record   its step and its decisions (StepTracker, GenerationRecord)
    branches          its cached tensors and signal references (BranchState per branch)
    schedule          its own copy of the schedule (accumulated error, counters, calibration state)

A call runs in two phases (`Lanes.run`):

    decide   each row's call opens in its lane, on its row of every batched argument, and runs up to its decision
             point (the embedders and probe blocks at batch 1; nothing for call scope): its signals are measured
             against its own references and its own schedule decides, so it takes the decision it takes alone.
    run      rows with the same action row at the same step run as one sub-batch, their caches stacked along the
             batch dimension (dcache.runtime.lane_merge), and each sub-batch's outputs go back to its rows. Rows that
             compute run together; rows that reuse are served together.

What a row ran while it decided is not run again where it can be served: the blocks before the decision block
(FBCache's probe) return what they returned for each row then (`CallState.probe_outputs`, the rows' own stacked), and
a forecast a row's finite check evaluated is served as evaluated (lane_merge.merge_forecasts). The one exception is a
call where every row computes every unit: it runs whole, from its start, on the arguments as given, so it is the
uncached batch, bit for bit (a probe block's output at batch 1 differs from its row of the batch's in the last bits);
its probe blocks then run twice, once per row to decide and once in the batch. The embedders always run twice (at
batch 1 to decide, then in the sub-batch): a model's forward cannot start at its first block. A row's FLOPs
(`CallRecord.flops_total` / `flops_computed`, handle.stats()) are its share of its sub-batch's plus what its decide
phase ran besides (the embedders, signal probes, and probe blocks not run again), counted as computed work: the stats'
compute ratio is what a FLOP meter around the generation measures.

A sample's output is its own run's up to the kernels' batch-size rounding (< 1e-6 on the bundled model). Arguments
are split by row: every tensor whose first dimension is B (the latents, per-sample timesteps, text embeddings,
guidance); other arguments (RoPE ids, scalars) go to every lane whole.

Steps. Under a pipeline (its scheduler drives the generation) every lane is at the pipeline's step, branch and
timesteps. Without one (a serving loop calling the transformer), each lane tracks its own timestep, as a
transformer-only generation alone does: a row whose timestep goes back up starts that lane's next generation, so a
loop may admit a new request into a row while the others are mid-generation (continuous batching). Which request a
row is comes from its position, or from `handle.requests(ids)`.

A schedule that decides from the step alone (a plan, a fixed interval) takes the same decision for every row of a
pipeline's batch, so its calls run whole, without lanes. Where a call cannot be split, its decisions are the batch's
(one decision for all rows, as with `decisions="batch"`), and the handle says so once with the reason
(`BatchDecisionsWarning`).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

import torch

from ..actions import Action
from ..compat.torch import tree_flatten, tree_map, tree_unflatten
from .call_state import DECIDING, RESUMED, CallDecided, CallState
from ..generations.records import GenerationRecord, StepTracker
from .lane_merge import merge_branches, merge_forecasts, split_branch
from ..schedule import Schedule

if TYPE_CHECKING:  # the engine builds its lanes
    from .engine import Engine

DECISIONS = ("sample", "batch")
# The engine attributes one generation owns; a lane holds its own and swaps them in for its rows' call.
_COMPUTE = Action.COMPUTE.value
_LEAD = "lead"  # FLOP-book unit: what the transformer runs before its first block (the embedders), per argument shapes
_LANE_STATE = ("tracker", "record", "record_ended", "branches", "schedule", "generations", "bytes_seen")


class BatchDecisionsWarning(UserWarning):
    """A batched call took one decision for all its samples although decisions="sample" was asked for."""


def check_decisions(decisions: Any) -> str:
    if decisions not in DECISIONS:
        raise ValueError(f"decisions={decisions!r} is not one of {DECISIONS}: 'sample' decides every sample "
                         f"of a batch (and each CFG half) on its own, so a request's image does not depend on its "
                         f"batch (default); 'batch' takes one decision per batched call, for batches known to "
                         f"move together.")
    return decisions


@dataclass
class Lane:
    """One row's generation state (the engine attributes named in _LANE_STATE)."""

    tracker: StepTracker
    schedule: Schedule
    record: GenerationRecord | None = None
    record_ended: GenerationRecord | None = None
    branches: dict = field(default_factory=dict)
    generations: int = 0
    bytes_seen: tuple[int, int] = (0, 0)
    pipeline_record: GenerationRecord | None = None  # the pipeline generation this lane's record follows
    call: CallState | None = None  # its row's call of the running batched call, decided and not yet run (Lanes.run)


class Lanes:
    """The lanes of one engine, keyed by request id (a row's position unless `handle.requests` names them)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lanes: dict[Hashable, Lane] = {}
        self.ids: tuple[Hashable, ...] | None = None  # handle.requests(ids): the rows' request ids
        self.swapped = False  # a lane's state is in the engine now
        self._current: Lane | None = None  # the swapped-in lane
        self._saved: dict[str, Any] = {}  # the engine's own state while a lane's is in it
        self._warned = False
        self.batch_reason: str | None = None  # set where this engine's setup cannot split calls

    # ------------------------------------------------------------------------------------------------ splitting
    def rows(self, args: tuple, kwargs: dict, compiling: bool) -> int:
        """The number of lanes to split this call into (0: run it whole, one decision for the batch)."""
        x = kwargs.get("hidden_states", args[0] if args else None)
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else 1
        if self.ids is not None and len(self.ids) != rows:
            raise ValueError(f"handle.requests() named {len(self.ids)} requests, but this transformer call has "
                             f"{rows} rows (hidden_states.shape[0]); give one id per row, in row order (with "
                             f"batched CFG each CFG half is a row: e.g. ('a', 'uncond'), ('a', 'cond')).")
        if self.ids is None and (rows <= 1 or not self._reads_signals()):
            return 0  # a schedule that decides from the step alone decides every row alike: the batch is exact
        if self.ids is None and getattr(self.engine.schedule, "calibrating", False):
            return 0  # a generation that measures a calibration computes every call, and learns from the batch
        reason = self._batch_only(compiling)
        if reason is not None:
            self.warn_once(reason)
            return 0
        return rows

    def _reads_signals(self) -> bool:
        meter = self.engine.meter
        return bool(meter.wanted or meter.providers)

    def _batch_only(self, compiling: bool) -> str | None:
        if compiling:
            return ("torch.compile is tracing the transformer call, and splitting it by sample would put a "
                    "Python loop in the graph")
        if getattr(self.engine.schedule, "acts_on_steps", False):
            return ("its schedule changes the latents after every scheduler step (Schedule.after_step), and the "
                    "pipeline steps the whole batch at once")
        return self.batch_reason

    def warn_once(self, reason: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"dcache: this batched call takes one decision for all its samples (as decisions='batch'): "
                      f"{reason}. A sample's output may then depend on the rest of its batch; run the samples "
                      f"one at a time where that matters, or pass decisions='batch' to say it is intended.",
                      BatchDecisionsWarning, stacklevel=4)

    def run(self, rows: int, resume: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One batched call with a decision per row. `resume(*args, **kwargs)` runs a call the engine opened to its end
        (dcache.runtime.hooks.run_opened). Lanes of requests no longer in the batch are finished and dropped first.

            1. decide: each row's call opens in its lane, on its row alone, and runs up to its decision point (the
               signals measured there, the decision taken, CallDecided raised): the same decision as alone.
            2. run: rows with the same action row at the same step run as one sub-batch with their caches stacked
               (dcache.runtime.lane_merge), served what each row's blocks before the decision block returned in step
               1; where every row decided alike that is the whole call. Where every row computes everything it runs
               from its start on the arguments as given, as without dcache (the uncached batch, bit for bit). Each
               sub-batch's outputs go back to their rows.
        """
        engine = self.engine
        ids = self.ids if self.ids is not None else tuple(range(rows))
        for gone in [k for k in self.lanes if k not in ids]:
            self._finish(self.lanes.pop(gone))
        main = engine.tracker
        engine.follow_pipeline()  # a new pipeline object or scheduler is found before the lanes read its steps
        shared = main.record if main.scheduler_driven and main.in_generation() else None
        lanes = [self.lanes.get(r) or self.lanes.setdefault(r, self._new_lane()) for r in ids]
        outs: list[Any] = [None] * rows
        try:
            for row, lane in enumerate(lanes):
                if shared is not None:
                    self._follow(lane, shared)
                lane.tracker.context_name = main.context_name  # diffusers' cache_context of this call
                outs[row] = self._decide(lane, resume, *split_row(args, kwargs, rows, row))
            groups: dict[tuple, list[int]] = {}
            for row, lane in enumerate(lanes):
                if lane.call is not None:
                    groups.setdefault((lane.call.actions, lane.call.step, lane.call.branch), []).append(row)
            for members in groups.values():
                whole = len(members) == rows  # every row decided alike: the call runs on the batch as given
                sub = (args, kwargs) if whole else take_rows(args, kwargs, rows, members)
                out = self._run_group([lanes[r] for r in members], resume, *sub, whole=whole)
                if out is None:  # the caches cannot be stacked: one row at a time
                    for row in members:
                        outs[row] = self._run_group([lanes[row]], resume, *split_row(args, kwargs, rows, row))
                elif whole:
                    return self._done(shared, out)
                else:
                    for j, row in enumerate(members):
                        outs[row] = output_row(out, j, len(members))
        except BaseException:
            for lane in lanes:  # the batched call raised: every row's generation is over, as one call's would be
                if lane.call is not None:
                    with self._swap(lane):
                        engine.call, lane.call = lane.call, None
                        engine.abort(None, whole_call=True)  # also drops the open call, and leaves the guard
                lane.tracker.abort()
                if lane.record is not None:
                    lane.record.aborted = True
            raise
        return self._done(shared, concat_rows(outs))

    @staticmethod
    def _done(shared: GenerationRecord | None, out: Any) -> Any:
        if shared is not None:
            shared.calls_in_step += 1  # one call of the pipeline, whatever its rows
        return out

    def _decide(self, lane: Lane, resume: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Open the lane's call on its row and run it up to its decision (left open in `lane.call`). Returns None,
        or the row's output where the call ended before any decision point (nothing of it is cached)."""
        engine = self.engine
        with self._swap(lane):
            engine.begin_call(args, kwargs)
            call = engine.call
            call.phase = DECIDING
            try:
                return resume(*args, **kwargs)  # closed by run_opened
            except CallDecided:
                engine.executor.abort_call(call)  # the executor's per-call state restarts when the call resumes
                # what it ran deciding; its embedders (what runs before the first block) run again in its sub-batch
                call.prefix_flops = (call.flops_total, call.flops_computed + self._lead_flops(args, kwargs))
                lane.call = call
                engine.runtime.drop_call()
                engine.guard.exit_call()
                return None

    def _lead_flops(self, args: tuple, kwargs: dict) -> float:
        """FLOPs the transformer runs before its first block on these arguments (counted once per argument shapes);
        0 where the decision comes before the forward (call scope)."""
        engine = self.engine
        if engine.executor.kind == "call":
            return 0.0
        book = engine.runtime.flops
        shapes = tuple(t.shape for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        if not book.known(_LEAD, shapes):
            engine.runtime.count_lead(_LEAD, shapes, args, kwargs)
        return book.costs.get((_LEAD, shapes), 0.0)

    def _run_group(self, members: list[Lane], resume: Callable[..., Any], args: tuple, kwargs: dict,
                   whole: bool = False) -> Any:
        """Run the decided calls of `members` (the same action row, step and branch) as one call on `args` (their
        rows, in order; `whole`: the batch as given). One member: its own call and cache. Several: one call on their
        stacked caches (dcache.runtime.lane_merge), then each member's share of the call goes into its own record;
        None (nothing run) where the caches cannot be stacked."""
        engine = self.engine
        first = members[0].call
        if len(members) == 1:  # its own blocks before the decision block are served: what it runs alone
            with self._swap(members[0]):
                self._reopen(members[0], first, args, kwargs)
                return resume(*args, **kwargs)
        computes_all = first.actions == _COMPUTE * len(first.actions)
        states = [lane.branches[first.branch] for lane in members]
        merged = merge_branches(states, computes_all)
        if merged is None:
            return None
        bstate, before = merged
        calls = [lane.call for lane in members]
        # the whole batch computing everything runs from its start: the uncached batch, bit for bit (its probe blocks
        # at batch 1, from the decisions, differ from the batch's in the last bits); otherwise the blocks before the
        # decision block are served what they returned for each row, and the forecasts each row evaluated
        from_start = whole and computes_all
        probes = {} if from_start else {i: concat_rows([c.probe_outputs[i] for c in calls])
                                        for i in first.probe_outputs if all(i in c.probe_outputs for c in calls)}
        group = replace(first, bstate=bstate, arguments=None, pre={}, flops_total=0.0, flops_computed=0.0, shared=True,
                        served=merge_forecasts(calls), probe_outputs=probes)
        with self._swap(members[0]):  # its schedule serves the group (the lanes' copies are configured alike)
            self._reopen(members[0], group, args, kwargs)
            out = resume(*args, **kwargs)  # run_opened closes `group`: it is recorded nowhere (no lane's record)
        split_branch(bstate, before, states)
        n = len(members)
        for j, lane in enumerate(members):
            call, lane.call = lane.call, None
            call.stack_input = output_row(group.stack_input, j, n)
            call.stack_output = output_row(group.stack_output, j, n)
            # its share of the sub-batch's FLOPs (linear in the batch) and what it ran deciding; where the blocks it
            # ran deciding ran again in the sub-batch, they are computed work an uncached call does not do
            call.flops_total = (0.0 if from_start else call.prefix_flops[0]) + group.flops_total / n
            call.flops_computed = call.prefix_flops[1] + group.flops_computed / n
            call.probe_outputs, call.served = {}, {}
            with self._swap(lane):
                engine.runtime.call_inputs = split_row(args, kwargs, n, j)
                engine.record_call(call)
        return out

    def _reopen(self, lane: Lane, call: CallState, args: tuple, kwargs: dict) -> None:
        """Make `call` (decided) the engine's running call again, to run from its start on `args`."""
        engine = self.engine
        with engine.guard.lock:
            engine.guard.enter_call()
        if call is lane.call:
            lane.call = None
            call.flops_total, call.flops_computed = call.prefix_flops  # what it ran deciding, counted once
        call.phase, call.unit, call.stack_input, call.stack_output = RESUMED, engine.executor.new_call(), None, None
        engine.runtime.open_call(call, args, kwargs)

    # ------------------------------------------------------------------------------------------------ lanes
    def _new_lane(self) -> Lane:
        engine = self.engine
        # the schedule's own copy; the model it was built for is shared, not copied
        memo = {id(t): t for t in [engine.transformer, *engine.transformer.modules(),
                                   *engine.transformer.parameters(), *engine.transformer.buffers()]}
        return Lane(tracker=StepTracker(engine.tracker.fixed_num_steps), schedule=copy.deepcopy(engine.schedule, memo))

    @staticmethod
    def _follow(lane: Lane, shared: GenerationRecord) -> None:
        """A pipeline drives the steps: the lane's record starts with the pipeline's generation and is at its step
        (the engine's `_open_call` then finishes the lane's previous generation and starts this one)."""
        if lane.pipeline_record is not shared:
            lane.pipeline_record = shared
            lane.tracker.on_set_timesteps(shared.timesteps)
            lane.tracker.record.num_steps = shared.num_steps
        rec = lane.tracker.record
        rec.step, rec.calls_in_step = shared.step, shared.calls_in_step

    @contextmanager
    def _swap(self, lane: Lane) -> Iterator[None]:
        engine = self.engine
        saved = self._saved = {name: getattr(engine, name) for name in _LANE_STATE}
        for name in _LANE_STATE:
            setattr(engine, name, getattr(lane, name))
        self.swapped, self._current = True, lane
        try:
            yield
        finally:
            for name in _LANE_STATE:
                setattr(lane, name, getattr(engine, name))
                setattr(engine, name, saved[name])
            self.swapped, self._current, self._saved = False, None, {}

    def _finish(self, lane: Lane) -> None:
        if lane.pipeline_record is not None and lane.record is not None:
            lane.record.step = max(lane.record.step, lane.pipeline_record.step)  # a full count: it completed
        with self._swap(lane):
            self.engine.finish_generation()

    def finish_all(self) -> None:
        """The engine's generation ends (the pipeline's last step, a new generation, remove): every lane's too."""
        if self.swapped:
            return
        engine, total, before = self.engine, {}, self.engine.memory_at_end
        for lane in self.lanes.values():
            engine.memory_at_end = {}
            self._finish(lane)
            for branch, kinds in engine.memory_at_end.items():  # handle.memory(): the lanes' bytes add up
                into = total.setdefault(branch, {})
                for kind, size in kinds.items():
                    into[kind] = into.get(kind, 0) + size
        engine.memory_at_end = total or before  # lanes already finished keep the sum taken then


    # ------------------------------------------------------------------------------------------------ reading
    def records(self) -> list[tuple[Hashable, GenerationRecord]]:
        """(request id, its last generation's record) of every lane that recorded a call."""
        return [(k, lane.record) for k, lane in self.lanes.items() if lane.record is not None and lane.record.calls]

    def branch_states(self) -> list[dict]:
        """The branch states not in the engine now: every lane's, or, while one is swapped in, the engine's own
        and the other lanes'."""
        if not self.swapped:
            return [lane.branches for lane in self.lanes.values()]
        return [self._saved["branches"], *(lane.branches for lane in self.lanes.values() if lane is not self._current)]

    @contextmanager
    def requests(self, ids: Sequence[Hashable]) -> Iterator[None]:
        ids = tuple(ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"handle.requests({list(ids)!r}): request ids must be distinct, one per row (with "
                             f"batched CFG, one per CFG half: e.g. ('a', 'uncond'), ('a', 'cond')).")
        before, self.ids = self.ids, ids
        try:
            yield
        finally:
            self.ids = before


def _shared(name: str, value: Any) -> bool:
    """An argument every row shares although its first dimension may equal the batch: RoPE position ids
    [T, axes] (Flux's `img_ids` / `txt_ids`, any `*_ids` of 2 dims with at most 4 axes)."""
    return name.endswith("_ids") and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] <= 4


def take_rows(args: tuple, kwargs: dict, rows: int, members: Sequence[int]) -> tuple[tuple, dict]:
    """Rows `members` (in order) of every tensor whose first dimension is `rows` ([rows, ...] -> [len(members), ...]),
    in nested arguments too; shared arguments (`_shared`) and anything else whole."""
    first, count = members[0], len(members)
    contiguous = list(members) == list(range(first, first + count))
    index: dict[torch.device, torch.Tensor] = {}

    def take(leaf: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows):
            return leaf
        if contiguous:
            return leaf[first:first + count]
        if leaf.device not in index:
            index[leaf.device] = torch.tensor(members, device=leaf.device)
        return leaf.index_select(0, index[leaf.device])
    return tree_map(take, args), {k: v if _shared(k, v) else tree_map(take, v) for k, v in kwargs.items()}


def split_row(args: tuple, kwargs: dict, rows: int, row: int) -> tuple[tuple, dict]:
    """Row `row` of every batched argument ([rows, ...] -> [1, ...]), as `take_rows`."""
    return take_rows(args, kwargs, rows, (row,))


def output_row(out: Any, j: int, n: int) -> Any:
    """Row j of an output of n rows (tensor leaves [n, ...] -> [1, ...]); the output itself when n is 1."""
    if n == 1:
        return out
    return tree_map(lambda t: t[j:j + 1] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t, out)


def concat_rows(outs: list[Any]) -> Any:
    """The lanes' outputs as one batch: tensor leaves concatenated along dim 0, the rest taken from the first."""
    flat = [tree_flatten(out) for out in outs]
    leaves, spec = flat[0]
    merged = [torch.cat([f[0][i] for f in flat]) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
              for i, leaf in enumerate(leaves)]
    return tree_unflatten(merged, spec)


__all__ = ["DECISIONS", "BatchDecisionsWarning", "Lane", "Lanes", "check_decisions", "take_rows", "split_row",
           "output_row", "concat_rows"]
