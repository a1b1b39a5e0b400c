"""The hook engine: executes a schedule's actions on a diffusers transformer, one call at a time.

The engine coordinates the parts; each lives in its own module:
  * dcache.runtime.hooks: the diffusers hooks (name "dcache", removable, signature-preserving) on the transformer, on
    every block and, at module granularity, on the inner modules;
  * dcache.runtime.executors: one executor per unit kind (stack, block, module, call) that lays out, installs and runs
    its units: COMPUTE / REUSE / FORECAST;
  * dcache.generations.scheduler_tracking: the scheduler *instance* is wrapped (set_timesteps: new generation; step:
    next step);
  * dcache.runtime.signal_meter, dcache.runtime.signal_providers: the signals the schedule reads, at most one host sync
    per call;
  * dcache.runtime.decision: the schedule's decision and its feasibility; dcache.runtime.unit_store: storing and
    serving units;
  * dcache.runtime.cache_state: the branch caches (BranchState, UnitHistory); dcache.runtime.call_state: one call's
    record;
  * dcache.runtime.call_runtime: what the executor, the meter and the decision see of the engine (CallRuntime: the
    model, schedule, FLOP book, kernels, running generation and call).

Here: the engine's lifetime (install, remove), the generations (start, finish: the schedule's reset and end) and
each transformer call (begin_call: step, branch, its branch state; end_call: the record entry and post signals).
The attributes the runtime holds (schedule, record, branches, call, ...) read and write through to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from ..actions import Action, Granularity
from ..compat.diffusers import enabled_cache_config
from ..model.adapters import Adapter
from .cache_ops import CacheOps
from .call_runtime import CallRuntime
from .call_scope import check_scope
from .call_state import BlockSlot, CallState
from .concurrency import GenerationGuard
from .decision import decide
from ..generations.health import HealthMonitor
from .executors import EXECUTORS, executor_kind
from .flops import FlopBook
from .forecast import history_depth, history_fit_bytes
from ..generations.records import CallRecord, GenerationRecord, StepTracker
from .lanes import Lanes, check_decisions
from .hooks import (HOOK_NAME, TransformerHook, install_outer_hook, refuse_other_cache, remove_outer_hook,
                    timestep_slot, traced_twins, transformer_call)
from .step_invariant import install_memos
from ..memory.report import branch_breakdown
from ..schedule import GenerationInfo, Schedule
from ..generations.scheduler_tracking import SchedulerHook
from .signal_meter import SignalMeter
from .cache_state import BranchState

if TYPE_CHECKING:
    from ..memory.cache_codec import CacheCodec
    from .call_output import PlainOutput

_COMPUTE = Action.COMPUTE.value
T = TypeVar("T")


class OnRuntime(Generic[T]):
    """An engine attribute kept on its CallRuntime: reads and writes go through to `engine.runtime`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: "Engine | None", owner: type | None = None) -> T:
        if engine is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        return getattr(engine.runtime, self.name)

    def __set__(self, engine: "Engine", value: T) -> None:
        setattr(engine.runtime, self.name, value)


class Engine:
    transformer: OnRuntime[nn.Module] = OnRuntime()
    adapter: OnRuntime[Adapter] = OnRuntime()
    schedule: OnRuntime[Schedule] = OnRuntime()  # the running generation's (a lane's own copy, dcache.runtime.lanes)
    pipeline: OnRuntime[Any] = OnRuntime()
    health: OnRuntime[HealthMonitor] = OnRuntime()
    units: OnRuntime[tuple[str, ...]] = OnRuntime()
    order: OnRuntime[int] = OnRuntime()
    flops: OnRuntime[FlopBook] = OnRuntime()
    meter: OnRuntime[SignalMeter] = OnRuntime()
    ops: OnRuntime[CacheOps] = OnRuntime()
    record: OnRuntime[GenerationRecord | None] = OnRuntime()
    branches: OnRuntime[dict[str, BranchState]] = OnRuntime()
    call: OnRuntime[CallState | None] = OnRuntime()
    memos: OnRuntime[list] = OnRuntime()

    def __init__(self, transformer: nn.Module, adapter: Adapter, schedule: Schedule, *,
                 pipeline: Any = None, num_steps: int | None = None,
                 count_flops: bool = True, memoize: bool = True, scope: str = "blocks", leader: "Engine | None" = None,
                 cache_codec: CacheCodec | None = None, health: HealthMonitor | None = None, decisions: str = "sample",
                 call_output: PlainOutput | None = None, own_generations: bool = True):
        """leader: for the second expert of a two-transformer pipeline (Wan 2.2's transformer_2): the engine of the
        pipeline's first transformer, which hooks the scheduler and hands every generation and step on to this one
        (one scheduler, one wrapper; each expert keeps its own generation record, caches and schedule state).
        cache_codec: a dcache.memory.cache_codec.CacheCodec storing cached unit tensors in a low dtype (None: as
        computed). health: what each finished generation did, said once per kind (dcache.generations.health; None: a
        silent monitor). decisions: "sample" (each row of a batched call decides on its own, dcache.runtime.lanes) or
        "batch". call_output: call scope, how the call's output is cached (None: x + Delta; a
        dcache.runtime.call_output.PlainOutput: reused whole, as a ControlNet's samples). own_generations: False for an
        engine that only runs in the generations its leader hands on (a ControlNet's): a call outside one runs
        uncached and is not recorded, where an engine of its own opens a generation for it."""
        # the model, schedule, FLOP book, kernels, running generation and call (dcache.runtime.call_runtime)
        self.runtime = runtime = CallRuntime(transformer, adapter, schedule,
                                             health if health is not None else HealthMonitor(warn=False),
                                             pipeline=pipeline, order=int(schedule.forecast_order),
                                             call_output=call_output)
        self.own_generations = own_generations
        self.cache_codec = cache_codec
        self.leader = leader
        self.followers: list[Engine] = []
        if leader is not None:
            leader.followers.append(self)
        self.tracker = StepTracker(num_steps)
        self.guard = GenerationGuard()  # one generation at a time on this transformer (dcache.runtime.concurrency)
        self.granularity = Granularity(schedule.granularity)
        self.call_scope = check_scope(scope, schedule, self.granularity.value)  # dcache.runtime.call_scope
        self.scope = scope
        self.executor = EXECUTORS[executor_kind(self.granularity, self.call_scope)](runtime)
        self.call_executor = self.executor if self.call_scope else None  # TransformerHook serves whole calls
        self.blocks: list[BlockSlot] = self.executor.blocks
        runtime.units = self.executor.unit_names()
        layout = (tuple((type(s.block), s.list_index, s.modules) for s in self.blocks), runtime.units)
        runtime.flops = FlopBook.for_model(transformer, layout, count_flops)
        self.composed_units = self.executor.composed_units  # MODULE: (unit, its input units), Adapter.composed
        self.segment_lists = self.executor.segment_lists  # STACK: lists with a cached middle segment, in order
        self.bytes_seen: tuple[int, int] = (0, 0)  # (branches, units) when the cache bytes were last summed
        self.record_ended: GenerationRecord | None = None  # the last record whose end the schedule was told
        self.generations = 0
        self.peak_cache_bytes = 0
        self.memory_at_end: dict[str, dict[str, int]] = {}  # {branch: {kind: bytes}} of the last generation
        # not named `scheduler`: calling_pipeline takes a caller with a .scheduler and this .transformer for a pipeline
        self.scheduler_hook = SchedulerHook(self)
        self.scheduler_name: str | None = None  # class of the scheduler driving generations (kept after remove)
        self._removed = False
        self._timestep_slot = timestep_slot(transformer)
        self.memoize = memoize
        # the schedule decides from the step alone (no signal): a call is decided when it opens, so that compiled
        # blocks can take their traced path (docs/architecture.md, "torch.compile"); set per generation
        self.step_decided = False
        self.lanes = Lanes(self) if check_decisions(decisions) == "sample" else None  # dcache.runtime.lanes
        self._install()

    # ------------------------------------------------------------------------------------------------ lifetime
    def _install(self) -> None:
        t = self.transformer
        # under accelerate's offload hook; `transformer_call` in front of the chain (dcache.runtime.hooks)
        self.transformer_hook = TransformerHook(self)
        self._installed_forward = install_outer_hook(t, self.transformer_hook, transformer_call)
        self.runtime.call_forward = self.transformer_hook.chain  # the FLOP-counting pass of compiled calls
        if self.memoize:
            self.memos = install_memos(t, self.adapter.invariants, HOOK_NAME, self.runtime.call_arguments)
        self.executor.install()  # block hooks (call scope: none, the call is the unit) and module hooks
        self.scheduler_hook.hook()

    def remove(self) -> None:
        if self._removed:
            return
        self.finish_generation()
        remove_outer_hook(self.transformer, self._installed_forward, recurse=True)
        self.executor.remove()
        self.scheduler_hook.unhook()
        if self.lanes is not None:
            self.lanes.finish_all()  # their records stay for handle.stats(); their caches are freed
        if self.leader is not None and self in self.leader.followers:
            self.leader.followers.remove(self)
        self.branches.clear()
        self._removed = True

    # ------------------------------------------------------------------------------------------------ generations
    def on_set_timesteps(self, scheduler: Any) -> None:
        """A new pipeline generation (the scheduler wrapper calls this under `guard.lock`); an open generation of
        another thread is taken over (its thread's next call is refused: dcache.runtime.concurrency)."""
        self.scheduler_name = type(scheduler).__name__
        ts = getattr(scheduler, "timesteps", None)
        self.open_generation(tuple(float(t) for t in ts.tolist()) if isinstance(ts, torch.Tensor) else None)

    def open_generation(self, timesteps: tuple[float, ...] | None, num_steps: int | None = None) -> None:
        """A new generation whose steps are signalled (a scheduler's set_timesteps, or a custom loop:
        dcache.api.custom_loop), under `guard.lock`; an open generation of another thread is taken over."""
        self.guard.take_over(self.tracker.record)
        self.finish_generation()
        self.tracker.on_set_timesteps(timesteps, num_steps)
        self._start_generation(self.tracker.record)

    def _start_generation(self, record: GenerationRecord) -> None:
        self.executor.start_generation()
        self.guard.own(record)
        self.health.start_generation(self.schedule.calibrating)
        self.record = record
        self.generations += 1
        self.branches = {}
        self.schedule.reset(GenerationInfo(num_steps=record.num_steps, timesteps=record.timesteps, units=self.units,
                                           model_class=type(self.transformer).__name__, num_blocks=len(self.blocks)))
        self.meter.refresh()  # a schedule may change the signals it reads between generations
        self.step_decided = (not self.meter.wanted and not self.meter.providers and not self.call_scope
                             and self.executor.traces_decided_calls)

    def finish_generation(self) -> None:
        """Flush pending post-call signals into the record (one sync) and free every cached tensor."""
        if self.lanes is not None:
            self.lanes.finish_all()  # per-sample lanes end with the pipeline's generation (dcache.runtime.lanes)
        rec = self.record
        if rec is None:
            return
        for bstate in self.branches.values():
            self.meter.flush(bstate)
        if self.record_ended is not rec:  # tell the schedule once per record, with the post signals flushed
            self.record_ended = rec
            self.schedule.end(rec.num_steps is not None and rec.step >= rec.num_steps)
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())
        self.health.end_generation(rec, self.branches)
        if self.branches:  # handle.memory(): where the bytes were (dcache.memory.report)
            self.memory_at_end = branch_breakdown(self.branches, self.granularity.value)
        self.branches = {}
        self.bytes_seen = (0, 0)
        rec.finished = True

    def cache_bytes(self) -> int:
        """Bytes the caches hold now: every branch of the running generation, and of the per-sample lanes."""
        states = [self.branches]
        if self.lanes is not None:
            states += self.lanes.branch_states()  # per-sample lanes' caches (dcache.runtime.lanes)
        return sum(b.nbytes for branches in states for b in branches.values())

    def _update_peak_bytes(self) -> None:
        """Peak cache size. Summing every cached tensor each call costs more than a skipped block on small models,
        and after a unit's first store its buffers are rewritten in place (same shapes), so the sum is only taken
        when the number of cached units changes; generation end (`finish_generation`) takes it again."""
        seen = (len(self.branches), sum(len(b.units) for b in self.branches.values()))
        if seen != self.bytes_seen:
            self.bytes_seen = seen
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())

    # ------------------------------------------------------------------------------------------------ calls
    def call_arguments(self) -> dict[str, Any] | None:
        """The running transformer call's arguments by name (CallRuntime.call_arguments)."""
        return self.runtime.call_arguments()

    def begin_call(self, args: tuple, kwargs: dict, compiling: bool = False) -> None:
        """Open a transformer call: its generation (a new one starts the schedule over), step, branch and the
        branch's state; measure the provider signals the schedule reads. A call that would mix two threads'
        generations is refused before it changes anything (dcache.runtime.concurrency). compiling: dynamo runs the call
        (a schedule that decides from the step alone then decides now, for the blocks' traced path)."""
        with self.guard.lock:
            self.guard.enter_call()
            try:
                self._open_call(args, kwargs)
                if compiling and self.step_decided:
                    # no signal to wait for: the same decision the decision block takes
                    decide(self.runtime, self.executor, self.call)
                    self.executor.decided_early(self.call)
            except BaseException:
                self.guard.exit_call()
                raise

    def _open_call(self, args: tuple, kwargs: dict) -> None:
        if not self.own_generations and not self.tracker.in_generation():
            return  # no call opens: the model runs as it is (the call executor serves nothing)
        if enabled_cache_config(self.transformer) is not None:  # diffusers' enable_cache after apply
            refuse_other_cache(self.transformer, "enabled after dcache.apply; the call is refused")
        guard = self.guard
        guard.check_not_taken()
        name, pos = self._timestep_slot
        timestep = kwargs.get(name) if name in kwargs else args[pos] if pos is not None and pos < len(args) else None
        foreign = guard.other_owner(self.tracker.record)
        if foreign is not None and self.tracker.scheduler_driven:
            # Another thread's pipeline generation is open: this thread's pipeline starts its own (taking over).
            self.scheduler_hook.follow_calling_pipeline(take_over=True)
            guard.refuse_foreign(self.tracker.record, "a transformer call")
        elif foreign is not None and not self.tracker.starts_generation(timestep):
            guard.refuse_foreign(self.tracker.record, "a transformer call")
        runtime = self.runtime
        runtime.call_inputs = (args, kwargs)
        self.follow_pipeline()
        record, new = self.tracker.begin_call(timestep)
        if new or record is not self.record:
            if self.record is not record:
                self.finish_generation()
            self._start_generation(record)
        branch = self.tracker.branch_name(record)
        bstate = self.branches.get(branch)
        if bstate is None:
            bstate = self.branches[branch] = BranchState(codec=self.cache_codec, depth=history_depth(self.schedule),
                                                         fit_bytes=history_fit_bytes(self.schedule))
        runtime.call = CallState(record, record.step, branch, len(record.calls), timestep, bstate,
                                 self.executor.new_call())
        if runtime.meter.providers:
            runtime.meter.measure_providers(runtime.call, args, kwargs)

    def follow_pipeline(self) -> None:
        """Outside a generation, track the pipeline object calling the transformer and its scheduler (a pipeline
        built from this one's components, `pipe.scheduler = ...` since the last generation)."""
        if self.pipeline is not None and self.leader is None and not self.tracker.in_generation():
            self.scheduler_hook.follow_calling_pipeline()
            self.scheduler_hook.follow_replaced_scheduler()
        self.scheduler_hook.hook()

    def end_call(self) -> None:
        """Close the call: its actions and signals go into the generation record; a computed call measures the post
        signals (delivered with the branch's next decision)."""
        try:
            self._close_call()
        finally:
            self.guard.exit_call()

    def _close_call(self) -> None:
        call, self.runtime.call = self.runtime.call, None
        self.executor.end_call(call)
        self.record_call(call)

    def record_call(self, call: CallState | None) -> None:
        """A call's actions, signals and FLOPs go into its generation record; a computed call measures the post
        signals (from `call.stack_input` / `stack_output` and the arguments in `runtime.call_inputs`)."""
        runtime = self.runtime
        if call is None or call.actions is None or call.shared:
            runtime.call_inputs = None
            return
        entry = CallRecord(call.step, call.branch, call.actions, dict(call.signal_values),
                           flops_total=call.flops_total, flops_computed=call.flops_computed)
        call.record.calls.append(entry)
        if call.actions == _COMPUTE * len(call.actions):
            call.bstate.last_compute_step = call.step
            runtime.meter.measure_post(call)  # "computed" providers read the call's arguments: cleared after
            call.bstate.pending_call = entry
        runtime.call_inputs = None
        self._update_peak_bytes()

    def abort(self, state: Any = None, whole_call: bool = False) -> None:
        """A forward raised: close an open FLOP counter and drop the call (its record entry is never written;
        state: a unit's hook state, UnitExecutor.abort_unit). whole_call: the transformer call itself raised, so its
        generation is over (StepTracker.abort)."""
        if whole_call:
            self.tracker.abort()
            if self.record is not None:
                self.record.aborted = True  # its stats stay; no health verdict or warning
        self.executor.abort_unit(state)
        if whole_call:
            self.guard.exit_call()


# The same entry points behind torch.compiler.disable, for hook frames that run while torch.compile traces the model
# (dcache.runtime.hooks): `begin_call_traced`, `end_call_traced`, `abort_traced`.
traced_twins(Engine, ("begin_call", "end_call", "abort"))

__all__ = ["Engine", "BlockSlot", "CallState", "HOOK_NAME"]
